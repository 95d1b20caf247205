"""The two pictures of a run: per-token cost against M, and total kernel time against M.

Both on log-log axes (M doubles from point to point; times span two or three decades), with
the floor drawn beside the measurement, the knee marked, the p20-p80 spread shaded, and, when
there is one, the previous comparable run in grey with any M that got slower circled in red.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullLocator  # noqa: E402

from .figures import floor_per_token, per_token, percent  # noqa: E402

FIGURE_SIZE_IN = (10.0, 6.0)
FIGURE_DPI = 100  # 1000 x 600 pixels
MEASURED_COLOUR = "#1f77b4"
FLOOR_COLOUR = "#d62728"
BASELINE_COLOUR = "#7f7f7f"
KNEE_COLOUR = "#2ca02c"
SATURATION_COLOUR = "#9467bd"
SLOWER_COLOUR = "#ff7f0e"


def _m_axis(axes, ms: list[int]) -> None:
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_locator(FixedLocator(ms))
    axes.xaxis.set_minor_locator(NullLocator())
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{int(round(value))}"))
    axes.set_xlabel("M: tokens in the batch (log scale)")
    axes.grid(True, which="major", alpha=0.3)
    axes.grid(True, which="minor", axis="y", alpha=0.12)


def _title(axes, what: str, context: dict) -> None:
    axes.set_title(
        f"{what}: {context['host']} · {context['gpu']} · backend {context['backend']}\n"
        f"{context['config']} · run {context['run_id']}",
        fontsize=11,
    )


def _time_axis(axes, label: str) -> None:
    # Ticks at 1, 2, 5 x 10^k labelled in plain numbers: values can be read off the picture.
    axes.set_yscale("log")
    axes.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes.yaxis.set_minor_locator(NullLocator())
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:,.10g}"))
    axes.set_ylabel(label)


def _mark_saturation(axes, saturation: dict | None) -> None:
    if saturation:
        axes.axvline(
            saturation["m"],
            color=SATURATION_COLOUR,
            linestyle="-.",
            linewidth=1.4,
            label=f"saturation M={saturation['m']}: doubling M adds {saturation['growth_per_doubling'] * 100:+.0f}% time",
        )


def _mark_knee(axes, knee: dict | None, y_value: float | None, label: str, text_at: tuple[float, float]) -> None:
    """A dotted line at the knee, and its figures in a box at `text_at` (axes fraction, the
    box's right edge) with an arrow to the point."""
    if not knee:
        return
    axes.axvline(knee["m"], color=KNEE_COLOUR, linestyle=":", linewidth=1.6, label=label)
    if y_value is not None:
        axes.annotate(
            label,
            xy=(knee["m"], y_value),
            xytext=text_at,
            textcoords="axes fraction",
            ha="right",
            va="center",
            color=KNEE_COLOUR,
            fontsize=9,
            bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": KNEE_COLOUR, "alpha": 0.9},
            arrowprops={"arrowstyle": "->", "color": KNEE_COLOUR},
        )


def _mark_slower(axes, rows: list[dict], slower_ms: set[int], value_of, threshold: float | None) -> None:
    points = [(int(row["m"]), value_of(row)) for row in rows if int(row["m"]) in slower_ms]
    if points:
        axes.scatter(
            [m for m, _ in points],
            [value for _, value in points],
            s=160,
            facecolors="none",
            edgecolors=SLOWER_COLOUR,
            linewidths=2.0,
            zorder=5,
            label=f"slower than previous run by more than {threshold * 100:.0f}%" if threshold else "slower than previous run",
        )


def plot_per_token(path: Path, rows: list[dict], context: dict, knee: dict | None, saturation: dict | None,
                   baseline_rows: list[dict] | None = None, slower_ms: set[int] | None = None) -> None:
    ms = [int(row["m"]) for row in rows]
    figure, axes = plt.subplots(figsize=FIGURE_SIZE_IN, dpi=FIGURE_DPI)
    try:
        measured = [per_token(row) for row in rows]
        low = [float(row["us_p20"]) / int(row["m"]) if row.get("us_p20") else value for row, value in zip(rows, measured)]
        high = [float(row["us_p80"]) / int(row["m"]) if row.get("us_p80") else value for row, value in zip(rows, measured)]
        axes.fill_between(ms, low, high, color=MEASURED_COLOUR, alpha=0.18, linewidth=0, label="p20–p80 spread")
        axes.plot(ms, measured, marker="o", color=MEASURED_COLOUR, linewidth=2, zorder=3,
                  label="measured us per token (median)")
        floor_points = [(int(row["m"]), floor_per_token(row)) for row in rows if floor_per_token(row) is not None]
        if floor_points:
            axes.plot(
                [m for m, _ in floor_points],
                [value for _, value in floor_points],
                linestyle="--",
                marker=".",
                color=FLOOR_COLOUR,
                linewidth=1.6,
                label=f"floor per token ({context['ceilings']})",
            )
        if baseline_rows:
            axes.plot(
                [int(row["m"]) for row in baseline_rows],
                [per_token(row) for row in baseline_rows],
                linestyle="-.",
                marker="s",
                markersize=4,
                color=BASELINE_COLOUR,
                linewidth=1.2,
                zorder=1,
                label=f"previous run {context.get('baseline_run_id')}",
            )
        _mark_slower(axes, rows, slower_ms or set(), per_token, context.get("threshold"))
        knee_label = None
        if knee:
            knee_label = f"knee M={knee['m']}: {knee['us_per_token']:.2f} us/token"
            if knee.get("pct_of_floor") is not None:
                knee_label += f", {percent(knee['pct_of_floor'])} of floor"
        # Per-token cost falls with M: the top right corner stays free.
        _mark_knee(axes, knee, knee["us_per_token"] if knee else None, knee_label, (0.98, 0.93))
        _mark_saturation(axes, saturation)
        _time_axis(axes, "time per token (µs, log scale; lower is better)")
        _m_axis(axes, ms)
        _title(axes, "MoE layer cost per token", context)
        axes.legend(loc="lower left", fontsize=9, framealpha=0.9)
        figure.tight_layout()
        figure.savefig(path, dpi=FIGURE_DPI)
    finally:
        plt.close(figure)


def plot_total_time(path: Path, rows: list[dict], context: dict, knee: dict | None, saturation: dict | None,
                    baseline_rows: list[dict] | None = None, slower_ms: set[int] | None = None) -> None:
    ms = [int(row["m"]) for row in rows]
    figure, axes = plt.subplots(figsize=FIGURE_SIZE_IN, dpi=FIGURE_DPI)
    try:
        measured = [float(row["us"]) for row in rows]
        low = [float(row.get("us_p20") or row["us"]) for row in rows]
        high = [float(row.get("us_p80") or row["us"]) for row in rows]
        axes.fill_between(ms, low, high, color=MEASURED_COLOUR, alpha=0.18, linewidth=0, label="p20–p80 spread")
        axes.plot(ms, measured, marker="o", color=MEASURED_COLOUR, linewidth=2, zorder=3,
                  label="measured kernel time (median)")
        for row, value in zip(rows, measured):
            if row.get("pct_of_floor") is not None:
                axes.annotate(
                    percent(float(row["pct_of_floor"])),
                    xy=(int(row["m"]), value),
                    xytext=(0, 8),
                    textcoords="offset points",
                    ha="center",
                    fontsize=8,
                    color=MEASURED_COLOUR,
                    bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
                    zorder=4,
                )
        floor_points = [(int(row["m"]), float(row["floor_us"])) for row in rows if row.get("floor_us")]
        if floor_points:
            axes.plot(
                [m for m, _ in floor_points],
                [value for _, value in floor_points],
                linestyle="--",
                marker=".",
                color=FLOOR_COLOUR,
                linewidth=1.6,
                label=f"floor ({context['ceilings']})",
            )
        if baseline_rows:
            axes.plot(
                [int(row["m"]) for row in baseline_rows],
                [float(row["us"]) for row in baseline_rows],
                linestyle="-.",
                marker="s",
                markersize=4,
                color=BASELINE_COLOUR,
                linewidth=1.2,
                zorder=1,
                label=f"previous run {context.get('baseline_run_id')}",
            )
        _mark_slower(axes, rows, slower_ms or set(), lambda row: float(row["us"]), context.get("threshold"))
        knee_label = f"knee M={knee['m']}: {knee['us']:.0f} µs" if knee else None
        # On the right, between the measured plateau and the floor's plateau, is free.
        _mark_knee(axes, knee, knee["us"] if knee else None, knee_label, (0.98, 0.76))
        _mark_saturation(axes, saturation)
        _time_axis(axes, "kernel time for the whole batch (µs, log scale)")
        # Head room above the highest point for its % of floor label.
        axes.set_ylim(top=max(high) * 1.6)
        _m_axis(axes, ms)
        _title(axes, "MoE layer time per batch (labels: % of floor)", context)
        axes.legend(loc="lower right", fontsize=9, framealpha=0.9)
        figure.tight_layout()
        figure.savefig(path, dpi=FIGURE_DPI)
    finally:
        plt.close(figure)


MOE_COLOUR = "#1f77b4"
ALLREDUCE_COLOUR = "#ff7f0e"
LAYER_COLOUR = "#2ca02c"


def plot_tp_layer(path: Path, rows: list[dict], context: dict) -> None:
    """The tensor-parallel layer against M: on the left its time and its two parts (log-log)
    beside the one-GPU run's curve; on the right the all-reduce's share of MoE + all-reduce,
    the part a faster kernel cannot win back."""
    ms = [row["m"] for row in rows]
    ranks = rows[0].get("ranks") if rows else "?"
    figure, (times, share) = plt.subplots(1, 2, figsize=FIGURE_SIZE_IN, dpi=FIGURE_DPI,
                                          gridspec_kw={"width_ratios": [3, 2]})
    try:
        low = [float(row.get("layer_us_p20") or row["layer_us"]) for row in rows]
        high = [float(row.get("layer_us_p80") or row["layer_us"]) for row in rows]
        times.fill_between(ms, low, high, color=LAYER_COLOUR, alpha=0.18, linewidth=0, label="layer p20–p80")
        times.plot(ms, [row["layer_us"] for row in rows], marker="o", color=LAYER_COLOUR, linewidth=2,
                   label=f"layer on {ranks} ranks (MoE + all-reduce)")
        times.plot(ms, [row["moe_us"] for row in rows], marker=".", color=MOE_COLOUR, linewidth=1.4,
                   label="its MoE shard alone")
        times.plot(ms, [row["allreduce_us"] for row in rows], marker=".", color=ALLREDUCE_COLOUR, linewidth=1.4,
                   label="its all-reduce alone")
        single = [(row["m"], row["single_gpu_us"]) for row in rows if row.get("single_gpu_us")]
        if single:
            times.plot([m for m, _ in single], [us for _, us in single], linestyle="--", marker="s", markersize=4,
                       color=BASELINE_COLOUR, linewidth=1.4, label=f"one GPU ({context.get('single_gpu_config')})")
        _time_axis(times, "time per batch (µs, log scale)")
        # Head room above the curves for the legend.
        times.set_ylim(top=max(high + [row["single_gpu_us"] or 0 for row in rows]) * 4)
        _m_axis(times, ms)
        times.legend(loc="upper left", fontsize=8, framealpha=0.9)
        times.set_title(f"Layer time on {ranks} ranks: {context['host']} · {context['gpu']}\n"
                        f"{context['config']} · run {context['run_id']}", fontsize=10)
        shares = [100.0 * row["allreduce_share"] for row in rows]
        share.bar(range(len(ms)), [100.0 - value for value in shares], color=MOE_COLOUR, label="MoE")
        share.bar(range(len(ms)), shares, bottom=[100.0 - value for value in shares], color=ALLREDUCE_COLOUR,
                  label="all-reduce")
        for index, value in enumerate(shares):
            share.annotate(f"{value:.0f}%", xy=(index, 100.0 - value / 2), ha="center", va="center", fontsize=8)
        share.set_xticks(range(len(ms)), [str(m) for m in ms])
        share.set_xlabel("M: tokens in the batch")
        share.set_ylim(0, 115)  # the legend above the bars
        share.set_yticks(range(0, 101, 20))
        share.set_ylabel("share of MoE + all-reduce time (%)")
        share.set_title("Split of the layer's time\n(labels: the all-reduce's share)", fontsize=10)
        share.legend(loc="upper center", ncol=2, fontsize=8, framealpha=0.9)
        figure.tight_layout()
        figure.savefig(path, dpi=FIGURE_DPI)
    finally:
        plt.close(figure)


def plot_series(path: Path, series: dict[str, dict[int, float]], title: str, flagged: set[tuple[str, int]],
                threshold: float) -> None:
    """Time per token against M, one line per series (a GPU of a host, or host/GPU of a fleet);
    the points flagged as outliers circled in red."""
    ms = sorted({m for values in series.values() for m in values})
    figure, axes = plt.subplots(figsize=FIGURE_SIZE_IN, dpi=FIGURE_DPI)
    try:
        for label, values in sorted(series.items()):
            points = sorted(values.items())
            if not points:
                continue
            axes.plot([m for m, _ in points], [v for _, v in points], marker="o", markersize=3, linewidth=1.2,
                      label=label)
        marked = [(m, series[label][m]) for label, m in sorted(flagged) if m in series.get(label, {})]
        if marked:
            axes.scatter([m for m, _ in marked], [v for _, v in marked], s=120, facecolors="none",
                         edgecolors=SLOWER_COLOUR, linewidths=2, zorder=5,
                         label=f"more than {threshold * 100:.0f}% over the median")
        _time_axis(axes, "time per token (µs, log scale; lower is better)")
        if ms:
            _m_axis(axes, ms)
        axes.set_title(title, fontsize=11)
        axes.legend(loc="lower left", fontsize=8, framealpha=0.9, ncol=2)
        figure.tight_layout()
        figure.savefig(path, dpi=FIGURE_DPI)
    finally:
        plt.close(figure)


def plot_per_gpu(path: Path, section: dict, context: dict) -> None:
    """Every GPU of one host (one payload per GPU in one downtime)."""
    series = {gpu["label"]: {} for gpu in section["gpus"]}
    for row in section["per_m"]:
        for label, value in row["us_per_token"].items():
            if value is not None:
                series[label][row["m"]] = value
    plot_series(path, series, f"Every GPU of {context['host']}, run {context['run_id']}\n{context['config']}",
                {(item["label"], item["m"]) for item in section["outliers"]}, section["threshold"])
