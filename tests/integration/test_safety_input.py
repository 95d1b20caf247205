"""Bad input is refused before the service is touched; the unit was never stopped."""

import json
import re

import pytest


def assert_untouched(host, before, since_epoch):
    after = host.unit_show()
    assert after["ActiveState"] == "active", after
    assert after["MainPID"] == before["MainPID"], "the unit was restarted: %s -> %s" % (before, after)
    assert after["ActiveEnterTimestampMonotonic"] == before["ActiveEnterTimestampMonotonic"], (before, after)
    assert host.stop_count(since_epoch) == 0, host.journal(since_epoch=since_epoch)
    # Nothing was started on the host's side: no run folder, no dead-man timer.
    assert host.run_ids() == [], host.run_ids()
    assert not host.timer_loaded()


# Each refusal names the variable as the operator writes it, and says nothing was stopped.
BAD_INPUTS = [
    pytest.param({"moe_bench_unit": "no-such-model.service"}, r"does not exist.*moe_bench_unit", id="unknown-unit"),
    pytest.param({"moe_bench_unit": ""}, r"moe_bench_unit", id="empty-unit"),
    pytest.param({"moe_bench_bench_budget_s": 0}, r"moe_bench_bench_budget_s must be more than 0", id="zero-budget"),
    pytest.param({"moe_bench_bench_budget_s": "soon"}, r"moe_bench_bench_budget_s", id="budget-word"),
    pytest.param({"moe_bench_load_budget_s": -5}, r"moe_bench_load_budget_s must be more than 0", id="negative-load-budget"),
    pytest.param({"moe_bench_health_poll_s": 120, "moe_bench_load_budget_s": 60},
                 r"moe_bench_health_poll_s \(120 s\) is longer than moe_bench_load_budget_s", id="poll-longer-than-budget"),
    pytest.param({"moe_bench_m_list": "1,two,4"}, r"moe_bench_m_list: 'two' in '1,two,4' is not a whole number", id="m-list-word"),
    pytest.param({"moe_bench_m_list": "8,4,2"}, r"moe_bench_m_list: the M list must be increasing", id="m-list-decreasing"),
    pytest.param({"moe_bench_health_url": "ftp://127.0.0.1:30000/health"}, r"moe_bench_health_url must be an http:// or https://",
                 id="health-url-ftp"),
    pytest.param({"moe_bench_gpus": [0, 9]}, r"GPU\(s\) 9 do not exist.*moe_bench_gpus", id="missing-gpu"),
    pytest.param({"moe_bench_payload_dir": "/etc"}, r"moe_bench_payload_dir: '/etc' is a top-level folder", id="payload-dir-etc"),
    pytest.param({"moe_bench_payload_dir": "/usr/local"}, r"moe_bench_payload_dir: '/usr/local' is a folder of the system",
                 id="payload-dir-usr-local"),
    pytest.param({"moe_bench_state_dir": "var/lib/moe-bench"}, r"moe_bench_state_dir: must be an absolute path",
                 id="state-dir-relative"),
    pytest.param({"moe_bench_state_dir": "/"}, r"moe_bench_state_dir: '/' is the root folder", id="state-dir-root"),
    pytest.param({"moe_bench_prewarm_paths": "/usr/lib/python3,/srv/models/no-such-model"},
                 r"moe_bench_prewarm_paths: /srv/models/no-such-model on .* does not exist", id="prewarm-path-missing"),
]


@pytest.mark.parametrize("overrides, message", BAD_INPUTS)
def test_bad_input_is_refused_before_the_service_is_touched(simhost, run_playbook, overrides, message):
    since = simhost.epoch()
    before = simhost.unit_show()
    run = run_playbook(simhost, overrides)
    assert run.rc != 0, run.describe()
    message_text = refusal_message(run.stdout, simhost.name)
    assert message_text, run.describe()
    assert re.search(message, message_text, re.S), (message_text, run.describe())
    # The refusal's own message ends with the promise.
    assert message_text.endswith("Nothing was stopped."), message_text
    assert "Stop the unit" not in run.stdout, run.describe()
    # The payload folder a bad input named was never created, nor anything copied into it.
    assert host_path_absent(simhost, "/etc/moe_bench") and host_path_absent(simhost, "/usr/local/moe_bench")
    assert_untouched(simhost, before, since)


def refusal_message(stdout, host):
    """The msg of the host's first failed task, whitespace collapsed."""
    line = re.search(r"(?:fatal|failed): \[%s\]: FAILED! => (.*)" % re.escape(host), stdout)
    if not line:
        return None
    try:
        msg = json.loads(line.group(1)).get("msg", "")
    except ValueError:
        # A YAML-formatted result: the msg folded over the following lines.
        block = stdout[line.start():]
        found = re.search(r"\bmsg: (.*?)(?:\n\S|\Z)", block, re.S)
        msg = found.group(1).strip("'\"") if found else block
    return " ".join(str(msg).split())


def host_path_absent(host, path):
    return host.exec("test -e %s" % path, check=False).returncode != 0


def test_unwritable_results_folder_is_refused_before_the_service_is_touched(simhost, run_playbook, tmp_path):
    # A regular file where a folder must be: even root cannot create the results folder there.
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    since = simhost.epoch()
    before = simhost.unit_show()
    run = run_playbook(simhost, {"moe_bench_results_dir": str(blocker / "results")})
    assert run.rc != 0, run.describe()
    assert "cannot write results" in run.output, run.describe()
    assert "Nothing was stopped" in run.output, run.describe()
    assert_untouched(simhost, before, since)
