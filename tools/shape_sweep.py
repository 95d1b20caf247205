"""Whole-forward candidates per preset shape and M, for the presets' shipped tables (GPU; a
development tool, not the payload).

Per (preset, --tp) and M: a few whole-forward rows (the one-row kernels, the tensor-core
rows of TILE_TABLE at block_m 16, 32 and 64), picked by slots per expert; each checked against
the float32 reference (poisoned workspace, fresh inputs) and then timed as tools/graph_timing.py
times (one CUDA graph of 8 forwards over 8 routings, mean per forward). Prints per M every
candidate and the winner; --out gets the JSON.

  PYTHONPATH=files python3 tools/shape_sweep.py --spec kimi-k2.6:8:16,64,256,2048 \
      --spec mixtral-8x7b:1:16,64 --out sweep.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import graph_timing as gt  # noqa: E402  (tools/ beside this file)
from moe_bench import cli, presets, quant  # noqa: E402
from moe_bench import triton_moe as tm  # noqa: E402

ONE_ROW_G2 = dict(gemv=True, bn=64, bkw=64, warps=4, stages=1, asm=True)
TENSOR_G1 = dict(bn=64, bk=128, warps=4, stages=3, post=False, whole=True, swap=True, split=1, asm=True, gu=True)
TENSOR_G1_LARGE = dict(bn=64, bk=64, warps=4, stages=3, post=False, whole=True, swap=True, split=1, asm=True, gu=True)
TENSOR_G2 = dict(bn=128, bk=64, warps=4, stages=4, post=False, whole=True, swap=True, split=1, asm=True)


def one_row(bn: int, sort: bool) -> dict:
    return dict(block_m=1, g1=dict(gemv=True, bn=bn, bkw=64, warps=4, stages=1, asm=True, sort=sort), g2=ONE_ROW_G2)


def tensor(block_m: int, large: bool = False) -> dict:
    return dict(block_m=block_m, g1=TENSOR_G1_LARGE if large else TENSOR_G1, g2=TENSOR_G2)


def candidates(shape: quant.MoEShape, m: int) -> list[tuple[str, dict]]:
    """Rows worth trying at this M, by slots per expert (the first sweep, round 15 of
    PERFORMANCE.md: the one-row kernels lose to block_m 16 from about one slot per expert,
    block_m 64 wins from about 40)."""
    per_expert = m * shape.topk / shape.experts
    out = []
    if per_expert <= 2:
        out.append(("one-row bn32" + (" sort" if m > 4 else ""), one_row(32, m > 4)))
    if per_expert <= 40:
        out.append(("bm16", tensor(16)))
    if per_expert > 2:
        out.append(("bm32", tensor(32)))
    if per_expert > 12:
        out.append(("bm64", tensor(64, large=True)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", action="append", required=True, help="PRESET:TP:M,M,...")
    parser.add_argument("--budget-s", type=float, default=0.8)
    parser.add_argument("--out", default="shape_sweep.json")
    parser.add_argument("--device", default="cuda:0", help="cpu: the script's control flow only (interpreter)")
    args = parser.parse_args()
    device = torch.device(args.device)
    t0 = time.time()
    report = dict(driver=gt.driver_version(), triton=tm.triton.__version__, torch=torch.__version__,
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  shapes=[])
    summary = []
    for spec in args.spec:
        name, tp, ms = spec.split(":")
        shape = presets.PRESETS[name].shape(int(tp))
        m_list = [int(v) for v in ms.split(",")]
        weights = quant.random_weights(shape, device, seed=0)
        # Workspace for block_m 64 at the largest M: every candidate fits it.
        moe = tm.TritonW4A16MoE(weights, max(m_list), table=[(1 << 62, tensor(64))])
        entry = dict(preset=name, tp=int(tp), shape=shape.__dict__, ms=[])
        for m in m_list:
            rows = []
            for label, cfg in candidates(shape, m):
                moe.table = [(1 << 62, cfg)]
                row = dict(name=label, cfg=cfg)
                try:
                    error = gt.check_m(moe, weights, shape, m, device, seed=1)
                    row["rel_err"] = error
                    row["ok"] = error is not None and error <= cli.RELATIVE_ERROR_BOUND["bfloat16"]
                    if row["ok"]:
                        row.update(gt.graph_time_us(moe, shape, m, device, 0, 400, args.budget_s))
                        row["pct_field_notes_floor"] = 100 * gt.perfmodel.floor_us(
                            shape, m, gt.FIELD_NOTES_BANDWIDTH_GBPS, gt.FIELD_NOTES_TFLOPS) / row["us"]
                        row["config"] = moe.configs_used(m)
                except Exception as exc:  # compile failure, out of resources: the candidate is out
                    row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
                rows.append(row)
                print(f"{name} tp{tp} M={m:5d} {label:18s} ok={row.get('ok')} rel={row.get('rel_err')} "
                      f"us={row.get('us', float('nan')):9.1f} {row.get('pct_field_notes_floor', float('nan')):5.1f}% "
                      f"{row.get('error', '')} [{time.time() - t0:.0f}s]", flush=True)
            good = [r for r in rows if r.get("ok") and "us" in r]
            best = min(good, key=lambda r: r["us"]) if good else None
            entry["ms"].append(dict(m=m, rows=rows, best=best and best["name"]))
            if best:
                summary.append(f"{name} tp{tp} M={m:5d} best {best['name']:18s} {best['us']:9.1f} us "
                               f"{best['pct_field_notes_floor']:5.1f}% | "
                               + " ".join(f"{r['name']}={r['us']:.0f}" for r in good))
            with open(args.out, "w") as fh:
                json.dump(dict(report, shapes=report["shapes"] + [entry]), fh, indent=1, default=str)
        report["shapes"].append(entry)
        del moe, weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1, default=str)
    print("\n".join(summary))
    print(f"sweep {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
