"""The unit will not come back (fails on start, crash-loops under Restart=, answers once and then
dies): the playbook fails within one health poll of the unit dying, not after the load budget,
with the journal's tail and the restarts named; the service is reported DOWN, the dead-man timer
stays armed to try again, the lock is released and the finished benchmark's results are fetched."""

import json
import re

import pytest

from conftest import STATE_DIR, fetched_run_dirs

LOAD_BUDGET_S = 300
POLL_S = 5
# The fake unit restarts 2 s after it dies (RestartSec=2 in simhost's fake-inference.service).
RESTART_SEC = 2
# A crash period this long keeps the unit under its start limit (5 starts in 60 s) for ever: it
# cycles active -> crash -> auto-restart and never reaches `failed`, so only the restart counter
# and the auto-restart state can tell it is dead.
CRASH_AFTER_S = 12
# One SSH round trip and module start on a loaded 2-core controller.
ROUND_TRIP_S = 3


def recovery_wait(run):
    """The recovery's own clock: seconds from the start command to the verdict."""
    found = re.search(r"did NOT come back: .*? after ([0-9.]+) s\. Unit state now", " ".join(run.stdout.split()))
    assert found, run.describe()
    return float(found.group(1))


def assert_reported_down(host, run, results_dir, answers_between_crashes=False):
    text = " ".join(run.stdout.split())
    assert run.rc != 0, run.describe()
    assert "did NOT come back" in text and "THE SERVICE IS DOWN" in text, run.describe()
    assert "Journal tail" in text, run.describe()
    assert "service_recover.yml -l %s" % host.name in text, run.describe()
    # The service is not serving (a unit that answers for a few seconds between its crashes may
    # answer at this very moment), the host says so; the dead-man timer stays armed to try again.
    if not answers_between_crashes:
        assert host.health_status() != 200
    assert host.timer_loaded(), "the dead-man timer was disarmed although the service is down"
    assert host.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock not released"
    (run_id,) = host.run_ids()
    recover = host.read_json("%s/runs/%s/recover.json" % (STATE_DIR, run_id))
    assert recover and str(recover["ready"]).lower() == "false", recover
    assert str(recover["dead"]).lower() == "true", recover
    # The benchmark had finished before the failed restart: its results are on the controller.
    (fetched,) = fetched_run_dirs(results_dir, host)
    results = json.loads((fetched / "results.json").read_text())
    assert results["status"] == "complete"
    assert [row["m"] for row in results["results"]] == [1, 2, 4, 8]
    return text


def test_unit_that_fails_on_start_is_reported_within_one_poll(simhost, run_playbook, results_dir):
    # The switch takes effect at the next start: the playbook's own.
    simhost.set_switches(restart=False, FAKE_FAIL_ON_START="1")
    run = run_playbook(simhost, {"moe_bench_load_budget_s": LOAD_BUDGET_S, "moe_bench_health_poll_s": POLL_S})
    text = assert_reported_down(simhost, run, results_dir)
    assert "FAKE_FAIL_ON_START" in text, run.describe()
    # It exits at once; systemd shows auto-restart within RestartSec, seen within one poll.
    assert recovery_wait(run) <= RESTART_SEC + POLL_S + ROUND_TRIP_S, recovery_wait(run)
    assert run.wall_s < LOAD_BUDGET_S, run.wall_s


def test_crash_loop_under_the_start_limit_is_reported_within_one_poll(simhost, run_playbook, results_dir):
    simhost.set_switches(restart=False, FAKE_CRASH_LOOP="1", FAKE_CRASH_AFTER_SECONDS=str(CRASH_AFTER_S),
                         FAKE_LOAD_SECONDS="60")
    since = simhost.epoch()
    run = run_playbook(simhost, {"moe_bench_load_budget_s": LOAD_BUDGET_S, "moe_bench_health_poll_s": POLL_S})
    text = assert_reported_down(simhost, run, results_dir)
    # The fault really happened: the unit crashed and systemd restarted it, and it never reached
    # the start limit (still cycling, not `failed`).
    assert "CUDA error: an illegal memory access" in simhost.journal(since_epoch=since)
    state = simhost.unit_show()
    assert state["ActiveState"] != "failed" and state["Result"] != "start-limit-hit", state
    assert int(state["NRestarts"]) >= 1, state
    # The message names the restarts.
    assert re.search(r"restarted by systemd \d+ time\(s\)|crash-looping", text), run.describe()
    assert re.search(r"NRestarts \d+", text), run.describe()
    # Reported within one poll of the first crash (the crash comes CRASH_AFTER_S after the start).
    assert recovery_wait(run) <= CRASH_AFTER_S + RESTART_SEC + POLL_S + ROUND_TRIP_S, recovery_wait(run)


def test_unit_healthy_for_a_moment_then_crash_looping_is_not_called_back(simhost, run_playbook, results_dir):
    # Loads in 2 s and answers healthy, crashes 6 s after each start: inside the settle period.
    simhost.set_switches(restart=False, FAKE_CRASH_LOOP="1", FAKE_CRASH_AFTER_SECONDS="6", FAKE_LOAD_SECONDS="2")
    since = simhost.epoch()
    run = run_playbook(simhost, {"moe_bench_health_poll_s": 1, "moe_bench_health_settle_s": 20})
    text = assert_reported_down(simhost, run, results_dir, answers_between_crashes=True)
    # It did answer healthy first (the fault is the one under test), then crashed.
    journal = simhost.journal(since_epoch=since)
    assert "The server is fired up and ready to roll" in journal and "crashing" in journal, journal[-3000:]
    assert int(simhost.unit_show()["NRestarts"]) >= 1, simhost.unit_show()
    assert "did not stay healthy for the settle period of 20 s" in text, run.describe()
    assert re.search(r"MainPID \d+ -> \S+, NRestarts \d+ -> \S+", text), run.describe()
