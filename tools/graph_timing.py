"""An independent timing of the triton backend's forward, beside the harness's own (issue 17).

The harness (moe_bench.timing) times a forward inside one CUDA graph of a forward per routing
(since round 18; before, one graph per routing, each replay carrying a graph launch's gap), in
batches of replays led by an untimed one, from its own inputs and through the backend as the
payload calls it. This script measures on its own: per M, one CUDA graph of 8 forwards over 8
different routings of its own, replayed many times, timed with a pair of events around each
replay; the figure is the mean per forward (replay time / 8), the median over replays.
Consecutive forwards read different expert sets (the L2 cannot hold one M=1 set of kimi-k2.6's
experts, let alone 8).

Every M is checked against the float32 reference (moe_bench.backends.reference_moe) on
fresh inputs, with the workspace and output poisoned, before it is timed; an M that fails is
reported and not timed. Each M's figure is compared with the harness's median: they must
agree within --agree-pct (5%), else the exit code is 1. Two ways to get the harness's figure:
  --harness       the harness runs first, whole, in the same process (same preset, shape, M
                  list and seed; its results JSON to --harness-out), then this script;
  --interleave R  per M, R rounds of the harness's own timing routine (moe_bench.cli.time_one_m,
                  on the backend this script times) alternating with this script's, the harness
                  first in even rounds and second in odd ones; each side's median over the
                  rounds is compared. At large M the H200 reaches its
                  power limit within a second and the clock then depends on what ran just
                  before (PERFORMANCE.md): measured a minute apart, the two ways differed by up
                  to 10% in either direction at some M (round 15), interleaved they measure
                  the same state of the GPU. With both, --interleave gives the comparison.

  PYTHONPATH=files python3 tools/graph_timing.py --preset kimi-k2.6 [--tp 8] \
      [--m-list 1,2,...,8192] [--interleave 2] [--harness --harness-out h.json] --out g.json

The floor: max(bytes / bandwidth, FLOPs / matmul rate) of moe_bench.perfmodel (expected
distinct experts), at 4.3 TB/s and 790 TFLOP/s (field-notes section 2; the issue's bars),
and, with --harness, also at the ceilings the harness measured in its run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from moe_bench import cli, perfmodel, presets, quant
from moe_bench import triton_moe as tm
from moe_bench.backends import reference_moe

FIELD_NOTES_BANDWIDTH_GBPS = 4300.0
FIELD_NOTES_TFLOPS = 790.0
FORWARDS_PER_GRAPH = 8


def driver_version() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def activation_dtype(device) -> torch.dtype:
    """bf16 on a GPU; float32 on the CPU (Triton's interpreter computes bf16 dots wrongly),
    where this script runs only to exercise its own control flow."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_m(moe, weights, shape, m: int, device, seed: int) -> float | None:
    """Relative error against the float32 reference on fresh inputs; None when the output holds
    NaN (a row never written: workspace and output poisoned first)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed * 7777 + m)
    x, ids, wts = cli.make_inputs(shape, m, activation_dtype(device), device, generator)
    for ws in moe._workspace.values():
        for buf in ws.values():
            buf.fill_(float("nan"))
    for buf in moe._partials.values():
        buf.fill_(float("nan"))
    gluon = getattr(moe, "_gluon", None)
    for ws in (gluon._buffers.values() if gluon is not None else ()):
        for name in ("xs", "inter"):
            ws[name].fill_(float("nan"))
    out = cli.poisoned_call(moe, x, ids, wts, shape.hidden)
    ref = reference_moe(weights, x, ids, wts)
    return cli.relative_error(out, ref)


# Offset of this script's routing seed from the harness's (cli.time_one_m seeds seed * 1_000_003
# + m): its own routings by default; --same-routings takes the harness's (offset 0), which
# separates the timing methods from the routing sample where the time depends much on which
# experts a routing touches (few experts: mixtral-8x7b's 8, PERFORMANCE.md round 20).
ROUTING_SEED_OFFSET = 17


def graph_time_us(moe, shape, m: int, device, seed: int, replays: int, budget_s: float,
                  routing_offset: int = ROUTING_SEED_OFFSET) -> dict:
    """Mean us per forward of one graph of FORWARDS_PER_GRAPH forwards over as many routings."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed * 1_000_003 + m + routing_offset)
    sets = [cli.make_inputs(shape, m, activation_dtype(device), device, generator) for _ in range(FORWARDS_PER_GRAPH)]
    for x, ids, wts in sets:  # compiles and decides each configuration's MMA form before capture
        moe(x, ids, wts)
    if device.type != "cuda":  # control flow only: one timed pass over the routings
        started = time.perf_counter()
        for x, ids, wts in sets:
            moe(x, ids, wts)
        us = (time.perf_counter() - started) * 1e6 / FORWARDS_PER_GRAPH
        return {"us": us, "us_mean": us, "us_min": us, "us_max": us, "replays": 1}
    torch.cuda.synchronize(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for x, ids, wts in sets:
            moe(x, ids, wts)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    outputs = []
    with torch.cuda.graph(graph):
        for x, ids, wts in sets:
            outputs.append(moe(x, ids, wts))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(device)
    per_forward = []
    started = time.perf_counter()
    while len(per_forward) < replays and (len(per_forward) < 5 or time.perf_counter() - started < budget_s):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_forward.append(start.elapsed_time(end) * 1e3 / FORWARDS_PER_GRAPH)
    del graph, outputs
    return {"us": statistics.median(per_forward), "us_mean": statistics.fmean(per_forward),
            "us_min": min(per_forward), "us_max": max(per_forward), "replays": len(per_forward)}


class ClockSampler:
    """nvidia-smi's SM clock and power every 20 ms in the background, with host timestamps."""

    def __init__(self, device):
        import subprocess
        import threading

        self.samples: list[tuple[float, float, float]] = []
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "20",
             "-i", str(cli._physical_index(device))],
            stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for line in self._proc.stdout:
            try:
                sm, power = (float(v) for v in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.time(), sm, power))

    def summarise(self, windows) -> list[str]:
        """One line per timed window: which method, its us, the median SM MHz and W inside it."""
        self._proc.terminate()
        self._thread.join(timeout=2)
        lines = []
        for name, t0, t1, us in windows:
            inside = [(sm, w) for t, sm, w in self.samples if t0 <= t <= t1]
            sm = statistics.median(v for v, _ in inside) if inside else float("nan")
            watts = statistics.median(w for _, w in inside) if inside else float("nan")
            lines.append(f"{name:8s} {us:9.1f} us  SM {sm:6.0f} MHz  {watts:5.0f} W  ({len(inside)} samples)")
        return lines


def path_of(config: dict) -> str:
    """Which kernels an M ran (with " pdl" where they launched with programmatic dependent
    launch)."""
    return _path_of(config) + (" pdl" if config.get("pdl") else "")


def _path_of(config: dict) -> str:
    """The one-row (CUDA-core) path, the block_m 8 one, or the tensor-core one, and for the
    latter whether its warp-group MMAs ran overlapped (TritonW4A16MoE._launch)."""
    if config.get("path") == "gluon-hopper-ws":
        return f"gluon-hopper-ws bm{config['gluon']['g1']['bm']}"
    if config["g1"].get("gemv"):
        return "one-row" + ("/by-expert" if config["g1"].get("sort") else "")
    if config["g1"].get("mma8"):
        return f"mma8 rt{config['g1']['rt']}/{config['g2']['rt']}"
    overlap = [config[g].get("mma_overlap") for g in ("g1", "g2")]
    form = "overlapped" if all(overlap) else ("serialised" if not any(o is None for o in overlap) else "mma-?")
    fallback = f" (Gluon path not run: {config['gluon_fallback']})" if config.get("gluon_fallback") else ""
    return f"tensor-core bm{config['block_m']} {form}{fallback}"


def shape_arguments(parser) -> None:
    """The layer a tool here times: a preset's shape, sharded --tp ways (shape_of)."""
    parser.add_argument("--preset", default="kimi-k2.6", choices=sorted(presets.PRESETS))
    parser.add_argument("--tp", type=int, default=1)


def shape_of(args) -> quant.MoEShape:
    return presets.PRESETS[args.preset].shape(args.tp)


def common_arguments(parser, m_list: str, budget_s: float) -> None:
    """The options every timing tool here shares (this one, path_compare, row_compare)."""
    shape_arguments(parser)
    parser.add_argument("--m-list", default=m_list)
    parser.add_argument("--budget-s", type=float, default=budget_s, help="stop replaying an M after this (at least 5)")


def round_order(items: list, index: int) -> list:
    """The order the compared rows or paths run in round index (path_compare, row_compare, and
    this script's --interleave for the harness and the graph): as given in even rounds,
    reversed in odd ones, so with an even number of rounds each one runs as often in each
    position. At large M the GPU is at its power limit and what runs later in
    a round finds it hotter: in a fixed order the first of two bm128 tile sets was 4-5% faster
    at kimi-k2.6 M=3072 whichever set it was (PERFORMANCE.md rounds 30 and 32)."""
    return list(items) if index % 2 == 0 else list(items)[::-1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(parser, m_list="1,2,4,8,16,32,64,128,256,512,1024,2048", budget_s=1.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--harness", action="store_true", help="run the harness first and compare its medians")
    parser.add_argument("--harness-out", default="", help="with --harness: its results JSON")
    parser.add_argument("--interleave", type=int, default=0,
                        help="rounds per M of the harness's own timing (moe_bench.cli.time_one_m, same backend) "
                             "alternating with this script's; the figures compared are each one's median over the "
                             "rounds. Give an even number: the method that runs second in a round finds the GPU "
                             "hotter and its SM clock lower (at the power limit, PERFORMANCE.md round 21), and only "
                             "an even number of rounds puts each method second as often as the other")
    parser.add_argument("--agree-pct", type=float, default=5.0)
    parser.add_argument("--same-routings", action="store_true",
                        help="time the harness's routings (its seed) instead of this script's own")
    parser.add_argument("--clocks", action="store_true",
                        help="with --interleave: sample the SM clock and power (nvidia-smi, every 20 ms) and give "
                             "each round's median beside its time")
    parser.add_argument("--out", default="")
    parser.add_argument("--device", default="cuda:0", help="cpu: the script's control flow only (interpreter)")
    args = parser.parse_args(argv)
    offset = 0 if args.same_routings else ROUTING_SEED_OFFSET
    if args.interleave % 2:
        print(f"warning: --interleave {args.interleave} is odd: the harness runs second in fewer rounds than this "
              "script's timing, which biases the comparison (see --help)", flush=True)

    m_list = sorted({int(v) for v in args.m_list.split(",")})
    device = torch.device(args.device)
    shape = shape_of(args)
    harness_rows, harness_ceilings = {}, None
    if args.harness:
        harness_out = args.harness_out or "/tmp/graph_timing_harness.json"
        code = cli.main(["--preset", args.preset, "--tp", str(args.tp), "--backend", "triton", "--device", args.device,
                         "--m-list", ",".join(map(str, m_list)), "--seed", str(args.seed), "--out", harness_out])
        if code != 0:
            print(f"harness exited {code}", flush=True)
            return code
        with open(harness_out) as fh:
            results = json.load(fh)
        harness_rows = {row["m"]: row for row in results["results"]}
        harness_ceilings = results.get("ceilings")
        torch.cuda.empty_cache()

    weights = quant.random_weights(shape, device, seed=args.seed)
    from moe_bench.backends import create_backend

    backend = create_backend("triton", weights, max(m_list), activation_dtype(device))
    moe = backend.impl
    settings = None
    if args.interleave:
        # The harness's own per-M timing, on this backend, with the ceilings it would measure.
        settings = cli.parse_settings(["--preset", args.preset, "--tp", str(args.tp), "--backend", "triton",
                                       "--device", args.device, "--m-list", ",".join(map(str, m_list)),
                                       "--seed", str(args.seed)])
        harness_ceilings = cli.resolve_ceilings(settings, device)
    report = dict(tool="tools/graph_timing.py", argv=sys.argv[1:], preset=args.preset, tp=args.tp,
                  shape=shape.__dict__, started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", driver=driver_version(), torch=torch.__version__,
                  triton=tm.triton.__version__, harness_ceilings=harness_ceilings, interleave=args.interleave,
                  same_routings=args.same_routings, rows=[])
    failed = False
    print(f"{args.preset} tp{args.tp} {shape} on {report['device']}, driver {report['driver']}, "
          f"triton {report['triton']}", flush=True)
    header = (f"{'M':>5} {'graph us':>10} {'%floor fn':>9} {'harness us':>10} {'%floor run':>10} {'diff %':>7} "
              f"{'rel err':>8}  path")
    lines = []
    for m in m_list:
        error = check_m(moe, weights, shape, m, device, args.seed)
        ok = error is not None and error <= cli.RELATIVE_ERROR_BOUND["bfloat16"]
        row = dict(m=m, rel_err=error, ok=ok)
        if ok and settings is not None:
            rounds, windows = [], []
            sampler = ClockSampler(device) if args.clocks else None
            for index in range(args.interleave):
                # The order alternates (round_order): whichever runs second finds the GPU warmer
                # (its clock falls as it nears the power limit), so a fixed order biases the comparison.
                took = {}
                for which in round_order(("harness", "graph"), index):
                    t0 = time.time()
                    if which == "graph":
                        graph = graph_time_us(moe, shape, m, device, args.seed, args.replays, args.budget_s, offset)
                        took[which] = graph["us"]
                    else:
                        took[which] = cli.time_one_m(settings, backend, m, activation_dtype(device), device)[1].us
                    windows.append((which, t0, time.time(), took[which]))
                rounds.append((took["harness"], graph))
            if sampler is not None:
                row["clock_rounds"] = sampler.summarise(windows)
                for line in row["clock_rounds"]:
                    print("      " + line, flush=True)
            row.update(rounds[len(rounds) // 2][1] if len(rounds) % 2 else rounds[0][1])
            row["us"] = statistics.median(graph["us"] for _, graph in rounds)
            row["graph_rounds_us"] = [graph["us"] for _, graph in rounds]
            row["harness_rounds_us"] = [us for us, _ in rounds]
            floor_run = perfmodel.floor_us(shape, m, harness_ceilings["bandwidth_gbps"], harness_ceilings["tflops"])
            harness_us = statistics.median(us for us, _ in rounds)
            harness_rows[m] = {"us": harness_us, "pct_of_floor": 100 * floor_run / harness_us}
        elif ok:
            row.update(graph_time_us(moe, shape, m, device, args.seed, args.replays, args.budget_s, offset))
        if ok:
            floor_fn = perfmodel.floor_us(shape, m, FIELD_NOTES_BANDWIDTH_GBPS, FIELD_NOTES_TFLOPS)
            row["floor_field_notes_us"] = floor_fn
            row["pct_field_notes_floor"] = 100 * floor_fn / row["us"]
        else:
            failed = True
        row["config"] = moe.configs_used(m)
        row["path"] = path_of(row["config"])
        harness = harness_rows.get(m)
        if harness and ok:
            row["harness_us"] = harness["us"]
            row["harness_pct_of_floor"] = harness["pct_of_floor"]
            row["diff_pct"] = 100 * (harness["us"] - row["us"]) / row["us"]
            if abs(row["diff_pct"]) > args.agree_pct:
                failed = True
        report["rows"].append(row)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(report, fh, indent=1, default=str)
        line = (f"{m:5d} {row.get('us', float('nan')):10.1f} {row.get('pct_field_notes_floor', float('nan')):9.1f} "
                f"{row.get('harness_us', float('nan')):10.1f} {row.get('harness_pct_of_floor', float('nan')):10.1f} "
                f"{row.get('diff_pct', float('nan')):7.1f} {error if error is not None else float('nan'):8.1e}  "
                f"{row['path']}" + ("" if ok else "  CORRECTNESS FAILED: not timed"))
        lines.append(line)
        print(line, flush=True)
    print(f"\n{args.preset} tp{args.tp} ({report['started_at']}, driver {report['driver']}, triton {report['triton']})")
    print(header)
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
