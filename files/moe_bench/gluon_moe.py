"""The warp-specialised Hopper path of the W4A16 MoE forward, written in Gluon
(`triton.experimental.gluon`), for the tensor-core M range.

Where it applies (path_unavailable_reason says why not): Gluon importable with the API this
module is written against (Triton 3.6's: `gl.warp_specialize(functions_and_args,
worker_num_warps, worker_num_regs)`, Hopper's `warpgroup_mma`, `mbarrier`, `tma`), a GPU of
compute capability 9.0 (warp-group MMA and the tensor copy engine as used here exist on sm_90
alone: sm_100 has its own MMA, sm_80/89/120 have neither), and a shape whose K dimensions
are whole 64-value blocks and whose output columns divide into the tile (shape_unavailable_reason).
Elsewhere the plain-Triton kernels of triton_moe run, and the results say which path ran
and why (TritonW4A16MoE.configs_used).

Per forward (M in the rows that take this path):
  1. triton_moe's _align_kernel and _scatter_kernel group the slots by expert into blocks of
     BM rows (as the plain-Triton path does);
  2. _gather_kernel (plain Triton): each block's owner and row count, and the activation rows
     gathered into sorted order, each 64-value K block in the operand order below (padded rows
     zero), so every block's rows are one contiguous tile the copy engine can fetch;
  3. _ws_gemm_kernel as GEMM1 (gate and up of w13, SiLU(gate) * up in the epilogue, stored in
     sorted order and in the same operand order for GEMM2), then as GEMM2 (w2, times each
     slot's top-k weight, stored per slot);
  4. triton_moe's _topk_sum_kernel.

_ws_gemm_kernel: one program per (block of BM sorted rows, tile of 2 * BNC weight rows), three
partitions: a producer warp that issues the copy-engine loads of each K step (the rows' two
halves, the packed weight tiles) into a ring of STAGES shared-memory buffers, each completing
on its `ready` mbarrier, and two consumer warp groups, each owning BNC weight rows (GEMM1:
BNC gate and BNC up columns): wait for a stage, load their packed bytes from shared memory in
the warp-group MMA's register-operand layout, convert each weight once (nibble to bf16 and
scale, two PTX blocks per pair of bytes, as the plain-Triton path's _PAIR_NIBBLES_PTX),
issue the MMAs with the activations from shared memory, wait for them and release the stage
(an `empty` mbarrier that both consumers arrive on).

Operand order: a 64-value K block of the packed layout holds in its 32 bytes per column the
values 0-15 and 32-47 in the low nibbles and 16-31 and 48-63 in the high nibbles; the rows
are stored with the low nibbles' 32 values first, then the high nibbles' (_operand_pos), so a
step's two MMAs each take one contiguous 32-value half: no nibble is ever interleaved.
"""

from __future__ import annotations

import inspect
import os

import torch
import triton
import triton.language as tl

from . import quant
from . import triton_moe as tm

GLUON_IMPORT_ERROR: str | None = None
try:  # Gluon is experimental: absent from older Triton, its API moves between versions.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception as exc:  # noqa: BLE001 - any failure means "no Gluon path", with the reason kept
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

PATH_NAME = "gluon-hopper-ws"

# The tile: BM sorted rows per block (the MMA's N), BNC weight rows per consumer warp group
# (the MMA's M; GEMM1 takes BNC gate and BNC up rows), STAGES shared-memory stages.
GLUON_TILES = {
    "g1": dict(bm=64, bnc=64, stages=4),
    "g2": dict(bm=64, bnc=128, stages=4),
}
# The smallest slots per expert at which this path can run (below it the plain-Triton rows
# with block_m 16 or 32 pad less): where the shipped rule takes block_m 64 (see
# triton_moe.SLOTS_PER_EXPERT_ROWS).
MIN_SLOTS_PER_EXPERT = 24.0
# K values per program of the gather (a multiple of 64: whole operand-order blocks).
GATHER_BK = 512
# Whether the backend picks it by itself where it can run. Measured on one H200 (PERFORMANCE.md,
# round 16): correct, but 1.7-2.8x slower than the plain-Triton rows at every M tried (kimi-k2.6
# M=512-8192), so not picked; MOE_BENCH_GLUON=force runs it wherever it can run (measurement and
# tuning), MOE_BENCH_GLUON=0 never.
SELECTED_BY_DEFAULT = False
NOT_SELECTED = ("not selected: slower than the plain-Triton kernels at every M measured on the H200 "
                "(PERFORMANCE.md, round 16); MOE_BENCH_GLUON=force runs it")


def api_error() -> str | None:
    """Why the installed Gluon is not the API this module is written against (None: it is)."""
    if GLUON_IMPORT_ERROR is not None:
        return f"Gluon not importable ({GLUON_IMPORT_ERROR})"
    try:
        params = list(inspect.signature(gl.warp_specialize).parameters)
    except (TypeError, ValueError) as exc:
        return f"gl.warp_specialize has no readable signature ({exc})"
    if params[:3] != ["functions_and_args", "worker_num_warps", "worker_num_regs"]:
        return f"gl.warp_specialize takes {params[:6]}, not (functions_and_args, worker_num_warps, worker_num_regs)"
    return None


def path_unavailable_reason(capability, api_problem: str | None = None, env: dict | None = None) -> str | None:
    """Why the Gluon path cannot run on a device of this compute capability (None: it can).

    capability: (major, minor), or None off a CUDA device. api_problem: api_error()'s answer
    (passed in so the decision is testable without the installed Triton); env: the
    environment (MOE_BENCH_GLUON=0 turns the path off)."""
    env = os.environ if env is None else env
    if env.get("MOE_BENCH_GLUON", "1") in ("0", "off", "false", "no"):
        return "turned off (MOE_BENCH_GLUON=0)"
    if env.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "Triton's interpreter runs no Gluon kernels"
    if capability is None:
        return "no CUDA device"
    if tuple(capability) != (9, 0):
        major, minor = capability
        return (f"sm_{major}{minor} has no warp-group MMA (the Gluon path is written for sm_90: "
                "H100/H200)")
    return api_problem


def shape_unavailable_reason(shape: quant.MoEShape) -> str | None:
    """Why this layer shape does not fit the Gluon kernels' tiles (None: it does)."""
    for which, k, n, gate_up in (("GEMM1", shape.hidden, shape.inter, True), ("GEMM2", shape.inter, shape.hidden, False)):
        tile = GLUON_TILES["g1" if gate_up else "g2"]
        if k % 64:
            return f"{which}'s K={k} is not a multiple of 64"
        if n % (2 * tile["bnc"]):
            return f"{which}'s N={n} is not a multiple of its tile's {2 * tile['bnc']} columns"
    if shape.group_size % 32:
        return f"group size {shape.group_size} is not a multiple of 32"
    return None


def can_run_at(shape: quant.MoEShape, m: int) -> bool:
    """Whether M is in the range this path can run for (slots per expert)."""
    return m * shape.topk / shape.experts >= MIN_SLOTS_PER_EXPERT


def selected(env: dict | None = None) -> bool:
    """Whether the path is picked where it can run: SELECTED_BY_DEFAULT, or MOE_BENCH_GLUON=force."""
    env = os.environ if env is None else env
    return SELECTED_BY_DEFAULT or env.get("MOE_BENCH_GLUON", "") == "force"


# ---------------------------------------------------------------------------
# The gather (plain Triton)
# ---------------------------------------------------------------------------


@triton.jit
def _operand_pos(k):
    """Position of K index k in the operand order: per 64-value block, the low nibbles'
    values (0-15, 32-47) first, then the high nibbles' (16-31, 48-63)."""
    r = k % 64
    i = r % 32
    return k - r + (i // 16) * 32 + (r // 32) * 16 + i % 16


@triton.jit
def _gather_kernel(x_ptr, out_ptr, sorted_slot_ptr, counts_ptr, starts_ptr, ends_ptr, block_expert_ptr,
                   block_rows_ptr, num_experts, K, stride_xm, stride_om, TOPK: tl.constexpr, BLOCK_M: tl.constexpr,
                   NUM_BINS: tl.constexpr, BK: tl.constexpr):
    pid_b = tl.program_id(0)
    pid_k = tl.program_id(1)
    expert, rows_used = tm._block_owner(pid_b, counts_ptr, starts_ptr, ends_ptr, num_experts, BLOCK_M, NUM_BINS)
    if pid_k == 0:
        tl.store(block_expert_ptr + pid_b, expert)
        tl.store(block_rows_ptr + pid_b, rows_used)
    if rows_used == 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows_used
    slot = tl.load(sorted_slot_ptr + pid_b * BLOCK_M + offs_m, mask=row_ok, other=0)
    token = (slot // TOPK).to(tl.int64)
    offs_k = pid_k * BK + tl.arange(0, BK)
    vals = tl.load(x_ptr + token[:, None] * stride_xm + offs_k[None, :], mask=row_ok[:, None], other=0.0)
    rows = (pid_b * BLOCK_M + offs_m).to(tl.int64)
    # K = 64 b + 32 c + 16 h + i goes to position 64 b + 32 h + 16 c + i (_operand_pos): the two
    # middle axes swapped in registers, then one contiguous store (a store through
    # _operand_pos's offsets ran element by element: 2.7 ms at kimi-k2.6 M=2048, round 16).
    vals = tl.reshape(tl.permute(tl.reshape(vals, (BLOCK_M, BK // 64, 2, 2, 16)), (0, 1, 3, 2, 4)), (BLOCK_M, BK))
    tl.store(out_ptr + rows[:, None] * stride_om + offs_k[None, :], vals)


# ---------------------------------------------------------------------------
# The warp-specialised GEMM (Gluon)
# ---------------------------------------------------------------------------

def _define_kernels():
    """The Gluon kernels, defined only where Gluon imports (a version whose names differ
    leaves GLUON_IMPORT_ERROR saying so instead of failing the payload's import)."""
    global _tma_load, _warps_barrier, _PAIR_PTX, _SCALE_PTX, _convert, _producer, _consumer, _convert_to_smem
    global _consumer_ss, _consumer_0, _consumer_1, _ws_gemm_kernel
    # The copy-engine load is tma.async_copy_global_to_shared in Triton 3.6, tma.async_load later.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # The barrier of the running warps: gl.thread_barrier in Triton 3.6, gl.barrier later.
    _warps_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _PAIR_PTX = gl.constexpr(tm._PAIR_NIBBLES_PTX.value)
    _SCALE_PTX = gl.constexpr("{ .reg .b32 mz;\nmov.b32 mz, 0x80008000;\nfma.rn.bf16x2 $0, $1, $2, mz; }")

    @gluon.jit
    def _convert(p, s):
        """Packed bytes p (uint8) and their scales s (bf16, same layout) -> the weights of the
        low and of the high nibbles, (u - 8) * s in bf16, exact before the one rounding."""
        lo, hi = gl.inline_asm_elementwise(_PAIR_PTX, "=r,=r,r", [p], dtype=(gl.bfloat16, gl.bfloat16),
                                           is_pure=True, pack=2)
        lo = gl.inline_asm_elementwise(_SCALE_PTX, "=r,r,r", [lo, s], dtype=gl.bfloat16, is_pure=True, pack=2)
        hi = gl.inline_asm_elementwise(_SCALE_PTX, "=r,r,r", [hi, s], dtype=gl.bfloat16, is_pure=True, pack=2)
        return lo, hi

    @gluon.jit
    def _producer(x_desc, w_desc, x_bufs, w_bufs, ready, empty, row0, wrow_g, wrow_u, num_k,
                  GATE_UP: gl.constexpr, STAGES: gl.constexpr):
        X_BYTES: gl.constexpr = x_desc.block_type.nbytes
        W_BYTES: gl.constexpr = w_desc.block_type.nbytes
        W_COPIES: gl.constexpr = 2 if GATE_UP else 1
        NBYTES: gl.constexpr = 2 * X_BYTES + W_COPIES * W_BYTES
        for i in range(num_k):
            s = i % STAGES
            # A fresh barrier is in phase 0: waiting for parity 1 passes at once (the first lap).
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, NBYTES)
            _tma_load(x_desc, [row0, i * 64], bar, x_bufs.index(2 * s))
            _tma_load(x_desc, [row0, i * 64 + 32], bar, x_bufs.index(2 * s + 1))
            _tma_load(w_desc, [wrow_g, i * 32, 0], bar, w_bufs.index(2 * s))
            if GATE_UP:
                _tma_load(w_desc, [wrow_u, i * 32, 0], bar, w_bufs.index(2 * s + 1))

    @gluon.jit
    def _consumer(x_bufs, w_bufs, ready, empty, s_ptr, s_base_g, s_base_u, stride_sg, num_k, out_ptr, stride_om,
                  topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, CID: gl.constexpr, BM: gl.constexpr,
                  BNC: gl.constexpr, GROUP: gl.constexpr, GATE_UP: gl.constexpr, STAGES: gl.constexpr):
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        BNH: gl.constexpr = 2 * BNC
        acc_g = gl.zeros([BNC, BM], gl.float32, mma_layout)
        acc_u = gl.zeros([BNC, BM], gl.float32, mma_layout)
        offs_n = CID * BNC + gl.arange(0, BNC, layout=gl.SliceLayout(1, a_layout))
        offs_j = gl.arange(0, 32, layout=gl.SliceLayout(0, a_layout))
        chunk_k = (offs_j // 16) * 32  # K offset (in the step) of each byte's 32-value chunk
        # Software-pipelined: while a step's MMAs run, the next step's weights are loaded and
        # converted and the scales of the one after are fetched; the operands of the MMAs in
        # flight stay live (passed to the wait) so nothing overwrites them early.
        sg = gl.load(s_ptr + s_base_g + ((chunk_k // GROUP)[None, :] * stride_sg + offs_n[:, None]))
        su = gl.load(s_ptr + s_base_u + ((chunk_k // GROUP)[None, :] * stride_sg + offs_n[:, None]))
        mbarrier.wait(ready.index(0), 0)
        wl, wh = _convert(w_bufs.index(0).reshape([BNH, 32]).slice(CID * BNC, BNC, 0).load(a_layout), sg)
        ul, uh = wl, wh
        if GATE_UP:
            ul, uh = _convert(w_bufs.index(1).reshape([BNH, 32]).slice(CID * BNC, BNC, 0).load(a_layout), su)
        i2 = 1 % num_k
        s_off = ((i2 * 64 + chunk_k) // GROUP)[None, :] * stride_sg + offs_n[:, None]
        sg = gl.load(s_ptr + s_base_g + s_off)
        if GATE_UP:
            su = gl.load(s_ptr + s_base_u + s_off)
        for i in range(num_k):
            s = i % STAGES
            xl = x_bufs.index(2 * s).permute((1, 0))
            xh = x_bufs.index(2 * s + 1).permute((1, 0))
            acc_g = warpgroup_mma(wl, xl, acc_g, is_async=True)
            acc_g = warpgroup_mma(wh, xh, acc_g, is_async=True)
            if GATE_UP:
                acc_u = warpgroup_mma(ul, xl, acc_u, is_async=True)
                acc_u = warpgroup_mma(uh, xh, acc_u, is_async=True)
            i1 = i + 1
            s1 = i1 % STAGES
            mbarrier.wait(ready.index(s1), (i1 // STAGES) & 1, pred=i1 < num_k)
            nl, nh = _convert(w_bufs.index(2 * s1).reshape([BNH, 32]).slice(CID * BNC, BNC, 0).load(a_layout), sg)
            ml, mh = nl, nh
            if GATE_UP:
                ml, mh = _convert(w_bufs.index(2 * s1 + 1).reshape([BNH, 32]).slice(CID * BNC, BNC, 0).load(a_layout),
                                  su)
            i2 = (i + 2) % num_k
            s_off = ((i2 * 64 + chunk_k) // GROUP)[None, :] * stride_sg + offs_n[:, None]
            sg = gl.load(s_ptr + s_base_g + s_off)
            if GATE_UP:
                su = gl.load(s_ptr + s_base_u + s_off)
                acc_g, acc_u, wl, wh, ul, uh = warpgroup_mma_wait(num_outstanding=0,
                                                                 deps=(acc_g, acc_u, wl, wh, ul, uh))
            else:
                acc_g, wl, wh = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, wl, wh))
            mbarrier.arrive(empty.index(s), count=1)
            wl, wh, ul, uh = nl, nh, ml, mh

        out_layout: gl.constexpr = gl.BlockedLayout([2, 1], [32, 1], [1, 4], [0, 1])
        offs_c = col0 + CID * BNC + gl.arange(0, BNC, layout=gl.SliceLayout(1, out_layout))
        offs_m = gl.arange(0, BM, layout=gl.SliceLayout(0, out_layout))
        row_ok = offs_m < rows_used
        if GATE_UP:
            h = acc_g * (1.0 / (1.0 + gl.exp(-acc_g))) * acc_u
            h = gl.convert_layout(h.to(out_ptr.dtype.element_ty), out_layout)
            rows = (row0 + offs_m).to(gl.int64)
            # Stored in GEMM2's operand order (its K is this GEMM's N).
            r = offs_c % 64
            q = r % 32
            pos = offs_c - r + (q // 16) * 32 + (r // 32) * 16 + q % 16
            gl.store(out_ptr + rows[None, :] * stride_om + pos[:, None], h, mask=row_ok[None, :])
        else:
            slot = gl.load(sorted_slot_ptr + row0 + offs_m, mask=row_ok, other=0)
            weight = gl.load(topk_w_ptr + slot, mask=row_ok, other=0.0)
            o = gl.convert_layout(acc_g, out_layout) * weight[None, :]
            gl.store(out_ptr + slot.to(gl.int64)[None, :] * stride_om + offs_c[:, None],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[None, :])

    @gluon.jit
    def _convert_to_smem(src, dst_lo, dst_hi, s_ptr, s_base, stride_sg, k0, row_first, BNC: gl.constexpr,
                         GROUP: gl.constexpr):
        """BNC rows of a stage's packed bytes (src: [>= row_first + BNC, 32] uint8) -> their low and
        high nibbles' weights, scaled, as bf16 [BNC, 32] into dst_lo / dst_hi (shared memory).
        Each thread takes one 16-byte chunk (one scale group)."""
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [16, 2, 1], [4, 1, 1], [2, 1, 0])
        L2: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
        p = src.slice(row_first, BNC, 0).load(L2)
        offs_n = row_first + gl.arange(0, BNC, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        offs_c = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        sc = gl.load(s_ptr + s_base + ((k0 + 32 * offs_c) // GROUP)[None, :] * stride_sg + offs_n[:, None])
        sc = gl.broadcast(gl.expand_dims(sc, 2), gl.full([BNC, 2, 16], 0, gl.bfloat16, L3))[0]
        sc = gl.convert_layout(sc.reshape([BNC, 32]), L2)
        lo, hi = _convert(p, sc)
        dst_lo.store(lo)
        dst_hi.store(hi)

    @gluon.jit
    def _consumer_ss(x_bufs, w_bufs, wc_bufs, ready, empty, s_ptr, s_base_g, s_base_u, stride_sg, num_k, out_ptr,
                     stride_om, topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, CID: gl.constexpr,
                     BM: gl.constexpr, BNC: gl.constexpr, GROUP: gl.constexpr, GATE_UP: gl.constexpr,
                     STAGES: gl.constexpr):
        """The consumer with both MMA operands in shared memory: the weights converted once into
        wc_bufs ([consumer x 2 buffers x (lo, hi), NR, 32] bf16, NR = BNC gate (+ BNC up) rows), the
        block's rows as the MMA's M side and the weight columns as its N (m64nNR)."""
        NR: gl.constexpr = 2 * BNC if GATE_UP else BNC
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, NR, 16])
        acc = gl.zeros([BM, NR], gl.float32, mma_layout)
        for i in range(num_k):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            b = i % 2
            dst = wc_bufs.index(4 * CID + 2 * b)
            dst_hi = wc_bufs.index(4 * CID + 2 * b + 1)
            _convert_to_smem(w_bufs.index(2 * s).reshape([2 * BNC, 32]), dst.slice(0, BNC, 0),
                             dst_hi.slice(0, BNC, 0), s_ptr, s_base_g, stride_sg, i * 64, CID * BNC, BNC, GROUP)
            if GATE_UP:
                _convert_to_smem(w_bufs.index(2 * s + 1).reshape([2 * BNC, 32]), dst.slice(BNC, BNC, 0),
                                 dst_hi.slice(BNC, BNC, 0), s_ptr, s_base_u, stride_sg, i * 64, CID * BNC, BNC,
                                 GROUP)
            fence_async_shared()
            _warps_barrier()
            acc = warpgroup_mma(x_bufs.index(2 * s), dst.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(x_bufs.index(2 * s + 1), dst_hi.permute((1, 0)), acc, is_async=True)
            # One group in flight: the previous step's MMAs are done, so its stage and its
            # converted buffer (the one the next step writes) are free.
            acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((num_k - 1) % STAGES), count=1)

        out_layout: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [4, 1], [1, 0])
        offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
        row_ok = offs_m < rows_used
        offs_c = col0 + CID * BNC + gl.arange(0, BNC, layout=gl.SliceLayout(0, out_layout))
        if GATE_UP:
            gate, up = acc.reshape([BM, 2, BNC]).permute((0, 2, 1)).split()
            h = gate * (1.0 / (1.0 + gl.exp(-gate))) * up
            h = gl.convert_layout(h.to(out_ptr.dtype.element_ty), out_layout)
            rows = (row0 + offs_m).to(gl.int64)
            r = offs_c % 64
            q = r % 32
            pos = offs_c - r + (q // 16) * 32 + (r // 32) * 16 + q % 16
            gl.store(out_ptr + rows[:, None] * stride_om + pos[None, :], h, mask=row_ok[:, None])
        else:
            slot = gl.load(sorted_slot_ptr + row0 + offs_m, mask=row_ok, other=0)
            weight = gl.load(topk_w_ptr + slot, mask=row_ok, other=0.0)
            o = gl.convert_layout(acc, out_layout) * weight[:, None]
            gl.store(out_ptr + slot.to(gl.int64)[:, None] * stride_om + offs_c[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @gluon.jit
    def _consumer_0(x_bufs, w_bufs, wc_bufs, ready, empty, s_ptr, s_base_g, s_base_u, stride_sg, num_k, out_ptr,
                    stride_om, topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, BM: gl.constexpr,
                    BNC: gl.constexpr, GROUP: gl.constexpr, GATE_UP: gl.constexpr, STAGES: gl.constexpr,
                    SS: gl.constexpr):
        if SS:
            _consumer_ss(x_bufs, w_bufs, wc_bufs, ready, empty, s_ptr, s_base_g, s_base_u, stride_sg,
                         num_k, out_ptr, stride_om, topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, 0, BM,
                         BNC, GROUP, GATE_UP, STAGES)
        else:
            _consumer(x_bufs, w_bufs, ready, empty, s_ptr, s_base_g, s_base_u, stride_sg, num_k, out_ptr,
                      stride_om, topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, 0, BM, BNC, GROUP,
                      GATE_UP, STAGES)

    @gluon.jit
    def _consumer_1(x_bufs, w_bufs, wc_bufs, ready, empty, s_ptr, s_base_g, s_base_u, stride_sg, num_k, out_ptr,
                    stride_om, topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, BM: gl.constexpr,
                    BNC: gl.constexpr, GROUP: gl.constexpr, GATE_UP: gl.constexpr, STAGES: gl.constexpr,
                    SS: gl.constexpr):
        if SS:
            _consumer_ss(x_bufs, w_bufs, wc_bufs, ready, empty, s_ptr, s_base_g, s_base_u, stride_sg,
                         num_k, out_ptr, stride_om, topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, 1, BM,
                         BNC, GROUP, GATE_UP, STAGES)
        else:
            _consumer(x_bufs, w_bufs, ready, empty, s_ptr, s_base_g, s_base_u, stride_sg, num_k, out_ptr,
                      stride_om, topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, 1, BM, BNC, GROUP,
                      GATE_UP, STAGES)

    @gluon.jit
    def _ws_gemm_kernel(x_desc, w_desc, s_ptr, out_ptr, topk_w_ptr, sorted_slot_ptr, block_expert_ptr, block_rows_ptr,
                        K, N, stride_se, stride_sg, stride_om, w_row_groups,
                        BM: gl.constexpr, BNC: gl.constexpr, GROUP: gl.constexpr, GATE_UP: gl.constexpr,
                        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                        SS: gl.constexpr = False):
        """One block of BM sorted rows x 2 * BNC output columns (GEMM1: gate and up of each);
        see the module docstring."""
        BNH: gl.constexpr = 2 * BNC
        pid = gl.program_id(0)
        num_n = N // BNH
        pid_b = pid // num_n
        pid_n = pid % num_n
        rows_used = gl.load(block_rows_ptr + pid_b)
        if rows_used > 0:
            expert = gl.load(block_expert_ptr + pid_b).to(gl.int64)
            x_bufs = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES] + x_desc.block_type.shape, x_desc.layout)
            w_bufs = gl.allocate_shared_memory(w_desc.dtype, [2 * STAGES] + w_desc.block_type.shape, w_desc.layout)
            NR: gl.constexpr = 2 * BNC if GATE_UP else BNC
            WC_ROWS: gl.constexpr = NR if SS else 8
            wc_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WC_ROWS, 32], gl.bfloat16)
            # Per consumer: 2 buffers x (low, high) of converted weights (SS only; a token size otherwise).
            wc_bufs = gl.allocate_shared_memory(gl.bfloat16, [8, WC_ROWS, 32], wc_layout)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
                mbarrier.init(empty.index(i), count=2)
            row0 = pid_b * BM
            col0 = pid_n * BNH
            # w13's up rows start INTER (= N) rows after its gate rows.
            wrow_g = (expert * w_row_groups + col0 // 32).to(gl.int32)
            wrow_u = (expert * w_row_groups + (N + col0) // 32).to(gl.int32)
            s_base_g = expert * stride_se + col0
            s_base_u = s_base_g + N
            num_k = K // 64
            gl.warp_specialize([
                (_consumer_0, (x_bufs, w_bufs, wc_bufs, ready, empty, s_ptr, s_base_g, s_base_u, stride_sg, num_k, out_ptr,
                                stride_om, topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, BM, BNC, GROUP,
                                GATE_UP, STAGES, SS)),
                (_consumer_1, (x_bufs, w_bufs, wc_bufs, ready, empty, s_ptr, s_base_g, s_base_u, stride_sg, num_k, out_ptr,
                                stride_om, topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, BM, BNC, GROUP,
                                GATE_UP, STAGES, SS)),
                (_producer, (x_desc, w_desc, x_bufs, w_bufs, ready, empty, row0, wrow_g, wrow_u, num_k, GATE_UP,
                             STAGES)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


if GLUON_IMPORT_ERROR is None:
    try:
        _define_kernels()
    except Exception as exc:  # noqa: BLE001
        GLUON_IMPORT_ERROR = f"Gluon kernels not definable with this Triton ({type(exc).__name__}: {exc})"


# ---------------------------------------------------------------------------
# The host side
# ---------------------------------------------------------------------------


def _x_layout(bm: int):
    return gl.NVMMASharedLayout.get_default_for([bm, 32], gl.bfloat16)


def _w_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)


def weight_descriptor(linear: quant.PackedLinear, bnh: int):
    """The stored tiles [E, N/32, K/64, 32, 32] seen as [E * N/32, K/64 * 32, 32] bytes: a box of
    bnh/32 x 32 x 32 is one step's 32 bytes of bnh consecutive columns."""
    packed = linear.packed
    e, groups, blocks = packed.shape[0], packed.shape[1], packed.shape[2]
    view = packed.view(e * groups, blocks * 32, 32)
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [bnh // 32, 32, 32], _w_layout())


def rows_descriptor(rows: torch.Tensor, bm: int):
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [bm, 32], _x_layout(bm))


class GluonHopperPath:
    """The Gluon path's launches for one TritonW4A16MoE (its workspace and routing stages)."""

    dtypes = (torch.bfloat16,)

    def __init__(self, moe):
        self.moe = moe
        shape = moe.shape
        self.bm = GLUON_TILES["g1"]["bm"]
        assert GLUON_TILES["g2"]["bm"] == self.bm
        self.max_padded = tm._padded_rows(shape, moe.max_m, self.bm)
        device = moe._device
        self.block_expert = torch.empty(triton.cdiv(self.max_padded, self.bm), dtype=torch.int32, device=device)
        self.block_rows = torch.empty_like(self.block_expert)
        self._buffers: dict[torch.dtype, dict] = {}
        self.w13_desc = weight_descriptor(moe.weights.w13, 2 * GLUON_TILES["g1"]["bnc"])
        self.w2_desc = weight_descriptor(moe.weights.w2, 2 * GLUON_TILES["g2"]["bnc"])

    def buffers(self, dtype):
        if dtype not in self._buffers:
            shape = self.moe.shape
            xs = torch.zeros((self.max_padded, shape.hidden), dtype=dtype, device=self.moe._device)
            inter = torch.zeros((self.max_padded, shape.inter), dtype=dtype, device=self.moe._device)
            self._buffers[dtype] = dict(xs=xs, inter=inter, xs_desc=rows_descriptor(xs, self.bm),
                                        inter_desc=rows_descriptor(inter, self.bm))
        return self._buffers[dtype]

    def release_buffers(self) -> None:
        """Drop the gathered rows and the intermediate (made again on the next forward)."""
        self._buffers.clear()

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                stages: tuple = ("route", "g1", "g2", "sum")) -> torch.Tensor | None:
        """The forward; `stages` (a tuning script's) runs only some of its launches, each reading
        what the ones before it left in the workspace."""
        moe, shape, bm = self.moe, self.moe.shape, self.bm
        if x.dtype != torch.bfloat16:
            raise ValueError("the Gluon path takes bf16 activations")
        m = x.shape[0]
        if tm._padded_rows(shape, m, bm) > moe._max_padded:
            raise ValueError(f"M={m} needs more workspace than was allocated")
        blocks = triton.cdiv(tm._padded_rows(shape, m, bm), bm)
        buf = self.buffers(x.dtype)
        _, slot_buf = moe._buffers(x.dtype)
        if "route" in stages:
            moe._m = m
            moe._group_slots(topk_ids, bm)
            gather_bk = tm._largest_dividing(GATHER_BK, shape.hidden, 64)
            _gather_kernel[(blocks, shape.hidden // gather_bk)](
                x, buf["xs"], moe._sorted_slot, moe._counts, moe._starts, moe._ends, self.block_expert,
                self.block_rows, shape.experts, shape.hidden, x.stride(0), buf["xs"].stride(0),
                TOPK=shape.topk, BLOCK_M=bm, NUM_BINS=moe._num_bins, BK=gather_bk, num_warps=8)
        for which, desc_x, w, desc_w, out, n, k in (
                ("g1", buf["xs_desc"], moe.weights.w13, self.w13_desc, buf["inter"], shape.inter, shape.hidden),
                ("g2", buf["inter_desc"], moe.weights.w2, self.w2_desc, slot_buf, shape.hidden, shape.inter)):
            if which not in stages:
                continue
            tile = GLUON_TILES[which]
            bnh = 2 * tile["bnc"]
            _ws_gemm_kernel[(blocks * (n // bnh),)](
                desc_x, desc_w, w.scales, out, topk_weights, moe._sorted_slot, self.block_expert, self.block_rows,
                k, n, w.scales.stride(0), w.scales.stride(1), out.stride(0), w.packed.shape[1],
                BM=bm, BNC=tile["bnc"], GROUP=shape.group_size, GATE_UP=which == "g1", STAGES=tile["stages"],
                CONSUMER_REGS=tile.get("consumer_regs", 232), PRODUCER_REGS=tile.get("producer_regs", 40),
                SS=bool(tile.get("ss", False)), num_warps=4)
        moe._g2_split = 1
        return moe.topk_sum(x) if "sum" in stages else None
