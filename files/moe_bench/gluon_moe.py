"""The warp-specialised Hopper path of the W4A16 MoE forward, written in Gluon
(`triton.experimental.gluon`), for the tensor-core M range.

Where it applies (path_unavailable_reason says why not): Gluon importable with the API this
module is written against (Triton 3.6's: `gl.warp_specialize(functions_and_args,
worker_num_warps, worker_num_regs)`, Hopper's `warpgroup_mma`, `mbarrier`, `tma`), a GPU of
compute capability 9.0 (warp-group MMA and the tensor copy engine as used here exist on sm_90
alone: sm_100 has its own MMA, sm_80/89/120 have neither), and a shape whose K dimensions
are whole pairs of 64-value blocks and whose output columns divide into the tile
(shape_unavailable_reason).
Elsewhere the plain-Triton kernels of triton_moe run, and the results say which path ran
and why (TritonW4A16MoE.configs_used).

Per forward (M in the rows that take this path; the tiles by slots per expert, tiles_for):
  1. triton_moe's _align_kernel and _scatter_kernel group the slots by expert into blocks of
     BM rows (as the plain-Triton path does);
  2. _gather_kernel (plain Triton): each block's owner and row count, and the activation rows
     gathered into sorted order (contiguous loads, the operand order below made in registers,
     padded rows zero), so every block's rows are one contiguous tile the copy engine can fetch;
  3. _ws_gemm_kernel as GEMM1 (gate and up of w13, SiLU(gate) * up in the epilogue, stored in
     sorted order and in the same operand order for GEMM2), then as GEMM2 (w2, times each
     slot's top-k weight, stored per slot);
  4. triton_moe's _topk_sum_kernel.

_ws_gemm_kernel: a tile is (a block of BM sorted rows, 2 * BNC weight rows); one program a tile,
or (the tile's PERSISTENT) one program an SM taking every SM-count-th tile, its ring of stages
running on from one tile into the next (a tile of an unused block is skipped by every
partition alike). Three partitions: a producer warp that issues the copy-engine loads of each
64-value K step (the rows' two halves, the packed weight tiles and their scales) into a ring of
STAGES shared-memory buffers, each completing on its `ready` mbarrier, and two consumer warp groups, each owning BNC weight rows
(GEMM1: BNC gate and BNC up columns); both take the narrowest MMA width (a power of two from
the tile's NARROW up to BM, and with the tile's MID 3 BM / 4 as a BM / 2 and a BM / 4 wide
accumulator on the same converted weights) that holds the block's rows, and the producer
fetches only those rows. A consumer waits for a stage, loads its packed bytes with
one 8-byte shared-memory load per thread and row (byte_layout: 8 consecutive bytes, 16
weights, all of one 32-value scale group, so one scale per row and step), converts each
4-byte word with 15 instructions (_WORD_PTX: nibble to bf16 under the exponent of 128, minus
136, times the scale), relabels K so that the registers already are the warp-group MMA's
register operand (no data movement: the conversion's assert_trivial), and issues the MMAs with
the activations from shared memory. The K loop (_consume) takes the tile's UNROLL steps a
turn. At one (the bm64 tiles) each step is converted, its MMAs issued and waited for and its
stage released before the next: a warp group's conversions run beside the other consumer's
MMAs, not its own, and each stage is held for the least time (PERFORMANCE.md round 30). From
two (the bm128 tiles) it is software-pipelined on two operand sets: step i's MMAs run while step
i + 1's weights are converted, step i + 1's MMAs are queued behind them at once, and while those
run step i's alone are waited for, its stage released and step i + 2's weights converted into
the registers step i read (round 24); the turn ends with a wait for all its MMAs (MMAs in flight
across the back edge make ptxas serialise every one), and ptxas places most of the conversion
before that wait after it (round 30). The epilogue: GEMM1 stores SiLU(gate) * up from the accumulator's
layout (no layout change through shared memory: with one the bm128 tile spilled under the
tile loop, and 16 B under Triton 3.6 without it), GEMM2 weights and rounds in that layout and
stores through a layout change (stored from it, its 128 x 128 pointers spilled).

Operand order: a 64-value K block of the packed layout holds in its 32 bytes per column the
values 0-15 and 32-47 in the low nibbles and 16-31 and 48-63 in the high nibbles. A consumer
thread (lane t of a quad, bits t0 t1) holds bytes 8t..8t+7 of its rows, its register e (bits
e0 e1 e2) byte 8t + 4 e2 + 2 e0 + e1 (the word conversion pairs bytes 0 and 2, 1 and 3), which
the MMA's register layout puts at K position 16 e2 + 8 e1 + 4 t1 + 2 t0 + e0 of the step's
low-nibble (or high-nibble) half. The activations are stored to match (operand_positions:
K = 32 c + 16 h + 8 i3 + 4 i2 + 2 i1 + i0 of a block goes to position 32 h + 16 i2 + 8 i0 + 4 c
+ 2 i3 + i1): the gather for GEMM1, GEMM1's epilogue for GEMM2's operand, so a step's two MMAs
each take one contiguous 32-value half of the rows.
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

# A tile: BM sorted rows per block (the MMA's N), BNC weight rows per consumer warp group (the
# MMA's M; GEMM1 takes BNC gate and BNC up rows), STAGES shared-memory stages; CONSUMER_REGS and
# PRODUCER_REGS the registers each warp group asks for (setmaxnreg; 2 x 128 x consumer +
# 128 x producer within the SM's 65536); NARROW (a power of two, 0: off) the narrowest MMA:
# a block's MMAs are as wide as its rows used, rounded up to NARROW, 2 NARROW, ... BM, and only
# those rows are fetched (an expert's last block is mostly partly full: kimi-k2.6 M=8192, 171
# slots per expert, takes 128 + 64 instead of 256 MMA columns; PERFORMANCE.md, round 23); MID
# (with NARROW <= BM / 4) adds the width 3 BM / 4 (a BM / 2 and a BM / 4 wide accumulator pair on
# the same converted weights): at 64-85 slots per expert most blocks hold 65-96 rows and took
# 128 columns (kimi-k2.6 M=3072 / 4096 forward 5.0 / 6.6% faster, PERFORMANCE.md round 25; with
# the scales through the copy engine, round 27); PERSISTENT: one program an SM, each taking every
# SM-count-th tile, its ring of stages running on from one tile into the next, so the next
# tile's first loads overlap the last one's epilogue (kimi-k2.6 M=2048, bm64: GEMM1 4%, GEMM2 6%
# faster; the bm128 GEMM1 level or slower, its GEMM2 2-5% faster but spilling 8 B: PERFORMANCE.md
# round 27); without it one program a tile. The bm64 tiles narrowed to 16 (MMA widths 16, 32,
# 64): at 16-32 slots per expert most blocks hold at most 32 rows, and the forward was 3-16%
# faster than with every block 64 wide (kimi-k2.6 M=768-1536, deepseek-v3, qwen3-235b-a22b and
# mixtral-8x7b at 24-32; PERFORMANCE.md round 28); a 48-wide body (MID) was level at 43-48.
# UNROLL (a tile's "unroll"): the K steps a turn of the consumers' loop (_consume), 1, 2, 4 or
# 8. The bm64 tiles take one step a turn (each step's MMAs waited for before the next step's
# conversion): on an H100 the forward was 2-5% faster than at two steps a turn at 16-48 slots
# per expert on kimi-k2.6, qwen3-235b-a22b and mixtral-8x7b (level on deepseek-v3 and kimi-k2.6
# M=1024-2048 in one of two readings), GEMM1 alone at kimi-k2.6 M=768 4% faster with the
# memory 80% busy instead of 77% (its stages held for less time); four and eight steps a turn
# were 2-13% slower, and the bm128 tiles at one step 4% slower at M=3072 (PERFORMANCE.md
# round 30).
TILES_BM64 = {
    "g1": dict(bm=64, bnc=64, stages=4, persistent=True, narrow=16, unroll=1),
    "g2": dict(bm=64, bnc=128, stages=4, persistent=True, narrow=16, unroll=1),
}
TILES_BM128 = {
    "g1": dict(bm=128, bnc=64, stages=4, narrow=32),
    "g2": dict(bm=128, bnc=128, stages=4, narrow=32, mid=True),
}
# Tiles by slots per expert (M x topk / experts of the layer): (up to this many, tiles), the
# last row without a bound. 128 sorted rows per block from where the experts' blocks are full
# enough that the larger tile's weight reuse outweighs its padding: at 64 slots per expert bm128
# was 4-13% faster than bm64 on every preset measured, at 43 (kimi-k2.6 M=2048) 31% slower
# (PERFORMANCE.md, round 22).
GLUON_TILE_ROWS = [(48.0, TILES_BM64), (None, TILES_BM128)]
# K steps a turn of the consumers' loop where a tile does not say (unroll_for).
UNROLL = 2
# The smallest slots per expert at which this path can run (MOE_BENCH_GLUON=force): below it
# most of an expert's block would be padding even in the narrowest (16-wide) MMA. (Where the
# plain-Triton rule takes the one-row or block_m 8 kernels, this path never runs.)
MIN_SLOTS_PER_EXPERT = 8.0
# K values per program of the gather (a multiple of 64: whole operand-order blocks).
GATHER_BK = 128
# The slots per expert from which the backend picks this path by itself (None: never). Measured
# against the plain-Triton rows, one CUDA graph of 8 forwards each (tools/path_compare.py,
# PERFORMANCE.md round 28): with the bm64 tiles narrowed to 16, on the H200 faster at 16-48 slots
# per expert on every preset with a large intermediate (kimi-k2.6 M=768 / 1024 / 1536 / 2048 by
# 6 / 6 / 10 / 7%; at 24 and 32 deepseek-v3 8 / 11%, qwen3-235b-a22b 10 / 13%, mixtral-8x7b 24 /
# 21%), and beyond (rounds 22-27: 7-24% at 43-64); on an H100 below 16: kimi-k2.6 faster from
# 13 (6%), slower at 8-11 (3-12%), mixtral-8x7b faster from 8 (11-17%), deepseek-v3 and
# qwen3-235b-a22b slower at 8-20 (2-5% at 16-20). 16 keeps the larger gains and gives up 2-5% on
# two presets at 16-20. Before round 28 (every bm64 block 64 wide) it was slower at 24-32 and
# selected from 40.
# MOE_BENCH_GLUON=force runs it wherever it can run (measurement and tuning), MOE_BENCH_GLUON=0 never.
SELECT_SLOTS_PER_EXPERT: float | None = 16.0
# ... and from SELECT_SLOTS_PER_EXPERT_WIDE on layers whose intermediate is at least
# SELECT_WIDE_INTER (mixtral-8x7b's 14336: GEMM1 224 column tiles of 128 a block, GEMM2's K 14336).
# There the path was faster than the plain rows at every slots per expert it can run at: on an
# H100, mixtral-8x7b M=32 / 48 / 64 (8 / 12 / 16) by 11 / 13 / 17% (round 28) and M=32 / 48 by
# 11 / 13% again (round 29), where the layers with an intermediate of 1536-2048 were level or
# slower below 16-24 slots per expert (PERFORMANCE.md rounds 28-29).
SELECT_WIDE_INTER = 8192
SELECT_SLOTS_PER_EXPERT_WIDE: float | None = 8.0
# ... and only where the layer's intermediate (GEMM2's K) is at least this wide: with kimi-k2.6's
# --tp 8 shard (256: GEMM2 four K steps, GEMM1 two column tiles a block) the plain rows were
# faster at 64 slots per expert (1307 against 1574 us) and as fast at 85 (PERFORMANCE.md, round 23).
SELECT_MIN_INTER = 1024
NOT_SELECTED = ("not selected at this M: below {bound:g} slots per expert on this layer the plain-Triton "
                "kernels were as fast or faster (PERFORMANCE.md, rounds 22-24 and 28-29); MOE_BENCH_GLUON=force runs it")
NOT_SELECTED_NEVER = "not selected by default (SELECT_SLOTS_PER_EXPERT is None); MOE_BENCH_GLUON=force runs it"
NOT_SELECTED_SHAPE = (f"not selected for this layer: with an intermediate under {SELECT_MIN_INTER} columns the "
                      "plain-Triton kernels are as fast or faster on the H200 (PERFORMANCE.md, round 23); "
                      "MOE_BENCH_GLUON=force runs it")


def select_slots_per_expert(shape: quant.MoEShape) -> float | None:
    """The slots per expert from which the path is picked on this layer (None: never, unless
    forced): SELECT_SLOTS_PER_EXPERT, or SELECT_SLOTS_PER_EXPERT_WIDE on a layer with an
    intermediate of at least SELECT_WIDE_INTER."""
    if SELECT_SLOTS_PER_EXPERT is None:
        return None
    if shape.inter >= SELECT_WIDE_INTER and SELECT_SLOTS_PER_EXPERT_WIDE is not None:
        return SELECT_SLOTS_PER_EXPERT_WIDE
    return SELECT_SLOTS_PER_EXPERT


def slots_per_expert(shape: quant.MoEShape, m: int) -> float:
    return m * shape.topk / shape.experts


def tiles_for(shape: quant.MoEShape, m: int) -> dict:
    """The tiles (GLUON_TILE_ROWS) for M on this layer."""
    spe = slots_per_expert(shape, m)
    for bound, tiles in GLUON_TILE_ROWS:
        if bound is None or spe <= bound:
            return tiles
    raise ValueError("GLUON_TILE_ROWS has no unbounded last row")


def tile_sets() -> list[dict]:
    """Every distinct tile set of GLUON_TILE_ROWS (what the compile check builds)."""
    out = []
    for _, tiles in GLUON_TILE_ROWS:
        if tiles not in out:
            out.append(tiles)
    return out


def max_block_m(shape: quant.MoEShape, max_m: int) -> int:
    """The largest block any M up to max_m runs with (the workspace's padding): every row up to
    and including max_m's."""
    spe = slots_per_expert(shape, max_m)
    bms = []
    for bound, tiles in GLUON_TILE_ROWS:
        bms.append(tiles["g1"]["bm"])
        if bound is None or spe <= bound:
            break
    return max(bms)


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
        if k % 128:
            return f"{which}'s K={k} is not a multiple of 128 (the K loop takes two 64-value steps a turn)"
        for tiles in tile_sets():
            columns = 2 * tiles["g1" if gate_up else "g2"]["bnc"]
            if n % columns:
                return f"{which}'s N={n} is not a multiple of its tile's {columns} columns"
    if shape.group_size % 32:
        return f"group size {shape.group_size} is not a multiple of 32"
    return None


def can_run_at(shape: quant.MoEShape, m: int) -> bool:
    """Whether M is in the range this path can run for (slots per expert)."""
    return slots_per_expert(shape, m) >= MIN_SLOTS_PER_EXPERT


def not_selected_reason(shape: quant.MoEShape, m: int, env: dict | None = None) -> str | None:
    """Why the path is not picked at this M where it can run (None: it is): below
    the layer's slots per expert (select_slots_per_expert) or SELECT_MIN_INTER intermediate
    columns, unless MOE_BENCH_GLUON=force."""
    env = os.environ if env is None else env
    if env.get("MOE_BENCH_GLUON", "") == "force":
        return None
    bound = select_slots_per_expert(shape)
    if bound is None:
        return NOT_SELECTED_NEVER
    if slots_per_expert(shape, m) < bound:
        return NOT_SELECTED.format(bound=bound)
    if shape.inter < SELECT_MIN_INTER:
        return NOT_SELECTED_SHAPE
    return None


def selected(shape: quant.MoEShape, m: int, env: dict | None = None) -> bool:
    """Whether the path is picked at this M where it can run (not_selected_reason)."""
    return not_selected_reason(shape, m, env) is None


# ---------------------------------------------------------------------------
# The gather (plain Triton)
# ---------------------------------------------------------------------------


def operand_positions(k: int) -> list[int]:
    """For each K index 0..k-1 (k a multiple of 64), its position in the operand order (the
    gathered rows' and the intermediate's): _operand_pos on the host, for tests and tools."""
    out = []
    for kk in range(k):
        r = kk % 64
        i0, i1, i2, i3, h, c = [(r >> s) & 1 for s in range(6)]
        out.append(kk - r + 32 * h + 16 * i2 + 8 * i0 + 4 * c + 2 * i3 + i1)
    return out


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
    # Contiguous (vectorised) loads of each row's K range, the operand order made in registers:
    # per 64-value block K = 32 c + 16 h + 8 i3 + 4 i2 + 2 i1 + i0 goes to position
    # 32 h + 16 i2 + 8 i0 + 4 c + 2 i3 + i1 (operand_positions), then a contiguous store. (A load
    # through the permuted indices instead cannot be vectorised: one 2-byte load per value, about
    # 6x slower at kimi-k2.6's M=8192, PERFORMANCE.md round 22.)
    vals = tl.load(x_ptr + token[:, None] * stride_xm + offs_k[None, :], mask=row_ok[:, None], other=0.0)
    vals = tl.reshape(vals, [BLOCK_M, BK // 64, 2, 2, 2, 2, 2, 2])  # c, h, i3, i2, i1, i0
    vals = tl.reshape(tl.permute(vals, (0, 1, 3, 5, 7, 2, 4, 6)), [BLOCK_M, BK])  # h, i2, i0, c, i3, i1
    rows = (pid_b * BLOCK_M + offs_m).to(tl.int64)
    tl.store(out_ptr + rows[:, None] * stride_om + offs_k[None, :], vals)


# ---------------------------------------------------------------------------
# The warp-specialised GEMM (Gluon)
# ---------------------------------------------------------------------------

# Four packed bytes ($4) and their scale ($5, bf16x2; $6, the same) -> the low nibbles' weights
# ($0: bytes 0 and 2, $1: bytes 1 and 3) and the high nibbles' ($2, $3), (u - 8) * s in bf16
# (exact before the one rounding): a nibble written under the bf16 exponent of 128 reads as
# 128 + u, one fma subtracts 136, one multiplies by the scale. 15 instructions for 8 weights.
_WORD_PTX = (
    "{ .reg .b32 t1, t2, t3, a, b, c, d, one, off, mz;\n"
    "mov.b32 one, 0x3F803F80;\n"
    "mov.b32 off, 0xC308C308;\n"
    "mov.b32 mz, 0x80008000;\n"
    "shr.b32 t1, $4, 4;\n"
    "shr.b32 t2, $4, 8;\n"
    "shr.b32 t3, $4, 12;\n"
    "lop3.b32 a, $4, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 b, t2, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 c, t1, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 d, t3, 0x000F000F, 0x43004300, 0xEA;\n"
    "fma.rn.bf16x2 a, a, one, off;\n"
    "fma.rn.bf16x2 b, b, one, off;\n"
    "fma.rn.bf16x2 c, c, one, off;\n"
    "fma.rn.bf16x2 d, d, one, off;\n"
    "fma.rn.bf16x2 $0, a, $5, mz;\n"
    "fma.rn.bf16x2 $1, b, $5, mz;\n"
    "fma.rn.bf16x2 $2, c, $5, mz;\n"
    "fma.rn.bf16x2 $3, d, $5, mz; }")


def unroll_for(tile: dict, k: int) -> int:
    """The K steps a turn of the consumers' loop for a GEMM with this K: the tile's "unroll"
    (UNROLL where it does not say; a power of two), halved until it divides the K / 64 steps
    (an even number, shape_unavailable_reason: from 2 it stops at 2 at the latest)."""
    unroll = tile.get("unroll", UNROLL)
    if not isinstance(unroll, int) or unroll < 1 or unroll & (unroll - 1):
        raise ValueError(f"unroll {unroll} is not a power of two (1, 2, 4, ...)")
    while (k // 64) % unroll:
        unroll //= 2
    return unroll


def byte_layout(rows: int, transposed: bool = False):
    """The layout a consumer warp group loads its [rows, 2, 16] packed bytes in (per row: the
    step's 32 bytes as two 16-byte chunks, one scale group each): each thread holds 8
    consecutive bytes (one 8-byte shared-memory load) of rows r and r + 8 of its warp's 16, the
    lanes as the warp-group MMA's register operand has them (lane % 4 along K, lane / 4 along
    the rows), so that after the conversion a relabelling of K (no data movement) gives that
    operand's layout. transposed: the same with the first two dimensions swapped ([2, rows,
    16]: how the stage's scales, [2, rows] per consumer, are loaded before their relabelling)."""
    reg = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0]] + [[64 * (1 << i), 0, 0] for i in range((rows // 64).bit_length() - 1)]
    lane = [[0, 0, 8], [0, 1, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    warp = [[16, 0, 0], [32, 0, 0]]
    shape = [rows, 2, 16]
    if transposed:
        reg, lane, warp = ([[b[1], b[0], b[2]] for b in bases] for bases in (reg, lane, warp))
        shape = [2, rows, 16]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[], shape=shape)


def _define_kernels():
    """The Gluon kernels, defined only where Gluon imports (a version whose names differ
    leaves GLUON_IMPORT_ERROR saying so instead of failing the payload's import)."""
    global _tma_load, _WORD, _convert, _mmas, _wait, _weights, _stage_scales, _producer, _producer_at, _produce_tile, _produce, _consumer, _consumer_at, _consume_tile, _consume, _consumer_0, _consumer_1, _ws_gemm_kernel
    # The copy-engine load is tma.async_copy_global_to_shared in Triton 3.6, tma.async_load later.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _WORD = gl.constexpr(_WORD_PTX)

    @gluon.jit
    def _convert(w_rows, s2, BYTE_L: gl.constexpr, A_L: gl.constexpr, R: gl.constexpr):
        """A consumer's R rows of a stage's packed bytes (w_rows: shared memory, [R, 2, 16] uint8)
        and their scales (s2: [R, 2], one per row and 32-value chunk) -> the weights of the low
        and of the high nibbles as the MMA's register operands ([R, 32] bf16 each, in A_L)."""
        p = w_rows.load(BYTE_L)
        s = gl.expand_dims(s2, 2).broadcast_to([R, 2, 16])
        lo, hi = gl.inline_asm_elementwise(_WORD, "=r,=r,=r,=r,r,r,r", [p, s], dtype=(gl.bfloat16, gl.bfloat16),
                                           is_pure=True, pack=4)
        # Register e (bits e0 e1 e2) of lane t (t0 t1) holds byte 8 t + 4 e2 + 2 e0 + e1's nibble
        # (the asm pairs bytes 0 and 2, 1 and 3); as K position 16 e2 + 8 e1 + 4 t1 + 2 t0 + e0
        # that is the register operand's layout, so the conversion below moves nothing.
        lo = lo.reshape([R, 2, 2, 2, 2, 2]).permute((0, 3, 4, 1, 2, 5)).reshape([R, 32])
        hi = hi.reshape([R, 2, 2, 2, 2, 2]).permute((0, 3, 4, 1, 2, 5)).reshape([R, 32])
        return gl.convert_layout(lo, A_L, assert_trivial=True), gl.convert_layout(hi, A_L, assert_trivial=True)

    @gluon.jit
    def _producer(x_desc, x_desc2, x_desc4, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, block_rows_ptr,
                  block_expert_ptr, first, step, num_tiles, num_n, N, w_row_groups, num_k, BM: gl.constexpr,
                  BNH: gl.constexpr, GATE_UP: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
                  NARROW: gl.constexpr, MID: gl.constexpr, PERSISTENT: gl.constexpr):
        """The copy-engine loads of this program's tiles: PERSISTENT, tiles first, first + step, ...,
        the ring of stages running on from one tile into the next (so the next tile's first steps
        load while the consumers store the last one's results); else tile first alone."""
        if PERSISTENT:
            base = 0
            for t in range(first, num_tiles, step):
                base = _producer_at(x_desc, x_desc2, x_desc4, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty,
                                    block_rows_ptr, block_expert_ptr, t, base, num_n, N, w_row_groups, num_k, BM, BNH,
                                    GATE_UP, STAGES, GROUP, NARROW, MID)
        else:
            _producer_at(x_desc, x_desc2, x_desc4, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty,
                         block_rows_ptr, block_expert_ptr, first, 0, num_n, N, w_row_groups, num_k, BM, BNH, GATE_UP,
                         STAGES, GROUP, NARROW, MID)

    @gluon.jit
    def _producer_at(x_desc, x_desc2, x_desc4, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, block_rows_ptr,
                     block_expert_ptr, t, base, num_n, N, w_row_groups, num_k, BM: gl.constexpr, BNH: gl.constexpr,
                     GATE_UP: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, NARROW: gl.constexpr,
                     MID: gl.constexpr):
        """Tile t's loads from ring position base on (none for a tile past the used blocks); the
        ring position after them."""
        pid_b = t // num_n
        rows_used = gl.load(block_rows_ptr + pid_b)
        if rows_used > 0:
            expert = gl.load(block_expert_ptr + pid_b)
            col0 = (t % num_n) * BNH
            # w13's up rows start INTER (= N) rows after its gate rows.
            wrow_g = expert * w_row_groups + col0 // 32
            wrow_u = expert * w_row_groups + (N + col0) // 32
            _produce_tile(x_desc, x_desc2, x_desc4, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty,
                          pid_b * BM, rows_used, wrow_g, wrow_u, expert, col0, N + col0, base, num_k, BM, GATE_UP,
                          STAGES, GROUP, NARROW, MID)
        return base + num_k * (rows_used > 0).to(gl.int32)

    @gluon.jit
    def _produce_tile(x_desc, x_desc2, x_desc4, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, row0,
                      rows_used, wrow_g, wrow_u, expert, scol_g, scol_u, base, num_k, BM: gl.constexpr,
                      GATE_UP: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, NARROW: gl.constexpr,
                      MID: gl.constexpr):
        """One tile's copy-engine loads (its steps from ring position base on); of the activations
        only the rows the consumers' MMAs read (the width _consumer picks: x_desc2 and x_desc4 fetch
        BM / 2 and BM / 4 rows; MID: 3 BM / 4 as the two, one after the other)."""
        if (NARROW > 0) & (NARROW <= BM // 4):
            if rows_used <= BM // 4:
                _produce(x_desc4, x_desc4, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, row0, wrow_g, wrow_u,
                         expert, scol_g, scol_u, base, num_k, BM // 4, 0, GATE_UP, STAGES, GROUP)
            elif rows_used <= BM // 2:
                _produce(x_desc2, x_desc2, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, row0, wrow_g, wrow_u,
                         expert, scol_g, scol_u, base, num_k, BM // 2, 0, GATE_UP, STAGES, GROUP)
            elif MID:
                if rows_used <= 3 * BM // 4:
                    _produce(x_desc2, x_desc4, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, row0, wrow_g,
                             wrow_u, expert, scol_g, scol_u, base, num_k, BM // 2, BM // 4, GATE_UP, STAGES, GROUP)
                else:
                    _produce(x_desc, x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, row0, wrow_g,
                             wrow_u, expert, scol_g, scol_u, base, num_k, BM, 0, GATE_UP, STAGES, GROUP)
            else:
                _produce(x_desc, x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, row0, wrow_g, wrow_u,
                         expert, scol_g, scol_u, base, num_k, BM, 0, GATE_UP, STAGES, GROUP)
        elif (NARROW > 0) & (NARROW <= BM // 2):
            if rows_used <= BM // 2:
                _produce(x_desc2, x_desc2, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, row0, wrow_g, wrow_u,
                         expert, scol_g, scol_u, base, num_k, BM // 2, 0, GATE_UP, STAGES, GROUP)
            else:
                _produce(x_desc, x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, row0, wrow_g, wrow_u,
                         expert, scol_g, scol_u, base, num_k, BM, 0, GATE_UP, STAGES, GROUP)
        else:
            _produce(x_desc, x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, row0, wrow_g, wrow_u,
                     expert, scol_g, scol_u, base, num_k, BM, 0, GATE_UP, STAGES, GROUP)

    @gluon.jit
    def _produce(x_desc, x_desc_b, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, row0, wrow_g, wrow_u,
                 expert, scol_g, scol_u, base, num_k, NE: gl.constexpr, NE2: gl.constexpr, GATE_UP: gl.constexpr,
                 STAGES: gl.constexpr, GROUP: gl.constexpr):
        """Each K step's loads, completing on the stage's `ready`: the rows' two 32-value halves
        (x_desc's NE rows into the first NE rows of the stage, and where NE2 > 0 x_desc_b's NE2
        rows after them), the packed weight tiles and their scales (the two groups from the
        step's first value on: with groups of 32 the step's two; the copy engine writes zeros
        past the tensor's end)."""
        X_BYTES: gl.constexpr = x_desc.block_type.nbytes + (x_desc_b.block_type.nbytes if NE2 > 0 else 0)
        W_BYTES: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes
        W_COPIES: gl.constexpr = 2 if GATE_UP else 1
        NBYTES: gl.constexpr = 2 * X_BYTES + W_COPIES * W_BYTES
        for i in range(num_k):
            s = (base + i) % STAGES
            # A fresh barrier is in phase 0: waiting for parity 1 passes at once (the first lap).
            mbarrier.wait(empty.index(s), (((base + i) // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, NBYTES)
            _tma_load(x_desc, [row0, i * 64], bar, x_bufs.index(2 * s).slice(0, NE, 0))
            _tma_load(x_desc, [row0, i * 64 + 32], bar, x_bufs.index(2 * s + 1).slice(0, NE, 0))
            if NE2 > 0:
                _tma_load(x_desc_b, [row0 + NE, i * 64], bar, x_bufs.index(2 * s).slice(NE, NE2, 0))
                _tma_load(x_desc_b, [row0 + NE, i * 64 + 32], bar, x_bufs.index(2 * s + 1).slice(NE, NE2, 0))
            _tma_load(w_desc, [wrow_g, i * 32, 0], bar, w_bufs.index(2 * s))
            _tma_load(s_desc, [expert, (i * 64) // GROUP, scol_g], bar, s_bufs.index(2 * s))
            if GATE_UP:
                _tma_load(w_desc, [wrow_u, i * 32, 0], bar, w_bufs.index(2 * s + 1))
                _tma_load(s_desc, [expert, (i * 64) // GROUP, scol_u], bar, s_bufs.index(2 * s + 1))

    @gluon.jit
    def _mmas(wl, wh, ul, uh, acc_g, acc_u, acc_g2, acc_u2, x_bufs, j, STAGES: gl.constexpr, GATE_UP: gl.constexpr,
              NE: gl.constexpr, NE2: gl.constexpr):
        """Step i's MMAs (asynchronous) on the converted operands and the stage's first NE rows
        (and, where NE2 > 0, the NE2 rows after them into the second accumulators: one converted
        operand feeds both); j: the step's position in the ring."""
        s = j % STAGES
        xl = x_bufs.index(2 * s).slice(0, NE, 0).permute((1, 0))
        xh = x_bufs.index(2 * s + 1).slice(0, NE, 0).permute((1, 0))
        acc_g = warpgroup_mma(wl, xl, acc_g, is_async=True)
        acc_g = warpgroup_mma(wh, xh, acc_g, is_async=True)
        if NE2 > 0:
            xl2 = x_bufs.index(2 * s).slice(NE, NE2, 0).permute((1, 0))
            xh2 = x_bufs.index(2 * s + 1).slice(NE, NE2, 0).permute((1, 0))
            acc_g2 = warpgroup_mma(wl, xl2, acc_g2, is_async=True)
            acc_g2 = warpgroup_mma(wh, xh2, acc_g2, is_async=True)
        if GATE_UP:
            acc_u = warpgroup_mma(ul, xl, acc_u, is_async=True)
            acc_u = warpgroup_mma(uh, xh, acc_u, is_async=True)
            if NE2 > 0:
                acc_u2 = warpgroup_mma(ul, xl2, acc_u2, is_async=True)
                acc_u2 = warpgroup_mma(uh, xh2, acc_u2, is_async=True)
        return acc_g, acc_u, acc_g2, acc_u2

    @gluon.jit
    def _weights(base, i, w_bufs, s_bufs, ready, num_k, CID: gl.constexpr, BNC: gl.constexpr, GATE_UP: gl.constexpr,
                 STAGES: gl.constexpr, GROUP: gl.constexpr, BYTE_L: gl.constexpr, BYTE_T: gl.constexpr,
                 A_L: gl.constexpr):
        """Step i's weights (when it has arrived; i >= num_k: a stale stage, never used)
        converted with their scales (from the same stage: one per row and 32-value chunk)."""
        BNH: gl.constexpr = 2 * BNC
        s = (base + i) % STAGES
        mbarrier.wait(ready.index(s), ((base + i) // STAGES) & 1, pred=i < num_k)
        sg = _stage_scales(s_bufs.index(2 * s), CID, BNC, GROUP, BYTE_L, BYTE_T)
        nl, nh = _convert(w_bufs.index(2 * s).reshape([BNH, 2, 16]).slice(CID * BNC, BNC, 0), sg, BYTE_L, A_L, BNC)
        ml, mh = nl, nh
        if GATE_UP:
            su = _stage_scales(s_bufs.index(2 * s + 1), CID, BNC, GROUP, BYTE_L, BYTE_T)
            ml, mh = _convert(w_bufs.index(2 * s + 1).reshape([BNH, 2, 16]).slice(CID * BNC, BNC, 0), su, BYTE_L,
                              A_L, BNC)
        return nl, nh, ml, mh

    @gluon.jit
    def _stage_scales(tile, CID: gl.constexpr, BNC: gl.constexpr, GROUP: gl.constexpr, BYTE_L: gl.constexpr,
                      BYTE_T: gl.constexpr):
        """A consumer's BNC rows of a stage's scale tile ([1, 2, BNH]: the two groups from the
        step's first value on, zero past the tensor's end) as [BNC, 2], one per row and 32-value
        chunk: with groups of 32 one group per chunk, larger groups the first for both."""
        BNH: gl.constexpr = 2 * BNC
        s_layout: gl.constexpr = gl.SliceLayout(2, BYTE_L)
        rows = tile.reshape([2, BNH]).slice(CID * BNC, BNC, 1)
        if GROUP == 32:
            # Loaded as stored ([2, BNC]) in s_layout's transpose, then relabelled (no data
            # movement).
            t = rows.load(gl.SliceLayout(2, BYTE_T))
            s2 = gl.convert_layout(gl.permute(t, (1, 0)), s_layout, assert_trivial=True)
        else:
            s1 = rows.index(0).load(gl.SliceLayout(1, s_layout))
            s2 = gl.expand_dims(s1, 1).broadcast_to([BNC, 2])
        return s2

    @gluon.jit
    def _consumer(x_bufs, w_bufs, ready, empty, s_bufs, num_k, out_ptr, stride_om, topk_w_ptr, sorted_slot_ptr,
                  block_rows_ptr, first, step, num_tiles, num_n, CID: gl.constexpr, BM: gl.constexpr,
                  BNC: gl.constexpr, GROUP: gl.constexpr, GATE_UP: gl.constexpr, STAGES: gl.constexpr,
                  BYTE_L: gl.constexpr, BYTE_T: gl.constexpr, NARROW: gl.constexpr, MID: gl.constexpr,
                  PERSISTENT: gl.constexpr, UNROLL: gl.constexpr):
        """A consumer warp group's tiles, as _producer takes them."""
        if PERSISTENT:
            base = 0
            for t in range(first, num_tiles, step):
                base = _consumer_at(x_bufs, w_bufs, ready, empty, s_bufs, num_k, out_ptr, stride_om, topk_w_ptr,
                                    sorted_slot_ptr, block_rows_ptr, t, base, num_n, CID, BM, BNC, GROUP, GATE_UP,
                                    STAGES, BYTE_L, BYTE_T, NARROW, MID, UNROLL)
        else:
            _consumer_at(x_bufs, w_bufs, ready, empty, s_bufs, num_k, out_ptr, stride_om, topk_w_ptr, sorted_slot_ptr,
                         block_rows_ptr, first, 0, num_n, CID, BM, BNC, GROUP, GATE_UP, STAGES, BYTE_L, BYTE_T, NARROW,
                         MID, UNROLL)

    @gluon.jit
    def _consumer_at(x_bufs, w_bufs, ready, empty, s_bufs, num_k, out_ptr, stride_om, topk_w_ptr, sorted_slot_ptr,
                     block_rows_ptr, t, base, num_n, CID: gl.constexpr, BM: gl.constexpr, BNC: gl.constexpr,
                     GROUP: gl.constexpr, GATE_UP: gl.constexpr, STAGES: gl.constexpr, BYTE_L: gl.constexpr,
                     BYTE_T: gl.constexpr, NARROW: gl.constexpr, MID: gl.constexpr, UNROLL: gl.constexpr):
        """Tile t with its steps from ring position base on (nothing for a tile past the used
        blocks); the ring position after it."""
        pid_b = t // num_n
        rows_used = gl.load(block_rows_ptr + pid_b)
        if rows_used > 0:
            _consume_tile(x_bufs, w_bufs, ready, empty, s_bufs, base, num_k, out_ptr, stride_om, topk_w_ptr,
                          sorted_slot_ptr, pid_b * BM, rows_used, (t % num_n) * (2 * BNC), CID, BM, BNC, GROUP,
                          GATE_UP, STAGES, BYTE_L, BYTE_T, NARROW, MID, UNROLL)
        return base + num_k * (rows_used > 0).to(gl.int32)

    @gluon.jit
    def _consume_tile(x_bufs, w_bufs, ready, empty, s_bufs, base, num_k, out_ptr, stride_om,
                      topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, CID: gl.constexpr, BM: gl.constexpr,
                      BNC: gl.constexpr, GROUP: gl.constexpr, GATE_UP: gl.constexpr, STAGES: gl.constexpr,
                      BYTE_L: gl.constexpr, BYTE_T: gl.constexpr, NARROW: gl.constexpr, MID: gl.constexpr,
                      UNROLL: gl.constexpr):
        """A consumer's block: its MMAs as wide as the block's rows need. NARROW > 0 (a power of
        two): the rows used rounded up to NARROW, 2 NARROW, 4 NARROW, ... BM (a tensor's sizes
        are powers of two), each width its own compiled body; MID (with NARROW <= BM / 4): also
        3 BM / 4, as a BM / 2 and a BM / 4 wide accumulator on the same converted weights; 0:
        always BM."""
        if NARROW == 0:
            _consume(x_bufs, w_bufs, ready, empty, s_bufs, base, num_k, out_ptr, stride_om,
                     topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, CID, BM, 0, BNC, GROUP, GATE_UP, STAGES,
                     BYTE_L, BYTE_T, UNROLL)
        else:
            MID_ON: gl.constexpr = MID & (NARROW <= BM // 4)
            for j in gl.static_range(BM.bit_length() - NARROW.bit_length() + 1):
                # width NARROW << j from just over the width below it (with MID, the full width
                # from just over 3 BM / 4)
                if ((rows_used > ((3 * BM // 4) if (MID_ON & ((NARROW << j) == BM)) else (NARROW << j) // 2))
                        | (j == 0)) & (rows_used <= (NARROW << j)):
                    _consume(x_bufs, w_bufs, ready, empty, s_bufs, base, num_k, out_ptr,
                             stride_om, topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, CID, NARROW << j, 0,
                             BNC, GROUP, GATE_UP, STAGES, BYTE_L, BYTE_T, UNROLL)
            if MID_ON:
                if (rows_used > BM // 2) & (rows_used <= 3 * BM // 4):
                    _consume(x_bufs, w_bufs, ready, empty, s_bufs, base, num_k, out_ptr,
                             stride_om, topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, CID, BM // 2, BM // 4,
                             BNC, GROUP, GATE_UP, STAGES, BYTE_L, BYTE_T, UNROLL)

    @gluon.jit
    def _epilogue(acc_g, acc_u, out_ptr, stride_om, topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0,
                  CID: gl.constexpr, BNC: gl.constexpr, NE: gl.constexpr, GATE_UP: gl.constexpr):
        """An accumulator pair's NE rows (from row0 of the sorted rows; rows_used of them real)
        stored: GEMM1 SiLU(gate) * up in GEMM2's operand order, GEMM2 times each slot's top-k
        weight, per slot."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, NE, 16])
        if GATE_UP:
            # Stored from the accumulator's layout (no layout change through shared memory).
            h = (acc_g * (1.0 / (1.0 + gl.exp(-acc_g))) * acc_u).to(out_ptr.dtype.element_ty)
            offs_o = col0 + CID * BNC + gl.arange(0, BNC, layout=gl.SliceLayout(1, mma_layout))
            offs_m = gl.arange(0, NE, layout=gl.SliceLayout(0, mma_layout))
            row_ok = offs_m < rows_used
            rows = (row0 + offs_m).to(gl.int64)
            # Stored in GEMM2's operand order (its K is this GEMM's N; operand_positions).
            r = offs_o % 64
            pos = (offs_o - r + 32 * ((r >> 4) & 1) + 16 * ((r >> 2) & 1) + 8 * (r & 1) + 4 * ((r >> 5) & 1)
                   + 2 * ((r >> 3) & 1) + ((r >> 1) & 1))
            gl.store(out_ptr + rows[None, :] * stride_om + pos[:, None], h, mask=row_ok[None, :])
        else:
            # Weighted and rounded in the accumulator's layout, so only bf16 values change layout
            # (at BM 128, BNC 128 the float32 conversion would not fit the registers).
            out_layout: gl.constexpr = gl.BlockedLayout([2, 1], [32, 1], [1, 4], [0, 1])
            offs_o = col0 + CID * BNC + gl.arange(0, BNC, layout=gl.SliceLayout(1, out_layout))
            offs_m = gl.arange(0, NE, layout=gl.SliceLayout(0, out_layout))
            row_ok = offs_m < rows_used
            offs_w = gl.arange(0, NE, layout=gl.SliceLayout(0, mma_layout))
            w_ok = offs_w < rows_used
            weight = gl.load(topk_w_ptr + gl.load(sorted_slot_ptr + row0 + offs_w, mask=w_ok, other=0), mask=w_ok,
                             other=0.0)
            o = gl.convert_layout((acc_g * weight[None, :]).to(out_ptr.dtype.element_ty), out_layout)
            slot = gl.load(sorted_slot_ptr + row0 + offs_m, mask=row_ok, other=0)
            gl.store(out_ptr + slot.to(gl.int64)[None, :] * stride_om + offs_o[:, None], o, mask=row_ok[None, :])

    @gluon.jit
    def _wait(acc_g, acc_u, acc_g2, acc_u2, o0, o1, o2, o3, N: gl.constexpr, GATE_UP: gl.constexpr,
              BM2: gl.constexpr):
        """warpgroup_mma_wait(N) over the accumulators in use and one operand set (GEMM2: the
        first two; the up operands are placeholders there)."""
        if GATE_UP:
            if BM2 > 0:
                acc_g, acc_u, acc_g2, acc_u2, o0, o1, o2, o3 = warpgroup_mma_wait(
                    num_outstanding=N, deps=(acc_g, acc_u, acc_g2, acc_u2, o0, o1, o2, o3))
            else:
                acc_g, acc_u, o0, o1, o2, o3 = warpgroup_mma_wait(num_outstanding=N,
                                                                  deps=(acc_g, acc_u, o0, o1, o2, o3))
        else:
            if BM2 > 0:
                acc_g, acc_g2, o0, o1 = warpgroup_mma_wait(num_outstanding=N, deps=(acc_g, acc_g2, o0, o1))
            else:
                acc_g, o0, o1 = warpgroup_mma_wait(num_outstanding=N, deps=(acc_g, o0, o1))
        return acc_g, acc_u, acc_g2, acc_u2, o0, o1, o2, o3

    @gluon.jit
    def _consume(x_bufs, w_bufs, ready, empty, s_bufs, base, num_k, out_ptr, stride_om,
                 topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, CID: gl.constexpr, BM: gl.constexpr,
                 BM2: gl.constexpr, BNC: gl.constexpr, GROUP: gl.constexpr, GATE_UP: gl.constexpr,
                 STAGES: gl.constexpr, BYTE_L: gl.constexpr, BYTE_T: gl.constexpr, UNROLL: gl.constexpr):
        """The consumer's K loop and epilogue on the first BM rows of its block (the MMA's N), and
        where BM2 > 0 on the BM2 rows after them too (a second pair of accumulators)."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        # (BM2 == 0: the second pair is a placeholder no MMA touches.)
        BM2_ALLOC: gl.constexpr = BM2 if BM2 > 0 else 8
        mma_layout2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, BM2_ALLOC, 16])
        # Each warpgroup_mma is one commit group: a step's count.
        GROUPS: gl.constexpr = (2 if GATE_UP else 1) * (4 if BM2 > 0 else 2)
        acc_g = gl.zeros([BNC, BM], gl.float32, mma_layout)
        acc_u = gl.zeros([BNC, BM], gl.float32, mma_layout)
        acc_g2 = gl.zeros([BNC, BM2_ALLOC], gl.float32, mma_layout2)
        acc_u2 = gl.zeros([BNC, BM2_ALLOC], gl.float32, mma_layout2)
        # UNROLL == 1: one step a turn, its weights converted, its MMAs issued and waited for,
        # its stage released (this warp group's conversions never beside its own MMAs; the other
        # consumer's run beside them). Otherwise software-pipelined, UNROLL steps a turn on two
        # operand sets: step i's MMAs run while
        # step i + 1's weights are converted, step i + 1's are issued behind them at once (so
        # the tensor cores keep this warp group's work queued), then the wait for step i's alone,
        # its stage released, and step i + 2's weights converted into the registers it read
        # while step i + 1's run, and so on; the turn ends with the wait for its last step's
        # MMAs (none stays in flight across the back edge: ptxas would serialise every MMA,
        # its C7512). ptxas places the conversion before that last wait after it, so one
        # conversion a turn runs with none of this warp group's MMAs in flight (PERFORMANCE.md
        # round 30). The operands of the MMAs in flight stay live (passed to the waits) so
        # nothing overwrites them early.
        if UNROLL == 1:
            for i in range(0, num_k):
                wl, wh, ul, uh = _weights(base, i, w_bufs, s_bufs, ready, num_k, CID, BNC, GATE_UP, STAGES, GROUP,
                                          BYTE_L, BYTE_T, a_layout)
                acc_g, acc_u, acc_g2, acc_u2 = _mmas(wl, wh, ul, uh, acc_g, acc_u, acc_g2, acc_u2, x_bufs, base + i,
                                                     STAGES, GATE_UP, BM, BM2)
                acc_g, acc_u, acc_g2, acc_u2, wl, wh, ul, uh = _wait(acc_g, acc_u, acc_g2, acc_u2, wl, wh, ul, uh, 0,
                                                                     GATE_UP, BM2)
                mbarrier.arrive(empty.index((base + i) % STAGES), count=1)
        else:
            wl, wh, ul, uh = _weights(base, 0, w_bufs, s_bufs, ready, num_k, CID, BNC, GATE_UP, STAGES, GROUP, BYTE_L, BYTE_T,
                                      a_layout)
            for i in range(0, num_k, UNROLL):  # (num_k is a multiple of UNROLL: the launch picks it)
                acc_g, acc_u, acc_g2, acc_u2 = _mmas(wl, wh, ul, uh, acc_g, acc_u, acc_g2, acc_u2, x_bufs, base + i, STAGES,
                                                     GATE_UP, BM, BM2)
                for j in gl.static_range(1, UNROLL):
                    # Step i + j's weights converted into the operand set step i + j - 2 read (retired
                    # by the last wait) while step i + j - 1's MMAs run, its MMAs queued behind them,
                    # then step i + j - 1's retired (step i + j's commit groups stay outstanding) and
                    # its stage released; then the names swapped (wl, ... the set in flight).
                    nl, nh, ml, mh = _weights(base, i + j, w_bufs, s_bufs, ready, num_k, CID, BNC, GATE_UP, STAGES,
                                              GROUP, BYTE_L, BYTE_T, a_layout)
                    acc_g, acc_u, acc_g2, acc_u2 = _mmas(nl, nh, ml, mh, acc_g, acc_u, acc_g2, acc_u2, x_bufs,
                                                         base + i + j, STAGES, GATE_UP, BM, BM2)
                    acc_g, acc_u, acc_g2, acc_u2, wl, wh, ul, uh = _wait(acc_g, acc_u, acc_g2, acc_u2, wl, wh, ul, uh,
                                                                         GROUPS, GATE_UP, BM2)
                    mbarrier.arrive(empty.index((base + i + j - 1) % STAGES), count=1)
                    wl, wh, ul, uh, nl, nh, ml, mh = nl, nh, ml, mh, wl, wh, ul, uh
                # The next turn's first weights (into the set step i + UNROLL - 2 read), then the
                # turn's last step retired: ptxas places most of this conversion after that wait,
                # so one conversion a turn runs without MMAs of this warp group in flight.
                nl, nh, ml, mh = _weights(base, i + UNROLL, w_bufs, s_bufs, ready, num_k, CID, BNC, GATE_UP, STAGES, GROUP,
                                          BYTE_L, BYTE_T, a_layout)
                acc_g, acc_u, acc_g2, acc_u2, wl, wh, ul, uh = _wait(acc_g, acc_u, acc_g2, acc_u2, wl, wh, ul, uh, 0,
                                                                     GATE_UP, BM2)
                mbarrier.arrive(empty.index((base + i + UNROLL - 1) % STAGES), count=1)
                wl, wh, ul, uh = nl, nh, ml, mh

        _epilogue(acc_g, acc_u, out_ptr, stride_om, topk_w_ptr, sorted_slot_ptr, row0, rows_used, col0, CID, BNC, BM,
                  GATE_UP)
        if BM2 > 0:
            _epilogue(acc_g2, acc_u2, out_ptr, stride_om, topk_w_ptr, sorted_slot_ptr, row0 + BM, rows_used - BM,
                      col0, CID, BNC, BM2, GATE_UP)

    @gluon.jit
    def _consumer_0(x_bufs, w_bufs, ready, empty, s_bufs, num_k, out_ptr, stride_om, topk_w_ptr, sorted_slot_ptr,
                    block_rows_ptr, first, step, num_tiles, num_n, BM: gl.constexpr, BNC: gl.constexpr,
                    GROUP: gl.constexpr, GATE_UP: gl.constexpr, STAGES: gl.constexpr, BYTE_L: gl.constexpr,
                    BYTE_T: gl.constexpr, NARROW: gl.constexpr, MID: gl.constexpr, PERSISTENT: gl.constexpr,
                    UNROLL: gl.constexpr):
        _consumer(x_bufs, w_bufs, ready, empty, s_bufs, num_k, out_ptr, stride_om, topk_w_ptr, sorted_slot_ptr,
                  block_rows_ptr, first, step, num_tiles, num_n, 0, BM, BNC, GROUP, GATE_UP, STAGES, BYTE_L,
                  BYTE_T, NARROW, MID, PERSISTENT, UNROLL)

    @gluon.jit
    def _consumer_1(x_bufs, w_bufs, ready, empty, s_bufs, num_k, out_ptr, stride_om, topk_w_ptr, sorted_slot_ptr,
                    block_rows_ptr, first, step, num_tiles, num_n, BM: gl.constexpr, BNC: gl.constexpr,
                    GROUP: gl.constexpr, GATE_UP: gl.constexpr, STAGES: gl.constexpr, BYTE_L: gl.constexpr,
                    BYTE_T: gl.constexpr, NARROW: gl.constexpr, MID: gl.constexpr, PERSISTENT: gl.constexpr,
                    UNROLL: gl.constexpr):
        _consumer(x_bufs, w_bufs, ready, empty, s_bufs, num_k, out_ptr, stride_om, topk_w_ptr, sorted_slot_ptr,
                  block_rows_ptr, first, step, num_tiles, num_n, 1, BM, BNC, GROUP, GATE_UP, STAGES, BYTE_L,
                  BYTE_T, NARROW, MID, PERSISTENT, UNROLL)

    @gluon.jit
    def _ws_gemm_kernel(x_desc, x_desc2, x_desc4, w_desc, s_desc, out_ptr, topk_w_ptr, sorted_slot_ptr,
                        block_expert_ptr, block_rows_ptr, num_blocks, K, N, stride_om, w_row_groups,
                        BM: gl.constexpr, BNC: gl.constexpr, GROUP: gl.constexpr, GATE_UP: gl.constexpr,
                        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                        BYTE_L: gl.constexpr, BYTE_T: gl.constexpr, NARROW: gl.constexpr, MID: gl.constexpr,
                        PERSISTENT: gl.constexpr, UNROLL: gl.constexpr):
        """Tiles of BM sorted rows x 2 * BNC output columns (GEMM1: gate and up of each), tile t =
        block t // (N / 2 BNC), columns t % (N / 2 BNC); program p takes tiles p, p + programs,
        ... (one each where the grid has a program a tile; persistent where it has one an SM);
        see the module docstring."""
        BNH: gl.constexpr = 2 * BNC
        first = gl.program_id(0)
        step = gl.num_programs(0)
        num_n = N // BNH
        num_tiles = num_blocks * num_n
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [2 * STAGES] + w_desc.block_type.shape, w_desc.layout)
        s_bufs = gl.allocate_shared_memory(s_desc.dtype, [2 * STAGES] + s_desc.block_type.shape, s_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        num_k = K // 64
        gl.warp_specialize([
            (_consumer_0, (x_bufs, w_bufs, ready, empty, s_bufs, num_k, out_ptr, stride_om, topk_w_ptr,
                           sorted_slot_ptr, block_rows_ptr, first, step, num_tiles, num_n, BM, BNC, GROUP, GATE_UP,
                           STAGES, BYTE_L, BYTE_T, NARROW, MID, PERSISTENT, UNROLL)),
            (_consumer_1, (x_bufs, w_bufs, ready, empty, s_bufs, num_k, out_ptr, stride_om, topk_w_ptr,
                           sorted_slot_ptr, block_rows_ptr, first, step, num_tiles, num_n, BM, BNC, GROUP, GATE_UP,
                           STAGES, BYTE_L, BYTE_T, NARROW, MID, PERSISTENT, UNROLL)),
            (_producer, (x_desc, x_desc2, x_desc4, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty,
                         block_rows_ptr, block_expert_ptr, first, step, num_tiles, num_n, N, w_row_groups, num_k, BM,
                         BNH, GATE_UP, STAGES, GROUP, NARROW, MID, PERSISTENT)),
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


def _s_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)


def weight_descriptor(linear: quant.PackedLinear, bnh: int):
    """The stored tiles [E, N/32, K/64, 32, 32] seen as [E * N/32, K/64 * 32, 32] bytes: a box of
    bnh/32 x 32 x 32 is one step's 32 bytes of bnh consecutive columns."""
    packed = linear.packed
    e, groups, blocks = packed.shape[0], packed.shape[1], packed.shape[2]
    view = packed.view(e * groups, blocks * 32, 32)
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [bnh // 32, 32, 32], _w_layout())


def scale_descriptor(linear: quant.PackedLinear, bnh: int):
    """The scales [E, K / group, N] in boxes of 1 x 2 x bnh: a step's two groups (from its first
    value on) of bnh consecutive columns."""
    scales = linear.scales
    return TensorDescriptor(scales, list(scales.shape), list(scales.stride()), [1, 2, bnh], _s_layout())


def rows_descriptor(rows: torch.Tensor, bm: int):
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [bm, 32], _x_layout(bm))


class GluonHopperPath:
    """The Gluon path's launches for one TritonW4A16MoE (its workspace and routing stages).

    The tiles follow the layer (moe.layer: a rehearsal compiles what the layer's run uses), the
    workspace the experts held (moe.shape), sized for the largest block any M up to max_m takes."""

    dtypes = (torch.bfloat16,)

    def __init__(self, moe):
        self.moe = moe
        self.max_padded = tm._padded_rows(moe.shape, moe.max_m, max_block_m(moe.layer, moe.max_m))
        smallest = min(tiles["g1"]["bm"] for tiles in tile_sets())
        device = moe._device
        self.block_expert = torch.empty(triton.cdiv(self.max_padded, smallest), dtype=torch.int32, device=device)
        self.block_rows = torch.empty_like(self.block_expert)
        self._buffers: dict[torch.dtype, dict] = {}
        self._weight_descs: dict[tuple, object] = {}
        # The persistent tiles' grid: one program an SM (a block takes an SM's registers), the SM
        # count the backend read off the device (triton_moe.device_limits).
        self.sm_count = moe.limits.sm_count if moe.limits is not None else 1

    def tiles(self, m: int) -> dict:
        return tiles_for(self.moe.layer, m)

    def weight_desc(self, which: str, bnc: int):
        """The packed weights' and their scales' descriptors for GEMM1 ("g1") or GEMM2 with bnc
        weight rows a consumer."""
        key = (which, bnc)
        if key not in self._weight_descs:
            linear = self.moe.weights.w13 if which == "g1" else self.moe.weights.w2
            self._weight_descs[key] = (weight_descriptor(linear, 2 * bnc), scale_descriptor(linear, 2 * bnc))
        return self._weight_descs[key]

    def buffers(self, dtype, bm: int):
        """The gathered rows and the intermediate (sized once), with their descriptors per block."""
        if dtype not in self._buffers:
            shape = self.moe.shape
            xs = torch.zeros((self.max_padded, shape.hidden), dtype=dtype, device=self.moe._device)
            inter = torch.zeros((self.max_padded, shape.inter), dtype=dtype, device=self.moe._device)
            self._buffers[dtype] = dict(xs=xs, inter=inter)
        buf = self._buffers[dtype]
        # Also BM / 2 and BM / 4 rows a copy: the narrowed blocks' loads (_producer).
        for rows in (bm, bm // 2, bm // 4):
            if ("xs", rows) not in buf:
                buf[("xs", rows)] = rows_descriptor(buf["xs"], rows)
                buf[("inter", rows)] = rows_descriptor(buf["inter"], rows)
        return buf

    def release_buffers(self) -> None:
        """Drop the gathered rows and the intermediate (made again on the next forward)."""
        self._buffers.clear()

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                stages: tuple = ("route", "g1", "g2", "sum"), tiles: dict | None = None) -> torch.Tensor | None:
        """The forward with M's tiles (tiles_for; a tuning script may give others); `stages` (a
        tuning script's) runs only some of its launches, each reading what the ones before it
        left in the workspace."""
        moe, shape = self.moe, self.moe.shape
        if x.dtype != torch.bfloat16:
            raise ValueError("the Gluon path takes bf16 activations")
        m = x.shape[0]
        tiles = self.tiles(m) if tiles is None else tiles
        bm = tiles["g1"]["bm"]
        if tiles["g2"]["bm"] != bm:
            raise ValueError(f"GEMM1 and GEMM2 share the sorted blocks: bm {bm} and {tiles['g2']['bm']}")
        for which in ("g1", "g2"):
            narrow = tiles[which].get("narrow", 0)
            if narrow and (narrow & (narrow - 1) or narrow > bm):
                raise ValueError(f"{which}'s narrow {narrow} is not 0 or a power of two up to bm {bm}")
            try:
                unroll_for(tiles[which], shape.hidden if which == "g1" else shape.inter)
            except ValueError as exc:
                raise ValueError(f"{which}'s {exc}") from None
            if tiles[which].get("mid") and not (narrow and narrow <= bm // 4):
                raise ValueError(f"{which}'s mid (the 3 bm / 4 wide body) needs a narrow of at most bm / 4 = {bm // 4}, "
                                 f"not {narrow}")
        padded = tm._padded_rows(shape, m, bm)
        blocks = triton.cdiv(padded, bm)
        if padded > min(moe._max_padded, self.max_padded) or blocks > self.block_expert.numel():
            # (Tiles other than those the path was made with: a tuning script's.)
            raise ValueError(f"M={m} with block_m {bm} needs more workspace than was allocated")
        buf = self.buffers(x.dtype, bm)
        _, slot_buf = moe._buffers(x.dtype)
        if "route" in stages:
            moe._m = m
            moe._group_slots(topk_ids, bm)
            gather_bk = tm._largest_dividing(GATHER_BK, shape.hidden, 64)
            _gather_kernel[(blocks, shape.hidden // gather_bk)](
                x, buf["xs"], moe._sorted_slot, moe._counts, moe._starts, moe._ends, self.block_expert,
                self.block_rows, shape.experts, shape.hidden, x.stride(0), buf["xs"].stride(0),
                TOPK=shape.topk, BLOCK_M=bm, NUM_BINS=moe._num_bins, BK=gather_bk, num_warps=4)
        for which, rows, w, out, n, k in (
                ("g1", "xs", moe.weights.w13, buf["inter"], shape.inter, shape.hidden),
                ("g2", "inter", moe.weights.w2, slot_buf, shape.hidden, shape.inter)):
            if which not in stages:
                continue
            tile = tiles[which]
            bnh = 2 * tile["bnc"]
            num_tiles = blocks * (n // bnh)
            # Persistent (one program an SM, each taking every SM-count-th tile) or one program a tile.
            programs = min(num_tiles, self.sm_count) if tile.get("persistent") else num_tiles
            _ws_gemm_kernel[(programs,)](
                buf[(rows, bm)], buf[(rows, bm // 2)], buf[(rows, bm // 4)], *self.weight_desc(which, tile["bnc"]),
                out, topk_weights,
                moe._sorted_slot, self.block_expert, self.block_rows,
                blocks, k, n, out.stride(0), w.packed.shape[1],
                BM=bm, BNC=tile["bnc"], GROUP=shape.group_size, GATE_UP=which == "g1", STAGES=tile["stages"],
                CONSUMER_REGS=tile.get("consumer_regs", 232), PRODUCER_REGS=tile.get("producer_regs", 40),
                BYTE_L=byte_layout(tile["bnc"]), BYTE_T=byte_layout(tile["bnc"], transposed=True), NARROW=tile.get("narrow", 0), MID=bool(tile.get("mid", False)),
                PERSISTENT=bool(tile.get("persistent", False)), UNROLL=unroll_for(tile, k),
                num_warps=4)
        moe._g2_split = 1
        return moe.topk_sum(x) if "sum" in stages else None
