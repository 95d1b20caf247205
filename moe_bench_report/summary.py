"""summary.md (for a person), the console lines (for the play's output) and summary.json's
headline figures (for AWX's set_stats), all from one summary dict built in build.py."""

from __future__ import annotations

from .figures import downtime_bar, downtime_line, human_duration, readable
from .history import config_label


def _num(value, pattern: str, missing: str = "–") -> str:
    if value is None:
        return missing
    return pattern.format(value)


def ceilings_text(ceilings: dict | None) -> str:
    if not ceilings:
        return "no ceilings recorded"
    return (
        f"{readable(ceilings.get('bandwidth_gbps'))} GB/s, "
        f"{readable(ceilings.get('tflops'))} TFLOP/s ({ceilings.get('source') or 'unknown source'})"
    )


def regression_sentence(regression: dict) -> str:
    threshold_pct = regression["threshold"] * 100
    if regression.get("baseline_run_id") is None:
        return "No earlier complete run of this host and configuration to compare with."
    if not regression.get("compared_m"):
        return f"Previous run {regression['baseline_run_id']} shares no M value with this run: nothing compared."
    if regression["regressed"]:
        where = ", ".join(f"M={item['m']} ({item['change'] * 100:+.1f}%)" for item in regression["slower"])
        return (
            f"REGRESSION: slower than the previous run {regression['baseline_run_id']} by more than "
            f"{threshold_pct:.0f}% at {where}."
        )
    return (
        f"No regression: within {threshold_pct:.0f}% of the previous run {regression['baseline_run_id']} "
        f"at all {len(regression['compared_m'])} common M values (worst change {regression['worst_change'] * 100:+.1f}%)."
    )


def knee_sentence(knee: dict | None, rule: dict, timed_m: int = 2) -> str:
    growth_pct = rule["growth_per_doubling"] * 100
    if knee is None and timed_m < 2:
        return "none: fewer than two M values were timed"
    if knee is None:
        return (
            f"none in the measured range: total time still grows by {growth_pct:.0f}% or more per "
            "doubling of M at every step"
        )
    pct = f", {knee['pct_of_floor']:.1f}% of floor" if knee.get("pct_of_floor") is not None else ""
    return (
        f"M={knee['m']}: {knee['us']:,.1f} us per batch, {knee['us_per_token']:.2f} us/token{pct}; "
        f"from there to M={knee['next_m']} the time changes only {knee['growth_per_doubling'] * 100:+.1f}% per doubling"
    )


def saturation_sentence(saturation: dict | None, knee: dict | None) -> str:
    if knee is None:
        return "not applicable without a knee"
    if saturation is None:
        return "not reached in the measured range: per-token cost still falls with every doubling of M"
    return (
        f"M={saturation['m']}: doubling M to {saturation['next_m']} adds "
        f"{saturation['growth_per_doubling'] * 100:+.0f}% time, so per-token cost "
        f"({saturation['us_per_token']:.2f} us/token there) hardly falls any more"
    )


def downtime_sentence(timeline: dict) -> str:
    if timeline.get("downtime_s") is None:
        missing = [
            name
            for name, key in (("service stopped", "service_stopped_at"), ("service ready", "service_ready_at"))
            if not timeline.get(key)
        ]
        return f"unknown (no timestamp for {' and '.join(missing)})"
    return (
        f"{human_duration(timeline['downtime_s'])} ({timeline['downtime_s']:.0f} s): service stopped "
        f"{timeline['service_stopped_at']}, ready again {timeline['service_ready_at']}"
    )


def downtime_itemised_sentence(timeline: dict) -> str:
    parts = timeline.get("downtime_parts")
    if not parts:
        return "not available (no sub-second timestamps of the stop and the healthy answer in this run's timeline)"
    text = downtime_line(parts)
    if parts.get("first_result_s") is not None:
        text += f"; first timed figure {parts['first_result_s']:.1f} s after the benchmark process started"
    if parts["unmeasured"]:
        text += f"; not measured (counted as overhead): {', '.join(parts['unmeasured'])}"
    return text


def gpu_at_start_sentence(gpu: dict) -> str:
    return (f"GPU {gpu.get('gpu')} {_num(gpu.get('utilization_pct'), '{:.0f}%')} busy, {_num(gpu.get('memory_used_mib'), '{:.0f}')} MiB "
            f"used, {_num(gpu.get('memory_free_mib'), '{:.0f}')} MiB free of {_num(gpu.get('memory_total_mib'), '{:.0f}')} "
            f"at {gpu.get('at')}")


def rehearsal_sentence(rehearsal: dict) -> str:
    """One line for the rehearsal: how it went and its figures, marked as the reduced layer."""
    held = f"{rehearsal.get('experts') or '?'} of the layer's {rehearsal.get('layer_experts') or '?'} experts"
    if rehearsal.get("status") != "complete":
        return f"{rehearsal.get('outcome') or rehearsal.get('status') or 'none'} ({held}): {rehearsal.get('error') or 'no figures'}"
    figures = ", ".join(f"M={row['m']} {row['us']:.1f} us" for row in rehearsal.get("results") or [])
    text = (f"{held} (fewer than the layer: a trend, not the layer's figures), measured beside the live service; "
            f"{len(rehearsal.get('checked_m') or [])} M checked; {figures}")
    if rehearsal.get("gpu_at_start"):
        text += f"; at its start {gpu_at_start_sentence(rehearsal['gpu_at_start'])}"
    return text


def prewarm_sentence(prewarm: dict) -> str:
    """What the read-ahead of the model's files did beside the benchmark."""
    if prewarm.get("bytes") is None:
        return f"no record ({prewarm.get('error') or prewarm.get('stopped') or 'unknown'})"
    gib = prewarm["bytes"] / 2**30
    total = prewarm.get("bytes_total")
    text = f"{gib:.2f} GiB" + (f" of {total / 2**30:.2f} GiB" if total else "")
    text += f" read into the page cache in {float(prewarm.get('seconds') or 0):.1f} s, {prewarm.get('files_read', 0)}"
    text += f" of {prewarm.get('files_total', 0)} files; stopped: {prewarm.get('stopped')}"
    if prewarm.get("error"):
        text += f" ({prewarm['error']})"
    return text


def job_sentence(timeline: dict) -> str:
    parts = []
    if timeline.get("benchmark_s") is not None:
        parts.append(
            f"ran {human_duration(timeline['benchmark_s'])} ({timeline['benchmark_started_at']} to "
            f"{timeline['benchmark_finished_at']})"
        )
    else:
        parts.append("duration unknown (no start or end timestamp)")
    if timeline.get("time_to_ready_s") is not None:
        parts.append(f"the service was ready {human_duration(timeline['time_to_ready_s'])} after its start")
    return "; ".join(parts)


def markdown(summary: dict) -> str:
    manifest = summary["manifest"]
    timeline = manifest["timeline"]
    regression = summary["regression"]
    knee = summary["knee"]
    lines = [f"# MoE benchmark on {summary['host']}, run {summary['run_id']}", ""]
    if not manifest["validity"]["valid"]:
        lines += [f"> **INVALID: {'; '.join(manifest['validity']['reasons'])}. The figures below are kept "
                  "for the record only.**", ""]
    if regression["regressed"]:
        lines += [f"> **{regression_sentence(regression)}**", ""]
    lines += [
        f"- **Status:** {summary['status']}"
        + (f" ({summary['error']['kind']}: {summary['error']['message']})" if summary.get("error") else ""),
        f"- **GPU:** {manifest['gpu']['name'] or 'unknown'} (driver {manifest['gpu']['driver'] or 'unknown'}, "
        f"CUDA {manifest['gpu']['cuda'] or 'unknown'}, device {manifest['gpu']['device'] or 'unknown'})",
        f"- **Software:** torch {manifest['software']['torch'] or 'unknown'}, triton {manifest['software']['triton'] or 'unknown'}, "
        f"python {manifest['software']['python'] or 'unknown'}",
        f"- **Configuration:** {config_label(summary['config_key'])}",
        f"- **Backend:** {summary['config_key'].get('backend') or 'unknown'}; **ceilings:** {ceilings_text(summary['ceilings'])}",
        f"- **Knee:** {knee_sentence(knee, summary['knee_rule'], len(summary['per_m']))}",
        f"- **Saturation:** {saturation_sentence(summary.get('saturation'), knee)}",
        f"- **Downtime:** {downtime_sentence(timeline)}",
        f"- **Downtime, itemised:** {downtime_itemised_sentence(timeline)}",
        f"- **Benchmark job:** {job_sentence(timeline)}",
        *([f"- **Model read-ahead:** {prewarm_sentence(manifest['prewarm'])}"] if manifest.get("prewarm") else []),
        *([f"- **Stop:** {manifest['stop'].get('why')}"] if manifest.get("stop") else []),
        *([f"- **GPU at the payload's start:** {gpu_at_start_sentence(manifest['payload']['gpu_at_start'])}"]
          if (manifest.get("payload") or {}).get("gpu_at_start") else []),
        *([f"- **Rehearsal (REDUCED, zero downtime):** {rehearsal_sentence(manifest['rehearsal'])}"]
          if manifest.get("rehearsal") else []),
        f"- **Compared with previous run:** {regression_sentence(regression)}",
        f"- **Project:** commit {manifest['project']['commit']}"
        + (" (working tree modified)" if manifest["project"].get("dirty") else "")
        + f"; launched by {launch_text(manifest['launch'])}",
        "",
    ]
    if timeline.get("downtime_parts"):
        lines += ["## Downtime", "", "```", *downtime_bar(timeline["downtime_parts"]), "```", ""]
    if summary.get("load_error"):
        lines += [f"**The results could not be read:** {summary['load_error']}", ""]
    if summary["per_m"]:
        has_baseline = regression.get("baseline_run_id") is not None
        header = "| M | us (median) | us p20–p80 | us/token | GB/s | TFLOP/s | floor us | % of floor |"
        rule = "|---:|---:|---:|---:|---:|---:|---:|---:|"
        if has_baseline:
            header += " vs previous |"
            rule += "---:|"
        lines += ["## Per M", "", header, rule]
        change_by_m = {item["m"]: item for item in regression.get("per_m") or []}
        for row in summary["per_m"]:
            marker = " **knee**" if knee and row["m"] == knee["m"] else ""
            saturation = summary.get("saturation")
            if saturation and row["m"] == saturation["m"]:
                marker += " **saturation**"
            cells = [
                f"{row['m']}{marker}",
                _num(row["us"], "{:,.1f}"),
                f"{_num(row['us_p20'], '{:,.1f}')}–{_num(row['us_p80'], '{:,.1f}')}",
                _num(row["us_per_token"], "{:,.3f}"),
                _num(row["gbps"], "{:,.0f}"),
                _num(row["tflops"], "{:,.2f}"),
                _num(row["floor_us"], "{:,.1f}"),
                _num(row["pct_of_floor"], "{:.1f}%"),
            ]
            if has_baseline:
                change = change_by_m.get(row["m"])
                if change is None:
                    cells.append("–")
                else:
                    text = f"{change['change'] * 100:+.1f}%"
                    cells.append(f"**{text} SLOWER**" if change["slower"] else text)
            lines.append("| " + " | ".join(cells) + " |")
        lines += [
            "",
            "Floor = max(bytes moved / bandwidth ceiling, FLOPs / compute ceiling); % of floor = floor / measured.",
            f"Knee rule: the smallest measured M whose step to the next measured M adds less than "
            f"{summary['knee_rule']['growth_per_doubling'] * 100:.0f}% to the total time per doubling of M "
            "(past it, extra tokens ride on weights already streamed and per-token cost falls like 1/M). "
            "Saturation: the smallest M at or after the knee whose step to the next M adds 50% or more "
            "per doubling (per-token cost no longer falls much).",
            "",
            "## Plots",
            "",
            "![per-token cost against M](per_token.png)",
            "",
            "![total time against M](total_time.png)",
            "",
        ]
    else:
        lines += ["No M value was timed in this run.", ""]
    if summary.get("tp"):
        lines += tp_markdown(summary["tp"])
    if summary.get("correctness"):
        lines += correctness_markdown(summary["correctness"], "## Correctness")
    lines += [
        "## Files",
        "",
        "[manifest.json](manifest.json) · [summary.json](summary.json) · [results.json](results.json) · "
        "[results.csv](results.csv) · [bench.log](bench.log) · [all runs of this host](../index.md)",
        "",
    ]
    return "\n".join(lines)


def correctness_markdown(checks: list[dict], heading: str) -> list[str]:
    lines = [heading, "", "| M | relative error | worst row (its error) | bound per row | ok |",
             "|---:|---:|---:|---:|---|"]
    for check in checks:
        worst = check.get("worst_row_rel_err")
        worst_text = "–" if worst is None else f"{check.get('worst_row')} ({worst:.2e})"
        lines.append(
            f"| {check.get('m')} | {_num(check.get('rel_err'), '{:.2e}')} | {worst_text} | "
            f"{_num(check.get('bound'), '{:.2e}')} | {'yes' if check.get('ok') else '**NO**'} |"
        )
    return lines + [""]


def tp_markdown(tp: dict) -> list[str]:
    """The tensor-parallel layer: its time split into MoE and all-reduce per M, beside the
    one-GPU run's time."""
    lines = [f"## Tensor-parallel layer: {tp.get('ranks') or '?'} ranks ({tp.get('collective') or 'unknown'})", ""]
    if tp.get("load_error"):
        return lines + [f"**The tensor-parallel results could not be read:** {tp['load_error']}", ""]
    status = f"- **Status:** {tp.get('status')}"
    if tp.get("error"):
        status += f" ({tp['error']['kind']}: {tp['error']['message']})"
    lines += [status, f"- **Configuration:** {tp.get('config_label')}",
              f"- **One-GPU curve:** {tp.get('single_gpu_config_label') or 'no one-GPU run beside it'}", ""]
    if not tp["per_m"]:
        return lines + ["No M value was timed on the ranks.", ""]
    lines += ["| M | layer us | MoE us | all-reduce us | all-reduce share | bus GB/s | one GPU us | layer / one GPU |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in tp["per_m"]:
        lines.append(
            f"| {row['m']} | {row['layer_us']:,.1f} | {row['moe_us']:,.1f} | {row['allreduce_us']:,.1f} | "
            f"{row['allreduce_share'] * 100:.1f}% | {_num(row['busbw_gbps'], '{:,.3g}')} | "
            f"{_num(row['single_gpu_us'], '{:,.1f}')} | {_num(row['layer_vs_single_gpu'], '{:.2f}x')} |"
        )
    lines += [
        "",
        "Layer = the shard's MoE then the all-reduce of its output (activation dtype), timed as one; MoE and all-reduce "
        "are each timed alone (the slowest rank's median), so they need not add up to the layer. "
        "All-reduce share = all-reduce / (MoE + all-reduce). Bus bandwidth as nccl-tests define it: "
        "bytes / time x 2 (n - 1) / n.",
        "",
        "![tensor-parallel layer against M](tp_layer.png)",
        "",
    ]
    if tp.get("correctness"):
        lines += correctness_markdown(tp["correctness"], "### Correctness of the reduced output (whole layer)")
    return lines


def launch_text(launch: dict) -> str:
    if launch.get("by") == "awx":
        parts = [f"AWX job {launch['job_id']}"]
        if launch.get("template"):
            parts.append(f"template {launch['template']!r}")
        if launch.get("scheduled"):
            parts.append(f"schedule {launch.get('schedule') or launch.get('schedule_id') or '?'}")
        else:
            parts.append(f"{launch.get('launch_type')} launch")
        if launch.get("user"):
            parts.append(f"by {launch['user']}")
        return ", ".join(parts)
    return f"{launch.get('user')} by hand on {launch.get('controller')}"


def console_lines(summary: dict) -> list[str]:
    manifest = summary["manifest"]
    regression = summary["regression"]
    lines = [
        f"{summary['host']} run {summary['run_id']}: {summary['status']}, {manifest['gpu']['name'] or 'no GPU name'}, "
        f"{config_label(summary['config_key'])}",
    ]
    if not manifest["validity"]["valid"]:
        lines.append(f"INVALID: {'; '.join(manifest['validity']['reasons'])}")
    if summary.get("error"):
        lines.append(f"payload error ({summary['error']['kind']}): {summary['error']['message']}")
    if summary.get("load_error"):
        lines.append(f"results could not be read: {summary['load_error']}")
    if summary["per_m"]:
        lines.append(f"{'M':>6} {'us':>10} {'us/token':>10} {'% floor':>8}")
        for row in summary["per_m"]:
            lines.append(
                f"{row['m']:>6} {row['us']:>10.1f} {row['us_per_token']:>10.3f} "
                f"{_num(row['pct_of_floor'], '{:.1f}%'):>8}"
            )
    lines.append(f"Knee: {knee_sentence(summary['knee'], summary['knee_rule'], len(summary['per_m']))}.")
    if summary.get("saturation"):
        lines.append(f"Saturation: {saturation_sentence(summary['saturation'], summary['knee'])}.")
    tp = summary.get("tp")
    if tp and tp.get("per_m"):
        lines.append(f"Tensor-parallel layer on {tp['ranks']} ranks ({tp['status']}):")
        lines.append(f"{'M':>6} {'layer us':>10} {'MoE us':>10} {'allred us':>10} {'share':>6} {'bus GB/s':>9}")
        for row in tp["per_m"]:
            lines.append(f"{row['m']:>6} {row['layer_us']:>10.1f} {row['moe_us']:>10.1f} {row['allreduce_us']:>10.1f} "
                         f"{row['allreduce_share'] * 100:>5.1f}% {_num(row['busbw_gbps'], '{:.3g}'):>9}")
    elif tp:
        lines.append(f"Tensor-parallel run: {tp.get('status')}" + (f" ({tp['load_error']})" if tp.get("load_error") else ""))
    if manifest.get("stop"):
        lines.append(f"Stop: {manifest['stop'].get('why')}.")
    if manifest.get("rehearsal"):
        lines.append(f"Rehearsal (REDUCED, zero downtime): {rehearsal_sentence(manifest['rehearsal'])}.")
    lines.append(f"Downtime: {downtime_sentence(manifest['timeline'])}.")
    if manifest["timeline"].get("downtime_parts"):
        lines.append(f"Downtime, itemised: {downtime_line(manifest['timeline']['downtime_parts'])}.")
        lines.extend(downtime_bar(manifest["timeline"]["downtime_parts"]))
    lines.append(regression_sentence(regression))
    lines.append(f"summary: {summary['files']['summary_md']}")
    return lines


def headline(summary: dict) -> dict:
    """The figures AWX shows for this host (set_stats), flat and small."""
    knee = summary["knee"] or {}
    regression = summary["regression"]
    return {
        "run_id": summary["run_id"],
        "status": summary["status"],
        "valid": summary["manifest"]["validity"]["valid"],
        "gpu": summary["manifest"]["gpu"]["name"],
        "backend": summary["config_key"].get("backend"),
        "config": config_label(summary["config_key"]),
        "us_per_m": {str(row["m"]): round(row["us"], 1) for row in summary["per_m"]},
        "pct_of_floor_per_m": {
            str(row["m"]): (round(row["pct_of_floor"], 1) if row["pct_of_floor"] is not None else None)
            for row in summary["per_m"]
        },
        "knee_m": knee.get("m"),
        "knee_us_per_token": round(knee["us_per_token"], 3) if knee else None,
        "knee_pct_of_floor": knee.get("pct_of_floor"),
        "saturation_m": (summary.get("saturation") or {}).get("m"),
        "downtime_s": summary["manifest"]["timeline"]["downtime_s"],
        "regression": regression["regressed"],
        "regression_at_m": [item["m"] for item in regression["slower"]],
        "baseline_run_id": regression.get("baseline_run_id"),
        "summary_md": summary["files"]["summary_md"],
        "tp_ranks": (summary.get("tp") or {}).get("ranks"),
        "tp_layer_us_per_m": {str(row["m"]): round(row["layer_us"], 1) for row in (summary.get("tp") or {}).get("per_m") or []},
        "gpus": len((summary.get("gpus") or {}).get("gpus") or []) or None,
        "gpu_outliers": (summary.get("gpus") or {}).get("outlier_labels") or [],
        "tp_allreduce_share_per_m": {
            str(row["m"]): round(row["allreduce_share"], 3) for row in (summary.get("tp") or {}).get("per_m") or []
        },
    }
