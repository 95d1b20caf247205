"""Two runs on one host (the lock), and a unit that was not running before the run (restore policy)."""

import json
import re
import socket
import time

import pytest

from conftest import STATE_DIR, fetched_run_dirs

OTHER_RUN = "20260101T000000Z-abcdef"


def write_lock(host, controller, pid, expires_in_s, run_id=OTHER_RUN):
    now = int(time.time())
    lock = {"run_id": run_id, "unit": "fake-inference.service", "owner": "someone", "controller": controller,
            "pid": pid, "started_at": "2026-01-01T00:00:00Z", "started_epoch": now - 60,
            "expires_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + expires_in_s)),
            "expires_epoch": now + expires_in_s}
    host.exec("mkdir -p %s/runs && printf '%%s' '%s' > %s/lock" % (STATE_DIR, json.dumps(lock), STATE_DIR))



def step_ran(stdout, step):
    """Whether a task whose name starts with `step` ran for the host (its header followed by
    anything but `skipping:`); False when it never showed up or was skipped each time."""
    ran = False
    for match in re.finditer(r"^TASK \[%s[^\n]*\n+([^\n]*)" % re.escape(step), stdout, re.M):
        ran = ran or not match.group(1).startswith("skipping:")
    return ran

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


# Restore policy x the unit's state before the run: (policy, active before) -> active after.
RESTORE_CASES = [
    pytest.param("previous", True, True, id="previous-active"),
    pytest.param("previous", False, False, id="previous-inactive"),
    pytest.param("always", True, True, id="always-active"),
    pytest.param("always", False, True, id="always-inactive"),
    pytest.param("never", True, False, id="never-active"),
    pytest.param("never", False, False, id="never-inactive"),
]


@pytest.mark.parametrize("policy, active_before, active_after", RESTORE_CASES)
def test_restore_policy_decides_the_end_state(simhost, run_playbook, results_dir, policy, active_before, active_after):
    if not active_before:
        simhost.exec("systemctl stop fake-inference.service")
    before = simhost.unit_show()
    since = simhost.epoch()
    run = run_playbook(simhost, {"moe_bench_restore": policy})
    assert run.rc == 0, run.describe()
    # The unit was stopped by this run only when it was running.
    assert simhost.stop_count(since) == (1 if active_before else 0), simhost.journal(since_epoch=since)
    after = simhost.unit_show()
    if active_after:
        assert after["ActiveState"] == "active", after
        assert after["MainPID"] != before["MainPID"], "not started again by this run"
        assert simhost.health_status() == 200
    else:
        assert after["ActiveState"] == "inactive", after
        assert simhost.health_status() != 200
        assert "is left stopped" in run.stdout, run.describe()
        reason = "restore policy never" if policy == "never" else "it was inactive before the run"
        assert reason in " ".join(run.stdout.split()), run.describe()
    # Whatever the policy: no dead-man timer left, lock released, results complete.
    assert not simhost.timer_loaded(), "dead-man timer left armed"
    assert simhost.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock not released"
    (run_id,) = simhost.run_ids()
    deadman = simhost.read_json("%s/runs/%s/deadman.json" % (STATE_DIR, run_id))
    # The timer is armed only where it would start the unit: a policy that starts it afterwards.
    armed = policy == "always" or (policy == "previous" and active_before)
    assert str(deadman["armed"]).lower() == str(armed).lower(), deadman
    recover = simhost.read_json("%s/runs/%s/recover.json" % (STATE_DIR, run_id))
    assert str(recover["started"]).lower() == str(active_after).lower(), recover
    (fetched,) = fetched_run_dirs(results_dir, simhost)
    results = json.loads((fetched / "results.json").read_text())
    assert results["status"] == "complete"
    assert [row["m"] for row in results["results"]] == [1, 2, 4, 8]


def test_two_runs_at_the_same_moment_stop_the_unit_once(simhost, start_playbook, results_dir):
    since = simhost.epoch()
    first = start_playbook(simhost)
    second = start_playbook(simhost)
    runs = [first.wait(timeout=600), second.wait(timeout=600)]
    winners = [run for run in runs if run.rc == 0]
    losers = [run for run in runs if run.rc != 0]
    assert len(winners) == 1 and len(losers) == 1, "\n\n".join(run.describe() for run in runs)
    loser = losers[0]
    # Refused by the lock it found, or by the read-back after both took it at the same instant.
    assert re.search(r"is locked by run \S+|Another run took the lock on \S+ at the same moment",
                     " ".join(loser.stdout.split())), loser.describe()
    assert "This run touched nothing" in " ".join(loser.stdout.split()), loser.describe()
    # The loser never ran the stop, the deploy or the dead-man switch: its failure is recorded (the
    # fleet report names it) and every later step of its host is skipped.
    for step in ("Record the service's state and stop it", "Deploy the payload", "Arm the dead-man switch"):
        assert step_ran(loser.stdout, step) is False, (step, loser.describe())
    assert simhost.stop_count(since) == 1, simhost.journal(since_epoch=since)
    # One run folder with its results; service back, no timer, no lock.
    assert len(simhost.run_ids()) == 1, simhost.run_ids()
    assert simhost.unit_show()["ActiveState"] == "active" and simhost.health_status() == 200
    assert not simhost.timer_loaded()
    assert simhost.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock not released"
    (fetched,) = fetched_run_dirs(results_dir, simhost)
    assert json.loads((fetched / "results.json").read_text())["status"] == "complete"
