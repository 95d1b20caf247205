"""The run history of each host: `results/<host>/history.json`, `results/<host>/index.md`,
and the list of hosts, `results/index.md`.

A run is compared with the previous *complete* run of the same host and the same
configuration (preset, shape, backend, TP, dtype, device); runs that failed or stopped early
are listed but never serve as a baseline, since their timings may be partial or wrong.
"Previous" means started earlier (the results' started_at, then the run id), so rebuilding the
report of an old run compares it with what came before it, not with newer runs.
"""

from __future__ import annotations

import fcntl
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from . import REPORT_VERSION
from .figures import human_duration

HISTORY_SCHEMA = "moe_bench_report.history"

# What makes two runs comparable: the payload config minus the M list and the seed, plus the
# device the kernel ran on.
CONFIG_KEY_FIELDS = ("preset", "experts", "hidden", "inter", "topk", "group_size", "tp", "backend", "dtype")


def config_key(document: dict | None) -> dict:
    config = (document or {}).get("config") or {}
    environment = (document or {}).get("environment") or {}
    key = {field: config.get(field) for field in CONFIG_KEY_FIELDS}
    key["device"] = environment.get("device")
    return key


def config_label(key: dict) -> str:
    if not any(value is not None for value in key.values()):
        return "unknown configuration"
    return (
        f"{key.get('preset')} E={key.get('experts')} H={key.get('hidden')} I={key.get('inter')} "
        f"top-{key.get('topk')} g{key.get('group_size')} TP={key.get('tp')} {key.get('dtype')} "
        f"{key.get('backend')} on {key.get('device')}"
    )


def _order(entry: dict) -> tuple[str, str]:
    return (entry.get("started_at") or "", entry.get("run_id") or "")


def load_history(host_dir: Path, host: str) -> dict:
    path = host_dir / "history.json"
    if not path.is_file():
        return {"schema": HISTORY_SCHEMA, "version": REPORT_VERSION, "host": host, "runs": []}
    try:
        history = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path} is not valid JSON ({error}); move it aside and rebuild the reports of the runs you need"
        ) from None
    if history.get("schema") != HISTORY_SCHEMA or not isinstance(history.get("runs"), list):
        raise ValueError(f"{path} is not a {HISTORY_SCHEMA} file")
    return history


def previous_comparable(history: dict, entry: dict) -> dict | None:
    """The latest complete run of the same configuration that started before `entry`."""
    candidates = [
        other
        for other in history["runs"]
        if other.get("run_id") != entry["run_id"]
        and other.get("config_key") == entry["config_key"]
        and other.get("status") == "complete"
        and other.get("results")
        and _order(other) < _order(entry)
    ]
    return max(candidates, key=_order) if candidates else None


def record_run(history: dict, entry: dict) -> dict:
    """Insert or replace this run's entry (a rebuild replaces), keep runs oldest first."""
    runs = [other for other in history["runs"] if other.get("run_id") != entry["run_id"]]
    runs.append(entry)
    runs.sort(key=_order)
    history["runs"] = runs
    return history


@contextmanager
def locked(results_root: Path) -> Iterator[None]:
    """Serialise history and index updates: the report runs once per host, in parallel forks."""
    results_root.mkdir(parents=True, exist_ok=True)
    with open(results_root / ".moe_bench_report.lock", "a+", encoding="utf-8") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _fmt(value, pattern: str, missing: str = "–") -> str:
    if value is None:
        return missing
    return pattern.format(value)


def _flag_text(entry: dict) -> str:
    regression = entry.get("regression") or {}
    if regression.get("regressed"):
        worst = max(regression.get("slower") or [], key=lambda item: item["change"], default=None)
        where = f" (worst M={worst['m']} +{worst['change'] * 100:.1f}%)" if worst else ""
        return f"**SLOWER** than {regression.get('baseline_run_id')}{where}"
    if regression.get("baseline_run_id"):
        return f"ok vs {regression['baseline_run_id']}"
    return "no earlier comparable run"


def host_index_markdown(history: dict) -> str:
    host = history["host"]
    runs = sorted(history["runs"], key=_order, reverse=True)
    lines = [
        f"# MoE benchmark runs on {host}",
        "",
        f"{len(runs)} run(s), newest first. Regression = slower than the previous complete run of the "
        "same configuration by more than the threshold at some M. [All hosts](../index.md)",
        "",
        "| run | started (UTC) | status | GPU | configuration | knee M | us/token at knee | % of floor at knee | downtime | vs previous |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in runs:
        lines.append(
            "| "
            + " | ".join(
                [
                    f"[{entry['run_id']}]({entry['summary']})",
                    entry.get("started_at") or "–",
                    entry.get("status") or "–",
                    entry.get("gpu_name") or "–",
                    config_label(entry.get("config_key") or {}),
                    _fmt(entry.get("knee_m"), "{}"),
                    _fmt(entry.get("knee_us_per_token"), "{:.2f}"),
                    _fmt(entry.get("knee_pct_of_floor"), "{:.1f}%"),
                    human_duration(entry.get("downtime_s")) if entry.get("downtime_s") is not None else "–",
                    _flag_text(entry),
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def results_index_markdown(results_root: Path) -> str:
    rows = []
    for history_path in sorted(results_root.glob("*/history.json")):
        try:
            history = json.loads(history_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        runs = sorted(history.get("runs") or [], key=_order)
        if not runs:
            continue
        latest = runs[-1]
        host = history.get("host") or history_path.parent.name
        rows.append(
            "| "
            + " | ".join(
                [
                    f"[{host}]({history_path.parent.name}/index.md)",
                    str(len(runs)),
                    f"[{latest['run_id']}]({history_path.parent.name}/{latest['summary']})",
                    latest.get("status") or "–",
                    latest.get("gpu_name") or "–",
                    _fmt(latest.get("knee_m"), "{}"),
                    _flag_text(latest),
                ]
            )
            + " |"
        )
    lines = [
        "# MoE benchmark results",
        "",
        "| host | runs | latest run | status | GPU | knee M | latest vs previous |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]
    return "\n".join(lines) + "\n"

