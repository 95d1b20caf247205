"""Compile the MoE kernels without a GPU and check what the compiler made of each
configuration: registers, spills, shared memory, the MMA race check, and counts of the
instructions that matter (a development tool, not the payload).

Portability (issue 17, item 5): every configuration any preset's table uses, for every
architecture asked for, with the installed Triton; exit 1 when one fails to compile, does not
fit the architecture (shared memory per block, registers per thread and per SM, any spill to
local memory) or, on sm_90, runs warp-group MMAs whose register operand is overwritten in
flight in the form the backend would keep, or (the Gluon GEMMs) whose MMAs the compiler
serialised (a wait after every one: wgmma_serialised):

  PYTHONPATH=files python3 tools/compile_check.py --arch sm_80,sm_89,sm_90,sm_100,sm_120 --preset all [--tp 1,8] [--jobs 2]

Each architecture gets the table as the backend would run it there (fit_to_device with that
architecture's shared memory and SM count). On sm_90 the swapped rows compile as the backend
tries them first, in the overlapped form (K a compile-time constant, MMAs left in flight
across steps), and are checked as the backend checks them (moe_bench.sass): a warp-group MMA
whose register operand a later instruction overwrites before the wait that retires it gives
results that vary run to run on the GPU (seen: relative error 7e-3 to 7e2 or NaN for the same
configuration). Where the overlapped form has such a write the tool says so and checks the
serialised form the backend then runs; a serialised form with one fails. Elsewhere the backend
compiles only the serialised form (TritonW4A16MoE._launch), and so does this tool.

Without --preset: the kimi-k2.6 table's rows and tools/kernel_sweep.py's candidates on sm_90
(the tuning view: [--sass-out DIR] keeps each kernel's SASS). The SASS differs between Triton
versions: the GPU host's Triton is the one whose code runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_bench import gluon_moe, presets
from moe_bench import triton_moe as tm
from moe_bench.sass import wgmma_operand_hazards

TARGET = GPUTarget("cuda", 90, 32)

# Per architecture: a GPU of it (for the SM count fit_to_device reads), the shared memory one
# block may opt into (CUDA's "maximum shared memory per block" of that compute capability).
# Every one of them has 64 K 32-bit registers per SM and at most 255 per thread.
ARCHS = {
    80: tm.DeviceLimits("A100 (sm_80)", (8, 0), 108, 166912),
    86: tm.DeviceLimits("RTX A6000 (sm_86)", (8, 6), 84, 101376),
    89: tm.DeviceLimits("L40S (sm_89)", (8, 9), 142, 101376),
    90: tm.DeviceLimits("H100/H200 (sm_90)", (9, 0), 132, 232448),
    100: tm.DeviceLimits("B200 (sm_100)", (10, 0), 148, 232448),
    120: tm.DeviceLimits("RTX PRO 6000 (sm_120)", (12, 0), 188, 101376),
}
REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 255
OPS = ("HGMMA", "WARPGROUP.DEPBAR", "HMMA", "LDSM", "LDS", "LDS.64", "LDS.128", "LDS.U8", "STS", "LDGSTS", "LDG", "LDL", "STL", "PRMT",
       "LOP3", "HFMA2", "F2FP", "FFMA", "BAR")

# (name, gemm, block_m) -- GEMM1 at the kimi-k2.6 shape (K = 7168), GEMM2 (K = 2048).
SIGNATURE_1 = {
    "x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*bf16", "out_ptr": "*bf16", "sorted_slot_ptr": "*i32",
    "counts_ptr": "*i32", "starts_ptr": "*i32", "ends_ptr": "*i32", "num_experts": "i32", "K": "i32", "INTER": "i32",
    "stride_xm": "i32", "stride_we": "i64", "stride_wt": "i32", "stride_se": "i64", "stride_sg": "i32",
    "stride_om": "i32", "part_ptr": "*fp32", "stride_ps": "i64",
}
SIGNATURE_2 = {
    "a_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*bf16", "out_ptr": "*bf16", "topk_weights_ptr": "*fp32",
    "sorted_slot_ptr": "*i32", "counts_ptr": "*i32", "starts_ptr": "*i32", "ends_ptr": "*i32", "num_experts": "i32",
    "K": "i32", "N": "i32", "stride_am": "i32", "stride_we": "i64", "stride_wt": "i32", "stride_se": "i64",
    "stride_sg": "i32", "stride_om": "i32", "part_ptr": "*fp32", "stride_ps": "i64",
}


SIGNATURE_GEMV = {
    "a_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16", "topk_ids_ptr": "*i32",
    "topk_weights_ptr": "*fp32", "order_ptr": "*i32", "K": "i32", "N": "i32", "stride_am": "i32", "stride_we": "i64", "stride_wt": "i32",
    "stride_se": "i64", "stride_sg": "i32", "stride_om": "i32",
}


def _attrs(signature: dict) -> dict:
    # As the JIT specialises them at the presets' shapes: every pointer and integer argument
    # divisible by 16 (a shape where one is not compiles a variant the JIT would pick there).
    return {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind != "constexpr"}


def _pdl(target) -> bool:
    """Whether the backend launches its kernels with programmatic dependent launch on this
    architecture (triton_moe.pdl_unavailable_reason: sm_90 on, a Triton with griddepcontrol):
    the form compiled is the one that runs there."""
    return (target or TARGET).arch >= 90 and tm.PDL_IMPORT_ERROR is None


def compile_gemv(which: int, g: dict, group: int = 32, *, target=None, topk: int = 8, by_expert=None):
    """The one-row kernel as GEMM1 (gate/up, float32 intermediate out) or GEMM2. by_expert: the
    slot order (the table's GEMM1 `sort` decides it for both GEMMs); default g's own."""
    split = max(1, int(g.get("split", 1)))  # (portability_jobs gives the launch's: tm.gemv_split)
    signature = dict(SIGNATURE_GEMV, out_ptr="*fp32" if which == 1 or split > 1 else "*bf16")
    constants = dict(TOPK=topk, GROUP=group, BLOCK_N=g["bn"], BLOCK_KW=g["bkw"], GATE_UP=which == 1,
                     CONVERT_ASM=bool(g.get("asm", False)), INTER_DTYPE=tm.tl.bfloat16,
                     BY_EXPERT=bool(g.get("sort", False) if by_expert is None else by_expert),
                     RAW_A=which == 1 and bool(g.get("fx", False)), SUM_TOPK=which == 2 and bool(g.get("fsum", False)),
                     PREFETCH=bool(g.get("pf", False)), PDL=_pdl(target), SPLIT=split)
    signature["stride_split"] = "i32"
    if which == 1 and split > 1:  # GEMM1's partials and arrival counts
        signature.update(part_ptr="*fp32", sem_ptr="*i32")
    else:
        constants.update(part_ptr=None, sem_ptr=None)
    if constants["SUM_TOPK"]:
        constants["BY_EXPERT"] = False  # a token's slots in their own order (TritonW4A16MoE.gemv2)
    for name in constants:
        signature[name] = "constexpr"
    src = ASTSource(fn=tm._gemv_kernel, signature=signature, constexprs=constants, attrs=_attrs(signature))
    return triton.compile(src, target=target or TARGET, options=dict(num_warps=g["warps"], num_stages=g.get("stages", 1)))


SIGNATURE_ALIGN = dict(topk_ids_ptr="*i32", num_slots="i32", num_experts="i32", counts_ptr="*i32",
                       starts_ptr="*i32", ends_ptr="*i32", cursor_ptr="*i32", part_ptr="*i32", ticket_ptr="*i32")


def compile_align(one_program: bool, num_bins: int = 512, block_m: int = 64, *, target=None):
    """The grouping's count (_align_kernel) as TritonW4A16MoE._group_slots launches it: one
    program for up to ALIGN_CHUNK slots, else a program per chunk and the ticket."""
    constants = dict(BLOCK_M=block_m, NUM_BINS=num_bins, CHUNK=tm.ALIGN_CHUNK, ONE_PROGRAM=one_program,
                     PDL=_pdl(target))
    signature = dict(SIGNATURE_ALIGN, **{name: "constexpr" for name in constants})
    src = ASTSource(fn=tm._align_kernel, signature=signature, constexprs=constants, attrs=_attrs(signature))
    return triton.compile(src, target=target or TARGET, options=dict(num_warps=8))


SIGNATURE_SCATTER = dict(topk_ids_ptr="*i32", num_slots="i32", cursor_ptr="*i32", sorted_slot_ptr="*i32",
                         counts_ptr="*i32", starts_ptr="*i32", ends_ptr="*i32")


def compile_scatter(block_m: int, num_bins: int = 512, *, target=None):
    """The grouping's scatter (_scatter_kernel) as TritonW4A16MoE._group_slots launches it: with
    blocks of at least TABLE_MIN_BLOCK_M rows it also writes the block table."""
    constants = dict(BLOCK=1024, BLOCK_M=block_m, NUM_BINS=num_bins, PDL=_pdl(target))
    signature = dict(SIGNATURE_SCATTER, **{name: "constexpr" for name in constants})
    src = ASTSource(fn=tm._scatter_kernel, signature=signature, constexprs=constants, attrs=_attrs(signature))
    return triton.compile(src, target=target or TARGET, options=dict(num_warps=4))


SIGNATURE_MMA8 = {
    "x_ptr": "*i64", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16", "topk_weights_ptr": "*fp32",
    "sorted_slot_ptr": "*i32", "counts_ptr": "*i32", "starts_ptr": "*i32", "ends_ptr": "*i32", "num_experts": "i32",
    "K": "i32", "N": "i32", "stride_xm": "i32", "stride_we": "i64", "stride_wt": "i32", "stride_se": "i64",
    "stride_sg": "i32", "stride_om": "i32",
}


def compile_mma8(which: int, g: dict, *, target=None, topk: int = 8, num_bins: int = 512):
    """A block_m 8 row's GEMM (triton_moe._mma8_kernel) as GEMM1 or GEMM2."""
    signature = dict(SIGNATURE_MMA8)
    constants = dict(TOPK=topk, NUM_BINS=num_bins, RT=g["rt"], KSPLIT=g["ksplit"], GATE_UP=which == 1, PDL=_pdl(target))
    for name in constants:
        signature[name] = "constexpr"
    src = ASTSource(fn=tm._mma8_kernel, signature=signature, constexprs=constants, attrs=_attrs(signature))
    return triton.compile(src, target=target or TARGET, options=dict(num_warps=g["ksplit"], num_stages=1))


def compile_gemm(which: int, block_m: int, g: dict, group: int = 32, overlap: bool | None = None, *,
                 target=None, topk: int = 8, num_bins: int = 512, k: int | None = None, by_expert=None):
    """GEMM1 or GEMM2 (default: at the kimi-k2.6 shape, K = 7168 for GEMM1 and 2048 for GEMM2).
    overlap (default: for swapped rows, as the backend tries first on sm_90): K as a
    compile-time constant, the form whose MMAs may stay in flight (TritonW4A16MoE._launch);
    otherwise K at run time, the form the compiler serialises."""
    if g.get("gemv"):
        return compile_gemv(which, g, group, target=target, topk=topk, by_expert=by_expert)
    if g.get("mma8"):
        return compile_mma8(which, g, target=target, topk=topk, num_bins=num_bins)
    kernel = tm._gemm1_kernel if which == 1 else tm._gemm2_kernel
    signature = dict(SIGNATURE_1 if which == 1 else SIGNATURE_2)
    constants = dict(GROUP=group, BLOCK_M=block_m, BLOCK_N=g["bn"], GROUPS_PER_STEP=g["bk"] // group,
                     NUM_BINS=num_bins, POST_SCALE=g["post"], WHOLE_TILE=g.get("whole", False), SWAP_AB=g["swap"],
                     CONVERT_ASM=bool(g.get("asm", False)), SPLIT_K=g.get("split", 1))
    if which == 1:
        constants["TOPK"] = topk
        constants["FUSE_GU"] = bool(g.get("gu", False))
    if overlap is None:
        overlap = bool(g["swap"])
    if k is None:
        k = 7168 if which == 1 else 2048
    constants["K_CONST"] = k if overlap else 0
    constants["PDL"] = _pdl(target)
    for name in constants:
        signature[name] = "constexpr"
    src = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=_attrs(signature))
    return triton.compile(src, target=target or TARGET, options=dict(num_warps=g["warps"], num_stages=g["stages"]))


def compile_gluon(which: str, tile: dict, group: int = 32, *, target=None):
    """The Gluon path's warp-specialised GEMM (gluon_moe._ws_gemm_kernel) as GEMM1 ("g1") or
    GEMM2 ("g2") with one of its tiles (gluon_moe.tile_sets())."""
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(dtype: str, block, layout) -> str:
        return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"

    signature = {"x_desc": desc("bf16", [tile["bm"], 32], gluon_moe._x_layout(tile["bm"])),
                 "x_desc2": desc("bf16", [tile["bm"] // 2, 32], gluon_moe._x_layout(tile["bm"] // 2)),
                 "x_desc4": desc("bf16", [tile["bm"] // 4, 32], gluon_moe._x_layout(tile["bm"] // 4)),
                 "w_desc": desc("u8", [2 * tile["bnc"] // 32, 32, 32], gluon_moe._w_layout()),
                 "s_desc": desc("bf16", [1, 2, 2 * tile["bnc"]], gluon_moe._s_layout()),
                 "out_ptr": "*bf16", "topk_w_ptr": "*fp32", "sorted_slot_ptr": "*i32",
                 "block_expert_ptr": "*i32", "block_rows_ptr": "*i32", "num_blocks": "i32", "K": "i32", "N": "i32",
                 "stride_om": "i32", "w_row_groups": "i32"}
    constants = dict(BM=tile["bm"], BNC=tile["bnc"], GROUP=group, GATE_UP=which == "g1", STAGES=tile["stages"],
                     CONSUMER_REGS=tile.get("consumer_regs", 232), PRODUCER_REGS=tile.get("producer_regs", 40),
                     BYTE_L=gluon_moe.byte_layout(tile["bnc"]), BYTE_T=gluon_moe.byte_layout(tile["bnc"], transposed=True),
                     NARROW=tile.get("narrow", 0), MID=bool(tile.get("mid", False)), UNROLL=int(tile.get("unroll", gluon_moe.UNROLL)),
                     PERSISTENT=bool(tile.get("persistent", False)))
    for name in constants:
        signature[name] = "constexpr"
    src = GluonASTSource(gluon_moe._ws_gemm_kernel, signature, constants, {})
    return triton.compile(src, target=target or TARGET, options=dict(num_warps=4))


BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def describe(compiled) -> dict:
    """Registers, spills and SASS opcode counts, read from the cubin with cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(compiled.asm["cubin"])
        fh.flush()
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", fh.name],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", fh.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    counts = {op: len(re.findall(rf"\b{re.escape(op)}(?:\.|\s)", sass)) for op in OPS}
    ptx = compiled.asm["ptx"]
    return dict(regs=int(regs.group(1)) if regs else -1, stack=int(stack.group(1)) if stack else -1,
                local=int(local.group(1)) if local else -1, shared=compiled.metadata.shared,
                wgmma=ptx.count("wgmma.mma_async"), mma=ptx.count("mma.sync"), counts=counts, sass=sass)


def candidates_main(args) -> int:
    """The tuning view: the kimi-k2.6 table and kernel_sweep's candidates on sm_90."""
    from kernel_sweep import variants  # noqa: E402  (same folder)

    seen = set()
    failed = 0
    for m in (1, 64, 128, 512, 1024, 2048):
        shape = tm.quant.MoEShape(384, 7168, 2048, 8, 32)
        for name, bm, g1, g2 in variants(m, tm._config_for(shape, m, tm.TILE_TABLE)):
            g1 = tm._fit(g1, shape.hidden, shape.inter, shape.group_size)
            g2 = tm._fit(g2, shape.inter, shape.hidden, shape.group_size)
            for which, g in ((1, g1), (2, g2)):
                key = (which, bm, tuple(sorted(g.items())))
                if key in seen:
                    continue
                seen.add(key)
                label = f"GEMM{which} bm{bm} {name}"
                try:
                    compiled = compile_gemm(which, bm, g)
                except Exception as exc:
                    failed += 1
                    print(f"{label:40s} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                d = describe(compiled)
                hazards = wgmma_operand_hazards(d["sass"])
                if hazards and g.get("swap"):
                    # The backend refuses the overlapped form and runs the serialised one.
                    print(f"{label:40s} overlapped form refused (the backend falls back): {hazards[:3]}", flush=True)
                    compiled = compile_gemm(which, bm, g, overlap=False)
                    d = describe(compiled)
                    hazards = wgmma_operand_hazards(d["sass"])
                if hazards:
                    failed += 1
                    print(f"{label:40s} UNSAFE: MMA register operand overwritten in flight: {hazards[:3]}", flush=True)
                print(f"{label:40s} regs {d['regs']:3d} stack {d['stack']:3d} local {d['local']:3d} smem {d['shared']:6d} "
                      f"wgmma {d['wgmma']:3d} mma {d['mma']:3d} "
                      + " ".join(f"{k}={v}" for k, v in d["counts"].items() if v), flush=True)
                if args.sass_out:
                    os.makedirs(args.sass_out, exist_ok=True)
                    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", label)
                    with open(os.path.join(args.sass_out, safe + ".sass"), "w") as fh:
                        fh.write(d["sass"])
    return 1 if failed else 0


# ---------------------------------------------------------------------------
# Portability: every preset's configurations on every architecture asked for
# ---------------------------------------------------------------------------

# M values whose configurations are collected per shape: every table row's first and last M
# (and the powers of two), so that a row fit_to_device changes with M is seen in each form.
def _m_values(table, largest: int = 8192) -> list[int]:
    ms = {1 << i for i in range(14) if 1 << i <= largest}
    for limit, _ in table:
        for m in (limit, limit + 1):
            if m <= largest:
                ms.add(m)
    return sorted(ms)


def shapes_for(preset_names: list[str], tps: list[int]) -> list[tuple[str, tm.quant.MoEShape]]:
    out = []
    for name in preset_names:
        for tp in tps:
            try:
                shape = presets.PRESETS[name].shape(tp)
                tm._check_shape(shape)
            except ValueError:
                continue  # not a shape this preset has at this --tp (inter not divisible)
            out.append((f"{name} tp{tp}", shape))
    return out


def portability_jobs(archs: list[int], shapes) -> list[dict]:
    """One job per distinct kernel compile: (architecture, kernel, its constants)."""
    jobs, seen = [], {}
    for arch in archs:
        limits = ARCHS[arch]
        for shape_label, shape in shapes:
            table = tm.table_for(shape, limits)
            for m in _m_values(table):
                cfg = tm.fit_to_device(tm._config_for(shape, m, table), limits, shape, m)
                by_expert = bool(cfg["g1"].get("sort", False))
                for which, g, k in ((1, cfg["g1"], shape.hidden), (2, cfg["g2"], shape.inter)):
                    if g.get("gemv") and "split" in g:  # the K slices the launch takes at this K
                        g = dict(g, split=tm.gemv_split(g, k))
                    overlap = bool(g.get("swap")) and arch == 90 and not g.get("gemv") and not g.get("mma8")
                    job = dict(arch=arch, which=which, block_m=cfg["block_m"], g=g, group=shape.group_size,
                               topk=shape.topk, num_bins=tm.num_bins(shape),
                               k=k if overlap else 0, overlap=overlap, by_expert=by_expert if g.get("gemv") else None)
                    key = json.dumps(job, sort_keys=True)
                    if key not in seen:
                        seen[key] = job
                        job["used_by"] = []
                        jobs.append(job)
                    seen[key]["used_by"].append(f"{shape_label} M={m}")
        # The Gluon path (gluon_moe): one kernel per GEMM and group size, wherever a shape fits
        # its tiles; on every other architecture reported as not applicable, never dropped.
        for shape_label, shape in shapes:
            if gluon_moe.shape_unavailable_reason(shape) is not None:
                continue
            for tiles in gluon_moe.tile_sets():
                for which, k in (("g1", shape.hidden), ("g2", shape.inter)):
                    # (the K steps a turn the launch picks for this K)
                    tile = dict(tiles[which], unroll=gluon_moe.unroll_for(tiles[which], k))
                    key = json.dumps(dict(arch=arch, gluon=which, tile=tile, group=shape.group_size),
                                     sort_keys=True)
                    if key not in seen:
                        seen[key] = dict(arch=arch, gluon=which, tile=tile, group=shape.group_size,
                                         used_by=[])
                        jobs.append(seen[key])
                    seen[key]["used_by"].append(f"{shape_label} (Gluon path)")
    return jobs


def fit_problems(d: dict, arch: int, limits, threads: int) -> list[str]:
    """What of a compiled kernel (describe's d) does not fit the architecture: shared memory
    per block, registers per thread and per SM, spills."""
    problems = []
    if d["shared"] > limits.smem_per_block:
        problems.append(f"shared memory {d['shared']} B over sm_{arch}'s {limits.smem_per_block} B per block")
    if d["regs"] > MAX_REGISTERS_PER_THREAD or d["regs"] * threads > REGISTERS_PER_SM:
        problems.append(f"{d['regs']} registers x {threads} threads do not fit sm_{arch}'s register file")
    if d["local"] > 0 or d["stack"] > 0:
        problems.append(f"spills: {d['local']} B local memory, {d['stack']} B stack per thread")
    return problems


def wgmma_serialised(counts: dict) -> str | None:
    """Why the compiled warp-group MMAs run one at a time (None: they do not): ptxas, where it
    cannot keep an MMA's registers untouched while it runs ("insufficient register resources",
    its C7512), puts a wait (WARPGROUP.DEPBAR) after every HGMMA; the code is right and about
    half as fast (seen with the Gluon GEMMs' MMAs left in flight across the K loop's back edge,
    PERFORMANCE.md round 24). A warp-specialised GEMM waits once per step or fewer."""
    hgmma, waits = counts.get("HGMMA", 0), counts.get("WARPGROUP.DEPBAR", 0)
    if hgmma and waits >= hgmma:
        return (f"warp-group MMAs serialised by the compiler: {waits} waits for {hgmma} HGMMA (each one waited "
                "for alone; ptxas's C7512)")
    return None


def check_gluon_job(job: dict) -> dict:
    """Compile the Gluon path's kernel for job's architecture, or say why it does not apply there."""
    started = time.perf_counter()
    arch, limits = job["arch"], ARCHS[job["arch"]]
    tile = job["tile"]
    label = (f"sm_{arch} GEMM{job['gluon'][1]} Gluon warp-specialised bm{tile['bm']},bnc={tile['bnc']},"
             f"stages={tile['stages']},unroll={tile.get('unroll', gluon_moe.UNROLL)}")
    reason = gluon_moe.path_unavailable_reason(limits.capability, gluon_moe.api_error(), env={})
    if reason is not None:
        return dict(label=label, used_by=job["used_by"], problems=[], notes=[f"not applicable: {reason}"],
                    summary="n/a", not_applicable=True, seconds=time.perf_counter() - started)
    problems = []
    try:
        d = describe(compile_gluon(job["gluon"], tile, job["group"], target=GPUTarget("cuda", arch, 32)))
    except Exception as exc:
        return dict(label=label, used_by=job["used_by"], problems=[f"compile failed: {type(exc).__name__}: "
                                                                   f"{str(exc)[:300]}"], notes=[],
                    seconds=time.perf_counter() - started)
    problems += fit_problems(d, arch, limits, threads=32 * 12)  # two consumer warp groups, the producer's
    if not d["counts"].get("HGMMA"):
        problems.append("no HGMMA in the compiled code")
    serialised = wgmma_serialised(d["counts"])
    if serialised:
        problems.append(serialised)
    summary = (f"regs {d['regs']:3d} smem {d['shared']:6d} local {d['local']} HGMMA={d['counts'].get('HGMMA', 0)} "
               f"waits={d['counts'].get('WARPGROUP.DEPBAR', 0)}")
    return dict(label=label, used_by=job["used_by"], problems=problems, notes=[], summary=summary,
                seconds=time.perf_counter() - started)


def check_job(job: dict) -> dict:
    """Compile one kernel for its architecture and check that it fits and is race-free."""
    if "gluon" in job:
        return check_gluon_job(job)
    started = time.perf_counter()
    arch, limits = job["arch"], ARCHS[job["arch"]]
    target = GPUTarget("cuda", arch, 32)
    kind = "one-row" if job["g"].get("gemv") else "mma8" if job["g"].get("mma8") else f"bm{job['block_m']}"
    label = f"sm_{arch} GEMM{job['which']} {kind} " + ",".join(
        f"{key}={value}" for key, value in sorted(job["g"].items())
        if key not in ("asm", "gemv", "post", "whole") and not (key == "split" and value == 1))
    problems, notes = [], []

    def build(overlap: bool):
        return compile_gemm(job["which"], job["block_m"], job["g"], job["group"], overlap, target=target,
                            topk=job["topk"], num_bins=job["num_bins"], k=job["k"] or None,
                            by_expert=job["by_expert"])

    try:
        compiled = build(job["overlap"])
        d = describe(compiled)
        if job["overlap"]:
            hazards = wgmma_operand_hazards(d["sass"])
            if hazards or "HGMMA" not in d["sass"]:
                why = f"operand overwritten in flight {hazards[:2]}" if hazards else "no HGMMA"
                notes.append(f"overlapped form refused ({why}): the backend runs the serialised form")
                compiled = build(False)
                d = describe(compiled)
        if arch == 90 and job["g"].get("swap"):
            hazards = wgmma_operand_hazards(d["sass"])
            if hazards:
                problems.append(f"MMA register operand overwritten in flight: {hazards[:3]}")
    except Exception as exc:
        return dict(label=label, used_by=job["used_by"], problems=[f"compile failed: {type(exc).__name__}: "
                                                                   f"{str(exc)[:300]}"], notes=notes,
                    seconds=time.perf_counter() - started)
    warps = job["g"]["ksplit"] if job["g"].get("mma8") else job["g"]["warps"]
    if job["g"].get("mma8") and "HMMA.16816.F32.BF16" not in d["sass"]:
        problems.append("no bf16 mma.sync (HMMA.16816.F32.BF16) in the compiled code")
    problems += fit_problems(d, arch, limits, threads=32 * warps)
    summary = (f"regs {d['regs']:3d} smem {d['shared']:6d} local {d['local']} "
               + " ".join(f"{op}={d['counts'][op]}" for op in ("HGMMA", "HMMA") if d["counts"].get(op))
               + (f" UTCMMA={d['sass'].count('UTCHMMA') + d['sass'].count('UTCQMMA')}" if 100 <= arch < 120 else ""))
    return dict(label=label, used_by=job["used_by"], problems=problems, notes=notes, summary=summary,
                seconds=time.perf_counter() - started)


def _parse_archs(text: str) -> list[int]:
    archs = []
    for part in text.split(","):
        match = re.fullmatch(r"(?:sm_)?(\d+)a?", part.strip())
        if not match or int(match.group(1)) not in ARCHS:
            raise argparse.ArgumentTypeError(f"unknown architecture {part!r}; known: "
                                             + ",".join(f"sm_{a}" for a in ARCHS))
        archs.append(int(match.group(1)))
    return archs


def portability_main(args) -> int:
    names = sorted(presets.PRESETS) if args.preset == "all" else args.preset.split(",")
    for name in names:
        if name not in presets.PRESETS:
            print(f"unknown preset {name!r}; known: {', '.join(sorted(presets.PRESETS))}", file=sys.stderr)
            return 2
    shapes = shapes_for(names, [int(v) for v in args.tp.split(",")])
    jobs = portability_jobs(args.arch, shapes)
    started = time.perf_counter()
    print(f"triton {triton.__version__}: {len(jobs)} kernel compiles for {len(shapes)} shapes "
          f"({', '.join(label for label, _ in shapes)}) on {', '.join(f'sm_{a}' for a in args.arch)}", flush=True)
    failed = not_applicable = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for result in pool.map(check_job, jobs):
            status = "FAIL" if result["problems"] else ("n/a" if result.get("not_applicable") else "ok")
            failed += bool(result["problems"])
            not_applicable += bool(result.get("not_applicable"))
            print(f"{status:4s} {result['label']:70s} {result.get('summary', '')} [{result['seconds']:.1f}s] "
                  f"used by {len(result['used_by'])} (shape, M), e.g. {result['used_by'][0]}", flush=True)
            for line in result["notes"] + result["problems"]:
                print(f"     {line}", flush=True)
    print(f"{len(jobs) - failed - not_applicable} of {len(jobs)} configurations compile and fit; {failed} failed; "
          f"{not_applicable} not applicable on their architecture (the Gluon path off sm_90) "
          f"[{time.perf_counter() - started:.0f} s]", flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=_parse_archs, default=[90], help="comma-separated, e.g. sm_80,sm_90,sm_120")
    parser.add_argument("--preset", default="", help="a preset, a comma-separated list, or all: the portability check")
    parser.add_argument("--tp", default="1,8", help="with --preset: the tensor-parallel shards each preset is checked at")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    parser.add_argument("--sass-out", default="", help="without --preset: write each kernel's SASS here")
    args = parser.parse_args(argv)
    if args.preset:
        return portability_main(args)
    return candidates_main(args)


if __name__ == "__main__":
    sys.exit(main())
