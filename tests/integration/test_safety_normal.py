"""A normal run against the simulated host: the baseline every failure case is compared with."""

import json
import os
import re

import pytest

from conftest import STATE_DIR, fetched_run_dirs


def test_normal_run_restores_service_fetches_results_and_disarms_deadman(simhost, run_playbook, results_dir):
    before = simhost.unit_show()
    # The model read-ahead beside the benchmark (a small folder of the host stands in for the
    # model's weights): it reads, records, and changes nothing the benchmark measures.
    run = run_playbook(simhost, {"moe_bench_prewarm_paths": "/usr/lib/python3.11", "moe_bench_prewarm_reserve_mib": 64})
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
    # The downtime, itemised in the manifest: from the stop to the first healthy answer, each
    # part measured, the benchmark process from the payload's own phases, the fetch after the
    # service was back (no part of it), the playbook's overhead the rest.
    manifest = json.loads((fetched / "manifest.json").read_text())
    parts = manifest["timeline"]["downtime_parts"]
    assert parts is not None, manifest["timeline"]
    seconds = {part["part"]: part["s"] for part in parts["parts"]}
    assert list(seconds) == ["stop", "memory", "benchmark", "fetch", "start", "overhead"] and parts["unmeasured"] == []
    assert sum(seconds.values()) == pytest.approx(parts["total_s"], abs=0.05)
    assert seconds["benchmark"] == pytest.approx(results["phases"]["process_s"], abs=0.01)
    assert [phase["phase"] for phase in parts["benchmark_phases"]] == ["import", "device", "weights", "check", "timing"]
    assert seconds["fetch"] == 0 and parts["fetch_after_downtime"] is True
    # The start part begins when the start is asked for, recover.json's time to ready once it returned.
    assert 0 < seconds["stop"] and 0 <= seconds["memory"] and ready_s - 0.5 <= seconds["start"]
    assert parts["total_s"] <= run.wall_s and parts["first_result_s"] < seconds["benchmark"]
    summary_md = (fetched / "summary.md").read_text()
    assert "**Downtime, itemised:** %.1f s = unit stop" % parts["total_s"] in summary_md
    assert "## Downtime\n\n```\n|" in summary_md
    prewarm = manifest["prewarm"]
    assert prewarm["paths"] == ["/usr/lib/python3.11"] and prewarm["error"] is None, prewarm
    assert prewarm["stopped"] in ("done", "benchmark ended") and 0 < prewarm["bytes"] <= prewarm["bytes_total"], prewarm
    assert "**Model read-ahead:** " in summary_md and "read into the page cache" in summary_md
    timing["downtime_s"] = parts["total_s"]
    timing["downtime_overhead_s"] = parts["overhead_s"]
    print("normal run timing: %s" % json.dumps(timing))
    timing_file = os.environ.get("MOE_BENCH_IT_TIMING_FILE")
    if timing_file:
        with open(timing_file, "w") as handle:
            json.dump(timing, handle)
