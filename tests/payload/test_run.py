"""Whole runs of the payload on the CPU, as the simulated host runs it: results, progress lines,
crashes mid-run leaving the finished M on disk."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from moe_bench import cli, presets
from moe_bench.schema import load_results

from conftest import REPO_ROOT, payload_env

PROGRESS = re.compile(
    r"^\[moe_bench\] M=(\d+) \((\d+)/(\d+)\) [\d.]+ us [\d.]+ us/token [\d.]+% of floor elapsed [\d.]+ s$"
)


def test_default_m_list_on_the_cpu_without_triton(run_payload, without_triton, tmp_path):
    """The simulated host: torch CPU build, no triton, tiny preset, every default M."""
    out = tmp_path / "run" / "results.json"
    started = time.monotonic()
    result = run_payload("--device", "cpu", "--backend", "torch", "--preset", "tiny", "--out", str(out),
                         path_first=without_triton, timeout=170)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert elapsed < 170

    progress = [PROGRESS.match(line) for line in result.stdout.splitlines() if PROGRESS.match(line)]
    assert [int(p.group(1)) for p in progress] == list(cli.DEFAULT_M_LIST)
    assert [int(p.group(2)) for p in progress] == list(range(1, 13))
    assert {int(p.group(3)) for p in progress} == {12}
    assert "[moe_bench] building weights ..." in result.stdout
    assert "[moe_bench] checking correctness ..." in result.stdout

    loaded = load_results(out)
    assert loaded["status"] == "complete" and loaded["error"] is None
    assert loaded["completed_m"] == list(cli.DEFAULT_M_LIST) and loaded["total_m"] == 12
    assert loaded["ceilings"] == {"bandwidth_gbps": 20.0, "tflops": 0.5, "source": "default"}
    assert loaded["config"]["preset"] == "tiny" and loaded["config"]["dtype"] == "float32"
    assert loaded["environment"]["device"] == "cpu" and loaded["environment"]["torch"]
    assert loaded["timing"]["method"] == "cpu-perf-counter"
    assert loaded["correctness"] and all(c["ok"] for c in loaded["correctness"])
    shape = presets.PRESETS["tiny"].shape()
    for row in loaded["results"]:
        assert row["us_p20"] <= row["us"] <= row["us_p80"]
        assert row["us_per_token"] == pytest.approx(row["us"] / row["m"], rel=1e-3)
        assert row["floor_us"] > 0 and 0 < row["pct_of_floor"]
        assert row["compile_s"] >= 0
        assert 0 < row["distinct_experts"] <= shape.experts
    csv_lines = (out.parent / "results.csv").read_text().splitlines()
    assert len(csv_lines) == 13 and csv_lines[0].startswith("m,us,us_p20,us_p80")
    # The process's own phases, in order, each measured, together the process's age at the end
    # (the downtime's benchmark part is itemised from them).
    phases = loaded["phases"]
    assert [name for name in phases if name.endswith("_s") and name not in ("compile_s", "first_result_s", "process_s")] \
        == ["import_s", "device_s", "weights_s", "check_s", "timing_s"]
    assert all(phases[name] >= 0 for name in phases)
    assert phases["import_s"] > 0.2, "importing torch takes time: the import phase must count it (from the process start)"
    parts = sum(phases[name] for name in ("import_s", "device_s", "weights_s", "check_s", "timing_s"))
    assert parts == pytest.approx(phases["process_s"], abs=0.01)
    assert phases["import_s"] + phases["device_s"] + phases["weights_s"] + phases["check_s"] \
        < phases["first_result_s"] < phases["process_s"] < elapsed
    assert phases["compile_s"] == loaded["compile_seconds"]


def test_given_ceilings_are_used_and_marked(tmp_path, capsys):
    out = tmp_path / "results.json"
    code = cli.main(["--device", "cpu", "--backend", "torch", "--preset", "tiny", "--m-list", "2",
                     "--bandwidth-gbps", "100", "--tflops", "3", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    loaded = load_results(out)
    assert loaded["ceilings"] == {"bandwidth_gbps": 100.0, "tflops": 3.0, "source": "given"}
    row = loaded["results"][0]
    assert row["floor_us"] == pytest.approx(row["bytes"] / 100e9 * 1e6, rel=1e-3)


def test_a_crash_mid_run_leaves_the_finished_m_on_disk(tmp_path, capsys, monkeypatch):
    out = tmp_path / "results.json"
    monkeypatch.setenv("MOE_BENCH_INTERNAL_FAIL_AT_M", "8")
    code = cli.main(["--device", "cpu", "--backend", "torch", "--preset", "tiny", "--m-list", "1,2,4,8,16",
                     "--out", str(out)])
    assert code == cli.EXIT_RUNTIME == 5
    captured = capsys.readouterr()
    assert "injected failure at M=8" in captured.err
    assert "[moe_bench] failed (runtime)" in captured.out
    loaded = load_results(out)
    assert loaded["status"] == "failed"
    assert loaded["error"]["kind"] == "runtime" and loaded["error"]["exit_code"] == 5
    assert "M=8" in loaded["error"]["message"]
    assert loaded["completed_m"] == [1, 2, 4]
    assert len((tmp_path / "results.csv").read_text().splitlines()) == 1 + 3


def test_a_killed_run_leaves_a_readable_file_with_the_finished_m(tmp_path):
    """SIGKILL (the async time limit) gives no chance to clean up: the atomic writes must do."""
    out = tmp_path / "results.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "moe_bench", "--device", "cpu", "--backend", "torch", "--preset", "tiny",
         "--m-list", ",".join(str(2**i) for i in range(14)), "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=payload_env(), cwd=REPO_ROOT,
    )
    try:
        deadline = time.monotonic() + 120
        completed = []
        while time.monotonic() < deadline and len(completed) < 3:
            time.sleep(0.2)
            if out.exists():
                completed = load_results(out)["completed_m"]
        assert len(completed) >= 3, "the run never got three M done"
    finally:
        process.kill()
        process.wait(timeout=30)
    loaded = load_results(out)
    assert loaded["status"] == "running"  # it never got to say otherwise
    assert loaded["completed_m"][:3] == [1, 2, 4]
    lines = (tmp_path / "results.csv").read_text().splitlines()
    assert len(lines) - 1 >= 3


def test_sigterm_marks_the_run_failed(tmp_path):
    out = tmp_path / "results.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "moe_bench", "--device", "cpu", "--backend", "torch", "--preset", "tiny",
         "--m-list", ",".join(str(2**i) for i in range(14)), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=payload_env(), cwd=REPO_ROOT,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if out.exists() and load_results(out)["completed_m"]:
            break
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 5
    assert "stopped by signal SIGTERM" in err
    loaded = load_results(out)
    assert loaded["status"] == "failed" and loaded["completed_m"]


def test_triton_backend_runs_end_to_end_under_the_interpreter(run_payload, tmp_path):
    try:
        from moe_bench import triton_moe  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name == "moe_bench.triton_moe":
            pytest.skip("moe_bench/triton_moe.py not present")
        raise
    out = tmp_path / "results.json"
    # A layer smaller than tiny: the interpreter runs every program in Python.
    result = run_payload("--device", "cpu", "--backend", "triton", "--experts", "8", "--hidden", "128",
                         "--inter", "64", "--topk", "2", "--m-list", "2", "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    loaded = load_results(out)
    assert loaded["status"] == "complete" and loaded["completed_m"] == [2]
    assert loaded["config"]["backend"] == "triton" and loaded["config"]["dtype"] == "float32"
    assert loaded["correctness"][0]["ok"] and loaded["correctness"][0]["config"]["block_m"] > 0


def test_out_of_memory_is_a_runtime_failure_that_names_the_phase(tmp_path, capsys, monkeypatch):
    from moe_bench import backends

    def exhausted(name, weights, max_m, dtype):
        raise RuntimeError("CUDA out of memory. Tried to allocate 36.00 GiB")

    monkeypatch.setattr(backends, "create_backend", exhausted)
    out = tmp_path / "results.json"
    code = cli.main(["--device", "cpu", "--backend", "torch", "--preset", "tiny", "--m-list", "1",
                     "--out", str(out)])
    assert code == cli.EXIT_RUNTIME
    assert "out of memory while preparing backend torch" in capsys.readouterr().err
    loaded = load_results(out)
    assert loaded["error"]["kind"] == "runtime" and loaded["error"]["exit_code"] == 5
    assert "out of memory" in loaded["error"]["message"]
