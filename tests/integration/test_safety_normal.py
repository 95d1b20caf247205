"""A normal run against the simulated host: the baseline every failure case is compared with."""

import json
import os
import re

from conftest import STATE_DIR, fetched_run_dirs


def test_normal_run_restores_service_fetches_results_and_disarms_deadman(simhost, run_playbook, results_dir):
    before = simhost.unit_show()
    run = run_playbook(simhost)
    assert run.rc == 0, run.describe()
    after = simhost.unit_show()
    assert after["ActiveState"] == "active", after
    assert after["MainPID"] != before["MainPID"], "the unit was never restarted"
    assert simhost.health_status() == 200
    # Dead-man switch: armed before the stop, disarmed by the normal recovery.
    assert not simhost.timer_loaded(), "dead-man timer still loaded after a normal run"
    (run_id,) = simhost.run_ids()
    files = simhost.run_files(run_id)
    for name in ("plan.json", "prior_state.json", "job.json", "bench.log", "results.json", "results.csv",
                 "deadman.json", "recover.json"):
        assert name in files, (name, files)
    assert simhost.read_json("%s/runs/%s/deadman.json" % (STATE_DIR, run_id))["armed"] in (True, "True", "true")
    assert simhost.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock not released"
    (fetched,) = fetched_run_dirs(results_dir, simhost)
    results = json.loads((fetched / "results.json").read_text())
    assert results["status"] == "complete"
    assert [row["m"] for row in results["results"]] == [1, 2, 4, 8]
    # The playbook's own overhead: total wall time minus the benchmark and the model load.
    recover = simhost.read_json("%s/runs/%s/recover.json" % (STATE_DIR, run_id))
    bench_s = float(re.search(r"complete: \d+ M values in ([0-9.]+) s", (fetched / "bench.log").read_text()).group(1))
    ready_s = float(recover["time_to_ready_s"])
    timing = {"total_s": round(run.wall_s, 1), "benchmark_s": bench_s, "time_to_ready_s": ready_s,
              "overhead_s": round(run.wall_s - bench_s - ready_s, 1)}
    print("normal run timing: %s" % json.dumps(timing))
    timing_file = os.environ.get("MOE_BENCH_IT_TIMING_FILE")
    if timing_file:
        with open(timing_file, "w") as handle:
            json.dump(timing, handle)
