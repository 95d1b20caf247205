"""The block_m 8 (mma.sync) rows on one GPU: each row checked against the float32 reference
at a small shape first, with GEMM1's intermediate compared per sorted row (which columns and
tokens are off) when the whole forward is wrong, so one call locates a fragment-mapping fault.

  PYTHONPATH=files:tools python3 tools/mma8_probe.py [--row NAME=JSON ...]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from moe_bench import cli, quant
from moe_bench import triton_moe as tm
from moe_bench.backends import reference_moe

import graph_timing as gt

ROWS = {
    "g1rt2_g2rt2": dict(block_m=8, g1=dict(mma8=True, gate_up=True, rt=2, ksplit=4),
                        g2=dict(mma8=True, rt=2, ksplit=4)),
}


def diagnose(moe, weights, shape, m, device):
    generator = torch.Generator(device=device)
    generator.manual_seed(99 + m)
    x, ids, wts = cli.make_inputs(shape, m, torch.bfloat16, device, generator)
    inter_buf, _ = moe._buffers(x.dtype)
    inter_buf.fill_(float("nan"))
    out = moe(x, ids, wts)
    torch.cuda.synchronize()
    counts = moe._counts.cpu()
    starts = moe._starts.cpu()
    sorted_slot = moe._sorted_slot.cpu()
    w13 = quant.dequantize(weights.w13, None, torch.float32)  # [E, hidden, 2 inter]
    bad = 0
    for e in range(shape.experts):
        for r in range(int(counts[e])):
            row = int(starts[e]) + r
            slot = int(sorted_slot[row])
            tok = slot // shape.topk
            gu = x[tok].float() @ w13[e]
            h = torch.nn.functional.silu(gu[: shape.inter]) * gu[shape.inter:]
            got = inter_buf[row].float()
            err = (got - h).abs() / (h.abs().mean() + 1e-6)
            wrong = (err > 0.05) | ~torch.isfinite(got)
            if bool(wrong.any()):
                bad += 1
                cols = torch.nonzero(wrong).flatten()[:24].tolist()
                print(f"  GEMM1 row {row} (expert {e}, slot {slot}, block row {row % 8}): {int(wrong.sum())} of "
                      f"{shape.inter} columns off, first {cols}; got {got[cols[:4]].tolist()} want {h[cols[:4]].tolist()}")
                if bad > 6:
                    return
    if not bad:
        print("  GEMM1's intermediate is right at every used row: the fault is in GEMM2 or the sum")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--row", action="append", default=[])
    parser.add_argument("--m-list", default="1,2,3,8,13")
    args = parser.parse_args(argv)
    device = torch.device("cuda:0")
    rows = dict(ROWS)
    for text in args.row:
        name, _, spec = text.partition("=")
        rows[name] = json.loads(spec)
    shape = quant.MoEShape(experts=16, hidden=512, inter=256, topk=4, group_size=32)
    weights = quant.random_weights(shape, device, seed=3)
    m_list = [int(v) for v in args.m_list.split(",")]
    failed = 0
    for name, row in rows.items():
        moe = tm.TritonW4A16MoE(weights, max(m_list), table=[(1 << 62, row)], gluon=False)
        for m in m_list:
            try:
                err = gt.check_m(moe, weights, shape, m, device, 0)
            except Exception as exc:  # noqa: BLE001
                print(f"{name} M={m}: error {type(exc).__name__}: {str(exc)[:2000]}")
                failed += 1
                break
            ok = err is not None and err <= cli.RELATIVE_ERROR_BOUND["bfloat16"]
            print(f"{name} M={m}: rel err {err}", "ok" if ok else "WRONG", flush=True)
            if not ok:
                failed += 1
                diagnose(moe, weights, shape, m, device)
                break
    print("probe:", "all right" if not failed else f"{failed} wrong")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
