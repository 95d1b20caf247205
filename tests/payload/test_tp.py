"""The tensor-parallel layer (--tp-ranks): the shards, the bus bandwidth arithmetic, and whole
runs of 2 and 4 gloo ranks on the CPU at the tiny preset (a correct one, a wrong all-reduce that
the check must stop, a rank that dies mid-run, a launcher stopped by SIGTERM)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moe_bench import backends, cli, presets, quant, tp
from moe_bench.schema import SCHEMA_VERSION, load_results, phases_csv_path_for

from conftest import REPO_ROOT, payload_env
from test_correctness import dequantize_from_layout, inputs, row_errors

TINY_M = "1,8"


def tp_run(*args: str, env_extra: dict | None = None, timeout: float = 90, path_first=None):
    env = payload_env(**(env_extra or {}))
    if path_first is not None:
        env["PYTHONPATH"] = f"{path_first}:{env['PYTHONPATH']}"
    return subprocess.run([sys.executable, "-m", "moe_bench", "--device", "cpu", "--backend", "torch",
                           "--preset", "tiny", *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO_ROOT)


# ---- arithmetic ---------------------------------------------------------------------------------

def test_bus_bandwidth_is_nccl_tests_ring_factor_times_algorithm_bandwidth():
    # 1 GB per rank in 1 s: algbw 1 GB/s; busbw 2 (n - 1) / n of it.
    assert tp.allreduce_bandwidth_gbps(10**9, 1e6, 2) == pytest.approx((1.0, 1.0))
    assert tp.allreduce_bandwidth_gbps(10**9, 1e6, 4) == pytest.approx((1.0, 1.5))
    assert tp.allreduce_bandwidth_gbps(10**9, 1e6, 8) == pytest.approx((1.0, 1.75))
    # M=2048 of hidden 7168 in bf16 (29.4 MB) in 100 us: 293.6 GB/s algbw, 513.8 at 8 ranks.
    algbw, busbw = tp.allreduce_bandwidth_gbps(2048 * 7168 * 2, 100.0, 8)
    assert algbw == pytest.approx(293.60128) and busbw == pytest.approx(293.60128 * 1.75)
    with pytest.raises(ValueError):
        tp.allreduce_bandwidth_gbps(1, 0.0, 2)


@pytest.mark.parametrize("ranks", [2, 4])
def test_shards_are_slices_of_the_full_layer_and_sum_to_it(ranks):
    """Read back through the documented layout (not quant's unpacking): rank r's W13.T is the
    full layer's gate and up columns [r I/N, (r + 1) I/N), its W2.T the same rows; the ranks'
    reference outputs add up to the full layer's."""
    # Smaller than tiny (this runs in the test's process): 8 experts, hidden 128, inter 128.
    full_shape = quant.MoEShape(experts=8, hidden=128, inter=128, topk=2, group_size=32)
    full = quant.random_weights(full_shape, "cpu", seed=4)
    full_w13, full_w2 = dequantize_from_layout(full.w13), dequantize_from_layout(full.w2)
    part = full_shape.inter // ranks
    x, topk_ids, topk_weights = inputs(full_shape, 9, torch.float32, seed=3)
    total = torch.zeros(9, full_shape.hidden)
    for rank in range(ranks):
        shard = tp.shard_weights(full, rank, ranks)
        assert shard.shape == presets.shard_shape(full_shape, ranks)
        gate = slice(rank * part, (rank + 1) * part)
        up = slice(full_shape.inter + rank * part, full_shape.inter + (rank + 1) * part)
        assert torch.equal(dequantize_from_layout(shard.w13), torch.cat([full_w13[:, :, gate], full_w13[:, :, up]], 2))
        assert torch.equal(dequantize_from_layout(shard.w2), full_w2[:, gate])
        assert shard.nbytes() == quant.weights_bytes(shard.shape)
        total += backends.reference_moe(shard, x, topk_ids, topk_weights)
    whole = backends.reference_moe(full, x, topk_ids, topk_weights)
    assert float(row_errors(total, whole).max()) < 1e-5


def test_arguments_of_the_tensor_parallel_run_are_checked(capsys):
    assert cli.main(["--tp-ranks", "1", "--device", "cpu"]) == 2
    assert "at least 2 ranks" in capsys.readouterr().err
    assert cli.main(["--tp-ranks", "4", "--tp", "2", "--device", "cpu"]) == 2
    assert "leave --tp out" in capsys.readouterr().err
    assert cli.main(["--tp-ranks", "3", "--preset", "tiny", "--device", "cpu"]) == 2  # inter 128 / 3
    assert "not divisible by --tp 3" in capsys.readouterr().err
    assert cli.main(["--tp-ranks", "2", "--device", "cuda:2"]) == 2
    assert "CUDA_VISIBLE_DEVICES" in capsys.readouterr().err


def test_preflight_reports_every_rank_against_the_per_rank_need(capsys):
    assert cli.main(["--preflight", "--tp-ranks", "2", "--device", "cpu", "--backend", "torch", "--preset", "tiny"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert cli.main(["--estimate", "--tp-ranks", "2", "--device", "cpu", "--backend", "torch", "--preset", "tiny"]) == 0
    assert report["need_mib"] == json.loads(capsys.readouterr().out)["total_mib"]
    assert [rank["rank"] for rank in report["ranks"]] == [0, 1] and all(r["fits_now"] for r in report["ranks"])


def test_cuda_ranks_without_cuda_devices_are_an_environment_failure(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.fail("this test needs a machine without CUDA devices (the payload suite runs on the CPU)")
    out = tmp_path / "results.json"
    code = cli.main(["--tp-ranks", "2", "--device", "cuda:0", "--backend", "torch", "--preset", "tiny",
                     "--out", str(out)])
    assert code == 3
    assert "--tp-ranks 2 on CUDA requested but" in capsys.readouterr().err
    loaded = load_results(out)
    assert loaded["error"]["kind"] == "environment" and loaded["tp"]["collective"] == "nccl"
    assert loaded["tp"]["environment"]["NCCL_NVLS_ENABLE"] == "0"


def test_estimate_is_per_rank_and_counts_the_full_layer_each_rank_cuts_from(capsys):
    assert cli.main(["--estimate", "--tp-ranks", "8", "--preset", "kimi-k2.6"]) == 0
    per_rank = json.loads(capsys.readouterr().out)
    assert cli.main(["--estimate", "--tp", "8", "--preset", "kimi-k2.6"]) == 0
    shard_alone = json.loads(capsys.readouterr().out)
    full = quant.weights_bytes(presets.PRESETS["kimi-k2.6"].shape())
    assert per_rank["per_rank"] is True and per_rank["devices"] == [f"cuda:{i}" for i in range(8)]
    assert per_rank["full_layer_weights_bytes"] == full
    reduce_buffers = cli.ROUTINGS["cuda"] * 2048 * 7168 * 2
    assert per_rank["total_bytes"] == shard_alone["total_bytes"] + full + reduce_buffers
    assert per_rank["total_mib"] * 2**20 >= per_rank["total_bytes"]


# ---- whole runs on gloo -------------------------------------------------------------------------

def test_two_ranks_time_the_phases_and_check_the_sum(tmp_path):
    out = tmp_path / "results.json"
    # An operator's NCCL_NVLS_ENABLE=1 must not reach the ranks.
    result = tp_run("--tp-ranks", "2", "--m-list", TINY_M, "--out", str(out), env_extra={"NCCL_NVLS_ENABLE": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    loaded = load_results(out)
    assert loaded["schema_version"] == SCHEMA_VERSION == 4 and loaded["status"] == "complete"
    assert loaded["config"]["tp_ranks"] == 2 and loaded["config"]["tp"] == 2 and loaded["config"]["inter"] == 64
    setup = loaded["tp"]
    assert setup["ranks"] == 2 and setup["collective"] == "gloo" and setup["full_inter"] == 128
    assert setup["environment_by_rank"] == [tp.MULTICAST_OFF] * 2
    assert setup["environment_by_rank"][1]["NCCL_NVLS_ENABLE"] == "0"
    # Checked: the sum of the ranks against the whole layer, every row.
    assert [c["m"] for c in loaded["correctness"]] == [1, 3, 8]
    assert all(c["ok"] and c["worst_row_rel_err"] < 1e-5 and "sum of 2 ranks" in c["checked"]
               for c in loaded["correctness"])
    assert loaded["completed_m"] == [1, 8]
    rows = loaded["tp_results"]
    assert [row["m"] for row in rows] == [1, 8]
    for row in rows:
        assert row["ranks"] == 2 and row["samples"] == tp.SAMPLES["cpu"]
        for phase in ("layer", "moe", "allreduce"):
            assert 0 < row[f"{phase}_us_p20"] <= row[f"{phase}_us"] <= row[f"{phase}_us_p80"]
        assert row["allreduce_bytes"] == row["m"] * 256 * 4  # float32 on the CPU
        assert row["algbw_gbps"] == pytest.approx(row["allreduce_bytes"] / row["allreduce_us"] / 1e3, rel=1e-3)  # us rounded to 1 ns
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"], rel=1e-9)  # 2 (n - 1) / n = 1 at n = 2
        assert len(row["moe_us_by_rank"]) == 2 and row["moe_us"] == pytest.approx(max(row["moe_us_by_rank"]))
    # `results` carries the shard's MoE (the slowest rank's), with its floor.
    assert [r["us"] for r in loaded["results"]] == [row["moe_us"] for row in rows]
    assert all(r["floor_us"] > 0 for r in loaded["results"])
    with open(phases_csv_path_for(out), newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [int(r["m"]) for r in table] == [1, 8] and len(table[0]["moe_us_by_rank"].split(";")) == 2
    assert "layer" in result.stdout and "all-reduce" in result.stdout


def defect_folder(tmp_path, body: str):
    """A sitecustomize.py put first on PYTHONPATH: every Python process of the run, the ranks
    that the launcher spawns included, runs `body` at start-up (monkeypatching in this process
    cannot reach a spawned one)."""
    folder = tmp_path / "defect"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(body)
    return folder


def test_an_all_reduce_that_sums_nothing_is_stopped_before_timing(tmp_path):
    """Each rank's output left as its own shard's: the check against the whole layer fails."""
    folder = defect_folder(tmp_path, "import sys\n"
                                     "if '--multiprocessing-fork' in sys.argv:  # the ranks alone\n"
                                     "    import torch.distributed\n"
                                     "    torch.distributed.all_reduce = lambda tensor, *args, **kwargs: None\n")
    out = tmp_path / "results.json"
    result = tp_run("--tp-ranks", "2", "--m-list", TINY_M, "--out", str(out), path_first=folder)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "the 2-rank layer (backend torch) is wrong at M=1" in result.stderr
    loaded = load_results(out)
    assert loaded["status"] == "failed" and loaded["error"]["kind"] == "correctness"
    assert loaded["correctness"][-1]["ok"] is False and loaded["tp_results"] == [] and loaded["results"] == []


def stuck_ranks(tmp_path, condition: str):
    """Ranks whose timing of an M never returns when `condition` (on self.rank and m) holds, as
    a rank waiting in an NCCL collective whose peer is gone would hang (gloo would notice the
    closed connection itself, so a plain crash on the CPU proves nothing about the launcher)."""
    return defect_folder(tmp_path, "import sys\n"
                                   "if '--multiprocessing-fork' in sys.argv:  # the ranks alone\n"
                                   "    import time\n"
                                   "    from moe_bench import tp\n"
                                   "    timed = tp._Rank.time_one_m\n"
                                   "    def time_one_m(self, m):\n"
                                   f"        if {condition}:\n"
                                   "            time.sleep(120)  # bounded: a broken launcher leaves no rank for long\n"
                                   "        return timed(self, m)\n"
                                   "    tp._Rank.time_one_m = time_one_m\n")


def test_a_rank_failing_mid_run_stops_the_others_and_keeps_the_finished_m(tmp_path):
    """Rank 1 fails at M=8 while rank 0 hangs there: the launcher names rank 1's failure and
    stops rank 0 within its grace period, not at the collective's timeout (15 min)."""
    out = tmp_path / "results.json"
    started = time.monotonic()
    result = tp_run("--tp-ranks", "2", "--m-list", TINY_M, "--out", str(out),
                    env_extra={"MOE_BENCH_INTERNAL_FAIL_AT_M": "8"},
                    path_first=stuck_ranks(tmp_path, "self.rank == 0 and m == 8"))
    assert result.returncode == 5, result.stdout + result.stderr
    assert "rank 1: injected failure at M=8" in result.stderr
    loaded = load_results(out)
    assert loaded["status"] == "failed" and loaded["error"]["exit_code"] == 5
    assert loaded["completed_m"] == [1] and [row["m"] for row in loaded["tp_results"]] == [1]
    assert time.monotonic() - started < 60


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path):
    """As the playbook does at the end of the benchmark's budget, with every rank hanging."""
    out = tmp_path / "results.json"
    env = payload_env()
    env["PYTHONPATH"] = f"{stuck_ranks(tmp_path, 'True')}:{env['PYTHONPATH']}"
    process = subprocess.Popen([sys.executable, "-m", "moe_bench", "--device", "cpu", "--backend", "torch",
                                "--preset", "tiny", "--tp-ranks", "2", "--m-list", TINY_M, "--out", str(out)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    deadline = time.monotonic() + 60
    # Every check done: the ranks are in their first timing, stuck.
    while time.monotonic() < deadline and not (out.exists() and len(load_results(out)["correctness"]) == 3):
        time.sleep(0.2)
    children = children_of(process.pid)
    try:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
        assert process.returncode == 5 and "stopped by signal SIGTERM" in err
        assert load_results(out)["status"] == "failed"
        assert len(children) >= 2  # the two ranks (and multiprocessing's resource tracker)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(pid) for pid in children):
            time.sleep(0.1)
        assert not [pid for pid in children if alive(pid)], "a rank outlived its launcher"
    finally:  # what this test started, by pid, when the launcher failed to stop it
        for pid in [process.pid, *children]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
