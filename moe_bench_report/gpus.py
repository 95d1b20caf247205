"""One payload per GPU: the per-GPU table of a host and the outlier rule, pure functions.

A run over several GPUs leaves one results file per GPU in its folder: the plan's
`payload_runs` lists them (the first chosen GPU's is `results.json`, the others'
`gpu<N>/results.json`). A GPU is an outlier when its time at some M is more than the
threshold over the median of the host's GPUs at that M: the same kernel on the same model of
GPU should take the same time, so a slower one points at clocks, power, ECC or a neighbour.
The same rule, applied across every host and GPU of one configuration, flags the fleet's
outliers (moe_bench_report.fleet).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .figures import per_token, timed_rows

DEFAULT_GPU_OUTLIER = 0.10


def gpu_result_paths(run_dir: Path, plan: dict | None) -> list[tuple[str, Path]]:
    """(label, results path) of every payload run of the plan, in GPU order; [] for a one-GPU run."""
    runs = (plan or {}).get("payload_runs") or []
    if len(runs) < 2:
        return []
    return [("GPU %s" % run.get("gpu"), run_dir / str(run.get("results", "results.json"))) for run in runs]


def load_documents(paths: list[tuple[str, Path]], load) -> list[dict]:
    """[{label, path, document, error}] through the results loader `load` (moe_bench.schema.load_results)."""
    loaded = []
    for label, path in paths:
        document, error = None, None
        try:
            document = load(path)
        except FileNotFoundError:
            error = "no results file"
        except (OSError, ValueError, json.JSONDecodeError) as exc:
            error = str(exc)
        loaded.append({"label": label, "path": str(path), "document": document, "error": error})
    return loaded


def per_token_by_m(document: dict | None) -> dict[int, float]:
    """{M: us per token} of a results document's timed rows."""
    return {int(row["m"]): per_token(row) for row in timed_rows(document)} if document else {}


def outliers(series: dict[str, dict[int, float]], threshold: float = DEFAULT_GPU_OUTLIER) -> list[dict]:
    """The points more than `threshold` over the median of all series at the same M.

    `series` maps a label (a GPU, or host/GPU across a fleet) to {M: us per token}. The median at
    an M is taken over the series that measured it; an M measured by fewer than two series is not
    judged. Returns [{label, m, us_per_token, median, over}] sorted by label then M."""
    if threshold <= 0:
        raise ValueError(f"the outlier threshold must be > 0 (a fraction: 0.10 = 10%), got {threshold}")
    ms = sorted({m for values in series.values() for m in values})
    flagged = []
    for m in ms:
        values = [values[m] for values in series.values() if m in values]
        if len(values) < 2:
            continue
        median = statistics.median(values)
        for label, per_m in series.items():
            if m in per_m and median > 0 and per_m[m] > median * (1 + threshold):
                flagged.append({"label": label, "m": m, "us_per_token": per_m[m], "median": median,
                                "over": per_m[m] / median - 1})
    return sorted(flagged, key=lambda item: (item["label"], item["m"]))


def gpu_section(loaded: list[dict], threshold: float = DEFAULT_GPU_OUTLIER) -> dict:
    """The per-GPU part of a host's summary: per-M rows, each GPU's status and the outliers."""
    series = {item["label"]: per_token_by_m(item["document"]) for item in loaded}
    ms = sorted({m for values in series.values() for m in values})
    flagged = outliers(series, threshold)
    return {
        "threshold": threshold,
        "gpus": [{"label": item["label"], "path": item["path"],
                  "status": (item["document"] or {}).get("status") or item["error"] or "unknown",
                  "correctness": [check.get("passed", check.get("ok")) for check in
                                  ((item["document"] or {}).get("correctness") or [])]}
                 for item in loaded],
        "per_m": [{"m": m, "us_per_token": {label: values.get(m) for label, values in series.items()},
                   "median": statistics.median([v[m] for v in series.values() if m in v])} for m in ms],
        "outliers": flagged,
        "outlier_labels": sorted({item["label"] for item in flagged}),
    }


def markdown(section: dict) -> str:
    """The per-GPU table of a host report (us per token; an outlier marked with !)."""
    labels = [gpu["label"] for gpu in section["gpus"]]
    flagged = {(item["label"], item["m"]) for item in section["outliers"]}
    lines = ["## Every GPU of the host", "",
             "One payload per GPU in the same downtime; microseconds per token. `!` marks a GPU more than "
             f"{section['threshold'] * 100:g}% over the host's median GPU at that M.", "",
             "| M | " + " | ".join(labels) + " | median |",
             "|---|" + "---|" * (len(labels) + 1)]
    for row in section["per_m"]:
        cells = []
        for label in labels:
            value = row["us_per_token"].get(label)
            cells.append("–" if value is None else ("%.2f%s" % (value, " !" if (label, row["m"]) in flagged else "")))
        lines.append("| %d | %s | %.2f |" % (row["m"], " | ".join(cells), row["median"]))
    lines += ["", "| GPU | status | correctness |", "|---|---|---|"]
    for gpu in section["gpus"]:
        checks = gpu["correctness"]
        lines.append("| %s | %s | %s |" % (gpu["label"], gpu["status"],
                                           ("%d of %d passed" % (sum(1 for c in checks if c), len(checks))) if checks else "–"))
    if section["outliers"]:
        lines += ["", "Outliers: " + "; ".join("%s at M=%d: %.2f us/token, %+.0f%% vs median %.2f"
                                            % (item["label"], item["m"], item["us_per_token"], item["over"] * 100,
                                               item["median"]) for item in section["outliers"])]
    else:
        lines += ["", "No GPU is an outlier."]
    return "\n".join(lines) + "\n"
