"""The health check's bearer token never appears in output, host logs or fetched files."""

import subprocess
import uuid

from conftest import STATE_DIR


def test_health_token_is_used_but_never_shown_logged_or_written(simhost, run_playbook, results_dir):
    token = "tok-" + uuid.uuid4().hex
    simhost.set_switches(restart=True, FAKE_REQUIRE_TOKEN=token)
    simhost.wait_healthy(token=token)
    assert simhost.health_status() == 401
    since = simhost.epoch()
    run = run_playbook(simhost, {"moe_bench_health_token": token}, verbose=3)
    # The token worked: the service passed its authenticated health check.
    assert run.rc == 0, run.describe().replace(token, "<TOKEN>")
    assert simhost.unit_show()["ActiveState"] == "active"
    assert token not in run.stdout, "token printed on stdout"
    assert token not in run.stderr, "token printed on stderr"
    # The host: the whole journal since the run (module invocations are logged there), the state
    # folder, the payload folder and /var/log.
    journal = simhost.journal(unit=None, since_epoch=since)
    assert journal.strip(), "empty journal: the search would prove nothing"
    assert token not in journal, "token in the host's journal"
    found = simhost.exec("grep -rl -F %s %s /opt/moe-bench /var/log /root/.ansible 2>/dev/null || true"
                         % (token, STATE_DIR)).stdout.strip()
    assert found == "", "token written on the host: %s" % found
    # The controller: every fetched file and report.
    found_local = subprocess.run(["grep", "-rl", "-F", token, str(results_dir)], capture_output=True, text=True)
    assert found_local.stdout.strip() == "", "token in fetched files: %s" % found_local.stdout
    assert any(results_dir.rglob("results.json")), "nothing fetched: the search would prove nothing"
