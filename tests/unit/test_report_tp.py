"""The report of a tensor-parallel run (--tp-ranks): the layer's time split into MoE and
all-reduce against M, beside the one-GPU curve, built from what the payload really wrote (two
CPU runs of the tiny preset: one device, and 2 gloo ranks) and from a schema-1 H200 run."""

from __future__ import annotations

import json
import shutil

import pytest
from report_fixtures import FIXTURES, REAL_H200, REPO, write_run

from moe_bench import schema
from moe_bench_report import figures
from moe_bench_report.build import TP_RESULTS_NAME, build_report

HOST = "gpu-h200-01"
ONE_DEVICE = FIXTURES / "cpu" / "cpu_tiny_torch.json"
TWO_RANKS = FIXTURES / "cpu" / "cpu_tiny_torch_tp2_gloo.json"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fixture(path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def run_with(tmp_path, main: dict | None, tp: dict | str | None = None, run_id="20261201T090000Z-aaaaaa", **options):
    run_dir = write_run(tmp_path / "results", HOST, run_id, main)
    if isinstance(tp, dict):
        (run_dir / TP_RESULTS_NAME).write_text(json.dumps(tp), encoding="utf-8")
    elif isinstance(tp, str):
        (run_dir / TP_RESULTS_NAME).write_text(tp, encoding="utf-8")
    options.setdefault("plots", False)
    return build_report(run_dir, HOST, {}, environ={}, **options), run_dir


def test_the_fixtures_are_what_the_payload_writes():
    one, two = schema.load_results(ONE_DEVICE), schema.load_results(TWO_RANKS)
    assert one["tp"] is None and one["config"]["tp_ranks"] is None and one["status"] == "complete"
    assert two["tp"]["ranks"] == 2 and two["config"]["tp_ranks"] == 2 and two["status"] == "complete"
    assert [row["m"] for row in two["tp_results"]] == [row["m"] for row in one["results"]] == [1, 2, 4, 8, 16, 32]


def test_layer_rows_split_the_time_and_stand_beside_the_one_gpu_time():
    document = {"tp_results": [
        # Timed on their own, the layer and its parts need not add up: 130 against 90 + 30.
        {"m": 4, "ranks": 8, "layer_us": 130.0, "moe_us": 90.0, "allreduce_us": 30.0, "busbw_gbps": 40.0},
        {"m": 1, "ranks": 8, "layer_us": 100.0, "moe_us": 40.0, "allreduce_us": 60.0, "busbw_gbps": 2.0},
        {"m": 2, "ranks": 8, "layer_us": None, "moe_us": 50.0, "allreduce_us": 50.0},  # not timed: left out
    ]}
    rows = figures.tp_layer_rows(document, [{"m": 1, "us": 250.0}, {"m": 2, "us": 260.0}])
    assert [row["m"] for row in rows] == [1, 4]
    assert rows[0]["allreduce_share"] == pytest.approx(0.6) and rows[1]["allreduce_share"] == pytest.approx(0.25)
    assert rows[0]["single_gpu_us"] == 250.0 and rows[0]["layer_vs_single_gpu"] == pytest.approx(0.4)
    assert rows[1]["single_gpu_us"] is None and rows[1]["layer_vs_single_gpu"] is None
    assert figures.tp_layer_rows({"tp_results": []}) == []


def test_report_shows_the_split_beside_the_one_gpu_curve(tmp_path):
    one, two = schema.load_results(ONE_DEVICE), schema.load_results(TWO_RANKS)
    summary, run_dir = run_with(tmp_path, fixture(ONE_DEVICE), fixture(TWO_RANKS), plots=True)
    tp = summary["tp"]
    assert tp["ranks"] == 2 and tp["collective"] == "gloo" and tp["status"] == "complete"
    assert [row["m"] for row in tp["per_m"]] == [1, 2, 4, 8, 16, 32]
    for row, phases, single in zip(tp["per_m"], two["tp_results"], one["results"]):
        assert row["layer_us"] == phases["layer_us"] and row["moe_us"] == phases["moe_us"]
        assert row["allreduce_share"] == pytest.approx(phases["allreduce_us"] / (phases["moe_us"] + phases["allreduce_us"]))
        assert row["single_gpu_us"] == single["us"]
    assert "TP=1" in tp["single_gpu_config_label"] and "TP=2" in tp["config_label"]

    text = (run_dir / "summary.md").read_text()
    assert "## Tensor-parallel layer: 2 ranks (gloo)" in text
    for row in tp["per_m"]:
        assert (f"| {row['m']} | {row['layer_us']:,.1f} | {row['moe_us']:,.1f} | {row['allreduce_us']:,.1f} | "
                f"{row['allreduce_share'] * 100:.1f}% |") in text
        assert f"| {row['single_gpu_us']:,.1f} |" in text
    assert "![tensor-parallel layer against M](tp_layer.png)" in text
    assert "### Correctness of the reduced output (whole layer)" in text
    assert any(line.startswith("Tensor-parallel layer on 2 ranks") for line in summary["console"])
    headline = json.loads((run_dir / "summary.json").read_text())["headline"]
    assert headline["tp_ranks"] == 2 and headline["tp_layer_us_per_m"]["32"] == round(two["tp_results"][-1]["layer_us"], 1)
    # The one-GPU run stays the run of record: its curve, history and comparison are untouched.
    assert [row["m"] for row in summary["per_m"]] == [1, 2, 4, 8, 16, 32]
    assert summary["config_key"]["tp"] == 1
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert set(manifest["files_sha256"]) == {"results.json", TP_RESULTS_NAME}

    picture = run_dir / "tp_layer.png"
    assert summary["files"]["tp_layer_png"] == str(picture)
    from matplotlib import image

    assert picture.read_bytes()[:8] == PNG_SIGNATURE
    pixels = image.imread(picture)
    assert pixels.shape[:2] == (600, 1000)
    rgb = (pixels[:, :, :3] * 255).round().astype(int)
    non_white = (rgb.sum(axis=2) < 3 * 250).mean()
    assert 0.05 < non_white < 0.7  # two panels of curves and bars, not a blank page
    orange = ((abs(rgb[:, :, 0] - 0xFF) < 20) & (abs(rgb[:, :, 1] - 0x7F) < 20) & (rgb[:, :, 2] < 40)).mean()
    assert orange > 0.01  # the all-reduce's bars are drawn


def test_a_tensor_parallel_run_alone_is_its_own_report(tmp_path):
    """Run instead of the per-GPU runs: the results are the TP run's, its shard's MoE the curve."""
    summary, run_dir = run_with(tmp_path, fixture(TWO_RANKS))
    assert summary["tp"]["ranks"] == 2 and summary["tp"]["single_gpu_config_label"] is None
    assert all(row["single_gpu_us"] is None for row in summary["tp"]["per_m"])
    assert summary["config_key"]["tp"] == 2
    assert "no one-GPU run beside it" in (run_dir / "summary.md").read_text()


def test_old_results_and_no_tensor_parallel_run_give_the_report_as_before(tmp_path):
    """A schema-1 H200 run: upgraded on load, no TP section, no TP picture."""
    raw = fixture(REAL_H200)
    assert raw["schema_version"] == 1 and "tp" not in raw
    summary, run_dir = run_with(tmp_path, raw, plots=True)
    assert summary["status"] == "complete" and summary["tp"] is None
    assert summary["files"]["tp_layer_png"] is None and not (run_dir / "tp_layer.png").exists()
    assert "Tensor-parallel" not in (run_dir / "summary.md").read_text()
    assert summary["headline"]["tp_ranks"] is None and summary["headline"]["tp_layer_us_per_m"] == {}
    assert all(check["worst_row_rel_err"] is None for check in summary["correctness"])


def test_an_old_one_gpu_run_beside_a_tensor_parallel_run(tmp_path):
    summary, _ = run_with(tmp_path, fixture(REAL_H200), fixture(TWO_RANKS))
    # The H200 run timed M=1..2048; the CPU ranks 1..32: the common M carry the one-GPU time.
    assert all(row["single_gpu_us"] for row in summary["tp"]["per_m"])


def test_an_unreadable_tensor_parallel_file_is_named_and_the_rest_is_built(tmp_path):
    summary, run_dir = run_with(tmp_path, fixture(ONE_DEVICE), '{"schema": "moe_bench.results", "sche')
    assert summary["status"] == "complete" and [row["m"] for row in summary["per_m"]] == [1, 2, 4, 8, 16, 32]
    assert summary["tp"]["status"] == "unreadable" and "not valid JSON" in summary["tp"]["load_error"]
    assert "The tensor-parallel results could not be read" in (run_dir / "summary.md").read_text()


def test_cli_takes_the_tensor_parallel_results_from_anywhere(tmp_path):
    import subprocess
    import sys

    run_dir = write_run(tmp_path / "results", HOST, "20261201T100000Z-bbbbbb", fixture(ONE_DEVICE))
    elsewhere = tmp_path / "tp.json"
    shutil.copy(TWO_RANKS, elsewhere)
    result = subprocess.run([sys.executable, "-m", "moe_bench_report", "build", "--run-dir", str(run_dir),
                             "--host", HOST, "--tp-results", str(elsewhere), "--no-plots", "--print", "json"],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert any(line.startswith("Tensor-parallel layer on 2 ranks") for line in printed["console"])
    assert json.loads((run_dir / "summary.json").read_text())["tp"]["results_file"] == str(elsewhere)
