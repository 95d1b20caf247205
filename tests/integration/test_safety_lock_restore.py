"""Two runs on one host (the lock), and a unit that was not running before the run (restore policy)."""

import json
import re
import socket
import time

from conftest import STATE_DIR, fetched_run_dirs

OTHER_RUN = "20260101T000000Z-abcdef"


def write_lock(host, controller, pid, expires_in_s, run_id=OTHER_RUN):
    now = int(time.time())
    lock = {"run_id": run_id, "unit": "fake-inference.service", "owner": "someone", "controller": controller,
            "pid": pid, "started_at": "2026-01-01T00:00:00Z", "started_epoch": now - 60,
            "expires_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + expires_in_s)),
            "expires_epoch": now + expires_in_s}
    host.exec("mkdir -p %s/runs && printf '%%s' '%s' > %s/lock" % (STATE_DIR, json.dumps(lock), STATE_DIR))


def test_lock_of_another_live_run_refuses_without_touching_the_service(simhost, run_playbook):
    write_lock(simhost, controller="other-controller.example", pid=4242, expires_in_s=3600)
    since = simhost.epoch()
    before = simhost.unit_show()
    run = run_playbook(simhost)
    assert run.rc != 0, run.describe()
    assert re.search(r"is locked by run %s" % OTHER_RUN, run.stdout), run.describe()
    assert "touched nothing" in run.stdout, run.describe()
    after = simhost.unit_show()
    assert after["MainPID"] == before["MainPID"] and after["ActiveState"] == "active", (before, after)
    assert after["ActiveEnterTimestampMonotonic"] == before["ActiveEnterTimestampMonotonic"]
    assert simhost.stop_count(since) == 0
    # The other run's lock is still in place.
    assert simhost.read_json("%s/lock" % STATE_DIR)["run_id"] == OTHER_RUN
    assert not simhost.timer_loaded()


def test_expired_lock_is_taken_over_with_a_warning(simhost, run_playbook, results_dir):
    write_lock(simhost, controller="other-controller.example", pid=4242, expires_in_s=-60)
    run = run_playbook(simhost)
    assert run.rc == 0, run.describe()
    assert re.search(r"WARNING: .*taking over the lock of run %s" % OTHER_RUN, run.stdout, re.S), run.describe()
    assert "expired" in run.stdout
    assert simhost.unit_show()["ActiveState"] == "active"
    assert simhost.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0
    (fetched,) = fetched_run_dirs(results_dir, simhost)
    assert fetched.name != OTHER_RUN
    assert json.loads((fetched / "results.json").read_text())["status"] == "complete"


def test_lock_whose_owner_is_gone_is_taken_over_with_a_warning(simhost, run_playbook):
    # Same controller, an ansible-playbook pid that no longer exists, lock not expired.
    write_lock(simhost, controller=socket.gethostname(), pid=2 ** 22 - 7, expires_in_s=3600)
    run = run_playbook(simhost)
    assert run.rc == 0, run.describe()
    assert re.search(r"WARNING: .*taking over the lock of run %s" % OTHER_RUN, run.stdout, re.S), run.describe()
    assert "gone" in run.stdout
    assert simhost.unit_show()["ActiveState"] == "active"


def test_unit_not_running_before_stays_stopped_and_is_reported(simhost, run_playbook, results_dir):
    simhost.exec("systemctl stop fake-inference.service")
    since = simhost.epoch()
    run = run_playbook(simhost)
    assert run.rc == 0, run.describe()
    assert "is left stopped" in run.stdout, run.describe()
    assert "was already" in run.stdout or "before the run" in run.stdout
    assert simhost.unit_active() == "inactive"
    assert simhost.stop_count(since) == 0
    assert not simhost.timer_loaded(), "a dead-man timer would start a unit the operator had stopped"
    (fetched,) = fetched_run_dirs(results_dir, simhost)
    assert json.loads((fetched / "results.json").read_text())["status"] == "complete"


def test_unit_not_running_before_is_started_when_asked(simhost, run_playbook):
    simhost.exec("systemctl stop fake-inference.service")
    run = run_playbook(simhost, {"moe_bench_restore": "always"})
    assert run.rc == 0, run.describe()
    assert simhost.unit_show()["ActiveState"] == "active"
    assert simhost.health_status() == 200
