"""Tile sweep for the Triton W4A16 MoE kernel on one GPU (a development tool, not the payload).

For every M: for each candidate BLOCK_M, time the GEMM1 candidates and the GEMM2 candidates
alone (CUDA graphs over several routings, so L2 never holds the expert set), then run the
best combination as a whole forward, check it against a float32 reference and time it.
Prints a compact table last; full numbers go to --out as JSON.

  PYTHONPATH=files python3 tools/kernel_sweep.py --out /tmp/sweep.json [--m-list 1,16,2048] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import triton

from moe_bench import quant
from moe_bench import triton_moe as tm

KIMI = quant.MoEShape(experts=384, hidden=7168, inter=2048, topk=8, group_size=32)
FIELD_FLOOR_US = {1: 46.1, 2: 91.2, 4: 178.7, 8: 343.0, 16: 632.8, 32: 1085, 64: 1638, 128: 2064, 256: 2204,
                  512: 2216, 1024: 2219, 2048: 2226}
ROTATIONS = 4


def gemm(bn, bk, warps, stages, post=False, swap=False, whole=False):
    return dict(bn=bn, bk=bk, warps=warps, stages=stages, post=post, swap=swap, whole=whole)


def candidates(m: int, quick: bool):
    """[(block_m, gemm options)] to try at this M; both GEMMs try the same options."""
    small = [gemm(128, 128, 4, 4, True), gemm(128, 128, 4, 6, True), gemm(64, 128, 4, 4, True),
             gemm(128, 256, 4, 3, True), gemm(256, 128, 8, 4, True), gemm(128, 128, 8, 4, True),
             gemm(128, 128, 4, 4, True, True)]
    large = [gemm(128, 64, 8, 4), gemm(128, 128, 8, 3), gemm(64, 128, 4, 3, whole=True),
             gemm(128, 128, 8, 3, whole=True), gemm(128, 64, 4, 4, swap=True, whole=True),
             gemm(128, 128, 4, 4, post=True), gemm(256, 64, 8, 3, swap=True, whole=True)]
    if quick:
        small, large = small[:2], large[:2]
    if m <= 256:
        return [(16, small)]
    if m <= 512:
        return [(16, small), (32, large)]
    if m <= 1024:
        return [(32, large), (64, large)]
    return [(32, large), (64, large)]


def tag(c):
    flags = ("p" if c["post"] else "") + ("w" if c.get("whole") else "") + ("s" if c["swap"] else "")
    return f"{c['bn']}/{c['bk']}/{c['warps']}/{c['stages']}{flags}"


def routing(m, shape, gen, device):
    scores = torch.rand(m, shape.experts, generator=gen, device=device)
    ids = scores.topk(shape.topk, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(m, shape.topk, generator=gen, device=device), dim=1)
    x = torch.randn(m, shape.hidden, generator=gen, device=device).to(torch.bfloat16)
    return x, ids, weights


def reference(weights: quant.MoEWeights, x, ids, wts):
    """float32 reference: dequantise each touched expert, loop over experts."""
    shape = weights.shape
    out = torch.zeros(x.shape[0], shape.hidden, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in torch.unique(ids).tolist():
        rows, which = (ids == e).nonzero(as_tuple=True)
        w13 = quant.dequantize(weights.w13, torch.tensor([e], device=x.device))[0]
        w2 = quant.dequantize(weights.w2, torch.tensor([e], device=x.device))[0]
        h = xf[rows] @ w13
        a = torch.nn.functional.silu(h[:, : shape.inter]) * h[:, shape.inter:]
        out.index_add_(0, rows, (a @ w2) * wts[rows, which][:, None])
    return out


def time_graph(fn, reps=30, warm=3):
    """Median ms of one replay of a graph that runs fn() once."""
    if not torch.cuda.is_available():  # control-flow check under TRITON_INTERPRET=1 only
        start = time.perf_counter()
        fn()
        ms = (time.perf_counter() - start) * 1e3
        return ms, ms, ms
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warm):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return statistics.median(times), times[len(times) // 5], times[(4 * len(times)) // 5]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m-list", default="1,2,4,8,16,32,64,128,256,512,1024,2048")
    parser.add_argument("--out", default="sweep.json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cpu-check", action="store_true", help="small shape on the CPU, interpreter")
    args = parser.parse_args()
    shape = KIMI
    device = torch.device("cuda:0")
    if args.cpu_check:
        shape = quant.MoEShape(experts=6, hidden=256, inter=128, topk=2, group_size=32)
        device = torch.device("cpu")
    m_list = [int(v) for v in args.m_list.split(",")]
    max_m = max(m_list)
    t0 = time.time()
    weights = quant.random_weights(shape, device, seed=0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"weights built in {time.time() - t0:.2f} s, {weights.nbytes() / 1e9:.2f} GB", flush=True)
    big_table = [(1 << 62, dict(block_m=64, g1=gemm(64, 64, 4, 4), g2=gemm(64, 64, 4, 4)))]
    # Per-kernel timings of the alignment step alone, for the notes.
    instances = [tm.TritonW4A16MoE(weights, max_m, table=big_table) for _ in range(ROTATIONS)]
    per_expert = quant.weights_bytes(quant.MoEShape(1, shape.hidden, shape.inter, shape.topk, shape.group_size))
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    report = []
    for m in m_list:
        sets = [routing(m, shape, gen, device) for _ in range(ROTATIONS)]
        if device.type == "cpu":
            sets = [(x.float(), ids, w) for x, ids, w in sets]
        best = None
        detail = {"m": m, "block_m": {}}
        for bm, g1_opts in candidates(m, args.quick):
            g2_opts = g1_opts
            rec = {"g1": [], "g2": []}

            def run_align():
                for inst, (x, ids, w) in zip(instances, sets):
                    inst.align(ids, bm)

            align_ms = time_graph(run_align)[0] / ROTATIONS
            run_align()
            for g1 in g1_opts:
                cfg = tm._fit(g1, shape.hidden, shape.inter, shape.group_size)

                def run_g1():
                    for inst, (x, ids, w) in zip(instances, sets):
                        inst.gemm1(x, bm, cfg)

                try:
                    ms = time_graph(run_g1)[0] / ROTATIONS
                except Exception as exc:  # out of shared memory and the like: skip the candidate
                    rec["g1"].append({"cfg": cfg, "error": str(exc)[:200]})
                    continue
                rec["g1"].append({"cfg": cfg, "us": ms * 1e3})
            for g2 in g2_opts:
                cfg = tm._fit(g2, shape.inter, shape.hidden, shape.group_size)

                def run_g2():
                    for inst, (x, ids, w) in zip(instances, sets):
                        inst.gemm2(x, w, bm, cfg)

                try:
                    ms = time_graph(run_g2)[0] / ROTATIONS
                except Exception as exc:
                    rec["g2"].append({"cfg": cfg, "error": str(exc)[:200]})
                    continue
                rec["g2"].append({"cfg": cfg, "us": ms * 1e3})

            def run_sum():
                for inst, (x, ids, w) in zip(instances, sets):
                    inst.topk_sum(x)

            sum_ms = time_graph(run_sum)[0] / ROTATIONS
            ok1 = [r for r in rec["g1"] if "us" in r]
            ok2 = [r for r in rec["g2"] if "us" in r]
            b1 = min(ok1, key=lambda r: r["us"])
            b2 = min(ok2, key=lambda r: r["us"])
            total = align_ms * 1e3 + b1["us"] + b2["us"] + sum_ms * 1e3
            rec.update(align_us=align_ms * 1e3, sum_us=sum_ms * 1e3, best_total_us=total)
            detail["block_m"][bm] = rec
            if best is None or total < best[0]:
                best = (total, dict(block_m=bm, g1=b1["cfg"], g2=b2["cfg"]))
        cfg = best[1]
        fused = instances[0]
        fused.table = [(1 << 62, cfg)]
        # Correctness of the whole forward on fresh inputs, output checked against float32.
        x, ids, w = routing(m, shape, gen, device)
        if device.type == "cpu":
            x = x.float()
        out = fused(x, ids, w)
        ref = reference(weights, x, ids, w)
        rel = float((out.float() - ref).norm() / ref.norm())
        finite = bool(torch.isfinite(out).all())

        def run_full():
            for (x, ids, w) in sets:
                fused(x, ids, w)

        med, p20, p80 = (v / ROTATIONS * 1e3 for v in time_graph(run_full))
        distinct = sum(int(torch.unique(s[1]).numel()) for s in sets) / ROTATIONS
        nbytes = distinct * per_expert + 2 * m * shape.hidden * 2
        floor = max(nbytes / 4.3e12, m * 2 * shape.topk * (shape.hidden * 2 * shape.inter
                                                           + shape.inter * shape.hidden) / 790e12) * 1e6
        row = dict(m=m, us=med, p20=p20, p80=p80, rel_err=rel, finite=finite, floor_us=floor,
                   field_floor_us=FIELD_FLOOR_US.get(m), pct=100 * floor / med, cfg=cfg,
                   gbps=nbytes / med / 1e3, detail=detail)
        report.append(row)
        print(f"M={m:5d} {med:9.1f} us  floor {floor:7.1f}  {row['pct']:5.1f}%  rel {rel:.2e}  cfg {cfg}  "
              f"[{time.time() - t0:.0f}s]", flush=True)
        for bm, rec in detail["block_m"].items():
            g1s = " ".join(f"{tag(r['cfg'])}={r.get('us', float('nan')):.0f}" for r in rec["g1"])
            g2s = " ".join(f"{tag(r['cfg'])}={r.get('us', float('nan')):.0f}" for r in rec["g2"])
            print(f"   bm={bm} align {rec['align_us']:.1f} sum {rec['sum_us']:.1f} | g1 {g1s} | g2 {g2s}", flush=True)
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
    print("\n  M        us   floor    %floor   rel_err  block_m  g1(bn/bk/w/s)  g2")
    for r in report:
        c = r["cfg"]
        print(f"{r['m']:5d} {r['us']:9.1f} {r['floor_us']:7.1f} {r['pct']:8.1f}  {r['rel_err']:.1e}  {c['block_m']:4d}  "
              f"{tag(c['g1'])}  {tag(c['g2'])}")
    print(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
