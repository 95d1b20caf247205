"""The numbers a report shows, computed from a loaded results document: pure functions.

Everything here takes the document returned by `moe_bench.schema.load_results` (or the rows
of its `results` list) and returns plain values, so it is tested without files or plots.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any, Iterable

# Two points on the curve of time against M (both on the measured M values):
#
# The knee (start of the plateau): the smallest M from which doubling the batch adds less
# than DEFAULT_KNEE_GROWTH to the kernel's total time. Below it each extra token brings the
# weights of experts not yet touched, so time grows with M; from it on nearly every expert is
# already streamed, extra tokens ride along almost free and per-token cost falls like 1/M.
# 10% sits well above run-to-run noise (p20-p80 spreads of 1-3%) and above the slow growth
# left on the plateau (about +8% per doubling on an H200 with the Triton kernel, from the
# activations and the compute that grow with M), and below the growth while experts are
# still being touched (+27% from M=64 to 128 there).
#
# Saturation (end of the plateau): the smallest M at or after the knee from which doubling
# the batch adds DEFAULT_SATURATION_GROWTH or more to the total time, i.e. per-token cost no
# longer falls much (by less than 25% per doubling at +50%): the kernel turns compute-bound
# or runs out of parallel slack, and bigger batches stop being cheap.
DEFAULT_KNEE_GROWTH = 0.10
DEFAULT_SATURATION_GROWTH = 0.50

# A slowdown beyond this fraction at any M against the previous comparable run is flagged.
DEFAULT_REGRESSION_THRESHOLD = 0.10


def timed_rows(document: dict) -> list[dict]:
    """The timed rows of a results document, sorted by M, skipping rows without a time."""
    rows = [row for row in document.get("results") or [] if _positive(row.get("us"))]
    return sorted(rows, key=lambda row: int(row["m"]))


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def growth_per_doubling(m_low: int, us_low: float, m_high: int, us_high: float) -> float:
    """How much total time grows per doubling of M between two measured points (0.1 = +10%)."""
    doublings = math.log2(m_high / m_low)
    return (us_high / us_low) ** (1.0 / doublings) - 1.0


def find_knee(rows: Iterable[dict], growth: float = DEFAULT_KNEE_GROWTH) -> dict | None:
    """The knee of the time-vs-M curve, or None when the measured range shows none.

    Rule: the knee is the smallest measured M whose step to the next measured M grows total
    time by less than `growth` per doubling of M (the step's growth is normalised per doubling
    so that gaps in the M list, e.g. 64 -> 256, are judged fairly). The largest M is never the
    knee: there is no step after it to show the plateau.

    Returns {"m", "us", "us_per_token", "pct_of_floor", "next_m", "growth_per_doubling"}.
    """
    if growth <= 0:
        raise ValueError(f"knee growth must be > 0, got {growth}")
    ordered = sorted((row for row in rows if _positive(row.get("us"))), key=lambda row: int(row["m"]))
    for current, following in zip(ordered, ordered[1:]):
        step = growth_per_doubling(int(current["m"]), float(current["us"]), int(following["m"]), float(following["us"]))
        if step < growth:
            return {
                "m": int(current["m"]),
                "us": float(current["us"]),
                "us_per_token": per_token(current),
                "pct_of_floor": current.get("pct_of_floor"),
                "next_m": int(following["m"]),
                "growth_per_doubling": round(step, 4),
            }
    return None


def find_saturation(rows: Iterable[dict], knee: dict | None, growth: float = DEFAULT_SATURATION_GROWTH) -> dict | None:
    """The end of the plateau, or None when the measured range does not reach it.

    Rule: the smallest measured M at or after the knee whose step to the next measured M
    grows total time by `growth` or more per doubling of M. None without a knee.

    Returns {"m", "us", "us_per_token", "next_m", "growth_per_doubling"}.
    """
    if knee is None:
        return None
    if growth <= 0:
        raise ValueError(f"saturation growth must be > 0, got {growth}")
    ordered = sorted((row for row in rows if _positive(row.get("us"))), key=lambda row: int(row["m"]))
    for current, following in zip(ordered, ordered[1:]):
        if int(current["m"]) < knee["m"]:
            continue
        step = growth_per_doubling(int(current["m"]), float(current["us"]), int(following["m"]), float(following["us"]))
        if step >= growth:
            return {
                "m": int(current["m"]),
                "us": float(current["us"]),
                "us_per_token": per_token(current),
                "next_m": int(following["m"]),
                "growth_per_doubling": round(step, 4),
            }
    return None


def tp_layer_rows(tp_document: dict, single_rows: Iterable[dict] | None = None) -> list[dict]:
    """Per M of a tensor-parallel run (tp_results): the whole layer's time, its MoE and
    all-reduce parts, the all-reduce's share of the two, the all-reduce's bus bandwidth, and
    the one-GPU run's time at the same M when one is given. The layer and each part are timed
    on their own, so the parts need not add up to the layer exactly."""
    single = {int(row["m"]): float(row["us"]) for row in single_rows or [] if _positive(row.get("us"))}
    rows = []
    for row in sorted(tp_document.get("tp_results") or [], key=lambda r: int(r["m"])):
        if not all(_positive(row.get(key)) for key in ("layer_us", "moe_us", "allreduce_us")):
            continue
        m = int(row["m"])
        moe, allreduce, layer = float(row["moe_us"]), float(row["allreduce_us"]), float(row["layer_us"])
        one_gpu = single.get(m)
        rows.append({
            "m": m,
            "ranks": row.get("ranks"),
            "layer_us": layer,
            "layer_us_p20": row.get("layer_us_p20"),
            "layer_us_p80": row.get("layer_us_p80"),
            "moe_us": moe,
            "allreduce_us": allreduce,
            "allreduce_share": allreduce / (moe + allreduce),
            "busbw_gbps": row.get("busbw_gbps"),
            "algbw_gbps": row.get("algbw_gbps"),
            "single_gpu_us": one_gpu,
            "layer_vs_single_gpu": layer / one_gpu if one_gpu else None,
        })
    return rows


def per_token(row: dict) -> float:
    """Microseconds per token of one row (the payload's own figure when it gave one)."""
    value = row.get("us_per_token")
    if _positive(value):
        return float(value)
    return float(row["us"]) / int(row["m"])


def floor_per_token(row: dict) -> float | None:
    floor = row.get("floor_us")
    if not _positive(floor):
        return None
    return float(floor) / int(row["m"])


def parse_time(value: Any) -> datetime | None:
    """An ISO-8601 timestamp (with Z or an offset; naive means UTC) as an aware datetime."""
    if value in (None, ""):
        return None
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        # Epoch seconds, as `now().timestamp()` or ansible_date_time.epoch give them.
        moment = datetime.fromtimestamp(float(value), tz=timezone.utc)
    elif isinstance(value, str) and value.strip().replace(".", "", 1).isdigit():
        moment = datetime.fromtimestamp(float(value), tz=timezone.utc)
    else:
        text = str(value).strip()
        if text.endswith("Z"):
            text = text[:-1] + "+00:00"
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc)


def iso_utc(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def seconds_between(start: Any, end: Any) -> float | None:
    """end - start in seconds, None when either is missing or unreadable."""
    start_time, end_time = parse_time(start), parse_time(end)
    if start_time is None or end_time is None:
        return None
    return round((end_time - start_time).total_seconds(), 1)


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    sign = "-" if seconds < 0 else ""
    total = int(round(abs(seconds)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{sign}{hours} h {minutes:02d} min {secs:02d} s"
    if minutes:
        return f"{sign}{minutes} min {secs:02d} s"
    return f"{sign}{secs} s"


def compare_runs(current_rows: Iterable[dict], baseline_rows: Iterable[dict], threshold: float) -> dict:
    """Per-M change of `us` against a baseline run; slowdowns beyond `threshold` are flagged.

    Only M values timed in both runs are compared. `change` is us / baseline_us - 1
    (0.15 = 15% slower).
    """
    if threshold <= 0:
        raise ValueError(f"regression threshold must be > 0, got {threshold}")
    baseline_by_m = {int(row["m"]): float(row["us"]) for row in baseline_rows if _positive(row.get("us"))}
    compared = []
    for row in sorted(current_rows, key=lambda r: int(r["m"])):
        m = int(row["m"])
        if m not in baseline_by_m or not _positive(row.get("us")):
            continue
        change = float(row["us"]) / baseline_by_m[m] - 1.0
        compared.append(
            {
                "m": m,
                "us": float(row["us"]),
                "baseline_us": baseline_by_m[m],
                "change": round(change, 4),
                "slower": change > threshold,
            }
        )
    slower = [entry for entry in compared if entry["slower"]]
    return {
        "threshold": threshold,
        "compared_m": [entry["m"] for entry in compared],
        "per_m": compared,
        "slower": slower,
        "regressed": bool(slower),
        "worst_change": max((entry["change"] for entry in compared), default=None),
    }


def readable(value: float | None) -> str:
    """A ceiling or rate for a person: thousands separated when large, 3 significant digits when small."""
    if value is None:
        return "?"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def percent(value: float | None) -> str:
    """A % of floor for a person: one decimal, more digits only below 0.1%."""
    if value is None:
        return "?"
    return f"{value:.1f}%" if abs(value) >= 0.1 else f"{value:.2g}%"


# The downtime's parts, in the order they happen. Each is the work itself as the one who did it
# measured it; what is left of the downtime is the playbook's own overhead (task round trips,
# polls, launches, checks between the parts).
DOWNTIME_PARTS = (
    ("stop", "unit stop"),
    ("memory", "memory check"),
    ("benchmark", "benchmark process"),
    ("fetch", "fetch"),
    ("start", "start until healthy"),
    ("overhead", "playbook overhead"),
)
# The benchmark process's own phases (the payload's clock, results `phases`).
BENCHMARK_PHASES = (
    ("import_s", "import"),
    ("device_s", "device"),
    ("weights_s", "weights"),
    ("check_s", "check"),
    ("timing_s", "timing"),
)


def _seconds(value: Any) -> float | None:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if math.isfinite(seconds) else None


def _epoch(value: Any) -> float | None:
    moment = parse_time(value)
    return moment.timestamp() if moment is not None else None


def downtime_parts(given: dict, phases: dict | None) -> dict | None:
    """The downtime, from the stop being issued to the first healthy answer, split into its parts.

    given holds the roles' facts (epoch seconds on the controller's clock, the memory check's own
    wait); phases the payload's (seconds on the host's clock, from the process's start). Durations
    only are taken from each clock, so the two clocks need not agree. None when the stop or the
    healthy answer is not known (no downtime to split).
    """
    issued = _epoch(given.get("service_stop_issued_epoch"))
    ready = _epoch(given.get("service_recover_ready_epoch"))
    if issued is None or ready is None or ready < issued:
        return None

    def between(start_key: str, end_key: str) -> float | None:
        # Only the part inside the downtime counts (the playbook fetches after the service is back).
        start, end = _epoch(given.get(start_key)), _epoch(given.get(end_key))
        if start is None or end is None or end < start:
            return None
        return max(0.0, min(end, ready) - max(start, issued))

    phases = phases if isinstance(phases, dict) else {}
    measured = {
        "stop": between("service_stop_issued_epoch", "service_stop_stopped_epoch"),
        "memory": _seconds(given.get("vram_check_waited_s")),
        "benchmark": _seconds(phases.get("process_s")),
        "fetch": between("bench_fetch_started_epoch", "bench_fetch_finished_epoch"),
        "start": between("service_recover_start_issued_epoch", "service_recover_ready_epoch"),
    }
    total = ready - issued
    known = sum(value for value in measured.values() if value is not None)
    measured["overhead"] = max(total - known, 0.0)
    parts = [{"part": key, "label": label, "s": None if measured[key] is None else round(measured[key], 2)}
             for key, label in DOWNTIME_PARTS]
    benchmark_phases = [{"phase": key[:-2], "label": label, "s": round(_seconds(phases[key]), 2)}
                        for key, label in BENCHMARK_PHASES if _seconds(phases.get(key)) is not None]
    fetch_started = _epoch(given.get("bench_fetch_started_epoch"))
    return {
        "fetch_after_downtime": fetch_started is not None and fetch_started >= ready,
        "from": iso_utc(datetime.fromtimestamp(issued, tz=timezone.utc)),
        "to": iso_utc(datetime.fromtimestamp(ready, tz=timezone.utc)),
        "total_s": round(total, 2),
        "parts": parts,
        "benchmark_phases": benchmark_phases,
        "compile_s": _seconds(phases.get("compile_s")),
        "first_result_s": _seconds(phases.get("first_result_s")),
        "unmeasured": [part["part"] for part in parts if part["s"] is None],
        "overhead_s": round(measured["overhead"], 2),
    }


def downtime_line(parts: dict) -> str:
    """One line: the total and each part, the benchmark's phases in brackets."""
    pieces = []
    for part in parts["parts"]:
        if part["s"] is None:
            pieces.append(f"{part['label']} not measured")
            continue
        text = f"{part['label']} {part['s']:.1f} s"
        if part["part"] == "fetch" and parts.get("fetch_after_downtime"):
            text = "fetch 0 s (after the service was back)"
        if part["part"] == "benchmark" and parts["benchmark_phases"]:
            text += " (" + ", ".join(f"{phase['label']} {phase['s']:.1f}" for phase in parts["benchmark_phases"]) + ")"
        pieces.append(text)
    return f"{parts['total_s']:.1f} s = " + " + ".join(pieces)


# One letter per part in the bar picture.
_BAR_SYMBOLS = {"stop": "S", "memory": "M", "benchmark": "B", "fetch": "F", "start": "H", "overhead": "."}


def downtime_bar(parts: dict, width: int = 60) -> list[str]:
    """A bar of the parts (each part's share of the width, at least one cell when it is not 0) and
    its legend, as monospace lines."""
    total = parts["total_s"] or 0.0
    cells = []
    for part in parts["parts"]:
        seconds = part["s"] or 0.0
        count = 0 if total <= 0 or seconds <= 0 else max(1, round(width * seconds / total))
        cells.append((part, count))
    # Trim or pad the largest part so the bar keeps its width.
    if cells and total > 0:
        largest = max(range(len(cells)), key=lambda index: cells[index][1])
        surplus = sum(count for _, count in cells) - width
        part, count = cells[largest]
        cells[largest] = (part, max(1, count - surplus))
    bar = "".join(_BAR_SYMBOLS[part["part"]] * count for part, count in cells)
    legend = "  ".join(f"{_BAR_SYMBOLS[part['part']]} {part['label']}" for part, count in cells if count)
    return [f"|{bar}| {total:.1f} s", legend]
