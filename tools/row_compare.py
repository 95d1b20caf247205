"""Table rows side by side on one GPU, timed the independent way (tools/graph_timing.py): per
M, each row checked against the float32 reference on fresh poisoned inputs, then one CUDA
graph of 8 forwards over 8 routings per row, the rows alternating for --rounds rounds (in
the order given in even rounds, reversed in odd ones: graph_timing.round_order).

  PYTHONPATH=files:tools python3 tools/row_compare.py --preset kimi-k2.6 --m-list 1,2,4,8 \
      --row 'name={"block_m": 1, "g1": {...}, "g2": {...}}' [--row ...] --out rows.json

The shipped row of each M runs as "shipped" (the preset's table, fitted to the device).
--shipped-with NAME=JSON runs the shipped table with changes, fitted to the device like it:
JSON's "g1" / "g2" options are merged into the rows whose path (one-row, mma8, tensor-core)
is in its "paths" (default all), and "pdl": false launches the kernels without programmatic
dependent launch, e.g. 'nopdl={"pdl": false}' or 'w2={"g2": {"warps": 2}, "paths": ["one-row"]}'.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from moe_bench import cli, perfmodel, quant
from moe_bench import triton_moe as tm

import graph_timing as gt


def _path(row: dict) -> str:
    return "mma8" if row["g1"].get("mma8") else "one-row" if row["g1"].get("gemv") else "tensor-core"


def shipped_with(weights, shape, max_m: int, change: dict):
    """The shipped table with change's options merged in, fitted to the device as shipped."""
    paths = change.get("paths", ("one-row", "mma8", "tensor-core"))
    table = []
    for limit, row in tm.table_for(shape):
        if _path(row) in paths:
            row = dict(row, **{w: dict(row[w], **change.get(w, {})) for w in ("g1", "g2")})
        table.append((limit, row))
    return tm.TritonW4A16MoE(weights, max_m, table=table, gluon=False, pdl=change.get("pdl", True), fit_device=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gt.common_arguments(parser, m_list="1,2,4,8,16", budget_s=0.3)
    parser.add_argument("--row", action="append", default=[], help="NAME=JSON table row; repeatable")
    parser.add_argument("--shipped-with", action="append", default=[],
                        help="NAME=JSON changes to the shipped table (see above); repeatable")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    device = torch.device("cuda:0")
    m_list = sorted({int(v) for v in args.m_list.split(",")})
    shape = gt.shape_of(args)
    weights = quant.random_weights(shape, device, seed=0)
    rows = {"shipped": tm.TritonW4A16MoE(weights, max(m_list), gluon=False)}
    for text in args.row:
        name, _, spec = text.partition("=")
        rows[name] = tm.TritonW4A16MoE(weights, max(m_list), table=[(1 << 62, json.loads(spec))], gluon=False)
    for text in args.shipped_with:
        name, _, spec = text.partition("=")
        rows[name] = shipped_with(weights, shape, max(m_list), json.loads(spec))
    report = dict(tool="tools/row_compare.py", argv=sys.argv[1:], shape=shape.__dict__, driver=gt.driver_version(),
                  triton=tm.triton.__version__, torch=torch.__version__, device=torch.cuda.get_device_name(device),
                  started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), rows=[])
    print(f"{args.preset} tp{args.tp} {shape} {report['device']} driver {report['driver']} triton {report['triton']}",
          flush=True)
    lines = []
    for m in m_list:
        floor = perfmodel.floor_us(shape, m, gt.FIELD_NOTES_BANDWIDTH_GBPS, gt.FIELD_NOTES_TFLOPS)
        checked = {}
        for name, moe in rows.items():
            try:
                checked[name] = gt.check_m(moe, weights, shape, m, device, 0)
            except Exception as exc:  # a row that does not compile or launch: reported, not timed
                checked[name] = f"error: {str(exc)[:300]}"
        ok = [n for n, e in checked.items() if isinstance(e, float) and e <= cli.RELATIVE_ERROR_BOUND["bfloat16"]]
        times = {n: [] for n in ok}
        for index in range(args.rounds):
            for name in gt.round_order(ok, index):
                times[name].append(gt.graph_time_us(rows[name], shape, m, device, 0, 200, args.budget_s)["us"])
        for name, err in checked.items():
            rec = dict(m=m, row=name, rel_err=err, config=rows[name].configs_used(m), floor_us=floor)
            if name in times:
                rec.update(us=statistics.median(times[name]), rounds_us=times[name],
                           pct_floor=100 * floor / statistics.median(times[name]))
            report["rows"].append(rec)
            line = (f"{m:5d} {name:24s} " + (f"{rec['us']:9.1f} us {rec['pct_floor']:5.1f}%  rounds "
                    + "/".join(f"{t:.1f}" for t in rec["rounds_us"]) + f"  err {err:.1e}" if name in times
                    else f"NOT TIMED: {err}"))
            lines.append(line)
            print(line, flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(report, fh, indent=1, default=str)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
