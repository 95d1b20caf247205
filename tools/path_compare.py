"""The Gluon warp-specialised path against the plain-Triton tensor-core path, side by side in
one process on the same weights (issue 17, item 1): per M, each checked against the float32
reference on fresh poisoned inputs (tools/graph_timing.check_m), then timed the independent
way (graph_timing.graph_time_us: one CUDA graph of 8 forwards over 8 routings), for
--rounds rounds, in the order given in even rounds and reversed in odd ones
(graph_timing.round_order: give an even number, or a column's place weighs on its figure).

  PYTHONPATH=files:tools python3 tools/path_compare.py --preset kimi-k2.6 --m-list 1024,2048,4096,8192 [--all-m]

--all-m: the Gluon path at every M given, also below the slots per expert it is shipped for
(gluon_moe.MIN_SLOTS_PER_EXPERT), to see where it starts to win. --tiles: one tile set
(gluon_moe.TILES_BM64's form) or a JSON list of them, each run at every M as its own column
(gluon0, gluon1, ...; one backend, each set checked on its first use); without it the shipped
tiles by slots per expert (gluon_moe.GLUON_TILE_ROWS).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton

from moe_bench import cli, gluon_moe, perfmodel, quant
from moe_bench import triton_moe as tm

import graph_timing as gt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gt.common_arguments(parser, m_list="1024,2048,4096,8192", budget_s=0.5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--all-m", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--stop-on-fallback", action="store_true")
    parser.add_argument("--stages", action="store_true", help="also time the Gluon forward's stages")
    parser.add_argument("--tiles", default="", help="JSON of one tile set for every M (gluon_moe.TILES_BM64's form; tuning)")
    args = parser.parse_args(argv)
    os.environ["MOE_BENCH_GLUON"] = "force"  # the Gluon path wherever it can run
    device = torch.device("cuda:0")
    m_list = sorted({int(v) for v in args.m_list.split(",")})
    shape = gt.shape_of(args)
    shipped_rows = list(gluon_moe.GLUON_TILE_ROWS)
    tile_sets = json.loads(args.tiles) if args.tiles else None
    if isinstance(tile_sets, dict):
        tile_sets = [tile_sets]
    # Each column: (name, backend, the tile rows it runs with).
    if tile_sets:
        # Made with every set in its rows: the workspace for the largest block, the block list for the smallest.
        by_bm = sorted(tile_sets, key=lambda t: t["g1"]["bm"])
        gluon_moe.GLUON_TILE_ROWS = [(0.0, tiles) for tiles in by_bm[:-1]] + [(None, by_bm[-1])]
    if args.all_m:
        gluon_moe.MIN_SLOTS_PER_EXPERT = 0.0
    weights = quant.random_weights(shape, device, seed=0)
    max_m = max(m_list)
    gluon = tm.TritonW4A16MoE(weights, max_m)
    columns = ([(f"gluon{i}" if len(tile_sets) > 1 else "gluon", gluon, [(None, t)]) for i, t in enumerate(tile_sets)]
               if tile_sets else [("gluon", gluon, shipped_rows)])
    columns.append(("triton", tm.TritonW4A16MoE(weights, max_m, gluon=False), shipped_rows))
    report = dict(tool="tools/path_compare.py", argv=sys.argv[1:], shape=shape.__dict__, driver=gt.driver_version(),
                  triton=tm.triton.__version__, torch=torch.__version__, device=torch.cuda.get_device_name(device),
                  started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), gluon_reason=gluon.gluon_reason,
                  tile_sets=tile_sets, rows=[])
    print(f"{args.preset} tp{args.tp} {shape} {report['device']} driver {report['driver']} triton {report['triton']}; "
          f"Gluon path: {'available' if gluon.gluon_reason is None else gluon.gluon_reason}", flush=True)
    lines = []
    for m in m_list:
        row = dict(m=m)
        for name, moe, rows in columns:
            gluon_moe.GLUON_TILE_ROWS = rows
            row[f"{name}_rel_err"] = gt.check_m(moe, weights, shape, m, device, 0)
            row[f"{name}_path"] = gt.path_of(moe.configs_used(m))
        ok = all(row[f"{n}_rel_err"] is not None and row[f"{n}_rel_err"] <= cli.RELATIVE_ERROR_BOUND["bfloat16"]
                 for n, _, _ in columns)
        if ok:
            times = {n: [] for n, _, _ in columns}
            for index in range(args.rounds):
                for name, moe, rows in gt.round_order(columns, index):
                    gluon_moe.GLUON_TILE_ROWS = rows
                    times[name].append(gt.graph_time_us(moe, shape, m, device, 0, 200, args.budget_s)["us"])
            floor = perfmodel.floor_us(shape, m, gt.FIELD_NOTES_BANDWIDTH_GBPS, gt.FIELD_NOTES_TFLOPS)
            for name in times:
                row[f"{name}_us"] = statistics.median(times[name])
                row[f"{name}_rounds_us"] = times[name]
                row[f"{name}_pct_floor"] = 100 * floor / row[f"{name}_us"]
        if ok and args.stages and gluon._gluon is not None:
            # The Gluon forward's stages, timed cumulatively (each run reads what the one before left).
            gen = torch.Generator(device=device).manual_seed(m)
            x, ids, wts = cli.make_inputs(shape, m, torch.bfloat16, device, gen)
            for name, _, rows in columns[:-1]:
                tiles = rows[-1][1] if tile_sets else gluon_moe.tiles_for(shape, m)
                cumulative = {}
                for label, stages in (("route", ("route",)), ("+g1", ("route", "g1")), ("+g2", ("route", "g1", "g2")),
                                      ("+sum", ("route", "g1", "g2", "sum"))):
                    cumulative[label] = 1e3 * triton.testing.do_bench(
                        lambda: gluon._gluon.forward(x, ids, wts, stages, tiles=tiles), warmup=20, rep=200,
                        return_mode="median")
                row[f"{name}_stages_cumulative_us"] = cumulative
                print(f"{m:6d} {name} bm{tiles['g1']['bm']} stages, cumulative us (do_bench median, one routing): "
                      + ", ".join(f"{k} {v:.0f}" for k, v in cumulative.items()), flush=True)
        for name, moe, rows in columns[:-1]:
            gluon_moe.GLUON_TILE_ROWS = rows
            row[f"{name}_config"] = moe.configs_used(m)
        report["rows"].append(row)
        if gluon.gluon_reason is not None and args.stop_on_fallback:
            print(f"M={m}: the Gluon path fell back: {gluon.gluon_reason}", flush=True)
            break
        line = f"{m:6d} " + " | ".join(
            f"{name} {row.get(f'{name}_us', float('nan')):9.1f} us {row.get(f'{name}_pct_floor', float('nan')):5.1f}% "
            f"err {row[f'{name}_rel_err'] if row[f'{name}_rel_err'] is not None else float('nan'):.1e} "
            f"({row[f'{name}_path']})" for name, _, _ in columns)
        lines.append(line)
        print(line, flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(report, fh, indent=1, default=str)
    gluon_moe.GLUON_TILE_ROWS = shipped_rows
    print("gluon reason at end:", gluon.gluon_reason, "check error", gluon.gluon_error)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
