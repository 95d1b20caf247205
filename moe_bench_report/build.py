"""Build the whole report of one run: manifest, history entry and comparison, plots, summaries."""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from . import REPORT_VERSION, history as history_module
from .figures import (
    DEFAULT_KNEE_GROWTH,
    DEFAULT_REGRESSION_THRESHOLD,
    compare_runs,
    find_knee,
    find_saturation,
    iso_utc,
    per_token,
    readable,
    timed_rows,
    tp_layer_rows,
)
from .manifest import build_manifest, launch_info, project_revision
from . import gpus as gpus_module
from .gpus import DEFAULT_GPU_OUTLIER
from .summary import console_lines, headline, markdown

SUMMARY_SCHEMA = "moe_bench_report.summary"
# Where the tensor-parallel run's results sit beside the one-GPU run's results.json.
TP_RESULTS_NAME = "results-tp.json"
PROJECT_DIR = Path(__file__).resolve().parents[1]


def schema_module():
    """moe_bench.schema, the one loader of results files (files/ may not be on sys.path yet)."""
    try:
        from moe_bench import schema
    except ImportError:
        sys.path.insert(0, str(PROJECT_DIR / "files"))
        from moe_bench import schema
    return schema


def _load(results_path: Path) -> tuple[dict | None, str | None]:
    schema = schema_module()
    try:
        return schema.load_results(results_path), None
    except FileNotFoundError:
        return None, f"{results_path} does not exist (the fetch brought no results)"
    except schema.ResultsFormatError as error:
        return None, str(error)


def _per_m_rows(rows: list[dict]) -> list[dict]:
    return [
        {
            "m": int(row["m"]),
            "us": float(row["us"]),
            "us_p20": row.get("us_p20"),
            "us_p80": row.get("us_p80"),
            "us_per_token": per_token(row),
            "gbps": row.get("gbps"),
            "tflops": row.get("tflops"),
            "floor_us": row.get("floor_us"),
            "pct_of_floor": row.get("pct_of_floor"),
        }
        for row in rows
    ]


def build_report(
    run_dir: str | os.PathLike,
    host: str,
    given: dict | None = None,
    *,
    results_path: str | os.PathLike | None = None,
    results_root: str | os.PathLike | None = None,
    run_id: str | None = None,
    threshold: float = DEFAULT_REGRESSION_THRESHOLD,
    knee_growth: float = DEFAULT_KNEE_GROWTH,
    project_dir: str | os.PathLike | None = None,
    environ: dict | None = None,
    plots: bool = True,
    tp_results_path: str | os.PathLike | None = None,
    gpu_outlier: float = DEFAULT_GPU_OUTLIER,
) -> dict:
    """Write manifest.json, summary.md, summary.json and the plots into `run_dir`, update the
    host's history.json and index.md and the results index; return the summary dict."""
    if threshold <= 0:
        raise ValueError(f"the regression threshold must be > 0 (a fraction: 0.10 = 10%), got {threshold}")
    if knee_growth <= 0:
        raise ValueError(f"the knee growth must be > 0 (a fraction: 0.10 = 10%), got {knee_growth}")
    given = dict(given or {})
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder {run_dir} does not exist")
    results_root = Path(results_root) if results_root is not None else run_dir.resolve().parent.parent
    host_dir = results_root / host
    results_path = Path(results_path) if results_path is not None else run_dir / "results.json"
    plan = given.get("moe_bench_plan") if isinstance(given.get("moe_bench_plan"), dict) else {}
    run_id = run_id or plan.get("run_id") or run_dir.name
    generated_at = iso_utc(datetime.now(timezone.utc))
    schema = schema_module()

    document, load_error = _load(results_path)
    rows = timed_rows(document) if document else []
    knee = find_knee(rows, knee_growth)
    saturation = find_saturation(rows, knee)
    key = history_module.config_key(document)
    status = document["status"] if document else ("unreadable" if results_path.exists() else "no results")

    # The rehearsal beside the live service (fewer experts than the layer): a reduced trend result.
    rehearsal_document, rehearsal_error = _load(run_dir / "rehearsal.json")
    if document is None and not results_path.exists() and rehearsal_document:
        # No full run (moe_bench_stop never): the reduced rehearsal is all there is, and says so.
        status = "rehearsal only"
    manifest = build_manifest(
        rehearsal_document=rehearsal_document,
        rehearsal_error=rehearsal_error if (run_dir / "rehearsal.json").exists() else None,
        run_id=run_id,
        host=host,
        run_dir=run_dir,
        document=document,
        given=given,
        project=project_revision(project_dir or PROJECT_DIR, environ),
        launch=launch_info(given, environ),
        generated_at=generated_at,
    )
    schema.atomic_write_text(run_dir / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    if not manifest["validity"]["valid"]:
        # Never a baseline for a later run, never reported as complete.
        status = "invalid"

    summary_md_path = run_dir / "summary.md"
    entry = {
        "run_id": run_id,
        "started_at": (document or {}).get("started_at") or manifest["timeline"]["benchmark_started_at"],
        "finished_at": (document or {}).get("finished_at"),
        "status": status,
        "config_key": key,
        "gpu_name": manifest["gpu"]["name"],
        "results": [
            {"m": int(row["m"]), "us": float(row["us"]), "us_per_token": per_token(row), "pct_of_floor": row.get("pct_of_floor")}
            for row in rows
        ],
        "knee_m": knee["m"] if knee else None,
        "saturation_m": saturation["m"] if saturation else None,
        "knee_us_per_token": knee["us_per_token"] if knee else None,
        "knee_pct_of_floor": knee.get("pct_of_floor") if knee else None,
        "downtime_s": manifest["timeline"]["downtime_s"],
        # The reduced zero-downtime trend (fewer experts than the layer): never a baseline of the
        # layer's figures, kept beside them run after run.
        "rehearsal": {
            "experts": (rehearsal_document.get("rehearsal") or {}).get("experts"),
            "layer_experts": (rehearsal_document.get("rehearsal") or {}).get("layer_experts"),
            "results": [{"m": int(row["m"]), "us": float(row["us"]), "us_per_token": per_token(row)}
                        for row in timed_rows(rehearsal_document)],
        } if rehearsal_document else None,
        "summary": os.path.relpath(summary_md_path.resolve(), host_dir.resolve()),
        "recorded_at": generated_at,
    }

    with history_module.locked(results_root):
        host_dir.mkdir(parents=True, exist_ok=True)
        history = history_module.load_history(host_dir, host)
        baseline = history_module.previous_comparable(history, entry)
        if baseline is not None:
            regression = compare_runs(rows, baseline["results"], threshold)
            regression["baseline_run_id"] = baseline["run_id"]
        else:
            regression = {
                "threshold": threshold,
                "compared_m": [],
                "per_m": [],
                "slower": [],
                "regressed": False,
                "worst_change": None,
                "baseline_run_id": None,
            }
        entry["regression"] = {
            "regressed": regression["regressed"],
            "baseline_run_id": regression["baseline_run_id"],
            "threshold": threshold,
            "slower": regression["slower"],
        }
        history_module.record_run(history, entry)
        schema.atomic_write_text(host_dir / "history.json", json.dumps(history, indent=2) + "\n")
        schema.atomic_write_text(host_dir / "index.md", history_module.host_index_markdown(history))
        schema.atomic_write_text(results_root / "index.md", history_module.results_index_markdown(results_root))

    tp = _tensor_parallel(run_dir, document, rows, tp_results_path)
    gpu_paths = gpus_module.gpu_result_paths(run_dir, plan)
    gpus = gpus_module.gpu_section(gpus_module.load_documents(gpu_paths, schema.load_results), gpu_outlier) \
        if gpu_paths else None

    files = {
        "manifest": str(run_dir / "manifest.json"),
        "summary_md": str(summary_md_path),
        "summary_json": str(run_dir / "summary.json"),
        "per_token_png": None,
        "total_time_png": None,
        "tp_layer_png": None,
        "per_gpu_png": None,
        "history": str(host_dir / "history.json"),
        "host_index": str(host_dir / "index.md"),
    }
    if plots and rows:
        from .plots import plot_per_token, plot_total_time

        context = {
            "host": host,
            "gpu": manifest["gpu"]["name"] or f"no GPU name ({manifest['gpu']['device'] or 'device unknown'})",
            "backend": key.get("backend") or "unknown",
            "config": history_module.config_label(key),
            "run_id": run_id,
            "ceilings": _ceilings_short(document.get("ceilings")),
            "baseline_run_id": regression.get("baseline_run_id"),
            "threshold": threshold,
        }
        baseline_rows = baseline["results"] if baseline is not None else None
        slower_ms = {item["m"] for item in regression["slower"]}
        files["per_token_png"] = str(run_dir / "per_token.png")
        files["total_time_png"] = str(run_dir / "total_time.png")
        plot_per_token(Path(files["per_token_png"]), rows, context, knee, saturation, baseline_rows, slower_ms)
        plot_total_time(Path(files["total_time_png"]), rows, context, knee, saturation, baseline_rows, slower_ms)
    if plots and tp and tp["per_m"]:
        from .plots import plot_tp_layer

        files["tp_layer_png"] = str(run_dir / "tp_layer.png")
        plot_tp_layer(Path(files["tp_layer_png"]), tp["per_m"], {
            "host": host,
            "gpu": manifest["gpu"]["name"] or f"no GPU name ({manifest['gpu']['device'] or 'device unknown'})",
            "config": tp["config_label"],
            "run_id": run_id,
            "single_gpu_config": tp["single_gpu_config_label"],
        })

    if plots and gpus and gpus["per_m"]:
        from .plots import plot_per_gpu

        files["per_gpu_png"] = str(run_dir / "per_gpu.png")
        plot_per_gpu(Path(files["per_gpu_png"]), gpus, {"host": host, "run_id": run_id,
                                                        "config": history_module.config_label(key)})

    summary = {
        "schema": SUMMARY_SCHEMA,
        "version": REPORT_VERSION,
        "host": host,
        "run_id": run_id,
        "status": status,
        "error": (document or {}).get("error"),
        "load_error": load_error,
        "generated_at": generated_at,
        "config_key": key,
        "ceilings": (document or {}).get("ceilings"),
        "per_m": _per_m_rows(rows),
        "knee": knee,
        "saturation": saturation,
        "knee_rule": {
            "growth_per_doubling": knee_growth,
            "text": "smallest measured M whose step to the next measured M adds less than "
            f"{knee_growth * 100:g}% to the total time per doubling of M",
        },
        "regression": regression,
        "correctness": (document or {}).get("correctness") or [],
        "tp": tp,
        "gpus": gpus,
        "manifest": manifest,
        "files": files,
    }
    summary["headline"] = headline(summary)
    summary["console"] = console_lines(summary)
    schema.atomic_write_text(summary_md_path, markdown(summary) + ("\n" + gpus_module.markdown(gpus) if gpus else ""))
    schema.atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _tensor_parallel(run_dir: Path, document: dict | None, rows: list[dict],
                     tp_results_path: str | os.PathLike | None) -> dict | None:
    """The tensor-parallel layer's part of the summary, or None without a tensor-parallel run:
    from TP_RESULTS_NAME beside the results (or the path given), or from the results
    themselves when they are a tensor-parallel run's; the one-GPU curve beside it is the
    results' own when those are a one-device run's."""
    path = Path(tp_results_path) if tp_results_path is not None else run_dir / TP_RESULTS_NAME
    if path.exists() or tp_results_path is not None:
        tp_document, load_error = _load(path)
        single_rows = rows if document and not document.get("tp") else None
        single_config = history_module.config_label(history_module.config_key(document)) if single_rows else None
    elif document and document.get("tp"):
        tp_document, load_error, single_rows, single_config = document, None, None, None
        path = None
    else:
        return None
    if tp_document is None:
        return {"results_file": str(path), "load_error": load_error, "status": "unreadable", "per_m": [],
                "ranks": None, "collective": None, "config_label": None, "single_gpu_config_label": single_config,
                "correctness": [], "error": None}
    setup = tp_document.get("tp") or {}
    return {
        "results_file": str(path) if path is not None else None,
        "load_error": None,
        "status": tp_document.get("status"),
        "error": tp_document.get("error"),
        "ranks": setup.get("ranks"),
        "collective": setup.get("collective"),
        "devices": setup.get("devices"),
        "config_label": history_module.config_label(history_module.config_key(tp_document)),
        "single_gpu_config_label": single_config,
        "per_m": tp_layer_rows(tp_document, single_rows),
        "correctness": tp_document.get("correctness") or [],
    }


def _ceilings_short(ceilings: dict | None) -> str:
    if not ceilings:
        return "no ceilings recorded"
    return f"{readable(ceilings.get('bandwidth_gbps'))} GB/s, {readable(ceilings.get('tflops'))} TFLOP/s, {ceilings.get('source')}"
