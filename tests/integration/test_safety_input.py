"""Bad input is refused before the service is touched; the unit was never stopped."""

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


BAD_INPUTS = [
    pytest.param({"moe_bench_unit": "no-such-model.service"}, r"does not exist", id="unknown-unit"),
    pytest.param({"moe_bench_bench_budget_s": 0}, r"bench_budget_s.*(more than 0|positive)", id="zero-budget"),
    pytest.param({"moe_bench_load_budget_s": -5}, r"load_budget_s.*(more than 0|positive)", id="negative-load-budget"),
    pytest.param({"moe_bench_health_poll_s": 120, "moe_bench_load_budget_s": 60},
                 r"health_poll_s.*longer than", id="poll-longer-than-budget"),
    pytest.param({"moe_bench_m_list": "1,two,4"}, r"not a whole number", id="m-list-word"),
    pytest.param({"moe_bench_m_list": "8,4,2"}, r"increasing", id="m-list-decreasing"),
    pytest.param({"moe_bench_health_url": "ftp://127.0.0.1:30000/health"}, r"http:// or https://", id="health-url-ftp"),
    pytest.param({"moe_bench_gpus": [0, 9]}, r"GPU\(s\) 9 do not exist", id="missing-gpu"),
]


@pytest.mark.parametrize("overrides, message", BAD_INPUTS)
def test_bad_input_is_refused_before_the_service_is_touched(simhost, run_playbook, overrides, message):
    since = simhost.epoch()
    before = simhost.unit_show()
    run = run_playbook(simhost, overrides)
    assert run.rc != 0, run.describe()
    assert re.search(message, run.output, re.S), run.describe()
    assert "Stop the unit" not in run.stdout, run.describe()
    assert_untouched(simhost, before, since)


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
