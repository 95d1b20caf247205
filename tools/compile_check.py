"""Compile the GEMM kernels for an H100/H200 (sm_90) without a GPU and report what the compiler
made of each configuration: registers, spills, shared memory, and counts of the instructions
that matter (a development tool, not the payload).

  PYTHONPATH=files python3 tools/compile_check.py [--sass-out DIR]

Catches PTX that does not assemble before any GPU time is spent, and shows whether a
configuration spills or which matrix instructions it uses. Swapped rows are compiled as the
backend tries them first, in the overlapped form (K a compile-time constant, MMAs left in
flight across steps), and checked as the backend checks them (moe_bench.sass): a warp-group
MMA whose register operand a later instruction overwrites before the wait that retires it
gives results that vary run to run on the GPU (seen: relative error 7e-3 to 7e2 or NaN for
the same configuration). Where the overlapped form has such a write the tool says so and
checks the serialised form the backend then runs; it refuses (exit 1) a configuration whose
serialised form has one too. Use the Triton
version the GPU host runs (the SASS differs between versions): for example a venv with
`pip install triton==3.6.0` and a CPU torch wheel.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_bench import triton_moe as tm
from moe_bench.sass import wgmma_operand_hazards

TARGET = GPUTarget("cuda", 90, 32)
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


def compile_gemv(which: int, g: dict, group: int = 32):
    """The one-row kernel as GEMM1 (gate/up, float32 intermediate out) or GEMM2."""
    signature = dict(SIGNATURE_GEMV, out_ptr="*fp32" if which == 1 else "*bf16")
    constants = dict(TOPK=8, GROUP=group, BLOCK_N=g["bn"], BLOCK_KW=g["bkw"], GATE_UP=which == 1,
                     CONVERT_ASM=bool(g.get("asm", False)), INTER_DTYPE=tm.tl.bfloat16,
                     BY_EXPERT=bool(g.get("sort", False)))
    for name in constants:
        signature[name] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind != "constexpr"}
    src = ASTSource(fn=tm._gemv_kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=g["warps"], num_stages=g.get("stages", 1)))


def compile_gemm(which: int, block_m: int, g: dict, group: int = 32, overlap: bool | None = None):
    """GEMM1 or GEMM2 at the kimi-k2.6 shape. overlap (default: for swapped rows, as the backend
    tries first): K as a compile-time constant, the form whose MMAs may stay in flight
    (TritonW4A16MoE._launch); otherwise K at run time, the form the compiler serialises."""
    if g.get("gemv"):
        return compile_gemv(which, g, group)
    kernel = tm._gemm1_kernel if which == 1 else tm._gemm2_kernel
    signature = dict(SIGNATURE_1 if which == 1 else SIGNATURE_2)
    constants = dict(GROUP=group, BLOCK_M=block_m, BLOCK_N=g["bn"], GROUPS_PER_STEP=g["bk"] // group, NUM_BINS=512,
                     POST_SCALE=g["post"], WHOLE_TILE=g.get("whole", False), SWAP_AB=g["swap"],
                     CONVERT_ASM=bool(g.get("asm", False)), SPLIT_K=g.get("split", 1))
    if which == 1:
        constants["TOPK"] = 8
        constants["FUSE_GU"] = bool(g.get("gu", False))
    if overlap is None:
        overlap = bool(g["swap"])
    constants["K_CONST"] = (7168 if which == 1 else 2048) if overlap else 0
    for name in constants:
        signature[name] = "constexpr"
    # As the JIT specialises them at this shape: every pointer and integer argument divisible by 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind != "constexpr"}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=g["warps"], num_stages=g["stages"]))


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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sass-out", default="")
    args = parser.parse_args()
    from kernel_sweep import variants  # noqa: E402  (same folder)

    seen = set()
    failed = 0
    for m in (1, 64, 128, 512, 1024, 2048):
        shape = tm.quant.MoEShape(384, 7168, 2048, 8, 32)
        for name, bm, g1, g2 in variants(m, tm._config_for(shape, m)):
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


if __name__ == "__main__":
    sys.exit(main())
