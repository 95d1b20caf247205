"""The fleet report: one summary on the controller after the last batch of a rollout.

Reads the rollout's outcome per host (a JSON list written by the playbook: host, outcome,
why, run folder) and, for each host that left results, its run folder as the host report
wrote it (timeline.json with the plan, summary.json, results.json and the per-GPU files).
Writes fleet.json, fleet.md and fleet_per_token.png (time per token against M for every host
and GPU of the same configuration), flags the outliers across the fleet with the rule of
moe_bench_report.gpus (a host/GPU more than the threshold over the fleet's median at an M).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import REPORT_VERSION
from . import gpus as gpus_module
from .history import config_key, config_label

FLEET_SCHEMA = "moe_bench_report.fleet"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def host_series(run_dir: Path, load) -> tuple[dict, dict[str, dict[int, float]]]:
    """(config key, {"GPU n": {M: us per token}}) of one host's run folder."""
    timeline = _read_json(run_dir / "timeline.json") or {}
    plan = timeline.get("moe_bench_plan") or {}
    paths = gpus_module.gpu_result_paths(run_dir, plan)
    if not paths:
        paths = [("GPU %s" % ((plan.get("gpus") or ["?"])[0]), run_dir / "results.json")]
    loaded = gpus_module.load_documents(paths, load)
    key = next((config_key(item["document"]) for item in loaded if item["document"]), {})
    return key, {item["label"]: gpus_module.per_token_by_m(item["document"]) for item in loaded}


def build_fleet(fleet_dir: Path, hosts: list[dict], load, threshold: float = gpus_module.DEFAULT_GPU_OUTLIER,
                plots: bool = True, fleet_id: str | None = None) -> dict:
    fleet_dir = Path(fleet_dir)
    fleet_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    groups: dict[str, dict] = {}
    for entry in hosts:
        host = str(entry.get("host"))
        run_dir = Path(entry["run_dir"]) if entry.get("run_dir") else None
        summary = _read_json(run_dir / "summary.json") if run_dir else None
        row = {
            "host": host,
            "outcome": entry.get("outcome") or "unknown",
            "why": entry.get("why") or "",
            "run_id": entry.get("run_id") or (summary or {}).get("run_id"),
            "downtime_s": ((summary or {}).get("headline") or {}).get("downtime_s", entry.get("downtime_s")),
            "status": (summary or {}).get("status"),
            "report": os.path.relpath(run_dir / "summary.md", fleet_dir) if summary else None,
            "gpus": 0,
        }
        if run_dir and run_dir.is_dir():
            key, series = host_series(run_dir, load)
            series = {label: values for label, values in series.items() if values}
            row["gpus"] = len(series)
            if series:
                label = config_label(key)
                group = groups.setdefault(label, {"config": label, "series": {}})
                for gpu, values in series.items():
                    group["series"]["%s %s" % (host, gpu)] = values
        rows.append(row)
    configurations = []
    for index, (label, group) in enumerate(sorted(groups.items())):
        flagged = gpus_module.outliers(group["series"], threshold)
        plot_name = "fleet_per_token.png" if index == 0 else "fleet_per_token_%d.png" % index
        configurations.append({"config": label, "series": sorted(group["series"]), "outliers": flagged,
                               "plot": plot_name if plots else None})
        if plots:
            from .plots import plot_series

            plot_series(fleet_dir / plot_name, group["series"], f"Fleet {fleet_id or ''}: {label}",
                        {(item["label"], item["m"]) for item in flagged}, threshold)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    fleet = {
        "schema": FLEET_SCHEMA,
        "version": REPORT_VERSION,
        "fleet_id": fleet_id,
        "threshold": threshold,
        "hosts": rows,
        "counts": counts,
        "configurations": configurations,
        "outliers": [dict(item, config=conf["config"]) for conf in configurations for item in conf["outliers"]],
    }
    fleet["console"] = console_lines(fleet)
    (fleet_dir / "fleet.json").write_text(json.dumps(fleet, indent=2) + "\n", encoding="utf-8")
    (fleet_dir / "fleet.md").write_text(markdown(fleet), encoding="utf-8")
    return fleet


def console_lines(fleet: dict) -> list[str]:
    width = max([4] + [len(row["host"]) for row in fleet["hosts"]])
    lines = ["fleet %s: %s" % (fleet.get("fleet_id") or "", ", ".join("%d %s" % (n, outcome)
                                                                       for outcome, n in sorted(fleet["counts"].items())))]
    for row in fleet["hosts"]:
        downtime = "" if row["downtime_s"] is None else "down %ss" % round(float(row["downtime_s"]))
        lines.append("%-*s  %-11s %-9s %s GPU(s)  %s" % (width, row["host"], row["outcome"], downtime, row["gpus"],
                                                      " ".join(row["why"].split())))
    for item in fleet["outliers"]:
        lines.append("outlier: %s at M=%d: %.2f us/token, %+.0f%% vs the fleet median %.2f"
                     % (item["label"], item["m"], item["us_per_token"], item["over"] * 100, item["median"]))
    return lines


def markdown(fleet: dict) -> str:
    lines = ["# Fleet run %s" % (fleet.get("fleet_id") or ""), "",
             ", ".join("%d %s" % (n, outcome) for outcome, n in sorted(fleet["counts"].items())), "",
             "| host | outcome | downtime | GPUs | report | why |", "|---|---|---|---|---|---|"]
    for row in fleet["hosts"]:
        lines.append("| %s | %s | %s | %s | %s | %s |" % (
            row["host"], row["outcome"], "–" if row["downtime_s"] is None else "%s s" % round(float(row["downtime_s"])),
            row["gpus"], "[summary](%s)" % row["report"] if row["report"] else "–",
            " ".join(row["why"].split()).replace("|", "\\|") or "–"))
    for conf in fleet["configurations"]:
        lines += ["", "## %s" % conf["config"], "", ", ".join(conf["series"]), ""]
        if conf.get("plot"):
            lines += ["![time per token](%s)" % conf["plot"], ""]
        if conf["outliers"]:
            lines.append("Outliers (more than %g%% over the fleet's median at that M):" % (fleet["threshold"] * 100))
            lines += ["- %s at M=%d: %.2f us/token, %+.0f%% vs %.2f" % (item["label"], item["m"], item["us_per_token"],
                                                                     item["over"] * 100, item["median"])
                      for item in conf["outliers"]]
        else:
            lines.append("No outlier.")
    return "\n".join(lines) + "\n"
