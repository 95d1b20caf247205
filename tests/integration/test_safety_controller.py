"""The controller dies, never comes back, or loses its connection mid-benchmark: the job runs on
on the host, the next run re-attaches to it (no second stop, no second launch), and the host's
dead-man timer brings the service back when nobody does."""

import json
import re
import time

from conftest import LONG_M_LIST, STATE_DIR, fetched_run_dirs, wait_until


def job_record(host):
    (run_id,) = host.run_ids()
    return run_id, host.read_json("%s/runs/%s/job.json" % (STATE_DIR, run_id))


def wait_for_job(host, timeout=400):
    """Until the payload runs and its job id is on the host; returns (run_id, job record)."""
    def launched():
        ids = host.run_ids()
        if len(ids) != 1 or not host.payload_pids():
            return None
        record = host.read_json("%s/runs/%s/job.json" % (STATE_DIR, ids[0]))
        return (ids[0], record) if record and record.get("jid") else None
    return wait_until(launched, timeout=timeout, interval=0.5, what="benchmark job launched")


def payload_outlived_controller(host, run_id):
    """The payload was not cut short: it still runs, or its results on the host are complete
    (a fast machine may finish the run between the controller's death and this check)."""
    if host.payload_pids():
        return True
    document = host.read_json("%s/runs/%s/results.json" % (STATE_DIR, run_id))
    return bool(document) and document.get("status") == "complete" and \
        len(document.get("results", [])) == len(LONG_M_LIST.split(","))


def assert_reattached_and_recovered(host, run, results_dir, run_id, jid, since_epoch):
    assert run.rc == 0, run.describe()
    assert "re-attaching to benchmark job %s" % jid in run.stdout, run.describe()
    # One run folder, the same job id: the payload was launched once.
    assert host.run_ids() == [run_id]
    assert job_record(host)[1]["jid"] == jid
    # The unit was stopped once (by the first controller), started again by the second.
    assert host.stop_count(since_epoch) == 1, host.journal(since_epoch=since_epoch)
    state = host.unit_show()
    assert state["ActiveState"] == "active", state
    assert host.health_status() == 200
    assert not host.timer_loaded(), "dead-man timer left armed"
    assert host.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock not released"
    # The re-run fetches into the re-attached run's folder (its own new run id is never used).
    fetched = results_dir / host.name / run_id
    assert fetched in fetched_run_dirs(results_dir, host), fetched_run_dirs(results_dir, host)
    results = json.loads((fetched / "results.json").read_text())
    assert results["status"] == "complete", results["status"]
    assert [row["m"] for row in results["results"]] == [int(m) for m in LONG_M_LIST.split(",")]
    log = (fetched / "bench.log").read_text()
    assert log.count("[moe_bench] starting:") == 1, log


def test_killed_controller_rerun_reattaches_to_the_same_job(simhost, start_playbook, run_playbook, results_dir):
    since = simhost.epoch()
    first = start_playbook(simhost, {"moe_bench_m_list": LONG_M_LIST})
    run_id, job = wait_for_job(simhost)
    first.kill_controller()
    # The benchmark runs on without its controller; the unit stays stopped.
    time.sleep(2)
    assert payload_outlived_controller(simhost, run_id), (
        "the payload died with its controller; its log: %s" % (simhost.read_file(
            "%s/runs/%s/bench.log" % (STATE_DIR, run_id), check=False) or "(none)")[-2000:])
    assert simhost.unit_active() in ("inactive", "failed")
    assert simhost.timer_loaded(), "no dead-man timer armed while the service is down"

    second = run_playbook(simhost, {"moe_bench_m_list": LONG_M_LIST})
    assert_reattached_and_recovered(simhost, second, results_dir, run_id, job["jid"], since)


def test_controller_that_never_returns_is_covered_by_the_deadman_timer(simhost, start_playbook, run_playbook):
    # Deadline = stop (the unit's own TimeoutStopSec 30 s beats the planned 5 s) + stop margin 15
    # + memory wait 5 + async limit 60 + the async wrapper's lag past it 6 + one bench poll 1
    # + the stop of a payload that outlived its job 10 + 10 + load 5 + one health poll 1 + settle 2,
    # margin 0: the dead-man timer fires 145 s after it is armed.
    budgets = {"moe_bench_m_list": LONG_M_LIST, "moe_bench_stop_timeout_s": 5, "moe_bench_vram_timeout_s": 5,
               "moe_bench_bench_budget_s": 60, "moe_bench_async_margin_s": 0, "moe_bench_load_budget_s": 5,
               "moe_bench_deadman_margin_s": 0, "moe_bench_bench_poll_s": 1}
    run = start_playbook(simhost, budgets)
    run_id = wait_until(lambda: next(iter(
        [rid for rid in simhost.run_ids()
         if simhost.exec("test -s %s/runs/%s/job.json" % (STATE_DIR, rid), check=False).returncode == 0]), None),
        timeout=400, interval=0.5, what="benchmark job launched")
    run.kill_controller()
    assert simhost.unit_active() in ("inactive", "failed")
    deadman = simhost.read_json("%s/runs/%s/deadman.json" % (STATE_DIR, run_id))
    assert deadman and str(deadman["armed"]).lower() == "true", deadman
    assert int(deadman["delay_s"]) == 30 + 15 + 5 + 60 + 6 + 1 + 10 + 10 + 5 + 1 + 2, deadman
    assert simhost.timer_loaded()
    deadline = int(deadman["deadline_epoch"])

    wait_until(lambda: simhost.unit_active() == "active", timeout=deadline - time.time() + 60, interval=1,
               what="the dead-man timer starting the unit")
    started = int(simhost.exec("systemctl show -p ActiveEnterTimestamp --value fake-inference.service "
                               "| xargs -I{} date -d {} +%s").stdout.strip())
    # Started by the timer at its deadline, not earlier.
    assert started >= deadline - 2, (started, deadline)
    simhost.wait_healthy(timeout=30)
    assert "moe-bench dead-man switch" in simhost.journal(unit="moe-bench-deadman-fake-inference.service") + \
        simhost.exec("journalctl --no-pager -o cat | grep -i dead-man || true").stdout
    # The lock of the vanished run is still there: the matrix's next step clears it, and leaves
    # the service healthy without a second start.
    assert simhost.read_json("%s/lock" % STATE_DIR)["run_id"] == run_id
    pid = simhost.unit_show()["MainPID"]
    recover = run_playbook(simhost, {"moe_bench_unit": "fake-inference.service", "moe_bench_health_poll_s": 1,
                                     "moe_bench_health_url": "http://127.0.0.1:30000/health",
                                     "moe_bench_health_settle_s": 2},
                           playbook="service_recover.yml", raw_vars=True)
    assert recover.rc == 0, recover.describe()
    assert simhost.unit_show()["MainPID"] == pid and simhost.health_status() == 200
    assert not simhost.timer_loaded()
    assert simhost.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock not cleared"


def test_connection_cut_mid_run_job_continues_and_next_run_recovers(simhost, start_playbook, run_playbook,
                                                                    results_dir):
    since = simhost.epoch()
    first = start_playbook(simhost, {"moe_bench_m_list": LONG_M_LIST})
    run_id, job = wait_for_job(simhost)
    first.wait_for_output(r"Wait for the benchmark to finish", timeout=120)
    # Cut the link while the controller polls: the SSH listener goes away and every session
    # (the controller's ControlMaster included) is killed, until Ansible gives the host up.
    simhost.exec("systemctl stop ssh.service")
    try:
        cut = simhost.kill_ssh_sessions()
        assert cut, "no SSH session to cut: the controller was not connected"
        first_result = first.wait(timeout=300)
    finally:
        simhost.exec("systemctl start ssh.service")
    # The cut really happened: Ansible reported the host unreachable and the run failed on it,
    # while the benchmark job went on on the host.
    assert first_result.rc != 0, first_result.describe()
    assert re.search(r"\[%s\]: UNREACHABLE!" % re.escape(simhost.name), first_result.stdout), first_result.describe()
    assert simhost.payload_pids() or payload_outlived_controller(simhost, run_id), \
        "the benchmark died with the connection"
    # The service is still down (the first controller never got to recover it), the lock and
    # the dead-man timer still hold.
    assert simhost.unit_active() in ("inactive", "failed")
    assert simhost.timer_loaded()
    assert simhost.read_json("%s/lock" % STATE_DIR)["run_id"] == run_id

    second = run_playbook(simhost, {"moe_bench_m_list": LONG_M_LIST})
    assert_reattached_and_recovered(simhost, second, results_dir, run_id, job["jid"], since)
