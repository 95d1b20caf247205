"""The benchmark fails (raises, is killed, runs past its budget): the service comes back, the
failure message carries the exit code and the log's tail, and the finished M values are fetched.
A payload that outlives its job is stopped before the unit starts."""

import json
import re

from conftest import LONG_M_LIST, STATE_DIR, fetched_run_dirs, unit_stays_down_while_payloads_run, wait_until


def assert_service_restored(host):
    state = host.unit_show()
    assert state["ActiveState"] == "active", state
    assert host.health_status() == 200
    assert not host.timer_loaded(), "dead-man timer left armed after the recovery"
    assert host.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock not released"


def fetched_results(results_dir, host):
    (run_dir,) = fetched_run_dirs(results_dir, host)
    return run_dir, json.loads((run_dir / "results.json").read_text())


def test_payload_raising_mid_run_restores_service_and_keeps_finished_m(simhost, run_playbook, results_dir):
    # The payload's test hook raises a runtime failure when M=4 is reached (exit code 5);
    # /etc/environment reaches it through the SSH session (pam_env).
    simhost.set_payload_env(MOE_BENCH_INTERNAL_FAIL_AT_M=4)
    run = run_playbook(simhost, {"moe_bench_m_list": "1,2,4,8"})
    assert run.rc != 0, run.describe()
    assert "The benchmark failed on %s" % simhost.name in run.stdout, run.describe()
    assert re.search(r"exit code 5\b", run.stdout), run.describe()
    # The log's tail is in the message: the payload's own failure line.
    assert "injected failure at M=4" in run.stdout, run.describe()
    assert "was restored" in run.stdout, run.describe()
    assert_service_restored(simhost)
    run_dir, results = fetched_results(results_dir, simhost)
    assert results["status"] == "failed"
    assert results["error"]["exit_code"] == 5
    assert [row["m"] for row in results["results"]] == [1, 2]
    assert (run_dir / "bench.log").exists(), sorted(p.name for p in run_dir.iterdir())
    assert "injected failure at M=4" in (run_dir / "bench.log").read_text()


def test_payload_killed_mid_run_restores_service_and_keeps_finished_m(simhost, start_playbook, results_dir):
    # SIGKILL of the payload stands in for the out-of-memory killer.
    run = start_playbook(simhost, {"moe_bench_m_list": LONG_M_LIST})

    def payload_with_results():
        pids = simhost.payload_pids()
        if not pids:
            return None
        for run_id in simhost.run_ids():
            doc = simhost.read_json("%s/runs/%s/results.json" % (STATE_DIR, run_id))
            if doc and len(doc.get("results", [])) >= 2:
                return pids
        return None

    pids = wait_until(payload_with_results, timeout=400, interval=0.5, what="payload with 2 finished M values")
    simhost.exec("kill -9 %s" % " ".join(map(str, pids)))
    result = run.wait(timeout=400)
    assert result.rc != 0, result.describe()
    assert "The benchmark failed on %s" % simhost.name in result.stdout, result.describe()
    assert re.search(r"exit code (-9|137)|killed", result.stdout), result.describe()
    assert "Log tail" in result.stdout, result.describe()
    assert_service_restored(simhost)
    run_dir, results = fetched_results(results_dir, simhost)
    assert len(results["results"]) >= 2, results
    assert results["status"] != "complete"
    assert (run_dir / "bench.log").exists()


def test_payload_past_its_budget_is_stopped_and_service_restored(simhost, run_playbook, results_dir):
    # Async limit = budget + margin = 3 s: the payload (torch import, weights, a long M list on
    # the CPU) cannot finish in that time.
    poll_s = 1
    run = run_playbook(simhost, {"moe_bench_m_list": LONG_M_LIST, "moe_bench_bench_budget_s": 2,
                                 "moe_bench_async_margin_s": 1, "moe_bench_bench_poll_s": poll_s})
    assert run.rc != 0, run.describe()
    text = " ".join(run.stdout.split())
    assert "The benchmark failed on %s" % simhost.name in text, run.describe()
    # The message says the time limit was hit (not some other failure).
    assert "killed at the async time limit of 3 s" in text, run.describe()
    # The payload was killed at the limit: it is gone by the time the run ends (it was killed
    # before the poll that noticed it), allowing one poll interval for the kill to land.
    wait_until(lambda: not simhost.payload_pids(), timeout=poll_s, interval=0.2, what="payload gone")
    assert_service_restored(simhost)
    # What was measured is kept, with a status that says the run did not complete (on a slow
    # machine the kill can come before the payload's first write: then there is no results file,
    # and its log shows it never finished).
    (run_dir,) = fetched_run_dirs(results_dir, simhost)
    assert (run_dir / "bench.log").exists(), sorted(p.name for p in run_dir.iterdir())
    if (run_dir / "results.json").exists():
        results = json.loads((run_dir / "results.json").read_text())
        assert results["status"] != "complete", results["status"]
        assert len(results["results"]) < len(LONG_M_LIST.split(","))
    assert "complete:" not in (run_dir / "bench.log").read_text()


def test_payloads_that_outlive_their_job_are_stopped_before_the_unit_starts(simhost, start_playbook, results_dir):
    # Two GPUs at once: one shell runs both payloads and waits for them. SIGKILL of that shell ends
    # the async job (its exit code -9) while both payloads keep running, orphaned, on their GPUs -
    # as a payload outside the async wrapper's process group outlives the kill at the time limit.
    run = start_playbook(simhost, {"moe_bench_m_list": LONG_M_LIST, "moe_bench_gpus": [0, 1],
                                   "moe_bench_gpu_parallel": True})

    def both_payloads_measuring():
        if run.proc.poll() is not None:
            raise AssertionError("the run ended before its payloads ran:\n%s" % run.stdout_so_far()[-6000:])
        pids = simhost.payload_pids()
        shells = {simhost.exec("ps -o ppid= -p %d" % pid, check=False).stdout.strip() for pid in pids}
        if len(pids) != 2 or len(shells) != 1 or "" in shells:
            return None
        # Each has measured an M (its results file exists): what is stopped later has figures to keep.
        for run_id in simhost.run_ids():
            docs = [simhost.read_json("%s/runs/%s/%s" % (STATE_DIR, run_id, name))
                    for name in ("results.json", "gpu1/results.json")]
            if all(doc and doc.get("results") for doc in docs):
                return pids, shells
        return None

    pids, (shell,) = wait_until(both_payloads_measuring, timeout=400, interval=0.5, what="both payloads running")
    assert "rc=0" in simhost.exec("ps -o args= -p %s" % shell).stdout, "the parent is not the job's shell"
    simhost.exec("kill -9 %s" % shell)
    # The job has ended; its payloads still run. Until they are gone the unit must stay down.
    samples = unit_stays_down_while_payloads_run(simhost, pids)
    assert samples >= 1, "the payloads ended with their shell: nothing under test"
    result = run.wait(timeout=400)
    text = " ".join(result.stdout.split())
    assert result.rc != 0, result.describe()
    assert "The benchmark failed on %s" % simhost.name in text, result.describe()
    assert re.search(r"exit code (-9|137)", text), result.describe()
    assert re.search(r"%s: 2 benchmark process\(es\) still ran from \S+ \(pids %s\); "
                     r"stopped them before starting" % (re.escape(simhost.name), ", ".join(map(str, sorted(pids)))),
                     text), result.describe()
    assert "2 by SIGTERM" in text, result.describe()
    assert not set(simhost.payload_pids()) & set(pids)
    assert_service_restored(simhost)
    # What each payload measured is kept: SIGTERM reached it, and it recorded the stop.
    (run_dir,) = fetched_run_dirs(results_dir, simhost)
    for gpu_results in (run_dir / "results.json", run_dir / "gpu1" / "results.json"):
        assert gpu_results.exists(), sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
        doc = json.loads(gpu_results.read_text())
        assert doc["results"], "the measured figures were lost"
        assert doc["status"] == "failed" and "SIGTERM" in json.dumps(doc["error"]), doc.get("error")
