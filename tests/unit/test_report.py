"""The controller-side report (moe_bench_report) built from a real results file.

Every build goes through the real package: moe_bench.schema.load_results reads the JSON,
matplotlib draws the PNGs, git answers for the project commit, history.json accumulates.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from report_fixtures import REPO, results_fixture, slowed, write_run

from moe_bench import schema
from moe_bench_report import figures
from moe_bench_report.build import build_report
from moe_bench_report.manifest import launch_info, project_revision

HOST = "gpu-h200-01"
TIMELINE = {
    "service_stop_stopped_at": "2026-11-29T14:01:02Z",
    "bench_run_async_started_at": "2026-11-29T14:01:40Z",
    "bench_run_async_finished_at": "2026-11-29T14:05:50.500000+00:00",
    "service_recover_ready_at": "2026-11-29T15:13:31+01:00",
    "service_recover_time_to_ready_s": "455.2",
    "moe_bench_plan": {"run_id": "20261129T140100Z-a1b2c3", "budgets": {"bench_s": 1800}},
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def real_document() -> dict:
    # The loader is the one the report uses; the fixture must pass it as it is.
    return schema.load_results(results_fixture())


def _rows(document: dict) -> list[dict]:
    return figures.timed_rows(document)


# ---- the knee -----------------------------------------------------------------------------


def _curve(times: dict[int, float]) -> list[dict]:
    return [{"m": m, "us": us} for m, us in times.items()]


def test_knee_is_first_step_whose_growth_per_doubling_is_below_the_rule():
    rows = _curve({1: 100, 2: 190, 4: 350, 8: 600, 16: 640, 32: 650, 64: 1300})
    knee = figures.find_knee(rows, growth=0.10)
    # 8 -> 16 grows 6.7%: the first step under 10%; the later jump at 64 does not move it.
    assert knee["m"] == 8
    assert knee["next_m"] == 16
    assert knee["us_per_token"] == pytest.approx(600 / 8)
    assert knee["growth_per_doubling"] == pytest.approx(640 / 600 - 1, abs=1e-4)


def test_knee_normalises_gaps_in_the_m_list_per_doubling():
    # 64 -> 256 is two doublings: +34.6% overall is +16% per doubling, not a plateau at 10%.
    rows = _curve({1: 411, 4: 1369, 16: 4470, 64: 12197, 256: 16416, 1024: 16563, 2048: 16698})
    assert figures.find_knee(rows, growth=0.10)["m"] == 256
    # The same points with a 20% rule: 64 -> 256 (+16% per doubling) already qualifies.
    assert figures.find_knee(rows, growth=0.20)["m"] == 64


def test_no_knee_when_time_keeps_growing_and_never_at_the_last_m():
    assert figures.find_knee(_curve({1: 10, 2: 20, 4: 40, 8: 80}), growth=0.05) is None
    assert figures.find_knee(_curve({1: 10, 2: 20, 4: 40, 8: 41}), growth=0.05)["m"] == 4
    assert figures.find_knee(_curve({1: 10}), growth=0.05) is None
    with pytest.raises(ValueError):
        figures.find_knee(_curve({1: 10, 2: 11}), growth=0)


def test_knee_and_saturation_on_the_h200_run(real_document):
    rows = _rows(real_document)
    knee = figures.find_knee(rows)
    saturation = figures.find_saturation(rows, knee)
    ordered = sorted(rows, key=lambda row: row["m"])
    by_m = {row["m"]: row for row in ordered}
    growth = {
        low["m"]: (high["us"] / low["us"]) ** (1 / math.log2(high["m"] / low["m"])) - 1
        for low, high in zip(ordered, ordered[1:])
    }
    # The defining properties, checked from the raw rows: every step before the knee grew by
    # 10% or more per doubling, the knee's own step by less; saturation is the first step
    # from the knee on that grows by 50% or more.
    assert all(growth[m] >= figures.DEFAULT_KNEE_GROWTH for m in growth if m < knee["m"])
    assert growth[knee["m"]] < figures.DEFAULT_KNEE_GROWTH
    end = saturation["m"] if saturation else max(growth) + 1
    assert all(growth[m] < figures.DEFAULT_SATURATION_GROWTH for m in growth if knee["m"] <= m < end)
    if saturation:
        assert growth[saturation["m"]] >= figures.DEFAULT_SATURATION_GROWTH
    assert knee["us"] == by_m[knee["m"]]["us"]
    # On this H200 run (Triton kernel) time still grows by three quarters or more per doubling
    # up to M=64 (the one-row kernels, new experts being touched) and is flat from 64 to 128
    # (3766 -> 3779 us, the tensor-core kernels taking over): the plateau of the field notes.
    assert knee["m"] == 64


def test_saturation_needs_a_knee_and_a_steep_step_after_it():
    rows = _curve({1: 100, 2: 190, 4: 200, 8: 210, 16: 400})
    knee = figures.find_knee(rows, growth=0.10)
    assert knee["m"] == 2
    assert figures.find_saturation(rows, knee)["m"] == 8
    assert figures.find_saturation(rows, None) is None
    assert figures.find_saturation(_curve({1: 100, 2: 105, 4: 110}), {"m": 1}) is None


# ---- comparing two runs --------------------------------------------------------------------


def test_compare_runs_flags_only_slowdowns_beyond_the_threshold(real_document):
    baseline = _rows(real_document)
    for factor, flagged in ((1.15, True), (1.05, False), (0.80, False)):
        current = _rows(slowed(real_document, 64, factor))
        result = figures.compare_runs(current, baseline, 0.10)
        assert result["regressed"] is flagged
        assert [entry["m"] for entry in result["slower"]] == ([64] if flagged else [])
        change = next(entry["change"] for entry in result["per_m"] if entry["m"] == 64)
        assert change == pytest.approx(factor - 1, abs=1e-3)


def test_compare_runs_uses_only_m_values_both_runs_timed(real_document):
    baseline = [row for row in _rows(real_document) if row["m"] <= 64]
    current = _rows(slowed(real_document, 256, 2.0))
    result = figures.compare_runs(current, baseline, 0.10)
    assert result["compared_m"] == [row["m"] for row in baseline]
    assert result["regressed"] is False


# ---- the whole report ------------------------------------------------------------------------


def _build(tmp_path, run_id, document, given=None, **options):
    run_dir = write_run(tmp_path / "results", HOST, run_id, document)
    options.setdefault("plots", False)
    return build_report(run_dir, HOST, given or {}, environ={}, **options), run_dir


def test_report_files_manifest_and_summary_from_the_h200_run(tmp_path, real_document):
    run_id = TIMELINE["moe_bench_plan"]["run_id"]
    raw = json.loads(results_fixture().read_text())
    given = dict(TIMELINE, awx_job_id=4321, awx_job_launch_type="scheduled", awx_schedule_name="weekly h200")
    summary, run_dir = _build(tmp_path, run_id, raw, given)

    for name in ("manifest.json", "summary.md", "summary.json"):
        assert (run_dir / name).is_file(), name
    manifest = json.loads((run_dir / "manifest.json").read_text())
    environment = real_document["environment"]
    assert manifest["host"] == HOST and manifest["run_id"] == run_id
    assert manifest["gpu"]["name"] == environment["gpu_name"]
    assert manifest["gpu"]["driver"] == environment["driver"]
    assert manifest["software"] == {key: environment[key] for key in ("torch", "triton", "python")}
    assert manifest["payload"]["config"] == real_document["config"]
    assert manifest["payload"]["ceilings"] == real_document["ceilings"]
    assert manifest["plan"] == TIMELINE["moe_bench_plan"]
    timeline = manifest["timeline"]
    # Ready 15:13:31+01:00 is 14:13:31Z: 12 min 29 s after the stop.
    assert timeline["service_ready_at"] == "2026-11-29T14:13:31Z"
    assert timeline["downtime_s"] == 749.0
    assert timeline["benchmark_s"] == 250.5
    assert timeline["time_to_ready_s"] == 455.2
    assert manifest["launch"]["by"] == "awx"
    assert manifest["launch"]["job_id"] == "4321"
    assert manifest["launch"]["scheduled"] is True
    assert manifest["files_sha256"]["results.json"] == schema_sha256(run_dir / "results.json")
    git_head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "HEAD"], capture_output=True, text=True)
    expected_commit = git_head.stdout.strip() if git_head.returncode == 0 else "unknown"
    assert manifest["project"]["commit"] == expected_commit

    saved = json.loads((run_dir / "summary.json").read_text())
    rows = _rows(real_document)
    assert [row["m"] for row in saved["per_m"]] == [row["m"] for row in rows]
    headline = saved["headline"]
    assert headline["us_per_m"] == {str(row["m"]): round(row["us"], 1) for row in rows}
    assert headline["knee_m"] == figures.find_knee(rows)["m"]
    assert headline["downtime_s"] == 749.0
    assert headline["regression"] is False and headline["baseline_run_id"] is None

    text = (run_dir / "summary.md").read_text()
    assert f"# MoE benchmark on {HOST}, run {run_id}" in text
    for row in rows:
        assert f"| {row['m']}" in text
        assert f"{row['us']:,.1f}" in text
        assert f"{row['pct_of_floor']:.1f}%" in text
    assert f"| {headline['knee_m']} **knee** |" in text
    saturation = figures.find_saturation(rows, figures.find_knee(rows))
    assert headline["saturation_m"] == (saturation["m"] if saturation else None)
    if saturation:
        assert f"| {headline['saturation_m']} **saturation** |" in text
    assert f"**Backend:** {real_document['config']['backend']}; **ceilings:**" in text
    assert "12 min 29 s (749 s)" in text
    assert "AWX job 4321" in text and "weekly h200" in text
    assert summary["console"][-1].endswith("summary.md")


def schema_sha256(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _png_checks(path, context):
    from matplotlib import image

    assert path.read_bytes()[:8] == PNG_SIGNATURE, context
    pixels = image.imread(path)
    assert pixels.shape[:2] == (600, 1000), context
    rgb = (pixels[:, :, :3] * 255).round().astype(int)
    non_white = (rgb.sum(axis=2) < 3 * 250).mean()
    distinct = len({tuple(colour) for colour in rgb.reshape(-1, 3)[::7]})
    return non_white, distinct


@pytest.fixture(scope="module")
def plotted_run(tmp_path_factory, real_document):
    """One run drawn with every element: floor, knee, previous run, a slower M circled."""
    tmp_path = tmp_path_factory.mktemp("plots")
    baseline = slowed(real_document, 64, 1.0, started_at="2026-11-28T10:00:00Z")
    _build(tmp_path, "20261128T100000Z-000001", baseline)
    return _build(tmp_path, "20261129T100000Z-000002", slowed(real_document, 64, 1.3), plots=True)


def test_plots_are_written_and_linked(plotted_run):
    summary, run_dir = plotted_run
    assert summary["regression"]["regressed"]
    assert summary["files"]["per_token_png"] == str(run_dir / "per_token.png")
    text = (run_dir / "summary.md").read_text()
    assert "![per-token cost against M](per_token.png)" in text
    assert "![total time against M](total_time.png)" in text


def test_plots_are_readable_pictures(plotted_run):
    _summary, run_dir = plotted_run
    for name in ("per_token.png", "total_time.png"):
        non_white, distinct = _png_checks(run_dir / name, name)
        # Curves, legend, text and grid: a blank or single-line figure stays far below these.
        assert 0.03 < non_white < 0.6, (name, non_white)
        assert distinct > 40, (name, distinct)


def test_a_blank_figure_fails_the_picture_checks(tmp_path):
    # The picture checks above must be able to fail: a white 1000x600 PNG does not pass them.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=(10, 6), dpi=100)
    figure.savefig(tmp_path / "blank.png", dpi=100)
    plt.close(figure)
    non_white, distinct = _png_checks(tmp_path / "blank.png", "blank")
    assert non_white < 0.03 and distinct < 40


# ---- history and regressions -------------------------------------------------------------------


def test_a_run_15_percent_slower_at_one_m_is_flagged_everywhere(tmp_path, real_document):
    _build(tmp_path, "20261128T100000Z-000001", slowed(real_document, 64, 1.0, started_at="2026-11-28T10:00:00Z"))
    summary, run_dir = _build(
        tmp_path, "20261129T100000Z-000002", slowed(real_document, 64, 1.15, started_at="2026-11-29T10:00:00Z")
    )
    regression = summary["regression"]
    assert regression["regressed"] is True
    assert regression["baseline_run_id"] == "20261128T100000Z-000001"
    assert [entry["m"] for entry in regression["slower"]] == [64]
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["headline"]["regression"] is True
    assert saved["headline"]["regression_at_m"] == [64]
    text = (run_dir / "summary.md").read_text()
    assert "> **REGRESSION: slower than the previous run 20261128T100000Z-000001 by more than 10% at M=64 (+15.0%)" in text
    assert "**+15.0% SLOWER**" in text
    assert any(line.startswith("REGRESSION:") for line in summary["console"])
    index = (tmp_path / "results" / HOST / "index.md").read_text()
    newest, oldest = index.index("20261129T100000Z-000002"), index.index("20261128T100000Z-000001")
    assert newest < oldest
    assert "**SLOWER** than 20261128T100000Z-000001 (worst M=64 +15.0%)" in index
    assert "[20261129T100000Z-000002](20261129T100000Z-000002/summary.md)" in index
    history = json.loads((tmp_path / "results" / HOST / "history.json").read_text())
    assert [entry["run_id"] for entry in history["runs"]] == ["20261128T100000Z-000001", "20261129T100000Z-000002"]
    assert history["runs"][1]["regression"]["regressed"] is True
    top = (tmp_path / "results" / "index.md").read_text()
    assert f"[{HOST}]({HOST}/index.md)" in top and "20261129T100000Z-000002" in top


def test_a_run_5_percent_slower_is_not_flagged(tmp_path, real_document):
    _build(tmp_path, "20261128T100000Z-000001", slowed(real_document, 64, 1.0, started_at="2026-11-28T10:00:00Z"))
    summary, run_dir = _build(
        tmp_path, "20261129T100000Z-000002", slowed(real_document, 64, 1.05, started_at="2026-11-29T10:00:00Z")
    )
    assert summary["regression"]["regressed"] is False
    assert summary["regression"]["baseline_run_id"] == "20261128T100000Z-000001"
    assert "No regression: within 10%" in (run_dir / "summary.md").read_text()
    assert "REGRESSION" not in (run_dir / "summary.md").read_text()
    # A stricter threshold turns the same 5% into a flag.
    strict, _ = _build(
        tmp_path, "20261129T100000Z-000002", slowed(real_document, 64, 1.05, started_at="2026-11-29T10:00:00Z"), threshold=0.03
    )
    assert strict["regression"]["regressed"] is True


def test_the_real_torch_backend_run_is_not_compared_with_the_triton_run(tmp_path, real_document):
    from report_fixtures import REAL_H200_TORCH

    _build(tmp_path, "20261128T100000Z-000001", slowed(real_document, 64, 1.0, started_at="2026-11-28T10:00:00Z"))
    torch_run = json.loads(REAL_H200_TORCH.read_text())
    torch_run["started_at"] = "2026-11-29T10:00:00Z"
    # The torch backend is several times slower at every M: compared with the Triton run it
    # would be flagged everywhere, but it is another configuration.
    summary, run_dir = _build(tmp_path, "20261129T100000Z-000002", torch_run)
    assert summary["config_key"]["backend"] == "torch"
    assert summary["regression"]["baseline_run_id"] is None and summary["regression"]["regressed"] is False
    assert "No earlier complete run of this host and configuration" in (run_dir / "summary.md").read_text()


@pytest.mark.parametrize(
    "change",
    [{"config": {"tp": 2}}, {"config": {"preset": "deepseek-v3"}}, {"environment": {"device": "cuda:3"}}],
    ids=["tp", "preset", "device"],
)
def test_a_different_configuration_is_not_compared(tmp_path, real_document, change):
    _build(tmp_path, "20261128T100000Z-000001", slowed(real_document, 64, 1.0, started_at="2026-11-28T10:00:00Z"))
    other = slowed(real_document, 64, 1.5, started_at="2026-11-29T10:00:00Z")
    for section, values in change.items():
        other[section].update(values)
    summary, _ = _build(tmp_path, "20261129T100000Z-000002", other)
    assert summary["regression"]["baseline_run_id"] is None
    assert summary["regression"]["regressed"] is False
    history = json.loads((tmp_path / "results" / HOST / "history.json").read_text())
    assert len(history["runs"]) == 2


def test_failed_runs_are_listed_but_never_a_baseline(tmp_path, real_document):
    _build(tmp_path, "20261127T100000Z-000001", slowed(real_document, 64, 1.0, started_at="2026-11-27T10:00:00Z"))
    failed = slowed(real_document, 64, 0.5, started_at="2026-11-28T10:00:00Z")
    failed["status"] = "failed"
    failed["error"] = {"kind": "runtime", "message": "CUDA out of memory at M=2048", "exit_code": 5}
    failed_summary, failed_dir = _build(tmp_path, "20261128T100000Z-000002", failed)
    assert failed_summary["status"] == "failed"
    assert "runtime: CUDA out of memory at M=2048" in (failed_dir / "summary.md").read_text()
    summary, _ = _build(tmp_path, "20261129T100000Z-000003", slowed(real_document, 64, 1.0, started_at="2026-11-29T10:00:00Z"))
    # Compared with the complete run of the 27th, not with the (much faster) failed one.
    assert summary["regression"]["baseline_run_id"] == "20261127T100000Z-000001"
    assert summary["regression"]["regressed"] is False


def test_rebuilding_a_report_replaces_its_entry_and_keeps_its_baseline(tmp_path, real_document):
    first = slowed(real_document, 64, 1.0, started_at="2026-11-28T10:00:00Z")
    second = slowed(real_document, 64, 1.2, started_at="2026-11-29T10:00:00Z")
    _build(tmp_path, "20261128T100000Z-000001", first)
    _build(tmp_path, "20261129T100000Z-000002", second)
    # Rebuild the first run after the second exists: it has no earlier run, so no flag, and
    # history still holds each run once.
    again, _ = _build(tmp_path, "20261128T100000Z-000001", first)
    assert again["regression"]["baseline_run_id"] is None
    rebuilt, _ = _build(tmp_path, "20261129T100000Z-000002", second)
    assert rebuilt["regression"]["regressed"] is True
    history = json.loads((tmp_path / "results" / HOST / "history.json").read_text())
    assert [entry["run_id"] for entry in history["runs"]] == ["20261128T100000Z-000001", "20261129T100000Z-000002"]


# ---- missing or unreadable results, launch and project revision ---------------------------------


def test_missing_results_still_give_a_manifest_and_the_downtime(tmp_path):
    summary, run_dir = _build(tmp_path, "20261129T100000Z-000009", None, dict(TIMELINE))
    assert summary["status"] == "no results"
    assert "does not exist" in summary["load_error"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["timeline"]["downtime_s"] == 749.0
    assert manifest["payload"] is None
    text = (run_dir / "summary.md").read_text()
    assert "No M value was timed" in text and "12 min 29 s" in text
    assert not (run_dir / "per_token.png").exists()


def test_a_results_file_of_a_newer_schema_is_reported_as_unreadable(tmp_path, real_document):
    newer = dict(json.loads(results_fixture().read_text()), schema_version=schema.SCHEMA_VERSION + 1)
    summary, run_dir = _build(tmp_path, "20261129T100000Z-000010", newer)
    assert summary["status"] == "unreadable"
    assert "newer than this loader" in summary["load_error"]
    assert "newer than this loader" in (run_dir / "summary.md").read_text()


def test_timestamps_in_the_forms_the_roles_may_set():
    # ISO with Z, with an offset, naive (UTC), with a space, and epoch seconds (number or text).
    forms = [
        "2026-11-29T14:01:02Z",
        "2026-11-29T15:01:02+01:00",
        "2026-11-29T14:01:02",
        "2026-11-29 14:01:02",
        1795960862,
        "1795960862.0",
    ]
    assert {figures.iso_utc(figures.parse_time(form)) for form in forms} == {"2026-11-29T14:01:02Z"}
    assert figures.parse_time("yesterday") is None and figures.parse_time(None) is None
    assert figures.seconds_between("2026-11-29T14:01:02Z", 1795960862 + 90) == 90.0
    assert figures.human_duration(3725) == "1 h 02 min 05 s" and figures.human_duration(None) == "unknown"


def test_launch_info_by_hand_and_by_awx():
    manual = launch_info({}, environ={"USER": "operator"})
    assert manual["by"] == "manual" and manual["user"] == "operator"
    tower = launch_info({"tower_job_id": 12, "tower_job_launch_type": "workflow"}, environ={})
    assert (tower["by"], tower["job_id"], tower["launch_type"], tower["scheduled"]) == ("awx", "12", "workflow", False)
    from_env = launch_info({}, environ={"JOB_ID": "99"})
    assert from_env["by"] == "awx" and from_env["job_id"] == "99"


def test_project_revision_outside_git(tmp_path):
    assert project_revision(tmp_path, environ={})["commit"] == "unknown"
    synced = project_revision(tmp_path, environ={"PROJECT_REVISION": "0123abcd"})
    assert synced == {"commit": "0123abcd", "dirty": None, "source": "PROJECT_REVISION", "path": str(tmp_path)}
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.txt").write_text("a")
    subprocess.run(["git", "-C", str(tmp_path), "add", "a.txt"], check=True)
    subprocess.run(
        ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-qm", "a"],
        check=True,
    )
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    clean = project_revision(tmp_path, environ={})
    assert clean["commit"] == head.stdout.strip() and clean["dirty"] is False
    (tmp_path / "a.txt").write_text("b")
    assert project_revision(tmp_path, environ={})["dirty"] is True


# ---- command line ----------------------------------------------------------------------------------


def _cli(*arguments, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-m", "moe_bench_report", *arguments],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPO}:{REPO / 'files'}"},
        timeout=120,
    )


def test_cli_builds_with_key_value_timeline_and_prints_json(tmp_path):
    run_dir = write_run(tmp_path / "results", HOST, "20261129T100000Z-000011", json.loads(results_fixture().read_text()))
    completed = _cli(
        "build", "--run-dir", str(run_dir), "--host", HOST, "--no-plots", "--print", "json",
        "--timeline", "service_stop_stopped_at=2026-11-29T14:00:00Z", "service_recover_ready_at=2026-11-29T14:10:00Z",
    )
    assert completed.returncode == 0, completed.stderr
    printed = json.loads(completed.stdout)
    assert printed["headline"]["downtime_s"] == 600.0
    assert printed["headline"]["run_id"] == "20261129T100000Z-000011"
    assert any(line.startswith("Downtime: 10 min 00 s") for line in printed["console"])
    assert (run_dir / "summary.json").is_file()


def test_cli_reads_the_timeline_on_stdin_and_keeps_it_beside_the_results(tmp_path):
    # The playbook hands the timeline over on stdin (no copy task on the controller first).
    run_dir = write_run(tmp_path / "results", HOST, "20261129T100000Z-000012", json.loads(results_fixture().read_text()))
    timeline = {"service_stop_stopped_at": "2026-11-29T14:00:00Z", "service_recover_ready_at": "2026-11-29T14:10:00Z",
                "moe_bench_plan": {"run_id": "20261129T100000Z-000012"}}
    completed = subprocess.run(
        [sys.executable, "-m", "moe_bench_report", "build", "--run-dir", str(run_dir), "--host", HOST, "--no-plots",
         "--print", "json", "--timeline-json", "-"],
        input=json.dumps(timeline), capture_output=True, text=True, cwd=REPO, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPO}:{REPO / 'files'}"})
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["headline"]["downtime_s"] == 600.0
    assert json.loads((run_dir / "timeline.json").read_text()) == timeline


def test_cli_rejects_bad_input_with_a_clear_message(tmp_path, capsys):
    from moe_bench_report.__main__ import main

    with pytest.raises(SystemExit) as bad_threshold:
        main(["build", "--run-dir", str(tmp_path), "--host", HOST, "--threshold", "-1"])
    assert bad_threshold.value.code == 2 and "fraction" in capsys.readouterr().err
    assert main(["build", "--run-dir", str(tmp_path), "--host", HOST, "--timeline", "no-equals-sign"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    (tmp_path / "timeline.json").write_text("[1, 2]")
    assert main(["build", "--run-dir", str(tmp_path), "--host", HOST, "--timeline-json", str(tmp_path / "timeline.json")]) == 2
    assert "not a JSON object" in capsys.readouterr().err
    assert main(["build", "--run-dir", str(tmp_path / "nope"), "--host", HOST]) == 3
    error = capsys.readouterr().err
    assert f"report of host {HOST}" in error and "does not exist" in error and "rerun" in error


# ---- the downtime, itemised ---------------------------------------------------------------

ITEMISED = {
    # Epoch seconds on the controller, as the roles set them (strings: Jinja hands them over so).
    "service_stop_issued_epoch": "1796047200.0",     # 2026-11-30T14:00:00Z
    "service_stop_stopped_epoch": "1796047203.5",
    "vram_check_waited_s": "0.8",
    "bench_run_async_launched_epoch": "1796047205.0",
    "bench_run_async_finished_epoch": "1796047236.2",
    "bench_fetch_started_epoch": "1796047236.5",
    "bench_fetch_finished_epoch": "1796047238.5",
    "service_recover_start_issued_epoch": "1796047239.0",
    "service_recover_ready_epoch": "1796047600.0",
}
PHASES = {"import_s": 5.4, "device_s": 0.6, "weights_s": 0.9, "check_s": 12.3, "timing_s": 11.0,
          "compile_s": 12.1, "first_result_s": 19.9, "process_s": 30.2}


def test_the_downtime_is_itemised_and_the_rest_is_the_playbook_overhead():
    parts = figures.downtime_parts(ITEMISED, PHASES)
    assert parts["from"] == "2026-11-30T14:00:00Z" and parts["total_s"] == 400.0
    seconds = {part["part"]: part["s"] for part in parts["parts"]}
    assert seconds == {"stop": 3.5, "memory": 0.8, "benchmark": 30.2, "fetch": 2.0, "start": 361.0,
                       "overhead": pytest.approx(400.0 - 3.5 - 0.8 - 30.2 - 2.0 - 361.0)}
    assert [part["part"] for part in parts["parts"]] == ["stop", "memory", "benchmark", "fetch", "start", "overhead"]
    assert [phase["phase"] for phase in parts["benchmark_phases"]] == ["import", "device", "weights", "check", "timing"]
    assert parts["first_result_s"] == 19.9 and parts["unmeasured"] == []
    line = figures.downtime_line(parts)
    assert line.startswith("400.0 s = unit stop 3.5 s + memory check 0.8 s + benchmark process 30.2 s (import 5.4, ")
    assert line.endswith("start until healthy 361.0 s + playbook overhead 2.5 s")
    bar, legend = figures.downtime_bar(parts, width=80)
    assert bar.startswith("|") and bar.endswith("| 400.0 s") and len(bar.split("|")[1]) == 80
    # Every part shows (at least one cell), the model's load takes most of the bar.
    assert [bar.count(symbol) > 0 for symbol in "SMBFH."] == [True] * 6 and bar.count("H") > 60
    assert "H start until healthy" in legend and ". playbook overhead" in legend


def test_an_unknown_part_is_counted_as_overhead_and_named_and_no_stop_means_no_itemisation():
    given = dict(ITEMISED, bench_fetch_started_epoch=None)
    parts = figures.downtime_parts(given, None)
    assert parts["unmeasured"] == ["benchmark", "fetch"] and parts["benchmark_phases"] == []
    assert {part["part"]: part["s"] for part in parts["parts"]}["overhead"] == pytest.approx(400.0 - 3.5 - 0.8 - 361.0)
    assert "benchmark process not measured" in figures.downtime_line(parts)
    assert figures.downtime_parts(dict(ITEMISED, service_recover_ready_epoch=None), PHASES) is None
    assert figures.downtime_parts(dict(ITEMISED, service_stop_issued_epoch="1796047700"), PHASES) is None


def test_the_report_shows_the_itemised_downtime(tmp_path, real_document):
    raw = dict(json.loads(results_fixture().read_text()), schema_version=3, phases=PHASES)
    summary, run_dir = _build(tmp_path, "20261130T140000Z-d0d0d0", raw, dict(TIMELINE, **ITEMISED))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    parts = manifest["timeline"]["downtime_parts"]
    assert parts["total_s"] == 400.0 and parts["overhead_s"] == pytest.approx(2.5)
    text = (run_dir / "summary.md").read_text()
    assert "**Downtime, itemised:** 400.0 s = unit stop 3.5 s" in text
    assert "first timed figure 19.9 s after the benchmark process started" in text
    assert "## Downtime\n\n```\n|S" in text
    assert any(line.startswith("Downtime, itemised: 400.0 s") for line in summary["console"])
    # A run without the sub-second facts (older playbooks) says so instead.
    summary, run_dir = _build(tmp_path / "old", "20261129T140100Z-a1b2c3", json.loads(results_fixture().read_text()), TIMELINE)
    assert "**Downtime, itemised:** not available" in (run_dir / "summary.md").read_text()


def test_a_fetch_after_the_service_is_back_is_no_part_of_the_downtime():
    given = dict(ITEMISED, bench_fetch_started_epoch="1796047601.0", bench_fetch_finished_epoch="1796047604.0")
    parts = figures.downtime_parts(given, PHASES)
    assert {part["part"]: part["s"] for part in parts["parts"]}["fetch"] == 0.0 and parts["fetch_after_downtime"]
    assert parts["overhead_s"] == pytest.approx(400.0 - 3.5 - 0.8 - 30.2 - 361.0)
    assert "fetch 0 s (after the service was back)" in figures.downtime_line(parts)


def test_a_run_beside_the_service_reports_its_stop_decision_and_the_reduced_rehearsal(tmp_path, real_document):
    rehearsal = json.loads(json.dumps(real_document))
    rehearsal.update(schema_version=4, rehearsal={"reduced": True, "layer_experts": 384, "experts": 16},
                     gpu_at_start={"gpu": 0, "utilization_pct": 16.0, "memory_used_mib": 113855.0,
                                   "memory_free_mib": 29302.0, "memory_total_mib": 143771.0, "at": "2026-12-01T16:51:32Z"})
    rehearsal["config"]["experts"] = 16
    run_dir = write_run(tmp_path / "results", HOST, "20261201T165100Z-d0d0d0", None)
    (run_dir / "rehearsal.json").write_text(json.dumps(rehearsal), encoding="utf-8")
    stop = {"mode": "never", "stop": False, "beside": False, "need_mib": 12000, "gpus_beside": [],
            "why": "moe_bench_stop is never: only the rehearsal ran (a reduced run beside the live service), "
                   "the unit was not stopped"}
    summary = build_report(run_dir, HOST, {"stop_decision": stop, "rehearsal": {"outcome": "ok"}}, environ={},
                           plots=False)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stop"] == stop and manifest["timeline"]["downtime_s"] is None
    section = manifest["rehearsal"]
    assert section["reduced"] is True and (section["experts"], section["layer_experts"]) == (16, 384)
    assert [row["m"] for row in section["results"]] == [row["m"] for row in rehearsal["results"]]
    assert section["gpu_at_start"]["memory_free_mib"] == 29302.0 and "files_sha256" in manifest
    assert manifest["files_sha256"]["rehearsal.json"] == schema_sha256(run_dir / "rehearsal.json")
    text = (run_dir / "summary.md").read_text()
    assert "- **Stop:** moe_bench_stop is never" in text
    assert "**Rehearsal (REDUCED, zero downtime):** 16 of the layer's 384 experts (fewer than the layer" in text
    assert "GPU 0 16% busy, 113855 MiB used, 29302 MiB free of 143771" in text
    # No full run: the rehearsal is no result of the layer, and the status says what there is.
    assert summary["status"] == "rehearsal only"
    (entry,) = json.loads((run_dir.parent / "history.json").read_text())["runs"]
    assert entry["status"] == "rehearsal only" and entry["results"] == []
    assert entry["rehearsal"]["experts"] == 16 and entry["rehearsal"]["layer_experts"] == 384
    assert [row["m"] for row in entry["rehearsal"]["results"]] == [row["m"] for row in rehearsal["results"]]
