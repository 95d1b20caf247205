"""No downtime when it is not needed: the rehearsal beside the live service (torch backend here:
fewer experts than the layer, every M checked and timed) with moe_bench_stop never (the reduced
run only), then auto (the full run beside the unit, which fits on the simulated GPU's free memory).
Each run: the unit never stopped (same MainPID, no stop in its journal), no dead-man timer, no
lock, and results marked as what they are."""

import json

from conftest import STATE_DIR, fetched_run_dirs


def assert_service_untouched(host, before, since):
    after = host.unit_show()
    assert after["ActiveState"] == "active" and host.health_status() == 200
    assert after["MainPID"] == before["MainPID"], (before, after)
    assert host.stop_count(since) == 0
    assert not host.timer_loaded()
    assert host.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0


def test_never_and_auto_run_beside_the_live_service(simhost, run_playbook, results_dir):
    before = simhost.unit_show()
    since = simhost.epoch()

    # never: only the rehearsal, a reduced zero-downtime trend result.
    run = run_playbook(simhost, {"moe_bench_stop": "never", "moe_bench_rehearse": "required"})
    assert run.rc == 0, run.describe()
    print("never run: %.1f s" % run.wall_s)
    text = " ".join(run.stdout.split())
    assert "moe_bench_stop is never: only the rehearsal ran" in text, run.describe()
    assert_service_untouched(simhost, before, since)
    (never_dir,) = fetched_run_dirs(results_dir, simhost)
    rehearsal = json.loads((never_dir / "rehearsal.json").read_text())
    assert rehearsal["status"] == "complete" and rehearsal["rehearsal"]["reduced"] is True
    assert rehearsal["config"]["experts"] == 8 < rehearsal["rehearsal"]["layer_experts"] == 16
    assert [r["m"] for r in rehearsal["results"]] == [1, 2, 4, 8]
    assert all(check["ok"] for check in rehearsal["correctness"])
    assert not (never_dir / "results.json").exists()  # no full run
    manifest = json.loads((never_dir / "manifest.json").read_text())
    assert manifest["stop"]["mode"] == "never" and manifest["stop"]["stop"] is False
    assert manifest["rehearsal"]["reduced"] is True and manifest["rehearsal"]["experts"] == 8
    assert manifest["timeline"]["downtime_s"] is None
    assert "**Rehearsal (REDUCED, zero downtime):** 8 of the layer's 16 experts" in (never_dir / "summary.md").read_text()

    # auto: the simulated GPU has about 13 GB free beside the unit, the tiny run needs far less:
    # the full run goes beside it (the rehearsal, proven above, is left out to keep the test short).
    run = run_playbook(simhost, {"moe_bench_stop": "auto", "moe_bench_rehearse": "false"})
    assert run.rc == 0, run.describe()
    print("auto run: %.1f s" % run.wall_s)
    text = " ".join(run.stdout.split())
    assert "moe_bench_stop is auto and the run fits beside the serving unit (GPU 0" in text, run.describe()
    assert_service_untouched(simhost, before, since)
    auto_dir = [d for d in fetched_run_dirs(results_dir, simhost) if d != never_dir][0]
    results = json.loads((auto_dir / "results.json").read_text())
    assert results["status"] == "complete" and results["config"]["experts"] == 16 and results["rehearsal"] is None
    assert not (auto_dir / "rehearsal.json").exists()
    manifest = json.loads((auto_dir / "manifest.json").read_text())
    assert manifest["stop"]["mode"] == "auto" and manifest["stop"]["beside"] is True
    assert manifest["stop"]["gpus_beside"][0]["index"] == 0 and manifest["stop"]["gpus_beside"][0]["free_mib"] > 0
    assert manifest["timeline"]["downtime_s"] is None


def test_the_triton_rehearsal_runs_under_the_interpreter_beside_the_live_service(simhost, run_playbook, results_dir):
    """The triton backend's rehearsal on the simulated host: Triton's interpreter (the bench venv
    carries Triton) runs the payload's own kernels on the CPU, each configuration checked against
    the reference, with the service serving throughout."""
    before = simhost.unit_show()
    since = simhost.epoch()
    known = set(fetched_run_dirs(results_dir, simhost))
    run = run_playbook(simhost, {"moe_bench_stop": "never", "moe_bench_rehearse": "required",
                                 "moe_bench_backend": "triton",
                                 # the interpreter computes bf16 dots wrongly: float16 on the CPU
                                 "moe_bench_extra_args": ["--dtype", "float16"]})
    assert run.rc == 0, run.describe()
    print("triton rehearsal run: %.1f s" % run.wall_s)
    assert "moe_bench_stop is never: only the rehearsal ran" in " ".join(run.stdout.split()), run.describe()
    assert_service_untouched(simhost, before, since)
    (run_dir,) = [d for d in fetched_run_dirs(results_dir, simhost) if d not in known]
    rehearsal = json.loads((run_dir / "rehearsal.json").read_text())
    assert rehearsal["status"] == "complete", rehearsal.get("error")
    assert rehearsal["config"]["backend"] == "triton" and rehearsal["config"]["dtype"] == "float16"
    assert rehearsal["environment"]["triton"] and rehearsal["environment"]["device"] == "cpu"
    assert rehearsal["rehearsal"]["reduced"] is True
    # Every M was checked through one of the Triton kernels' paths (the torch backend's is
    # "looped-experts"), then timed.
    checks = rehearsal["correctness"]
    # (the check adds an odd M of its own: 3)
    assert {1, 2, 4, 8} <= {check["m"] for check in checks} and all(check["ok"] for check in checks), checks
    assert all(check["config"]["path"] in ("one-row", "tensor-core") for check in checks), checks
    assert [r["m"] for r in rehearsal["results"]] == [1, 2, 4, 8]


def test_a_rehearsal_that_computes_wrongly_refuses_the_host_before_anything_is_stopped(simhost, run_playbook):
    """A rehearsal whose check fails (the payload's test hook makes M=2's output wrong): the
    host is refused in the preflight with the M, the tile configuration and the error, and the
    service keeps serving: no stop, no dead-man timer, no lock, no benchmark launched."""
    before = simhost.unit_show()
    since = simhost.epoch()
    simhost.set_payload_env(MOE_BENCH_INTERNAL_WRONG_AT_M=2)
    run = run_playbook(simhost, {"moe_bench_rehearse": "true"})
    assert run.rc != 0, run.describe()
    text = " ".join(run.stdout.split())
    assert "The rehearsal failed on %s (exit code 4 (correctness)): backend torch is wrong at M=2 (tile config" % (
        simhost.name) in text, run.describe()
    assert "(rehearsal with 8 of the layer's 16 experts)" in text, run.describe()
    assert "was not touched and is still serving; nothing was stopped" in text, run.describe()
    assert_service_untouched(simhost, before, since)
    (run_id,) = simhost.run_ids()
    rehearsal = simhost.read_json("%s/runs/%s/rehearsal.json" % (STATE_DIR, run_id))
    assert rehearsal["status"] == "failed" and rehearsal["error"]["kind"] == "correctness", rehearsal
    assert [(c["m"], c["ok"]) for c in rehearsal["correctness"]][-1] == (2, False), rehearsal["correctness"]
    assert "job.json" not in simhost.run_files(run_id) and not simhost.payload_pids()
