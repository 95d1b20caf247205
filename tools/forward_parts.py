"""The triton backend's forward at one M under sustained load: whole forward against the sum
of its parts (alignment, GEMM1, GEMM2, top-k sum), with the SM clock, power draw and
throttle reasons nvidia-smi reports after each measurement.

The kernel sweep times each part alone for a few hundred milliseconds; the harness times the
whole forward. At large M the GPU reaches its power limit within a second, so the two can
disagree; this script measures both ways in one process, over several rounds, and can
compare table rows under the same sustained load (GPU only). Rows: the shipped one as the
backend runs it, the same with its MMAs serialised ("serial", TritonW4A16MoE._launch), and
any given with --row:

    PYTHONPATH=files python3 tools/forward_parts.py --m 2048
    PYTHONPATH=files python3 tools/forward_parts.py --preset kimi-k2.6 --tp 8 --m 2048
    PYTHONPATH=files python3 tools/forward_parts.py --m 2048 --row '{"block_m": 64, "g1": {...}, "g2": {...}}'
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import graph_timing as gt  # noqa: E402  (tools/ beside this file)
import kernel_sweep as ks  # noqa: E402
from moe_bench import quant, timing  # noqa: E402
from moe_bench import triton_moe as tm  # noqa: E402

ROUTINGS = 8  # as the harness rotates on a CUDA device


def gpu_state() -> str:
    """SM clock, power draw and active throttle reasons, as nvidia-smi prints them."""
    query = "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active"
    try:
        return subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi unavailable ({exc})"


def measure_row(insts, sets, cfg: dict, reps: int, serialised: bool = False) -> dict:
    """us per forward: whole forward and each part, each a CUDA graph over all routings.
    serialised: the swapped GEMMs in the form with K at run time (TritonW4A16MoE._launch)."""
    bm = cfg["block_m"]
    for inst in insts:
        inst.table = [(1 << 62, cfg)]
        for which in ("g1", "g2"):
            key = (which, bm, json.dumps(cfg[which], sort_keys=True))
            if serialised:
                inst._overlap[key] = False
            else:
                inst._overlap.pop(key, None)  # decided afresh by the first launch

    def each(fn):
        def run():
            for inst, (x, ids, w) in zip(insts, sets):
                fn(inst, x, ids, w)
        return run

    def us(run) -> float:
        return ks.time_graph(run, reps=reps)[0] / len(insts) * 1e3

    out = {"full": us(each(lambda i, x, ids, w: i(x, ids, w)))}
    out["align"] = us(each(lambda i, x, ids, w: i.align(ids, bm)))
    each(lambda i, x, ids, w: i.align(ids, bm))()
    out["gemm1"] = us(each(lambda i, x, ids, w: i.gemm1(x, bm, cfg["g1"])))
    out["gemm2"] = us(each(lambda i, x, ids, w: i.gemm2(x, w, bm, cfg["g2"])))
    out["sum"] = us(each(lambda i, x, ids, w: i.topk_sum(x)))
    out["parts"] = out["align"] + out["gemm1"] + out["gemm2"] + out["sum"]
    out["gpu_after"] = gpu_state()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gt.shape_arguments(parser)
    parser.add_argument("--m", type=int, default=2048)
    parser.add_argument("--row", action="append", default=[],
                        help="a table row as JSON (block_m, g1, g2) to compare with the shipped one; repeatable")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=40, help="graph replays per measurement")
    parser.add_argument("--out", default="", help="write the measurements as JSON here")
    args = parser.parse_args()
    device = torch.device("cuda:0")
    shape = gt.shape_of(args)
    weights = quant.random_weights(shape, device, seed=0)
    gen = torch.Generator(device=device)
    gen.manual_seed(7)
    insts = [tm.TritonW4A16MoE(weights, args.m) for _ in range(ROUTINGS)]
    sets = [ks.routing(args.m, shape, gen, device) for _ in range(ROUTINGS)]
    shipped_table = insts[0].table
    table_row = insts[0]._config(args.m)  # the row the backend runs: fitted to this device
    rows = [("table", table_row, False)]
    if any(table_row[which].get("swap") for which in ("g1", "g2")):
        rows.append(("serial", table_row, True))
    for i, text in enumerate(args.row):
        row = json.loads(text)
        row["g1"] = tm._fit(row["g1"], shape.hidden, shape.inter, shape.group_size)
        row["g2"] = tm._fit(row["g2"], shape.inter, shape.hidden, shape.group_size)
        rows.append((f"row{i + 1}", row, False))
    print(f"{args.preset} --tp {args.tp} {shape} M={args.m}, {ROUTINGS} routings, GPU before: {gpu_state()}",
          flush=True)
    report = []
    for rnd in range(args.rounds):
        for name, cfg, serialised in rows:
            res = measure_row(insts, sets, cfg, args.reps, serialised)
            report.append(dict(round=rnd, name=name, cfg=cfg, serialised=serialised, **res))
            print(f"round {rnd} {name:6s} full {res['full']:7.0f} us  parts {res['parts']:7.0f} (align {res['align']:.0f}"
                  f" gemm1 {res['gemm1']:.0f} gemm2 {res['gemm2']:.0f} sum {res['sum']:.0f})  GPU after: "
                  f"{res['gpu_after']}", flush=True)
    # The harness's own timing of the shipped row (moe_bench.timing.time_cuda).
    for inst in insts:
        inst.table = shipped_table
        inst._overlap.clear()

    def call(r):
        x, ids, w = sets[r]
        return insts[r](x, ids, w)

    harness = timing.time_cuda(call, ROUTINGS, device, capture=True)
    print(f"harness timing, table: {harness.us:.0f} us (p20 {harness.us_p20:.0f}, p80 {harness.us_p80:.0f}, "
          f"{harness.samples} samples)  GPU after: {gpu_state()}", flush=True)
    time.sleep(5)
    idle = gpu_state()
    cool = ks.time_graph(lambda: [insts[r](*sets[r]) for r in range(ROUTINGS)], reps=5, warm=1)[0] / ROUTINGS * 1e3
    print(f"after 5 s idle ({idle}): whole forward {cool:.0f} us over the next 5 graph replays  GPU after: "
          f"{gpu_state()}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(preset=args.preset, tp=args.tp, m=args.m, rows=report, harness_us=harness.us,
                           cool_start_us=cool), fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
