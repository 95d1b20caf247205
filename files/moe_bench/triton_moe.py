"""The payload's own fused W4A16 MoE forward, written in Triton.

Three paths, picked per M by the shape's table (a preset's shipped one, else the rule by slots
per expert; see "Tiles by shape and device"); all have shapes fixed by M (CUDA-graph
capturable: no host synchronisation, no data-dependent shapes; programs past the rows in use
exit at once).

Few tokens (rows with block_m 1): one-row kernels on the CUDA cores, three launches (five
with `sort`) plus the top-k sum. With a few tokens almost every (token, expert) slot is the only row of its expert,
so a tensor-core tile of at least 16 rows would be mostly padding:
  1. _word_order_kernel: x's rows as float32 in the order the nibbles of a packed word come
     out in, with a per-word bias (see _store_word_order). Rows with `sort` also group the
     slots by expert (_align_kernel and _scatter_kernel below, without padding).
  2. _gemv_kernel (GATE_UP): one slot (its expert read from topk_ids) x a tile of gate and up
     columns, dotted in float32 over all of K; SiLU(gate) * up, rounded to the activations'
     dtype, stored per slot in the same operand order. The programs take the slots in token
     order, or grouped by expert (`sort`: an expert's slots run side by side, so its weights
     come from DRAM once).
  3. _gemv_kernel: the intermediate against w2, times the slot's top-k weight, per slot.

Some tokens sharing experts (from 64 slots, or past 0.25 slots per expert, to 4 slots per expert,
on layers of at least 1024 intermediate columns): block_m 8 rows, _align_kernel and
_scatter_kernel as below with blocks of 8 rows, then _mma8_kernel for each GEMM (mma.sync in
inline PTX, a block's rows as the MMA's 8 columns: each weight converted once for all of its
expert's slots in the block; see "Block_m 8 rows") and the top-k sum. Off a GPU with bf16
mma.sync, and under Triton's interpreter, the block_m 16 row runs in their place.

More tokens: tensor-core kernels, five launches (six when GEMM1 is split along K):

  1. _align_kernel (a program per 1024 slots, the last to finish adding up the others'
     counts): count the (token, k) slots per expert, pad each expert's count to a multiple of
     BLOCK_M, and store each expert's count and start and end of its range of sorted rows.
  2. _scatter_kernel: place every slot at its expert's next free sorted position (atomic
     cursors: the order inside an expert is free, every row is computed independently, so the
     result does not depend on it); the slot on a block's first row writes the block's expert
     and rows into the block table.
  3. _gemm1_kernel: one block of BLOCK_M sorted rows (one expert, read from the block table) by one
     tile of intermediate columns: the gate and up tiles of w13 against the gathered activation
     rows, int4 unpacked in registers, SiLU(gate) * up in the epilogue.
  4. _gemm2_kernel: the intermediate block against w2, scaled by each slot's top-k weight in
     the epilogue, stored per slot.
  5. _topk_sum_kernel: each token's sum over its top-k slots, in float32 (both paths).

With split-K (small M) each GEMM tile is shared by several programs, each reducing one slice of
K into float32 partials: GEMM1's are added by _silu_mul_kernel (the extra launch), which then
applies SiLU-and-mul; GEMM2's are added by the top-k sum along with the slots.

Weights are in the packed layout of quant.py: per output column its K values, two a byte,
inside every 32-value chunk of K byte j holding value j (low nibble) and value 16 + j (high
nibble); stored in tiles of 32 columns x 64 K values (1 KB, quant.tile_packed), so a step's
pieces of neighbouring columns are neighbours in memory (_tile_offsets). A step of the
reduction loads a [BK / 2, BN] byte tile whose columns are whole 16-byte runs (wide loads into
shared memory and out of it, straight into the tensor-core operand layout); its low nibbles are the first halves of the step's 32-value
chunks and its high nibbles the second halves, so each is one dot against the matching half
of the activations (gathered with the same index pattern): no nibble is ever interleaved.
A nibble u becomes a number without an integer conversion: written under the bf16 exponent of
128 it reads as 128 + u, and one bf16 fused multiply-add makes it q = u - 8, exactly.

On an sm_90 GPU with Gluon, a third path exists for the tensor-core M range: moe_bench.gluon_moe
(warp-specialised, copy-engine loads, warp-group MMAs), checked against this module's kernels
on each tile set's first call and falling back to them on any failure (TritonW4A16MoE._gluon_runs);
it is selected from gluon_moe.select_slots_per_expert(layer) slots per expert (16; 8 on a layer
with an intermediate of at least 8192), where it measured faster (PERFORMANCE.md rounds 22-24 and
28-29; MOE_BENCH_GLUON=force runs it wherever it can run, =0 never).

From sm_90 every kernel of a forward launches with programmatic dependent launch (PDL): the
next kernel's programs take the SMs the last programs of the one before leave idle and wait
there (griddepcontrol.wait) for it to complete; the one-row GEMMs after the first load their
first step's weights before that wait (see the note above _pdl_enter).

Constraints (ValueError otherwise): group size a power of two, at least 32 (so every 32-value
chunk lies inside one group); hidden and inter multiples of the group size. Tiles come from
the shape's table per M (table_for), fitted to the device (fit_to_device) and shrunk to divide
the shape. Activations: bf16 on a GPU; float16 / float32
work too (the CPU tests use them under TRITON_INTERPRET=1, whose tl.dot is wrong on bf16).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import perfmodel, quant, sass

# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while
# the one before it in the stream finishes; griddepcontrol.wait then blocks until that one has
# completed and its writes are visible. Every kernel of a forward takes PDL (a constexpr):
# with it, a kernel whose inputs all come from earlier kernels waits first and then lets the
# next kernel launch (_pdl_enter); a one-row GEMM that is not the forward's first kernel lets
# the next one launch at once, reads only what existed before the forward began (the routing,
# the weights) before its wait, and waits before it reads an activation or writes anything
# (_gemv_kernel). So the next kernel's programs take the SMs the last programs leave idle, and
# the one-row GEMMs have their first weights in flight when the kernel before them ends
# (PERFORMANCE.md round 21; pdl_unavailable_reason says where it cannot run).
PDL_IMPORT_ERROR: str | None = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except Exception as exc:  # noqa: BLE001 - an older Triton: the kernels run without PDL
    PDL_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

    @triton.jit
    def _gdc_wait():
        pass

    @triton.jit
    def _gdc_launch_dependents():
        pass

# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    """A PDL kernel whose inputs come from the kernels before it: wait for them, then let the
    next kernel launch (in that order, so a kernel after this one that reads the routing or
    the weights before its own wait finds every kernel before the forward complete)."""
    if PDL:
        _gdc_wait()
        _gdc_launch_dependents()


# Slots counted by one program of the grouping (_align_kernel): at kimi-k2.6 --tp 8 M=2048
# (16384 slots) one program counting them all took 43 us of a 940 us forward (PERFORMANCE.md
# round 36b); a program per chunk counts them side by side.
ALIGN_CHUNK = 1024


def _align_part_elems(slots: int, bins: int) -> int:
    """int32 elements of the grouping's per-program counts: a row of bins per ALIGN_CHUNK slots."""
    return triton.cdiv(slots, ALIGN_CHUNK) * bins


# Blocks of at least this many rows take their owner from the block table the scatter writes
# (_block_owner); the block_m 8 rows keep the search of the ends. PERFORMANCE.md round 38: the
# table took 1.4-2.1% off kimi-k2.6 --tp 8 at M=16-2048 on an H100; round 37c: read at block_m 8
# too, it made that GEMM1 128 registers instead of 106 and those rows 1-1.5% slower.
TABLE_MIN_BLOCK_M = tl.constexpr(16)


def _block_table_elems(shape: quant.MoEShape, m: int) -> int:
    """int32 elements of the block table: an (expert, rows) pair for each block of m tokens'
    padded rows (_padded_rows) at the smallest block_m that writes one; larger blocks fill fewer."""
    return 2 * triton.cdiv(_padded_rows(shape, m, TABLE_MIN_BLOCK_M.value), TABLE_MIN_BLOCK_M.value)


@triton.jit
def _align_kernel(
    topk_ids_ptr,
    num_slots,
    num_experts,
    counts_ptr,
    starts_ptr,
    ends_ptr,
    cursor_ptr,
    part_ptr,
    ticket_ptr,
    BLOCK_M: tl.constexpr,
    NUM_BINS: tl.constexpr,
    CHUNK: tl.constexpr,
    ONE_PROGRAM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Per expert: slot count, and start/end of its range of sorted rows padded to BLOCK_M.
    Each program counts one CHUNK of slots; with several programs each stores its counts as
    a row of part_ptr and takes a ticket, and the program that takes the last ticket adds the
    rows, stores the ranges and sets the ticket back to 0 for the next launch."""
    _pdl_enter(PDL)
    bins = tl.arange(0, NUM_BINS)
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    # Out-of-range lanes go to the last bin, which is never an expert (NUM_BINS > E).
    ids = tl.load(topk_ids_ptr + offs, mask=offs < num_slots, other=NUM_BINS - 1)
    counts = tl.histogram(ids, NUM_BINS)
    last = True
    if not ONE_PROGRAM:
        programs = tl.num_programs(0)
        tl.store(part_ptr + pid * NUM_BINS + bins, counts)
        # Every thread's row stored before the ticket (the barrier), the ticket released to
        # and acquired from the GPU scope, the rows read from L2 (.cg): the last program sees
        # every other program's row.
        tl.debug_barrier()
        taken = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        last = taken == programs - 1
        if last:
            counts = tl.zeros([NUM_BINS], dtype=tl.int32)
            for first in range(0, programs, 16):  # 16 rows of counts a load
                rows = first + tl.arange(0, 16)
                ok = rows[:, None] < programs
                part = tl.load(part_ptr + rows[:, None] * NUM_BINS + bins[None, :], mask=ok, other=0,
                               cache_modifier=".cg")
                counts += tl.sum(part, axis=0)
            tl.store(ticket_ptr, 0)
    if last:
        counts = tl.where(bins < num_experts, counts, 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        starts = ends - padded
        is_expert = bins < num_experts
        tl.store(counts_ptr + bins, counts, mask=is_expert)
        tl.store(starts_ptr + bins, starts, mask=is_expert)
        tl.store(cursor_ptr + bins, starts, mask=is_expert)
        # Past the last expert the end is "never": blocks beyond the used rows find no owner.
        tl.store(ends_ptr + bins, tl.where(is_expert, ends, 0x7FFFFFFF))


@triton.jit
def _scatter_kernel(topk_ids_ptr, num_slots, cursor_ptr, sorted_slot_ptr, counts_ptr, starts_ptr, ends_ptr,
                    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, PDL: tl.constexpr = False):
    """Every slot at its expert's next free sorted position. With blocks of at least
    TABLE_MIN_BLOCK_M rows, the slot that lands on the first row of a block also writes the
    block's entry (expert, real rows) into the block table that follows the ends (ends_ptr +
    NUM_BINS: two int32 a block), which _block_owner reads instead of searching the ends."""
    _pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < num_slots
    ids = tl.load(topk_ids_ptr + offs, mask=valid, other=0)
    pos = tl.atomic_add(cursor_ptr + ids, 1, mask=valid)
    tl.store(sorted_slot_ptr + pos, offs, mask=valid)
    if BLOCK_M >= TABLE_MIN_BLOCK_M:
        rel = pos - tl.load(starts_ptr + ids, mask=valid, other=0)
        first = valid & (rel % BLOCK_M == 0)
        rows = tl.minimum(tl.load(counts_ptr + ids, mask=first, other=0) - rel, BLOCK_M)
        entry = ends_ptr + NUM_BINS + 2 * (pos // BLOCK_M)
        tl.store(entry, ids, mask=first)
        tl.store(entry + 1, rows, mask=first)


@triton.jit
def _block_owner(pid_b, counts_ptr, starts_ptr, ends_ptr, num_experts, BLOCK_M: tl.constexpr,
                 NUM_BINS: tl.constexpr):
    """(expert, real rows) of sorted block pid_b; rows is 0 for a block past the used ones.
    Blocks of at least TABLE_MIN_BLOCK_M rows read the block table the scatter wrote (its
    entries past the used rows are stale: the last expert's end says which are used); smaller
    blocks (the block_m 8 rows) count the experts whose padded range ends at or before the block."""
    if BLOCK_M >= TABLE_MIN_BLOCK_M:
        used = tl.load(ends_ptr + num_experts - 1)
        entry = ends_ptr + NUM_BINS + 2 * pid_b
        owned = pid_b * BLOCK_M < used
        return tl.where(owned, tl.load(entry), 0), tl.where(owned, tl.load(entry + 1), 0)
    first_row = pid_b * BLOCK_M
    ends = tl.load(ends_ptr + tl.arange(0, NUM_BINS))
    expert = tl.sum((ends <= first_row).to(tl.int32), axis=0)
    owned = expert < num_experts
    safe = tl.minimum(expert, num_experts - 1)
    count = tl.load(counts_ptr + safe)
    start = tl.load(starts_ptr + safe)
    rows = tl.minimum(tl.maximum(count - (first_row - start), 0), BLOCK_M)
    return safe, tl.where(owned, rows, 0)


def _nibbles_ptx(high: bool) -> str:
    """PTX for four packed bytes ($2) -> the four values q = u - 8 of their low (or high)
    nibbles as two bf16x2 registers ($0, $1): byte permute, nibble mask with the exponent of
    128 set (128 + u), one bf16x2 fma subtracting 136. For the mma.sync operand, whose
    registers hold four K-neighbours; two separate blocks measured faster than one block with
    four outputs (round 7, PERFORMANCE.md; the high-nibble block redoing the permutes is
    cheaper than keeping both results live). The warp-group MMA operand takes
    _PAIR_NIBBLES_PTX instead (see _dequant)."""
    source = "s" if high else "$2"
    lines = ["{ .reg .b32 " + ("s, " if high else "") + "t0, t1, one, off;", "mov.b32 one, 0x3F803F80;",
             "mov.b32 off, 0xC308C308;"]
    if high:
        lines.append("shr.b32 s, $2, 4;")
    lines += [f"prmt.b32 t0, {source}, 0, 0x4140;", f"prmt.b32 t1, {source}, 0, 0x4342;",
              "lop3.b32 t0, t0, 0x000F000F, 0x43004300, 0xEA;", "lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xEA;",
              "fma.rn.bf16x2 $0, t0, one, off;", "fma.rn.bf16x2 $1, t1, one, off; }"]
    return "\n".join(lines)


_LOW_NIBBLES_PTX = tl.constexpr(_nibbles_ptx(high=False))
_HIGH_NIBBLES_PTX = tl.constexpr(_nibbles_ptx(high=True))
# Two packed bytes ($2, low half) -> the values q of their low nibbles ($0) and of their high
# nibbles ($1), one bf16x2 register each: one byte permute serves both.
_PAIR_NIBBLES_PTX = tl.constexpr(
    "{ .reg .b32 t, th, lo, hi, one, off;\n"
    "mov.b32 one, 0x3F803F80;\n"
    "mov.b32 off, 0xC308C308;\n"
    "prmt.b32 t, $2, 0, 0x4140;\n"
    "shr.b32 th, t, 4;\n"
    "lop3.b32 lo, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 hi, th, 0x000F000F, 0x43004300, 0xEA;\n"
    "fma.rn.bf16x2 $0, lo, one, off;\n"
    "fma.rn.bf16x2 $1, hi, one, off; }")


@triton.jit
def _dequant(p, CONVERT_ASM: tl.constexpr, PAIRS: tl.constexpr = False):
    """Packed bytes p -> (low, high): the int4 values q = u - 8 of the low and the high nibbles,
    as exact bf16 numbers.

    A nibble u written under the bf16 exponent of 128 (0x4300) reads as 128 + u: no
    integer-to-float conversion; one fused multiply-add per two values then subtracts 136.
    With CONVERT_ASM that runs in PTX (GPU only: Triton's interpreter runs no PTX) on the
    bytes as the operand layout hands them over: four at a time (a byte permute spreads two
    bytes into the low halves of two 16-bit lanes, one lop3 masks the nibbles and sets the
    exponent in both lanes, one bf16x2 fma; see _nibbles_ptx) for the mma.sync operand, whose
    registers hold four K-neighbours; with PAIRS two at a time (_PAIR_NIBBLES_PTX) for the
    warp-group MMA's register operand, whose registers hold K pairs: four-byte packs there
    cost about 7 extra byte permutes per pack to assemble (compiled: the M=2048 GEMM1 loop
    314 -> 250 instructions), while for mma.sync the pairs cost more than they save."""
    if CONVERT_ASM and PAIRS:
        lo, hi = tl.inline_asm_elementwise(_PAIR_NIBBLES_PTX, "=r,=r,r", [p], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=2)
    elif CONVERT_ASM:
        lo = tl.inline_asm_elementwise(_LOW_NIBBLES_PTX, "=r,=r,r", [p], dtype=tl.bfloat16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(_HIGH_NIBBLES_PTX, "=r,=r,r", [p], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        p16 = p.to(tl.uint16)
        lo = ((p16 & 0xF) | 0x4300).to(tl.bfloat16, bitcast=True).to(tl.float32) - 136.0
        hi = ((p16 >> 4) | 0x4300).to(tl.bfloat16, bitcast=True).to(tl.float32) - 136.0
    return lo, hi


@triton.jit
def _scaled(q, s, dtype: tl.constexpr, CONVERT_ASM: tl.constexpr):
    """Weights q * s rounded once to dtype (q exact small integers, s the float32 scales of
    bf16 values, so the product is exact before the rounding). With CONVERT_ASM and bf16
    activations: one bf16x2 multiply per two weights instead of float32 arithmetic."""
    if CONVERT_ASM and dtype == tl.bfloat16:
        s16 = s.to(tl.bfloat16)  # exact: s holds bf16 values
        q, s16 = tl.broadcast(q, s16)
        return tl.inline_asm_elementwise(
            "{ .reg .b32 mz;\n"
            "mov.b32 mz, 0x80008000;\n"
            "fma.rn.bf16x2 $0, $1, $2, mz; }",
            "=r,r,r", [q, s16], dtype=tl.bfloat16, is_pure=True, pack=2)
    return (q.to(tl.float32) * s).to(dtype)


@triton.jit
def _step(a_lo, a_hi, p, s, acc, POST_SCALE: tl.constexpr, SWAP_AB: tl.constexpr, CONVERT_ASM: tl.constexpr):
    """Add one reduction step to acc ([BM, BN], or [BN, BM] when SWAP_AB).

    a_lo / a_hi: [BM, BKH] activations at the K indices of the low / high nibbles of p, the
    packed [BKH, BN] weight bytes. With POST_SCALE the step is exactly one group and s the
    [BN] float32 scales: the dot runs on the integers and its result is scaled once. Without
    it s is a [BKH, BN] float32 tile (each weight's scale) and the weights are scaled before
    the dot (one rounding to the activation dtype, as a dequantised weight would have)."""
    lo, hi = _dequant(p, CONVERT_ASM, SWAP_AB)
    if POST_SCALE:
        lo = lo.to(a_lo.dtype)
        hi = hi.to(a_lo.dtype)
        if SWAP_AB:
            d = tl.dot(tl.trans(lo), tl.trans(a_lo))
            d = tl.dot(tl.trans(hi), tl.trans(a_hi), d)
            acc += d * s[:, None]
        else:
            d = tl.dot(a_lo, lo)
            d = tl.dot(a_hi, hi, d)
            acc += d * s[None, :]
    else:
        w_lo = _scaled(lo, s, a_lo.dtype, CONVERT_ASM)
        if SWAP_AB:
            # The high half is scaled after the low half's dot, not before: a warp-group MMA
            # reads its register operand while it runs, and the dot that ends a step is still
            # running when the next step begins. Scaled up front, the next step would rewrite
            # that operand (the same registers, one step later) before the wait that follows
            # its first dot; in this order each operand is written after that wait, so a
            # step's last MMAs may stay in flight (see TritonW4A16MoE._launch).
            acc = tl.dot(tl.trans(w_lo), tl.trans(a_lo), acc)
            w_hi = _scaled(hi, s, a_lo.dtype, CONVERT_ASM)
            acc = tl.dot(tl.trans(w_hi), tl.trans(a_hi), acc)
        else:
            w_hi = _scaled(hi, s, a_lo.dtype, CONVERT_ASM)
            acc = tl.dot(a_lo, w_lo, acc)
            acc = tl.dot(a_hi, w_hi, acc)
    return acc


@triton.jit
def _scale_rows(s_ptrs, GROUPS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scales of GROUPS consecutive groups ([GROUPS, BLOCK_N] contiguous rows) as the
    [GROUPS * GROUP / 2, BLOCK_N] float32 tile of one step's low (or high) nibbles: byte row j
    of a step belongs to group j // (GROUP / 2) (every 32-value chunk lies inside one group)."""
    s = tl.load(s_ptrs).to(tl.float32)
    HG: tl.constexpr = GROUP // 2
    return tl.broadcast_to(s[:, None, :], (GROUPS, HG, BLOCK_N)).reshape(GROUPS * HG, BLOCK_N)


@triton.jit
def _tile_offsets(rows, byte, stride_wt):
    """Offsets of byte `byte` of packed row `rows` in the stored tiles (quant.tile_packed):
    32 rows x 32 bytes per 1 KB block, blocks of a 32-row group in K order, stride_wt apart."""
    return (rows // 32) * stride_wt + (byte // 32) * 1024 + (rows % 32) * 32 + byte % 32


@triton.jit
def _tile_shift(byte):
    """What moves a step's pointers `byte` bytes further along every row: `byte` is a multiple
    of 16 (steps are whole groups of at least 32 values) and of the step's width, so a step never
    crosses a block's end. Written with the multiple of 16 spelled out: the compiler then knows
    the pointers stay 16-byte aligned and keeps its wide asynchronous copies."""
    return (byte // 32) * 1024 + (byte // 16 % 2) * 16


@triton.jit
def _gemm_step(a_ptrs, row_ok, w_ptrs, s_ptrs, acc, k0, stride_sg,
               GROUP: tl.constexpr, GROUPS_PER_STEP: tl.constexpr, BLOCK_N: tl.constexpr,
               POST_SCALE: tl.constexpr, WHOLE_TILE: tl.constexpr, SWAP_AB: tl.constexpr,
               CONVERT_ASM: tl.constexpr):
    """acc += rows x weights over K in [k0, k0 + GROUPS_PER_STEP * GROUP).

    a_ptrs: [BM, GROUP/2] (per-group forms) or [BM, BK/2] (whole tile) pointers to the
    activations at the low nibbles' K indices of the step starting at K = 0 (the high nibbles'
    are 16 further); w_ptrs: the matching [GROUP/2 or BK/2, BN] packed bytes; s_ptrs: [BN]
    scales of group 0, or [GROUPS_PER_STEP, BN] rows for the whole tile."""
    g0 = k0 // GROUP
    if POST_SCALE or not WHOLE_TILE:
        for gi in tl.static_range(GROUPS_PER_STEP):
            k = k0 + gi * GROUP
            a_lo = tl.load(a_ptrs + k, mask=row_ok, other=0.0)
            a_hi = tl.load(a_ptrs + k + 16, mask=row_ok, other=0.0)
            p = tl.load(w_ptrs + _tile_shift(k // 2))
            s = tl.load(s_ptrs + (g0 + gi) * stride_sg).to(tl.float32)
            if not POST_SCALE:
                s = s[None, :]
            acc = _step(a_lo, a_hi, p, s, acc, POST_SCALE, SWAP_AB, CONVERT_ASM)
    else:
        a_lo = tl.load(a_ptrs + k0, mask=row_ok, other=0.0)
        a_hi = tl.load(a_ptrs + k0 + 16, mask=row_ok, other=0.0)
        p = tl.load(w_ptrs + _tile_shift(k0 // 2))
        s = _scale_rows(s_ptrs + g0 * stride_sg, GROUPS_PER_STEP, GROUP, BLOCK_N)
        acc = _step(a_lo, a_hi, p, s, acc, POST_SCALE, SWAP_AB, CONVERT_ASM)
    return acc


@triton.jit
def _operand_ptrs(a_base, w_base, s_base, stride_wt, stride_sg, offs_n, GROUP: tl.constexpr, GROUPS_PER_STEP: tl.constexpr,
                  BLOCK_N: tl.constexpr, POST_SCALE: tl.constexpr, WHOLE_TILE: tl.constexpr):
    """(a_ptrs, w_ptrs, s_ptrs) of a program's first step for _gemm_step. a_base: [BM, 1]
    row starts; w_base / s_base: this expert's weights / scales; stride_wt: bytes per 32-row
    group of the stored tiles (quant.tile_packed)."""
    if POST_SCALE or not WHOLE_TILE:
        BKH: tl.constexpr = GROUP // 2
    else:
        BKH: tl.constexpr = GROUPS_PER_STEP * GROUP // 2
    offs_j = tl.arange(0, BKH)
    k_lo = offs_j // 16 * 32 + offs_j % 16  # K index of each byte's low nibble
    a_ptrs = a_base + k_lo[None, :]
    w_ptrs = w_base + _tile_offsets(offs_n[None, :], offs_j[:, None], stride_wt)
    if POST_SCALE or not WHOLE_TILE:
        s_ptrs = s_base + offs_n
    else:
        s_ptrs = s_base + offs_n[None, :] + tl.arange(0, GROUPS_PER_STEP)[:, None] * stride_sg
    return a_ptrs, w_ptrs, s_ptrs


@triton.jit
def _gemm1_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    sorted_slot_ptr,
    counts_ptr,
    starts_ptr,
    ends_ptr,
    num_experts,
    K,
    INTER,
    stride_xm,
    stride_we,
    stride_wt,
    stride_se,
    stride_sg,
    stride_om,
    part_ptr,
    stride_ps,
    TOPK: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr,
    NUM_BINS: tl.constexpr,
    POST_SCALE: tl.constexpr,
    WHOLE_TILE: tl.constexpr,
    SWAP_AB: tl.constexpr,
    CONVERT_ASM: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FUSE_GU: tl.constexpr,
    K_CONST: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """One block of sorted rows x one tile of BLOCK_N intermediate columns: gate and up tiles
    from w13 (columns n and INTER + n), SiLU(gate) * up stored per sorted row. With FUSE_GU
    the two tiles are one [.., 2 * BLOCK_N] operand (one dot per step instead of two)."""
    _pdl_enter(PDL)
    pid = tl.program_id(0)
    num_n = INTER // BLOCK_N
    pid_k = pid % SPLIT_K
    pid_b = pid // SPLIT_K // num_n
    pid_n = pid // SPLIT_K % num_n
    expert, rows_used = _block_owner(pid_b, counts_ptr, starts_ptr, ends_ptr, num_experts, BLOCK_M, NUM_BINS)
    if rows_used == 0:
        return
    expert = expert.to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows_used
    slot = tl.load(sorted_slot_ptr + pid_b * BLOCK_M + offs_m, mask=row_ok, other=0)
    token = (slot // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # With SPLIT_K each program reduces one slice (a whole number of steps); K_CONST: see _launch.
    if K_CONST > 0:
        k_split = K_CONST // SPLIT_K
    else:
        k_split = K // SPLIT_K
    k_first = pid_k * k_split
    BLOCK_K: tl.constexpr = GROUPS_PER_STEP * GROUP
    out_rows = (pid_b * BLOCK_M + offs_m).to(tl.int64)
    a_base = x_ptr + token[:, None] * stride_xm
    if FUSE_GU:
        # Gate and up columns as one [.., 2 * BLOCK_N] tile: one dot per step feeds both.
        offs_c = tl.arange(0, 2 * BLOCK_N)
        cols = tl.where(offs_c < BLOCK_N, pid_n * BLOCK_N + offs_c, INTER + pid_n * BLOCK_N + offs_c - BLOCK_N)
        a_ptrs, w_ptrs, s_ptrs = _operand_ptrs(
            a_base, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
            stride_wt, stride_sg, cols, GROUP, GROUPS_PER_STEP, 2 * BLOCK_N, POST_SCALE, WHOLE_TILE)
        if SWAP_AB:
            acc = tl.zeros((2 * BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(k_first, k_first + k_split, BLOCK_K):
            acc = _gemm_step(a_ptrs, row_ok[:, None], w_ptrs, s_ptrs, acc, k0, stride_sg, GROUP,
                             GROUPS_PER_STEP, 2 * BLOCK_N, POST_SCALE, WHOLE_TILE, SWAP_AB, CONVERT_ASM)
        if SWAP_AB:
            acc = tl.trans(acc)
        if SPLIT_K > 1:
            # float32 partials of gate (columns n) and up (INTER + n): exactly the tile's columns.
            part_ptrs = part_ptr + pid_k * stride_ps + out_rows[:, None] * (2 * INTER) + cols[None, :]
            tl.store(part_ptrs, acc, mask=row_ok[:, None])
            return
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    else:
        a_ptrs, wg_ptrs, sg_ptrs = _operand_ptrs(
            a_base, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
            stride_wt, stride_sg, offs_n, GROUP, GROUPS_PER_STEP, BLOCK_N, POST_SCALE, WHOLE_TILE)
        wu_ptrs = wg_ptrs + INTER // 32 * stride_wt  # INTER is a multiple of 32 (_check_shape)
        su_ptrs = sg_ptrs + INTER
        if SWAP_AB:
            gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_first, k_first + k_split, BLOCK_K):
            gate = _gemm_step(a_ptrs, row_ok[:, None], wg_ptrs, sg_ptrs, gate, k0, stride_sg, GROUP,
                              GROUPS_PER_STEP, BLOCK_N, POST_SCALE, WHOLE_TILE, SWAP_AB, CONVERT_ASM)
            up = _gemm_step(a_ptrs, row_ok[:, None], wu_ptrs, su_ptrs, up, k0, stride_sg, GROUP,
                            GROUPS_PER_STEP, BLOCK_N, POST_SCALE, WHOLE_TILE, SWAP_AB, CONVERT_ASM)
        if SWAP_AB:
            gate = tl.trans(gate)
            up = tl.trans(up)
        if SPLIT_K > 1:
            # float32 partial sums of gate (columns n) and up (INTER + n), one slice per pid_k;
            # _silu_mul_kernel adds the slices and applies the activation.
            part_ptrs = part_ptr + pid_k * stride_ps + out_rows[:, None] * (2 * INTER) + offs_n[None, :]
            tl.store(part_ptrs, gate, mask=row_ok[:, None])
            tl.store(part_ptrs + INTER, up, mask=row_ok[:, None])
            return
    h = gate * tl.sigmoid(gate) * up
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _gemm2_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_slot_ptr,
    counts_ptr,
    starts_ptr,
    ends_ptr,
    num_experts,
    K,
    N,
    stride_am,
    stride_we,
    stride_wt,
    stride_se,
    stride_sg,
    stride_om,
    part_ptr,
    stride_ps,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr,
    NUM_BINS: tl.constexpr,
    POST_SCALE: tl.constexpr,
    WHOLE_TILE: tl.constexpr,
    SWAP_AB: tl.constexpr,
    CONVERT_ASM: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_CONST: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """One block of sorted rows x one tile of BLOCK_N output columns of w2, times each slot's
    top-k weight, stored per slot."""
    _pdl_enter(PDL)
    pid = tl.program_id(0)
    num_n = N // BLOCK_N
    pid_k = pid % SPLIT_K
    pid_b = pid // SPLIT_K // num_n
    pid_n = pid // SPLIT_K % num_n
    expert, rows_used = _block_owner(pid_b, counts_ptr, starts_ptr, ends_ptr, num_experts, BLOCK_M, NUM_BINS)
    if rows_used == 0:
        return
    expert = expert.to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows_used
    a_rows = (pid_b * BLOCK_M + offs_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_ptrs, w_ptrs, s_ptrs = _operand_ptrs(
        a_ptr + a_rows[:, None] * stride_am, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
        stride_wt, stride_sg, offs_n, GROUP, GROUPS_PER_STEP, BLOCK_N, POST_SCALE, WHOLE_TILE)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if K_CONST > 0:
        k_split = K_CONST // SPLIT_K
    else:
        k_split = K // SPLIT_K
    k_first = pid_k * k_split
    BLOCK_K: tl.constexpr = GROUPS_PER_STEP * GROUP
    for k0 in range(k_first, k_first + k_split, BLOCK_K):
        acc = _gemm_step(a_ptrs, row_ok[:, None], w_ptrs, s_ptrs, acc, k0, stride_sg, GROUP,
                         GROUPS_PER_STEP, BLOCK_N, POST_SCALE, WHOLE_TILE, SWAP_AB, CONVERT_ASM)
    if SWAP_AB:
        acc = tl.trans(acc)
    slot = tl.load(sorted_slot_ptr + pid_b * BLOCK_M + offs_m, mask=row_ok, other=0)
    weight = tl.load(topk_weights_ptr + slot, mask=row_ok, other=0.0)
    if SPLIT_K == 1:
        out_ptrs = out_ptr + slot.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # float32 partial per slot and K slice; the top-k sum adds the slices too.
        part_ptrs = part_ptr + pid_k * stride_ps + slot.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(part_ptrs, acc * weight[:, None], mask=row_ok[:, None])


@triton.jit
def _topk_sum_kernel(slots_ptr, out_ptr, N, stride_split, TOPK: tl.constexpr, SPLIT_K: tl.constexpr,
                     BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    """Each token's sum over its top-k slot rows (and over GEMM2's K slices when it was split)."""
    _pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for part in tl.static_range(SPLIT_K):
        for k in tl.static_range(TOPK):
            acc += tl.load(slots_ptr + part * stride_split + (token * TOPK + k) * N + offs_n, mask=mask,
                           other=0.0).to(tl.float32)
    tl.store(out_ptr + token * N + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(part_ptr, out_ptr, counts_ptr, starts_ptr, ends_ptr, num_experts, INTER, stride_ps,
                     stride_om, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     NUM_BINS: tl.constexpr, PDL: tl.constexpr = False):
    """After a split GEMM1: add the K slices of gate and up, store SiLU(gate) * up per sorted row."""
    _pdl_enter(PDL)
    pid_b = tl.program_id(0)
    _, rows_used = _block_owner(pid_b, counts_ptr, starts_ptr, ends_ptr, num_experts, BLOCK_M, NUM_BINS)
    if rows_used == 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows_used
    rows = (pid_b * BLOCK_M + offs_m).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = part_ptr + rows[:, None] * (2 * INTER) + offs_n[None, :]
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for part in tl.static_range(SPLIT_K):
        gate += tl.load(ptrs + part * stride_ps, mask=row_ok[:, None], other=0.0)
        up += tl.load(ptrs + part * stride_ps + INTER, mask=row_ok[:, None], other=0.0)
    h = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], h.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


# ---------------------------------------------------------------------------
# One-row kernels (few tokens): CUDA-core dot products, no tensor core
# ---------------------------------------------------------------------------
#
# With a few tokens almost every (token, expert) slot is the only row of its expert, so a
# tensor-core tile of at least 16 rows is mostly padding and the work per weight (unpack,
# scale, operand shuffles) decides the speed. These kernels take one slot per program row,
# its expert straight from topk_ids (no padded blocks): a program is one slot x BLOCK_N columns,
# each thread dots whole 32-value chunks of its columns against the slot's activations in
# float32. A 32-bit word of packed weights is 8 nibbles; each is masked into the mantissa of
# a float32 (bits 16-19 under the exponent of 128 read as 128 + u, bits 12-15 under the
# exponent of 2048 as 2048 + u), no integer conversion, and multiplied by its activation; the
# offsets (136 for the chunk's first half, 2056 for its second, the 8 of q = u - 8 included)
# are taken off once per word through the activations' sum. Per weight that is one LOP3, one
# FFMA and 3/8 of a shift.


@triton.jit
def _nibble(x, MASK: tl.constexpr, EXPONENT: tl.constexpr):
    """The nibble of x under MASK, written under the float32 exponent bits EXPONENT: bits 16-19
    under 0x43000000 (2^7) read as 128 + u, bits 12-15 under 0x45000000 (2^11) as 2048 + u."""
    return ((x & MASK) | EXPONENT).to(tl.float32, bitcast=True)


_WORD_NIBBLES_PTX = tl.constexpr(
    "{ .reg .b32 up, down, rot;\n"
    "shl.b32 up, $8, 8;\n"
    "shr.b32 down, $8, 8;\n"
    "shf.l.wrap.b32 rot, $8, $8, 16;\n"
    "lop3.b32 $0, rot, 0xF0000, 0x43000000, 0xEA;\n"
    "lop3.b32 $1, up, 0xF000, 0x45000000, 0xEA;\n"
    "lop3.b32 $2, up, 0xF0000, 0x43000000, 0xEA;\n"
    "lop3.b32 $3, $8, 0xF000, 0x45000000, 0xEA;\n"
    "lop3.b32 $4, $8, 0xF0000, 0x43000000, 0xEA;\n"
    "lop3.b32 $5, down, 0xF000, 0x45000000, 0xEA;\n"
    "lop3.b32 $6, down, 0xF0000, 0x43000000, 0xEA;\n"
    "lop3.b32 $7, rot, 0xF000, 0x45000000, 0xEA; }")


@triton.jit
def _word_nibbles(w, CONVERT_ASM: tl.constexpr):
    """The 8 nibbles of each packed word w (uint32) as float32, in the order low / high of
    byte 0, low / high of byte 1, ...: low nibbles as 128 + u, high ones as 2048 + u. With
    CONVERT_ASM one PTX block (3 shifts, 8 lop3: one instruction per nibble, the exponent in a
    register); otherwise the same bits through Triton's integer operations."""
    if CONVERT_ASM:
        return tl.inline_asm_elementwise(_WORD_NIBBLES_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
                                         dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    up = w << 8
    down = w >> 8
    rot = (w << 16) | (w >> 16)
    return (_nibble(rot, 0xF0000, 0x43000000), _nibble(up, 0xF000, 0x45000000),
            _nibble(up, 0xF0000, 0x43000000), _nibble(w, 0xF000, 0x45000000),
            _nibble(w, 0xF0000, 0x43000000), _nibble(down, 0xF000, 0x45000000),
            _nibble(down, 0xF0000, 0x43000000), _nibble(rot, 0xF000, 0x45000000))


@triton.jit
def _store_word_order(vals, dst_ptr, KW, CHUNKS: tl.constexpr):
    """Store CHUNKS whole 32-value chunks of activations (vals: [CHUNKS * 32] float32, chunk c
    at K = 32 c) in the one-row kernels' operand order, at dst_ptr = row start + the first
    chunk's word index: position t of word w at dst_ptr[t * KW + w], where word i of chunk c
    (w = 4c + i) pairs with values 32c + 4i + j (position 2j, the low nibble of byte 4i + j)
    and 32c + 16 + 4i + j (position 2j + 1); position 8 is the word's bias,
    -(136 * low values + 2056 * high values) (see _word_dot). KW: words per row (K / 8)."""
    offs = tl.arange(0, CHUNKS * 32)
    v = offs % 32
    half = v // 16
    i = v % 16 // 4
    j = v % 4
    tl.store(dst_ptr + (2 * j + half) * KW + offs // 32 * 4 + i, vals)
    parts = tl.sum(tl.reshape(vals, (CHUNKS, 2, 4, 4)), axis=3)  # [chunk, half, i]
    low, high = tl.split(tl.permute(parts, (0, 2, 1)))  # [chunk, i] each
    bias = -(136.0 * low + 2056.0 * high)
    tl.store(dst_ptr + 8 * KW + tl.arange(0, CHUNKS * 4), tl.reshape(bias, (CHUNKS * 4,)))


@triton.jit
def _word_order_kernel(x_ptr, out_ptr, K, stride_xm, stride_om, CHUNKS: tl.constexpr, PDL: tl.constexpr = False):
    """x rows (bf16) -> float32 rows in the one-row kernels' operand order (_store_word_order)."""
    _pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * CHUNKS
    vals = tl.load(x_ptr + row * stride_xm + c0 * 32 + tl.arange(0, CHUNKS * 32)).to(tl.float32)
    _store_word_order(vals, out_ptr + row * stride_om + c0 * 4, K // 8, CHUNKS)


@triton.jit
def _word_acts(a_ptrs, KW, mask=None):
    """The activations of _word_dot: positions 0-7 and the bias (8) of each word, [1, W] each."""
    return (tl.load(a_ptrs, mask=mask), tl.load(a_ptrs + KW, mask=mask), tl.load(a_ptrs + 2 * KW, mask=mask),
            tl.load(a_ptrs + 3 * KW, mask=mask), tl.load(a_ptrs + 4 * KW, mask=mask),
            tl.load(a_ptrs + 5 * KW, mask=mask), tl.load(a_ptrs + 6 * KW, mask=mask),
            tl.load(a_ptrs + 7 * KW, mask=mask), tl.load(a_ptrs + 8 * KW, mask=mask))


@triton.jit
def _word_dot_of(w, acts, CONVERT_ASM: tl.constexpr):
    """_word_dot with its activations already loaded (_word_acts): the prefetching loop loads
    them a step ahead."""
    a0, a1, a2, a3, a4, a5, a6, a7, bias = acts
    n0, n1, n2, n3, n4, n5, n6, n7 = _word_nibbles(w, CONVERT_ASM)
    p = bias + n0 * a0
    p += n1 * a1
    p += n2 * a2
    p += n3 * a3
    p += n4 * a4
    p += n5 * a5
    p += n6 * a6
    p += n7 * a7
    return p


@triton.jit
def _word_dot(w, a_ptrs, KW, CONVERT_ASM: tl.constexpr):
    """sum over the 8 nibbles of each packed word w (uint32 [C, W]) of q * a: [C, W] float32.

    a_ptrs: [1, W] pointers to the words' activations in the order of _store_word_order
    (position t at + t * KW). The nibbles come out as 128 + u (low) and 2048 + u (high); the
    word's bias takes those offsets and the 8 of q = u - 8 off, so the result is exact up to
    float32 rounding."""
    return _word_dot_of(w, _word_acts(a_ptrs, KW), CONVERT_ASM)


@triton.jit
def _raw_word_dot(w, x_ptrs, CONVERT_ASM: tl.constexpr):
    """_word_dot with the activations read straight from x's row (any float dtype) instead of
    the word-order buffer: x_ptrs ([1, W]) point at value 32c + 4i of word w = 4c + i, whose
    positions 2j and 2j + 1 pair with values + j and + 16 + j (_store_word_order); the word's
    bias is formed here from the same values."""
    l0 = tl.load(x_ptrs).to(tl.float32)
    h0 = tl.load(x_ptrs + 16).to(tl.float32)
    l1 = tl.load(x_ptrs + 1).to(tl.float32)
    h1 = tl.load(x_ptrs + 17).to(tl.float32)
    l2 = tl.load(x_ptrs + 2).to(tl.float32)
    h2 = tl.load(x_ptrs + 18).to(tl.float32)
    l3 = tl.load(x_ptrs + 3).to(tl.float32)
    h3 = tl.load(x_ptrs + 19).to(tl.float32)
    bias = -(136.0 * (l0 + l1 + l2 + l3) + 2056.0 * (h0 + h1 + h2 + h3))
    return _word_dot_of(w, (l0, h0, l1, h1, l2, h2, l3, h3, bias), CONVERT_ASM)


@triton.jit
def _word_shift(kw):
    """What moves the one-row kernels' word pointers to word kw of every row: kw is a multiple of
    the step (a multiple of 4 words), so a step never crosses a 1 KB block's end and the shift is
    a multiple of 4 words (16-byte loads)."""
    return (kw // 8) * 256 + (kw // 4 % 2) * 4


@triton.jit
def _gemv_acc(acc, a_row, w_base, s_base, cols, K, stride_wt, stride_sg,
              GROUP: tl.constexpr, BLOCK_KW: tl.constexpr, RAW_A: tl.constexpr, CONVERT_ASM: tl.constexpr,
              PREFETCH: tl.constexpr = False, WAIT: tl.constexpr = False, kw_lo=0, kw_hi=None):
    """acc ([C, BLOCK_KW // 4] float32) plus the columns cols of one expert's
    packed weights (w_base, s_base: that expert's words and scales) dotted with one activation
    row over all of K: a_row points at the row in the operand order of _store_word_order, or,
    with RAW_A, at the row itself (_raw_word_dot). WAIT (PDL): the kernel's wait comes here,
    after the first step's weights and scales are loaded (with PREFETCH), before the first
    activation is read. kw_lo, kw_hi: the words of K this program takes (a split GEMM's
    slice; default all of them)."""
    KW = K // 8
    if kw_hi is None:
        kw_hi = KW
    CHUNKS: tl.constexpr = BLOCK_KW // 4
    offs_w = tl.arange(0, BLOCK_KW)
    # Word w of row n in the tiles: byte 4w of _tile_offsets, in words (8 words a row per block).
    # Written out in words: the same arithmetic through _tile_offsets / _tile_shift with a word
    # unit ran 17-37% slower on the H200 (PERFORMANCE.md round 14).
    w_ptrs = (w_base + (cols // 32)[:, None] * stride_wt + (offs_w // 8)[None, :] * 256
              + (cols % 32)[:, None] * 8 + (offs_w % 8)[None, :])
    if RAW_A:
        a_ptrs = a_row + (offs_w // 4 * 32 + offs_w % 4 * 4)[None, :]
    else:
        a_ptrs = a_row + offs_w[None, :]
    s_ptrs = s_base + cols[:, None]
    offs_ch = tl.arange(0, CHUNKS)
    if PREFETCH and not RAW_A:  # (fx forms its activations per step: it runs the plain loop)
        # Register double buffering: the next step's words, scales and activations are loaded
        # before this step's arithmetic, so each warp keeps its loads in flight while it
        # converts and multiplies. (Triton's pipeliner stages loads that feed no dot only when
        # the loop asks, tl.range(..., num_stages=S): a ring through shared memory, slower here at
        # every M measured, PERFORMANCE.md round 19g.)
        w = tl.load(w_ptrs + _word_shift(kw_lo)).to(tl.uint32, bitcast=True)
        s = tl.load(s_ptrs + ((kw_lo * 8 + offs_ch * 32) // GROUP)[None, :] * stride_sg)
        if WAIT:
            _gdc_wait()
        acts = _word_acts(a_ptrs + kw_lo, KW)
        for kw in range(kw_lo, kw_hi, BLOCK_KW):
            nk = kw + BLOCK_KW
            more = (nk + 0 * offs_w)[None, :] < kw_hi  # a tensor mask (the interpreter takes no scalar one)
            w_next = tl.load(w_ptrs + _word_shift(nk), mask=more).to(tl.uint32, bitcast=True)
            s_next = tl.load(s_ptrs + ((nk * 8 + offs_ch * 32) // GROUP)[None, :] * stride_sg,
                             mask=(nk + 0 * offs_ch)[None, :] < kw_hi)
            acts_next = _word_acts(a_ptrs + nk, KW, more)
            p = _word_dot_of(w, acts, CONVERT_ASM)
            chunk_sum = tl.sum(tl.reshape(p, (cols.shape[0], CHUNKS, 4)), axis=2)
            acc += s.to(tl.float32) * chunk_sum
            w = w_next
            s = s_next
            acts = acts_next
    else:
        if WAIT:
            _gdc_wait()
        for kw in range(kw_lo, kw_hi, BLOCK_KW):
            w = tl.load(w_ptrs + _word_shift(kw)).to(tl.uint32, bitcast=True)
            if RAW_A:
                p = _raw_word_dot(w, a_ptrs + kw * 8, CONVERT_ASM)
            else:
                p = _word_dot(w, a_ptrs + kw, KW, CONVERT_ASM)
            chunk_sum = tl.sum(tl.reshape(p, (cols.shape[0], CHUNKS, 4)), axis=2)
            g = (kw * 8 + offs_ch * 32) // GROUP
            s = tl.load(s_ptrs + g[None, :] * stride_sg).to(tl.float32)
            acc += s * chunk_sum
    return acc


@triton.jit
def _gemv_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    topk_ids_ptr,
    topk_weights_ptr,
    order_ptr,
    K,
    N,
    stride_am,
    stride_we,
    stride_wt,
    stride_se,
    stride_sg,
    stride_om,
    TOPK: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,
    GATE_UP: tl.constexpr,
    CONVERT_ASM: tl.constexpr,
    INTER_DTYPE: tl.constexpr,
    BY_EXPERT: tl.constexpr,
    RAW_A: tl.constexpr = False,
    SUM_TOPK: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    PDL: tl.constexpr = False,
    SPLIT: tl.constexpr = 1,
    stride_split=0,
    part_ptr=None,
    sem_ptr=None,
):
    """One slot x BLOCK_N output columns, reduced over all of K; with SPLIT, over one of K's
    SPLIT equal slices, the program's slice s = pid // (grid / SPLIT). GEMM2 stores its slice's
    result at out + s * stride_split for the top-k sum to add up; GEMM1 stores its gate and up
    sums in float32 at part_ptr (SPLIT rows a slot and column tile) and counts itself in on
    sem_ptr (an int32 a slot and column tile, zero before): the program that arrives last adds
    the SPLIT rows up in slice order, applies SiLU and stores as unsplit, and sets the count
    back to zero for the next forward.

    a: float32 activation rows in the order of _store_word_order. GATE_UP (GEMM1): a's row is
    the slot's token, w is w13, N = inter: the program dots gate columns n and up columns
    N + n and stores SiLU(gate) * up (rounded to INTER_DTYPE, the activations' dtype) at
    out[slot] in the same operand order for GEMM2 (BLOCK_N a multiple of 32); with RAW_A, a is
    x itself (its rows in their own order, no word-order step before). Otherwise (GEMM2): a's
    row is the slot, w is w2: stores the result times the slot's top-k weight at out[slot];
    with SUM_TOPK the program takes a token instead of a slot and sums its TOPK slots' weighted
    results into out[token] (no top-k sum step after). w_ptr: the stored tiles
    (quant.tile_packed) viewed as uint32 words, strides in words (stride_wt: per 32-row
    group). BY_EXPERT: the programs take the slots in the order of order_ptr (the slots
    grouped by expert, _scatter_kernel), so the slots that share an expert run side by side
    and its weights are read from DRAM once; otherwise in their own order. PDL: as GEMM2, or as
    GEMM1 after the word-order step, the program reads the routing and its first weights
    before it waits for the kernel before; the first
    kernel of a forward (GEMM1 on x's own rows, RAW_A) and the forms that read what the
    forward made before the weights (BY_EXPERT's order, SUM_TOPK) wait at once."""
    pid = tl.program_id(0)
    part = 0
    if SPLIT > 1:
        per_part = tl.num_programs(0) // SPLIT
        part = pid // per_part
        pid = pid % per_part
        if not GATE_UP:
            out_ptr += part.to(tl.int64) * stride_split
    num_n = N // BLOCK_N
    pid_n = pid % num_n
    CHUNKS: tl.constexpr = BLOCK_KW // 4
    EARLY: tl.constexpr = PDL and not (RAW_A or BY_EXPERT or SUM_TOPK)
    if EARLY:
        _gdc_launch_dependents()
    else:
        _pdl_enter(PDL)
    if SUM_TOPK:
        token = (pid // num_n).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in range(TOPK):
            slot = token * TOPK + k
            expert = tl.load(topk_ids_ptr + slot).to(tl.int64)
            acc = _gemv_acc(tl.zeros((BLOCK_N, CHUNKS), dtype=tl.float32), a_ptr + slot * stride_am,
                            w_ptr + expert * stride_we, s_ptr + expert * stride_se, cols, K, stride_wt, stride_sg,
                            GROUP, BLOCK_KW, False, CONVERT_ASM, PREFETCH)
            total += tl.sum(acc, axis=1) * tl.load(topk_weights_ptr + slot)
        tl.store(out_ptr + token * stride_om + cols, total.to(out_ptr.dtype.element_ty))
        return
    if BY_EXPERT:
        slot = tl.load(order_ptr + pid // num_n)
    else:
        slot = pid // num_n
    expert = tl.load(topk_ids_ptr + slot).to(tl.int64)
    if GATE_UP:
        row = (slot // TOPK).to(tl.int64)
        offs_c = tl.arange(0, 2 * BLOCK_N)
        cols = tl.where(offs_c < BLOCK_N, pid_n * BLOCK_N + offs_c, N + pid_n * BLOCK_N + offs_c - BLOCK_N)
    else:
        row = slot.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((cols.shape[0], CHUNKS), dtype=tl.float32)
    # The slice's words: whole steps (gemv_split), said so for the loads' width.
    part_kw = tl.multiple_of(K // 8 // SPLIT, BLOCK_KW)
    kw_lo = tl.multiple_of(part * part_kw, BLOCK_KW)
    acc = _gemv_acc(acc, a_ptr + row * stride_am, w_ptr + expert * stride_we, s_ptr + expert * stride_se, cols, K,
                    stride_wt, stride_sg, GROUP, BLOCK_KW, RAW_A, CONVERT_ASM, PREFETCH, EARLY,
                    kw_lo, tl.multiple_of(kw_lo + part_kw, BLOCK_KW))
    res = tl.sum(acc, axis=1)
    last = True
    if GATE_UP and SPLIT > 1:
        tile = slot.to(tl.int64) * num_n + pid_n
        offs_r = tl.arange(0, 2 * BLOCK_N)
        tl.store(part_ptr + (tile * SPLIT + part) * (2 * BLOCK_N) + offs_r, res)
        tl.debug_barrier()  # every thread's partial stored before the count is released
        last = tl.atomic_add(sem_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        if last:
            res = tl.zeros_like(res)
            for p in tl.static_range(SPLIT):  # in slice order: the same bits whoever arrives last
                res += tl.load(part_ptr + (tile * SPLIT + p) * (2 * BLOCK_N) + offs_r, cache_modifier=".cg")
            tl.atomic_xchg(sem_ptr + tile, 0, sem="relaxed", scope="gpu")
    if GATE_UP:
        if last:
            gate, up = tl.split(tl.trans(tl.reshape(res, (2, BLOCK_N))))
            h = (gate * tl.sigmoid(gate) * up).to(INTER_DTYPE).to(tl.float32)
            # Rounded as a stored intermediate would be, then kept in float32 operand order.
            _store_word_order(h, out_ptr + slot.to(tl.int64) * stride_om + pid_n * (BLOCK_N // 8), N // 8,
                              BLOCK_N // 32)
    else:
        weight = tl.load(topk_weights_ptr + slot)
        tl.store(out_ptr + slot.to(tl.int64) * stride_om + cols, (res * weight).to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------
# Block_m 8 rows: mma.sync with an expert's slots as the MMA's 8 columns (small M)
# ---------------------------------------------------------------------------
#
# A block of up to 8 sorted rows of one expert (block_m 8: _align_kernel / _scatter_kernel as
# for the tensor-core rows) is the N = 8 side of mma.sync.m16n8k16 (bf16 in, float32 out), the
# weights its M = 16 side: 16 output columns a row tile. Every element of the kernel's tensors
# is one thread ([32 * KSPLIT], one element a thread: lane = index % 32), so each inline PTX
# block below runs per thread on exactly that thread's MMA fragments; the KSPLIT warps of a
# program take K's 64-value blocks in equal runs and their sums meet at the end.
#
# Thread (g, t) = (lane // 4, lane % 4) of a row tile loads, per 32-value chunk of K, one packed
# word of column g and one of column g + 8: word t of the chunk (bytes 4t..4t+3, the values
# 4t..4t+3 in the low nibbles and 16+4t..16+4t+3 in the high ones, quant's layout). The nibbles
# under 0x000F000F after a shift of 0 / 8 / 4 / 12 are the K pairs (4t, 4t+2) / (4t+1, 4t+3) /
# (16+4t, 18+4t) / (17+4t, 19+4t), which become the A fragment's registers of two MMAs (the
# low and the high half of the chunk) with the MMA's K order permuted accordingly; the B
# fragment (token g's activations) is loaded in the same permuted order (two 8-byte loads and
# four byte permutes a chunk, shared by every row tile of the warp). Each nibble u becomes the
# exact bf16 128 + u by one lop3 (two a register); the 136 too much per value is taken off by
# starting each chunk's MMAs from -136 * (the chunk's activation sum), itself one MMA pair with
# a constant -136 operand per chunk, so the MMAs sum (u - 8) * x exactly in float32; the
# chunk's sum is then scaled by its group scale in float32 (one FMA per output value).
# Per row tile and chunk a thread issues 2 word loads, 2 scale loads, 6 shifts, 8 lop3,
# 2 mma.sync and 4 FMA for 16 weights.

_MMA8_BFRAG_PTX = tl.constexpr(
    "{ .reg .b32 r0, r1, r2, r3;\n"
    "mov.b64 {r0, r1}, $4;\n"
    "mov.b64 {r2, r3}, $5;\n"
    "prmt.b32 $0, r0, r1, 0x5410;\n"
    "prmt.b32 $1, r0, r1, 0x7632;\n"
    "prmt.b32 $2, r2, r3, 0x5410;\n"
    "prmt.b32 $3, r2, r3, 0x7632; }")

_MMA8_BIAS_PTX = tl.constexpr(
    "{ .reg .b32 a; .reg .f32 z, d0, d1, d2, d3, e2, e3;\n"
    "mov.b32 a, 0xC308C308;\n"
    "mov.f32 z, 0f00000000;\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d0, d1, d2, d3}, {a, a, a, a}, {$2, $3}, {z, z, z, z};\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, e2, e3}, {a, a, a, a}, {$4, $5}, {d0, d1, d2, d3}; }")

_MMA8_TILE_PTX = tl.constexpr(
    "{ .reg .b32 t1, t2, t3, u1, u2, u3, l0, l1, l2, l3, h0, h1, h2, h3; .reg .f32 d0, d1, d2, d3;\n"
    "shr.b32 t1, $4, 4;\n"
    "shr.b32 t2, $4, 8;\n"
    "shr.b32 t3, $4, 12;\n"
    "shr.b32 u1, $5, 4;\n"
    "shr.b32 u2, $5, 8;\n"
    "shr.b32 u3, $5, 12;\n"
    "lop3.b32 l0, $4, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 l1, $5, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 l2, t2, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 l3, u2, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 h0, t1, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 h1, u1, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 h2, t3, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 h3, u3, 0x000F000F, 0x43004300, 0xEA;\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d0, d1, d2, d3}, {l0, l1, l2, l3}, {$6, $7}, {$10, $11, $10, $11};\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d0, d1, d2, d3}, {h0, h1, h2, h3}, {$8, $9}, {d0, d1, d2, d3};\n"
    "fma.rn.f32 $0, d0, $12, $14;\n"
    "fma.rn.f32 $1, d1, $12, $15;\n"
    "fma.rn.f32 $2, d2, $13, $16;\n"
    "fma.rn.f32 $3, d3, $13, $17; }")


@triton.jit
def _mma8_bfrag(xa, xb):
    """Token g's activations of a chunk (xa: values 4t..4t+3, xb: 16+4t..16+4t+3, four bf16 in
    an int64 each) -> the B fragments of the chunk's low and high MMA (two bf16x2 each)."""
    return tl.inline_asm_elementwise(_MMA8_BFRAG_PTX, "=r,=r,=r,=r,l,l", [xa, xb], dtype=(tl.int32,) * 4,
                                     is_pure=True, pack=1)


@triton.jit
def _mma8_bias(bl0, bl1, bh0, bh1):
    """-136 times the chunk's activation sum for tokens 2t and 2t + 1 (the MMAs' starting sums)."""
    return tl.inline_asm_elementwise(_MMA8_BIAS_PTX, "=f,=f,r,r,r,r", [bl0, bl1, bh0, bh1],
                                     dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _mma8_tile(acc, w_lo, w_hi, b, c, s_lo, s_hi):
    """One row tile's chunk: acc (rows g / g + 8 x tokens 2t / 2t + 1) plus the chunk's scaled
    sums; w_lo / w_hi: the words of columns g and g + 8, b: _mma8_bfrag's fragments, c:
    _mma8_bias's sums, s_lo / s_hi: the two columns' group scales (float32)."""
    a0, a1, a2, a3 = acc
    bl0, bl1, bh0, bh1 = b
    c0, c1 = c
    return tl.inline_asm_elementwise(
        _MMA8_TILE_PTX, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f,f,f,f,f",
        [w_lo, w_hi, bl0, bl1, bh0, bh1, c0, c1, s_lo, s_hi, a0, a1, a2, a3],
        dtype=(tl.float32,) * 4, is_pure=True, pack=1)


@triton.jit
def _mma8_loads(w_ptrs, s_ptrs, x_ptrs, kb, stride_sg, RT: tl.constexpr):
    """One 64-value block kb of K: per chunk h (0, 1) token g's activations (two int64) and per
    row tile r < RT the words and scales of columns g and g + 8, as tuples."""
    xs = (tl.load(x_ptrs + kb * 16), tl.load(x_ptrs + kb * 16 + 4),
          tl.load(x_ptrs + kb * 16 + 8), tl.load(x_ptrs + kb * 16 + 12))
    ws = ()
    ss = ()
    for r in tl.static_range(RT):
        for h in tl.static_range(2):
            wp = w_ptrs[r] + kb * 256 + h * 4
            sp = s_ptrs[r] + (2 * kb + h) * stride_sg
            ws = ws + (tl.load(wp), tl.load(wp + 64))
            ss = ss + (tl.load(sp).to(tl.float32), tl.load(sp + 8).to(tl.float32))
    return xs, ws, ss


@triton.jit
def _mma8_block(accs, xs, ws, ss, RT: tl.constexpr):
    """accs (RT tuples of four) plus one 64-value block (_mma8_loads' values)."""
    for h in tl.static_range(2):
        b = _mma8_bfrag(xs[2 * h], xs[2 * h + 1])
        c = _mma8_bias(b[0], b[1], b[2], b[3])
        new = ()
        for r in tl.static_range(RT):
            # (Index expressions written out: a name bound to one is no longer a constant.)
            new = new + (_mma8_tile(accs[r], ws[4 * r + 2 * h], ws[4 * r + 2 * h + 1], b, c, ss[4 * r + 2 * h],
                                    ss[4 * r + 2 * h + 1]),)
        accs = new
    return accs


@triton.jit
def _mma8_kernel(x_ptr, w_ptr, s_ptr, out_ptr, topk_weights_ptr, sorted_slot_ptr, counts_ptr, starts_ptr, ends_ptr,
                 num_experts, K, N, stride_xm, stride_we, stride_wt, stride_se, stride_sg, stride_om,
                 TOPK: tl.constexpr, NUM_BINS: tl.constexpr, RT: tl.constexpr, KSPLIT: tl.constexpr,
                 GATE_UP: tl.constexpr, PDL: tl.constexpr = False):
    """One block of 8 sorted rows x RT row tiles of 16 columns (GEMM1: RT / 2 tiles of gate
    columns and the same columns of up), reduced over K by KSPLIT warps; see the section
    comment. x_ptr: the activations (GEMM1: x, rows by token; GEMM2: the intermediate, rows
    by sorted row) viewed as int64 (four bf16 a value), stride_xm in those units; w_ptr: the
    stored tiles as int32 words, stride_we / stride_wt in words. GEMM1 stores SiLU(gate) * up
    per sorted row, GEMM2 the result times the slot's top-k weight per slot."""
    _pdl_enter(PDL)
    NT: tl.constexpr = 32 * KSPLIT
    if GATE_UP:
        TILE: tl.constexpr = 8 * RT
    else:
        TILE: tl.constexpr = 16 * RT
    pid = tl.program_id(0)
    num_n = N // TILE
    pid_b = pid // num_n
    pid_n = pid % num_n
    expert, rows_used = _block_owner(pid_b, counts_ptr, starts_ptr, ends_ptr, num_experts, 8, NUM_BINS)
    if rows_used == 0:
        return
    expert = expert.to(tl.int64)
    idx = tl.arange(0, NT)
    lane = idx % 32
    warp = idx // 32
    g = lane // 4
    t = lane % 4
    row_ok = g < rows_used
    srow = pid_b * 8 + g
    if GATE_UP:
        slot = tl.load(sorted_slot_ptr + srow, mask=row_ok, other=0)
        xrow = (slot // TOPK).to(tl.int64)
    else:
        # Padded rows read a real row of the block: their MMA columns are never stored.
        xrow = tl.where(row_ok, srow, pid_b * 8).to(tl.int64)
    kblocks = K // 64
    per_warp = kblocks // KSPLIT
    kb0 = warp * per_warp
    x_ptrs = x_ptr + xrow * stride_xm + t
    w_ptrs = ()
    s_ptrs = ()
    for r in tl.static_range(RT):
        if GATE_UP:
            if r < RT // 2:
                col = pid_n * TILE + 16 * r + g
            else:
                col = N + pid_n * TILE + 16 * (r - RT // 2) + g
        else:
            col = pid_n * TILE + 16 * r + g
        w_ptrs = w_ptrs + (w_ptr + expert * stride_we + (col // 32) * stride_wt + (col % 32) * 8 + t,)
        s_ptrs = s_ptrs + (s_ptr + expert * stride_se + col,)
    zero = tl.zeros((NT,), dtype=tl.float32)
    accs = ()
    for r in tl.static_range(RT):
        accs = accs + ((zero, zero, zero, zero),)
    # Register double buffering: block kb + 1's loads are issued before block kb's arithmetic
    # (two blocks ahead took 144 registers at rt 4 and lost everywhere, PERFORMANCE.md round 20b).
    xs, ws, ss = _mma8_loads(w_ptrs, s_ptrs, x_ptrs, kb0, stride_sg, RT)
    for i in range(per_warp - 1):
        nxs, nws, nss = _mma8_loads(w_ptrs, s_ptrs, x_ptrs, kb0 + i + 1, stride_sg, RT)
        accs = _mma8_block(accs, xs, ws, ss, RT)
        xs, ws, ss = nxs, nws, nss
    accs = _mma8_block(accs, xs, ws, ss, RT)

    # The KSPLIT warps' sums meet; then per lane: rows g / g + 8 of each tile, tokens 2t / 2t + 1.
    lane1 = tl.arange(0, 32)
    g1 = lane1 // 4
    t1 = lane1 % 4
    sums = ()
    for r in tl.static_range(RT):
        a0, a1, a2, a3 = accs[r]
        sums = sums + ((tl.sum(tl.reshape(a0, (KSPLIT, 32)), axis=0), tl.sum(tl.reshape(a1, (KSPLIT, 32)), axis=0),
                        tl.sum(tl.reshape(a2, (KSPLIT, 32)), axis=0), tl.sum(tl.reshape(a3, (KSPLIT, 32)), axis=0)),)
    tok0 = 2 * t1
    ok0 = tok0 < rows_used
    ok1 = tok0 + 1 < rows_used
    if GATE_UP:
        rows0 = (pid_b * 8 + tok0).to(tl.int64)
        for r in tl.static_range(RT // 2):
            gate = sums[r]
            up = sums[r + RT // 2]
            col = pid_n * TILE + 16 * r + g1
            for j in tl.static_range(4):
                h = gate[j] * tl.sigmoid(gate[j]) * up[j]
                ptr = out_ptr + (rows0 + j % 2) * stride_om + col + (j // 2) * 8
                if j % 2 == 0:
                    tl.store(ptr, h.to(out_ptr.dtype.element_ty), mask=ok0)
                else:
                    tl.store(ptr, h.to(out_ptr.dtype.element_ty), mask=ok1)
    else:
        slot0 = tl.load(sorted_slot_ptr + pid_b * 8 + tok0, mask=ok0, other=0)
        slot1 = tl.load(sorted_slot_ptr + pid_b * 8 + tok0 + 1, mask=ok1, other=0)
        wt0 = tl.load(topk_weights_ptr + slot0, mask=ok0, other=0.0)
        wt1 = tl.load(topk_weights_ptr + slot1, mask=ok1, other=0.0)
        for r in tl.static_range(RT):
            col = pid_n * TILE + 16 * r + g1
            for j in tl.static_range(4):
                if j % 2 == 0:
                    ptr = out_ptr + slot0.to(tl.int64) * stride_om + col + (j // 2) * 8
                    tl.store(ptr, (sums[r][j] * wt0).to(out_ptr.dtype.element_ty), mask=ok0)
                else:
                    ptr = out_ptr + slot1.to(tl.int64) * stride_om + col + (j // 2) * 8
                    tl.store(ptr, (sums[r][j] * wt1).to(out_ptr.dtype.element_ty), mask=ok1)


# ---------------------------------------------------------------------------
# Tile configurations
# ---------------------------------------------------------------------------

# Per M bucket (largest M the row covers): rows per block (shared by both GEMMs), then per
# GEMM: bn columns per program, bk reduction rows per pipelined step (a multiple of the group
# size), warps, pipeline stages, and how the int4 tile meets the tensor core:
#   post   the dot runs on the integers, scales are applied to its result once per group
#          (cheapest when a block has few rows);
#   whole  (without post) the whole bk x bn tile is scaled before one dot per step;
#          otherwise one scaled group at a time;
#   swap   the dot is issued transposed, the weight tile as its left operand (on an H100/H200
#          this is what gets the warp-group MMA with the weights in registers);
#   split  split-K: that many programs share each output tile, each reducing one K slice into
#          float32 partials (GEMM1: a small kernel adds them and applies SiLU-and-mul; GEMM2:
#          the top-k sum adds them) -- more bytes in flight when there are few tiles (small M);
#   asm    PTX for the nibble conversion and the bf16 scaling (_dequant, _scaled);
#   gu     (GEMM1) gate and up tiles as one [.., 2 * bn] operand, one dot per step.
# Rows with block_m 1 and `gemv` in both GEMMs run the one-row kernels instead (_gemv_kernel:
# bn output columns per program, GEMM1's gate and up each; bkw 32-bit words of packed weights
# per column and step, a multiple of 4: whole 32-value chunks; warps; sort (GEMM1's entry
# decides for both): the programs take the slots grouped by expert, worth its two extra
# launches once slots start to share experts; fx (GEMM1): x's rows read as they are, no
# word-order launch; fsum (GEMM2): a program per token's columns over its top-k slots, no top-k
# sum launch, bn in runs of 16. Both lost at kimi-k2.6 M=1-32 (PERFORMANCE.md round 17: the
# scattered activation loads and the serial slots cost more than the launches): no row uses them;
# pf: each step's words, scales and activations loaded one step ahead into registers (register
# double buffering), so a warp's loads stay in flight while it converts and multiplies: at
# kimi-k2.6 M=1 82.5 -> 76.3 us, --tp 8 M=1 40.3 -> 32.3 us (PERFORMANCE.md round 18); with it
# bkw 32 (GEMM1 127 registers: four programs per SM), or 64 on small grids, and two warps with
# bkw 16 on large ones (fit_to_device; PERFORMANCE.md round 19).
# The rows' tiles were chosen on one H200 at the kimi-k2.6 shape with `tools/kernel_sweep.py
# --variants` (every candidate checked against the float32 reference, then each GEMM timed
# alone); which row runs at which M is decided by slots per expert (see "Tiles by shape and
# device" below), from whole-forward sweeps of five preset shapes (tools/shape_sweep.py,
# PERFORMANCE.md round 15). Swapped (warp-group MMA) rows run overlapped where their compiled
# code passes the race check (TritonW4A16MoE._launch, moe_bench.sass), else serialised.
ONE_ROW = dict(block_m=1,
               g1=dict(gemv=True, bn=32, bkw=32, warps=4, stages=1, asm=True, pf=True),
               g2=dict(gemv=True, bn=64, bkw=32, warps=4, stages=1, asm=True, pf=True))
# The tensor-core rows: GEMM1 gate and up as one tile, both GEMMs swapped (warp-group MMA
# with the weights in registers); block_m 64 steps GEMM1 by 64 K values instead of 128.
_GEMM1_BK128 = dict(bn=64, bk=128, warps=4, stages=3, post=False, whole=True, swap=True, split=1, asm=True, gu=True)
_GEMM1_BK64 = dict(_GEMM1_BK128, bk=64)
_GEMM2 = dict(bn=128, bk=64, warps=4, stages=4, post=False, whole=True, swap=True, split=1, asm=True)
TENSOR_BM16 = dict(block_m=16, g1=_GEMM1_BK128, g2=_GEMM2)
# The block_m 8 rows (mma.sync, an expert's slots as the MMA's 8 columns: _mma8_kernel): per
# GEMM rt row tiles of 16 columns a program (GEMM1: rt / 2 gate and as many up tiles), K shared
# by ksplit warps, the next 64-value block's loads issued before a block's arithmetic. On a GPU
# without mma.sync for bf16 (before sm_80) or under Triton's interpreter (it runs no PTX) the
# block_m 16 row runs in their place (TritonW4A16MoE._config).
MMA8 = dict(block_m=8, g1=dict(mma8=True, gate_up=True, rt=4, ksplit=4), g2=dict(mma8=True, rt=4, ksplit=4))
TENSOR_BM32 = dict(block_m=32, g1=_GEMM1_BK128, g2=_GEMM2)
TENSOR_BM64 = dict(block_m=64, g1=_GEMM1_BK64, g2=_GEMM2)

# Slots per expert (M * topk / experts) up to which each row runs; past the last, block_m 64.
# Measured (round 15): the one-row kernels win only while nearly every slot has an expert of
# its own (kimi-k2.6 M=4, 0.08 per expert: 269 against 274 us; M=8, 0.17: 507 against 488 us
# for block_m 16); block_m 16 wins up to 11 per expert (kimi-k2.6 M=512) and loses from 16
# (deepseek-v3 M=512: 3122 against 2613 us for block_m 32); block_m 32 wins at 21 (kimi-k2.6
# M=1024: 4130 against 4668 us for 64) and loses at 32 (deepseek-v3 M=1024, qwen3 M=512,
# mixtral M=128). Round 19: with the prefetching one-row kernels on two warps where their grids
# are large (fit_to_device) the one-row range reaches 0.25 per expert: kimi-k2.6 M=12 716 against
# 729 us for block_m 16, M=8 457-492 against 492-503 in three comparisons of four (the fourth 517
# against 495, its rounds 467-523), --tp 8 M=8 / 12 78 / 110 against 92 / 130,
# deepseek-v3 M=4 252 against 272, qwen3-235b-a22b M=2 / 4 66 / 119 against 73 / 125,
# mixtral-8x7b M=1 104 against 132; it lost at 0.33 (kimi-k2.6 M=16: 1018 against 938 us).
# Round 20: the block_m 8 rows win from past the one-row range to 4 slots per expert on layers
# of at least 1024 intermediate columns (kimi-k2.6 M=12-128 2-10% faster than the one-row and
# block_m 16 rows, deepseek-v3 M=8-128 2-6%, mixtral-8x7b M=2-16 11-19%, qwen3-235b-a22b M=8-64
# within 2%), and lose at 8 per expert (mixtral-8x7b M=32: 381 against 302 us) and on the --tp 8
# shards' 256 columns (kimi-k2.6 --tp 8 M=16 / 64: 196 / 480 against 154 / 356 us), where
# GEMM2's K is four 64-value blocks (one a warp: nothing to load ahead).
# Below them the one-row rows keep M with fewer than MMA8_MIN_SLOTS slots (M * topk): the
# block_m 8 rows' two grouping launches and fewer, longer programs cost more than the slots
# sharing an expert save there (kimi-k2.6 M=4 253 against 244 us, qwen3-235b-a22b M=4 123
# against 119, mixtral-8x7b M=1 107 against 105; at 64 slots kimi-k2.6 M=8 471 against 472,
# deepseek-v3 M=8 467 against 477; at 96, kimi-k2.6 M=12, 675 against 693).
SLOTS_PER_EXPERT_ROWS = ((0.25, ONE_ROW), (4.0, MMA8), (12.0, TENSOR_BM16), (24.0, TENSOR_BM32))
MMA8_MIN_INTER = 1024
MMA8_MIN_SLOTS = 64


def mma8_shape_error(shape: quant.MoEShape) -> str | None:
    """Why the block_m 8 rows cannot run this shape (None: they can): K and N of both GEMMs
    in whole 64-value blocks, and a group of 32 (the kernel reads one scale row per 32-value
    chunk; every preset's group, the only one measured on a GPU)."""
    if shape.group_size != 32:
        return f"group size {shape.group_size} (the block_m 8 kernel takes 32): the block_m 16 row ran in its place"
    for name in ("hidden", "inter"):
        if getattr(shape, name) % 64:
            return f"{name} {getattr(shape, name)} is not a multiple of 64: the block_m 16 row ran in its place"
    return None


def gemv_split(g: dict, k: int) -> int:
    """The K slices a one-row GEMM takes (its "split", default 1), lowered until each slice is
    a whole number of its steps (bkw words)."""
    split = max(1, int(g.get("split", 1)))
    while split > 1 and (k // 8) % (split * g["bkw"]):
        split -= 1
    return split


def _row_applies(shape: quant.MoEShape, entry: dict) -> bool:
    """Whether a rule row fits the shape: the block_m 8 rows need K and N in whole 64-value
    blocks and at least MMA8_MIN_INTER intermediate columns."""
    if entry["g1"].get("mma8"):
        return shape.inter >= MMA8_MIN_INTER and mma8_shape_error(shape) is None
    return True


def table_by_slots_per_expert(shape: quant.MoEShape) -> list[tuple[int, dict]]:
    """SLOTS_PER_EXPERT_ROWS at this shape's M: each row up to the M where M * topk / experts
    reaches its limit (rows that would cover no M, or do not fit the shape, dropped), block_m
    64 after the last."""
    table, previous = [], 0
    mma8 = _row_applies(shape, MMA8)
    for per_expert, entry in SLOTS_PER_EXPERT_ROWS:
        if not _row_applies(shape, entry):
            continue
        limit = int(per_expert * shape.experts / shape.topk + 1e-9)
        if entry is ONE_ROW and mma8:
            limit = min(limit, (MMA8_MIN_SLOTS - 1) // shape.topk)
        if limit > previous:
            table.append((limit, entry))
            previous = limit
    table.append((1 << 62, TENSOR_BM64))
    return table


# The kimi-k2.6 table (M <= 7 one-row, <= 192 block_m 8, <= 576 block_m 16, <= 1152 block_m 32,
# then 64).
TILE_TABLE: list[tuple[int, dict]] = table_by_slots_per_expert(
    quant.MoEShape(experts=384, hidden=7168, inter=2048, topk=8, group_size=32))

# The presets' shipped tables, by layer shape (`--tp 1` and `--tp 8`), each measured on an
# H200 at its own shape (round 15: every M's winner agreed with the slots-per-expert rule, so
# each table is that rule's output, fixed here so that a later change of the rule for other
# shapes leaves the measured presets alone; round 19 moved the one-row limit of all of them,
# measured at each preset's shape on one H200; round 20 put the block_m 8 rows into those of
# at least 1024 intermediate columns). kimi-k2.6's is TILE_TABLE itself (a tuning
# script that edits TILE_TABLE in place edits it).
PRESET_TABLES: dict[quant.MoEShape, list[tuple[int, dict]]] = {
    quant.MoEShape(experts=384, hidden=7168, inter=2048, topk=8, group_size=32): TILE_TABLE,
    # kimi-k2.6 --tp 8 (inter 256): the same slots per expert, the same M limits.
    quant.MoEShape(experts=384, hidden=7168, inter=256, topk=8, group_size=32):
        [(12, ONE_ROW), (576, TENSOR_BM16), (1152, TENSOR_BM32), (1 << 62, TENSOR_BM64)],
    # deepseek-v3 (and --tp 8): 256 experts, top-8.
    quant.MoEShape(experts=256, hidden=7168, inter=2048, topk=8, group_size=32):
        [(7, ONE_ROW), (128, MMA8), (384, TENSOR_BM16), (768, TENSOR_BM32), (1 << 62, TENSOR_BM64)],
    quant.MoEShape(experts=256, hidden=7168, inter=256, topk=8, group_size=32):
        [(8, ONE_ROW), (384, TENSOR_BM16), (768, TENSOR_BM32), (1 << 62, TENSOR_BM64)],
    # qwen3-235b-a22b (and --tp 8): 128 experts, top-8.
    quant.MoEShape(experts=128, hidden=4096, inter=1536, topk=8, group_size=32):
        [(4, ONE_ROW), (64, MMA8), (192, TENSOR_BM16), (384, TENSOR_BM32), (1 << 62, TENSOR_BM64)],
    quant.MoEShape(experts=128, hidden=4096, inter=192, topk=8, group_size=32):
        [(4, ONE_ROW), (192, TENSOR_BM16), (384, TENSOR_BM32), (1 << 62, TENSOR_BM64)],
    # mixtral-8x7b (and --tp 8): 8 experts, top-2: every M has slots sharing an expert.
    quant.MoEShape(experts=8, hidden=4096, inter=14336, topk=2, group_size=32):
        [(1, ONE_ROW), (16, MMA8), (48, TENSOR_BM16), (96, TENSOR_BM32), (1 << 62, TENSOR_BM64)],
    quant.MoEShape(experts=8, hidden=4096, inter=1792, topk=2, group_size=32):
        [(1, ONE_ROW), (16, MMA8), (48, TENSOR_BM16), (96, TENSOR_BM32), (1 << 62, TENSOR_BM64)],
}

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _asm_enabled(gemm: dict) -> bool:
    """The PTX nibble conversion runs on a GPU only; Triton's interpreter falls back to the
    equivalent 16-bit operations (same bits), so a table row that asks for it still runs there."""
    return bool(gemm.get("asm", False)) and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _largest_dividing(preferred: int, size: int, floor: int) -> int:
    tile = max(preferred, floor)
    while tile > floor and size % tile:
        tile //= 2
    if size % tile:
        raise ValueError(f"no tile of at least {floor} divides {size}")
    return tile


def _check_shape(shape: quant.MoEShape) -> None:
    shape.validate()
    error = quant.triton_shape_error(shape)
    if error:
        raise ValueError(error)
    # hidden and inter are multiples of the group (shape.validate), so of 32: every 32-value
    # pairing chunk of the packed layout is whole and lies inside one group.


def _fit_mma8(gemm: dict, k: int, n: int) -> dict:
    """A block_m 8 row's GEMM fitted to k and n: K in whole 64-value blocks shared by ksplit
    warps (a power of two dividing them), rt row tiles of 16 columns (GEMM1, gate_up: rt / 2
    gate and as many up tiles, so 8 * rt columns) dividing n."""
    if k % 64:
        raise ValueError(f"the block_m 8 rows need K in whole 64-value blocks, got K={k}")
    gate_up = bool(gemm.get("gate_up", False))
    least, width = (2, 8) if gate_up else (1, 16)
    rt = max(least, int(gemm["rt"]))
    while rt > least and n % (width * rt):
        rt //= 2
    if n % (width * rt):
        raise ValueError(f"the block_m 8 rows need N a multiple of {width * rt}, got N={n}")
    ksplit = max(1, int(gemm.get("ksplit", 4)))
    while ksplit > 1 and (k // 64) % ksplit:
        ksplit //= 2
    return dict(gemm, rt=rt, ksplit=ksplit)


def _fit(gemm: dict, k: int, n: int, group: int) -> dict:
    """Shrink a table entry's tiles until they divide this GEMM's k and n."""
    if gemm.get("mma8"):
        return _fit_mma8(gemm, k, n)
    if gemm.get("gemv"):
        # One-row kernels: whole 32-value chunks (4 words) per step, columns in runs of 32.
        # GEMM2 with `fsum` (no word-order store after it) takes columns in runs of 16.
        return dict(gemm, bn=_largest_dividing(gemm["bn"], n, 16 if gemm.get("fsum") else 32),
                    bkw=_largest_dividing(gemm["bkw"], k // 8, 4),
                    asm=bool(gemm.get("asm", False)))
    bn = _largest_dividing(gemm["bn"], n, 32)
    # The K step is whole groups: k is a multiple of the group, so the group itself always fits.
    bk = group * _largest_dividing(max(1, gemm["bk"] // group), k // group, 1)
    # Split-K: each slice is a whole number of bk steps.
    split = max(1, gemm.get("split", 1))
    while split > 1 and (k // bk) % split:
        split -= 1
    return dict(gemm, bn=bn, bk=bk, split=split, asm=bool(gemm.get("asm", False)))


# ---------------------------------------------------------------------------
# Tiles by shape and device
# ---------------------------------------------------------------------------
#
# What decides each M's path is how many of its (token, expert) slots share an expert: the
# one-row kernels pay per slot (each slot streams its expert's weights), the tensor-core
# kernels per block of block_m rows of one expert (padding included). So a shape's table
# follows from its slots per expert, M * topk / experts (SLOTS_PER_EXPERT_ROWS); presets ship
# their measured tables (PRESET_TABLES), any other shape takes the rule
# (table_by_slots_per_expert). Then the device, read at run time (device_limits), adjusts a
# row (fit_to_device): GEMM1 (the one-row kernels' and, on layers of few column tiles and slots
# per expert, the block_m 16 one) takes bn 32 instead of 64 when bn 64 would give fewer than four
# programs per SM (and the prefetching one-row GEMM1 takes 64 words a step on grids of fewer than
# three programs per SM; each prefetching one-row GEMM takes two warps and 16 words a step on
# grids of at least five per SM, and splits its K on grids of fewer programs than SMs), and a
# tensor-core row's stages drop until its pipelined tiles fit the device's shared memory (an
# sm_120 or sm_89 block gets 99 KB, an H100/H200 227 KB).

@dataclass(frozen=True)
class DeviceLimits:
    """What the tile choice reads off the GPU at run time."""

    name: str
    capability: tuple[int, int]
    sm_count: int
    smem_per_block: int  # bytes of shared memory one block may have (the opt-in maximum)


# An H200, for choices made without a device (the CPU, tools that only compile).
H200_LIMITS = DeviceLimits("NVIDIA H200 (assumed)", (9, 0), 132, 232448)


def device_limits(device) -> DeviceLimits | None:
    """The GPU's SM count and shared memory per block; None off a CUDA device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
    if not smem:
        try:
            smem = int(triton.runtime.driver.active.utils.get_device_properties(device.index or 0)["max_shared_mem"])
        except Exception:
            smem = 48 * 1024  # what every CUDA GPU allows without opting in
    return DeviceLimits(props.name, (props.major, props.minor), props.multi_processor_count, smem)


def _stage_bytes(block_m: int, g: dict, gate_up: bool) -> int:
    """Shared memory of one pipeline stage of a tensor-core GEMM: the activation tile (bf16),
    the packed weight bytes and the scales (an upper estimate: the compiler may keep one
    stage fewer in shared memory)."""
    columns = g["bn"] * (2 if gate_up else 1)
    return block_m * g["bk"] * 2 + g["bk"] // 2 * columns + g["bk"] // 32 * columns * 2


def fit_to_device(cfg: dict, limits: DeviceLimits | None, shape: quant.MoEShape, m: int) -> dict:
    """A table row's configuration adjusted to the device (see the section comment)."""
    if limits is None or cfg["g1"].get("mma8"):
        return cfg
    cfg = dict(cfg)
    if cfg["g1"].get("gemv"):
        g1 = cfg["g1"]

        def programs(g, n=shape.inter):  # a one-row GEMM's grid: a program per slot and column tile
            return m * shape.topk * (n // g["bn"])

        while g1["bn"] > 32 and programs(g1) < 4 * limits.sm_count and shape.inter % (g1["bn"] // 2) == 0:
            g1 = dict(g1, bn=g1["bn"] // 2)
        # The prefetching GEMM1 (pf) on a grid of fewer than three programs per SM (the --tp 8
        # shards at M <= 4, qwen3-235b-a22b M=1) takes 64 words a step: fewer programs per SM
        # fit (168 registers), each with twice the bytes in flight. Measured (PERFORMANCE.md
        # round 18): kimi-k2.6 --tp 8 M=1 32.3 against 37.6 us, qwen3-235b-a22b M=1 39.5 against
        # 40.8; with more programs bkw 32 wins (kimi-k2.6 M=1, 512 programs: 76.3 against 85.4).
        if g1.get("pf") and g1["bkw"] < 64 and programs(g1) < 3 * limits.sm_count and (shape.hidden // 8) % 64 == 0:
            g1 = dict(g1, bkw=64)
        # On a grid of at least five programs per SM a prefetching GEMM takes two warps and 16
        # words a step: the same registers per thread (128) and warps per SM, half the threads
        # per program. Measured (PERFORMANCE.md round 19): kimi-k2.6 M=2 / 4 131 / 248 against
        # 138 / 260 us, --tp 8 M=8 77 against 92 (block_m 16), qwen3-235b-a22b M=2 65 against
        # 72; with fewer programs four warps win (kimi-k2.6 M=1, GEMM1's 512 programs: 76
        # against 86 us). Why is not established: the per-step barrier of the four-warp loop
        # was the first guess, but a loop without it was not faster (round 19f).
        g2 = cfg["g2"]
        for which, g, grid in (("g1", g1, programs(g1)), ("g2", g2, programs(g2, shape.hidden))):
            if g.get("pf") and g["warps"] == 4 and 16 <= g["bkw"] <= 32 and grid >= 5 * limits.sm_count:
                cfg[which] = dict(g, warps=2, bkw=16)
            else:
                cfg[which] = g
        # A one-row GEMM on a grid of fewer programs than the device has SMs splits its K in 2 (or
        # 4) slices until it has as many (gemv_split; a row that names its split keeps it).
        # Measured (PERFORMANCE.md round 31, H100): kimi-k2.6 --tp 8 M=1 (GEMM1: 64 programs)
        # 21.1 against 27.5 us, mixtral-8x7b M=1 (GEMM2: 128 programs) 91.4 against 116.8; on
        # grids of 2-7 programs per SM a split was 1-7% slower (kimi-k2.6 and deepseek-v3 M=1-4,
        # qwen3-235b-a22b M=1-2, --tp 8 M=4).
        for which, n, k in (("g1", shape.inter, shape.hidden), ("g2", shape.hidden, shape.inter)):
            g = cfg[which]
            if "split" in g or g.get("fsum"):
                continue
            split = 1
            while split < 4 and programs(g, n) * split < limits.sm_count and gemv_split(dict(g, split=2 * split), k) == 2 * split:
                split *= 2
            if split > 1:
                cfg[which] = dict(g, split=split)
        return cfg
    # GEMM1's programs on a block_m 16 row are blocks (about one per expert touched) times inter /
    # bn column tiles. Where a layer has few column tiles (inter / 64 <= 8: the --tp 8 shards) and
    # few slots per expert (<= 0.5), bn 64 can leave fewer than four programs per SM (kimi-k2.6
    # --tp 8 M=16: about 460): bn 32 doubles them. Measured (PERFORMANCE.md round 17): kimi-k2.6
    # --tp 8 M=16 154 against 163 us, deepseek-v3 --tp 8 M=4 / 16 61 / 149 against 65 / 152,
    # qwen3-235b-a22b --tp 8 M=2-8 10-15% faster; no measured M lost more than 1%. With more
    # column tiles or more slots per expert bn 32 lost (qwen3-235b-a22b M=2, --tp 8 M=16-128;
    # mixtral-8x7b --tp 8 M=16-32: 3-14% slower), so those keep bn 64.
    slots_per_expert = m * shape.topk / shape.experts
    if cfg["block_m"] == 16 and shape.inter // 64 <= 8 and slots_per_expert <= 0.5:
        blocks = perfmodel.expected_distinct_experts(shape, m)
        g1 = cfg["g1"]
        while g1["bn"] > 32 and blocks * (shape.inter // g1["bn"]) < 4 * limits.sm_count \
                and shape.inter % (g1["bn"] // 2) == 0:
            g1 = dict(g1, bn=g1["bn"] // 2)
        cfg["g1"] = g1
    for which, gate_up in (("g1", True), ("g2", False)):
        g = cfg[which]
        while g["stages"] > 2 and g["stages"] * _stage_bytes(cfg["block_m"], g, gate_up) > limits.smem_per_block:
            g = dict(g, stages=g["stages"] - 1)
        cfg[which] = g
    return cfg


def mma8_unavailable_reason(limits: DeviceLimits | None, env: dict | None = None) -> str | None:
    """Why the block_m 8 rows cannot run here (None: they can): their kernel is inline PTX
    (mma.sync with bf16 operands, sm_80 and later), which Triton's interpreter does not run."""
    env = os.environ if env is None else env
    if env.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "Triton's interpreter runs no PTX: the block_m 16 row ran in its place"
    if limits is None:
        return "no CUDA device: the block_m 16 row ran in its place"
    if tuple(limits.capability) < (8, 0):
        return (f"sm_{limits.capability[0]}{limits.capability[1]} has no bf16 mma.sync: the block_m 16 row ran "
                "in its place")
    return None


def pdl_unavailable_reason(limits: DeviceLimits | None, env: dict | None = None) -> str | None:
    """Why the forward's kernels launch without programmatic dependent launch here (None:
    they take it): it needs Hopper or later, a Triton with griddepcontrol (3.4 on), and a GPU
    (the interpreter runs no PTX); MOE_BENCH_PDL=0 turns it off."""
    env = os.environ if env is None else env
    if env.get("MOE_BENCH_PDL", "1") == "0":
        return "MOE_BENCH_PDL=0"
    if env.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "Triton's interpreter runs no PTX"
    if PDL_IMPORT_ERROR:
        return f"this Triton has no griddepcontrol ({PDL_IMPORT_ERROR})"
    if limits is None:
        return "no CUDA device"
    if tuple(limits.capability) < (9, 0):
        return f"sm_{limits.capability[0]}{limits.capability[1]} has no programmatic dependent launch (sm_90 on)"
    return None


def table_for(shape: quant.MoEShape, limits: DeviceLimits | None = None) -> list[tuple[int, dict]]:
    """The shipped table of a preset's shape, else the rule's (table_by_slots_per_expert).
    limits: the device's, for a rule that would depend on them (none does yet: fit_to_device
    adjusts each M's row)."""
    table = PRESET_TABLES.get(shape)
    return table if table is not None else table_by_slots_per_expert(shape)


def _config_for(shape: quant.MoEShape, m: int, table=None) -> dict:
    table = table_for(shape) if table is None else table
    for limit, entry in table:
        if m <= limit:
            break
    if entry["g1"].get("mma8") and mma8_shape_error(shape):
        # (A rule table never gives such a shape these rows: _row_applies.)
        return dict(_config_for(shape, m, [(1 << 62, TENSOR_BM16)]), mma8_fallback=mma8_shape_error(shape))
    return dict(
        block_m=entry["block_m"],
        g1=_fit(entry["g1"], shape.hidden, shape.inter, shape.group_size),
        g2=_fit(entry["g2"], shape.inter, shape.hidden, shape.group_size),
    )


def tile_configs(shape: quant.MoEShape, m_list, limits: DeviceLimits | None = None) -> dict[int, dict]:
    """The tile configuration each M runs with at this shape (on a device with these limits:
    fit_to_device; none given, as the table has it)."""
    _check_shape(shape)
    table = table_for(shape, limits)
    return {int(m): fit_to_device(_config_for(shape, int(m), table), limits, shape, int(m)) for m in m_list}


def _padded_rows(shape: quant.MoEShape, m: int, block_m: int) -> int:
    slots = m * shape.topk
    return slots + min(shape.experts, slots) * (block_m - 1)


def _max_block_m(m: int, table=None) -> int:
    table = TILE_TABLE if table is None else table
    largest = 0
    for limit, entry in table:
        # A block_m 8 row keeps room for the block_m 16 row that takes its place off a GPU
        # with mma.sync (TritonW4A16MoE._config).
        largest = max(largest, 16 if entry["g1"].get("mma8") else entry["block_m"])
        if m <= limit:
            break
    return largest


def _split_partial_elems(shape: quant.MoEShape, m: int, block_m: int, g1: dict, g2: dict) -> tuple[int, int]:
    """float32 elements of the split-K partial buffers of GEMM1 and GEMM2 for m tokens (0 unsplit)."""
    g1_elems = g2_elems = 0
    if g1.get("split", 1) > 1:
        rows = triton.cdiv(_padded_rows(shape, m, block_m), block_m) * block_m
        g1_elems = g1["split"] * rows * 2 * shape.inter
    if g2.get("split", 1) > 1:
        g2_elems = g2["split"] * m * shape.topk * shape.hidden
    return g1_elems, g2_elems


def _max_split_elems(shape: quant.MoEShape, m: int, table=None) -> tuple[int, int]:
    """The largest split-K partial buffers any table row that covers some M <= m needs."""
    table = table_for(shape) if table is None else table
    g1_max = g2_max = 0
    for limit, entry in table:
        covered = min(limit, m)
        cfg = _config_for(shape, covered, table)
        g1_elems, g2_elems = _split_partial_elems(shape, covered, cfg["block_m"], cfg["g1"], cfg["g2"])
        g1_max, g2_max = max(g1_max, g1_elems), max(g2_max, g2_elems)
        if m <= limit:
            break
    return g1_max, g2_max


def _gemv_max_m(m: int, table=None) -> int:
    """The largest M <= m that runs the one-row kernels (0 if none does)."""
    table = TILE_TABLE if table is None else table
    largest, previous = 0, 0
    for limit, entry in table:
        if previous >= m:
            break
        if entry["g1"].get("gemv"):
            largest = min(limit, m)
        previous = limit
    return largest


def _word_order_elems(shape: quant.MoEShape, m: int) -> tuple[int, int]:
    """float32 elements of the one-row kernels' operand buffers for m tokens: x's rows and
    the intermediate's (one per slot), 9 floats per packed word (see _store_word_order)."""
    return m * 9 * (shape.hidden // 8), m * shape.topk * 9 * (shape.inter // 8)


def workspace_bytes(shape: quant.MoEShape, m: int, dtype_bytes: int = 2) -> int:
    """Device bytes of the workspace for up to m tokens, output excluded."""
    table = table_for(shape)
    block_m = _max_block_m(m, table)
    padded = _padded_rows(shape, m, block_m)
    return (
        4 * (padded + 4 * shape.experts + 1024)  # sorted slots, per-expert counts/starts/ends/cursors
        + 4 * (_align_part_elems(m * shape.topk, num_bins(shape)) + 1)  # the grouping's counts, ticket
        + 4 * _block_table_elems(shape, m)  # the block table after the ends
        + padded * shape.inter * dtype_bytes  # SiLU(gate) * up per sorted row
        + m * shape.topk * shape.hidden * dtype_bytes  # weighted GEMM2 output per slot
        + 4 * sum(_max_split_elems(shape, m, table))  # float32 split-K partial sums (small M only)
        + 4 * sum(_word_order_elems(shape, _gemv_max_m(m, table)))  # one-row kernels' operands (small M only)
    )


# The fewest bins (NUM_BINS): one per thread of a four-warp program. With fewer, each thread
# holds every bin of _block_owner's count, and ptxas parked a value in local memory to keep the
# block_m 8 GEMM1 at 128 registers on sm_90 (mixtral-8x7b's 8 experts, 16 bins, Triton 3.6;
# no frame from 128 bins). The price: the 128-wide sum crosses warps, mixtral-8x7b M=2-16 was
# 0.4-1.0% slower on an H200 (PERFORMANCE.md round 33); the other presets had 256 bins or more.
MIN_BINS = 128


def num_bins(layer: quant.MoEShape) -> int:
    """The expert histogram's bins (NUM_BINS): a power of two above the layer's expert count,
    so the last bin is never an expert, and at least MIN_BINS."""
    return max(MIN_BINS, triton.next_power_of_2(layer.experts + 1))


# ---------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------

# The Gluon path's first-call check: its output against the plain-Triton path's on the same
# inputs. Each lands 2e-3 to 4e-3 from the float32 reference (bf16 operands, float32
# accumulation; PERFORMANCE.md), so two correct paths differ by about 5e-3; an indexing or
# synchronisation fault gives O(1).
GLUON_TOLERANCE = 2e-2


def gluon_check_error(out: torch.Tensor, ref: torch.Tensor) -> float | None:
    """||out - ref|| / ||ref|| in float64; None when out holds a non-finite value."""
    out = out.double()
    ref = ref.double()
    if not torch.isfinite(out).all():
        return None
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))



class TritonW4A16MoE:
    """Fused W4A16 MoE forward on packed int4 weights; see the module docstring."""

    def __init__(self, weights: quant.MoEWeights, max_m: int, table=None, gluon: bool = True,
                 layer: quant.MoEShape | None = None, pdl: bool = True, fit_device: bool | None = None):
        _check_shape(weights.shape)
        if max_m < 1:
            raise ValueError(f"max_m must be at least 1, got {max_m}")
        self.weights = weights
        self.shape = weights.shape
        # The layer whose kernels run (a rehearsal holds fewer experts than its layer, see
        # quant.rehearsal_layer_error): every compile-time choice (the table row per M, NUM_BINS,
        # the Gluon path's range) follows the layer, so the rehearsal compiles exactly the
        # kernels the layer's run will find in Triton's cache; only buffer sizes follow the
        # experts held.
        self.layer = self.shape if layer is None else layer
        if self.layer != self.shape:
            error = quant.rehearsal_layer_error(self.shape, self.layer)
            if error:
                raise ValueError(error)
        self.max_m = max_m
        device = weights.w13.packed.device
        # The shape's table fitted to the device it runs on (read here, at run time); a table
        # given by the caller (tests, tuning scripts) runs as given.
        self.limits = device_limits(device)
        self._fit_device = table is None if fit_device is None else fit_device
        self.table = table_for(self.layer, self.limits) if table is None else table
        self._workspace: dict[torch.dtype, dict] = {}
        block_m = _max_block_m(max_m, self.table)
        self.gluon_reason = self._gluon_unavailable_reason(gluon)
        if self.gluon_reason is None:
            # Room for the Gluon path's blocks too (its tiles follow the layer, gluon_moe.tiles_for).
            from . import gluon_moe

            block_m = max(block_m, gluon_moe.max_block_m(self.layer, max_m))
        self._max_padded = _padded_rows(self.shape, max_m, block_m)
        self._layer_max_padded = _padded_rows(self.layer, max_m, block_m)
        e = self.shape.experts
        self._num_bins = num_bins(self.layer)
        self._sorted_slot = torch.empty(self._max_padded, dtype=torch.int32, device=device)
        self._counts = torch.empty(e, dtype=torch.int32, device=device)
        self._starts = torch.empty(e, dtype=torch.int32, device=device)
        # The ends, then the block table the scatter writes (_block_table_elems).
        self._ends = torch.empty(self._num_bins + _block_table_elems(self.shape, max_m),
                                 dtype=torch.int32, device=device)
        self._cursor = torch.empty(e, dtype=torch.int32, device=device)
        # The grouping's per-program counts (a row of bins per ALIGN_CHUNK slots) and its
        # ticket, which every launch leaves at 0 (_align_kernel).
        self._align_parts = torch.empty(_align_part_elems(max_m * self.shape.topk, self._num_bins),
                                        dtype=torch.int32, device=device)
        self._align_ticket = torch.zeros(1, dtype=torch.int32, device=device)
        self._device = device
        # float32 split-K partials for the table's rows; a tuning script that runs other
        # configurations grows them on first use (before capturing a graph).
        g1_elems, g2_elems = _max_split_elems(self.shape, max_m, self.table)
        self._partials = {"g1": torch.empty(g1_elems, dtype=torch.float32, device=device),
                          "g2": torch.empty(g2_elems, dtype=torch.float32, device=device)}
        # The one-row kernels' float32 operands (x's rows, the intermediate per slot), for the
        # M the table gives them; grown on first use like the partials.
        x_elems, inter_elems = _word_order_elems(self.shape, _gemv_max_m(max_m, self.table))
        self._partials["xw"] = torch.empty(x_elems, dtype=torch.float32, device=device)
        self._partials["hw"] = torch.empty(inter_elems, dtype=torch.float32, device=device)
        self._g2_split = 1
        # A split one-row GEMM1's arrival counts, a slot and column tile each (zero between
        # forwards); with the partials of the one-row GEMMs the device's fit splits (fit_to_device).
        self._gemv_sem = torch.zeros(0, dtype=torch.int32, device=device)
        self._size_gemv_splits(_gemv_max_m(max_m, self.table))
        # Per GEMM configuration: whether its overlapped form passed the SASS check (_launch).
        self._overlap: dict[tuple, bool] = {}
        # Programmatic dependent launch for every kernel of the forward where the GPU and
        # Triton have it (pdl_unavailable_reason); pdl=False turns it off (tools that compare).
        self.pdl_reason = pdl_unavailable_reason(self.limits) if pdl else "turned off by the caller"
        self._pdl = self.pdl_reason is None
        self._pdl_kw = {"launch_pdl": True} if self._pdl else {}
        self._init_gluon()
        # The activation-sized buffers depend on x's dtype: made on first use per dtype
        # (outside a graph capture: the harness warms up before capturing).

    def _gluon_unavailable_reason(self, wanted: bool) -> str | None:
        """Why the warp-specialised Gluon path (moe_bench.gluon_moe) cannot run here: the
        caller, the device, the installed Triton, the shape (None: it can)."""
        try:
            from . import gluon_moe
        except Exception as exc:  # noqa: BLE001 - the plain-Triton path needs nothing of it
            return f"moe_bench.gluon_moe not importable: {type(exc).__name__}: {exc}"
        if not wanted:
            return "not asked for (gluon=False)"
        capability = self.limits.capability if self.limits is not None else None
        reason = gluon_moe.path_unavailable_reason(capability, gluon_moe.api_error() if capability == (9, 0) else None)
        return reason or gluon_moe.shape_unavailable_reason(self.shape)

    def _init_gluon(self) -> None:
        """The Gluon path for the M it applies to, where _gluon_unavailable_reason found nothing
        against it; otherwise self.gluon_reason says why not (the results carry it, see
        configs_used). Decided here, then once more by its correctness check on first use
        (_gluon_runs)."""
        self._gluon = None
        self._gluon_checked: set[str] = set()  # the tile sets (as JSON) that passed their check
        self.gluon_error: float | None = None
        if self.gluon_reason is None:
            from . import gluon_moe

            try:
                self._gluon = gluon_moe.GluonHopperPath(self)
            except Exception as exc:  # noqa: BLE001 - any failure here means the plain-Triton path
                self.gluon_reason = f"setup failed: {type(exc).__name__}: {str(exc)[:200]}"

    def _gluon_can_run(self, m: int) -> bool:
        from . import gluon_moe

        # The workspace is sized for the largest block up to max_m (table and Gluon tiles); an M
        # past it (never, unless a caller changed the tiles) runs the plain-Triton rows.
        block = gluon_moe.tiles_for(self.layer, m)["g1"]["bm"]
        return gluon_moe.can_run_at(self.layer, m) and _padded_rows(self.layer, m, block) <= self._layer_max_padded

    def _gluon_applies(self, m: int) -> bool:
        from . import gluon_moe

        return gluon_moe.selected(self.layer, m) and self._gluon_can_run(m)

    def _gluon_key(self, m: int) -> str:
        from . import gluon_moe

        return json.dumps(gluon_moe.tiles_for(self.layer, m), sort_keys=True)

    def _gluon_runs(self, x, topk_ids, topk_weights):
        """The Gluon path's output for this call, or None when the plain-Triton path runs.

        Its first call compiles it and checks it against the plain-Triton path on the same
        inputs (relative difference at most GLUON_TOLERANCE, every element finite); a compile
        error or a failed check turns the path off for this backend, with the reason kept for
        the results (a fallback never fails the run). The first call must come before any
        graph capture (the harness warms up and checks every M first)."""
        if self._gluon is None or not self._gluon_applies(x.shape[0]) or x.dtype not in self._gluon.dtypes:
            return None
        key = self._gluon_key(x.shape[0])
        if key in self._gluon_checked:
            return self._gluon.forward(x, topk_ids, topk_weights)
        on_gpu = self._device.type == "cuda"
        if on_gpu and torch.cuda.is_current_stream_capturing():
            return None  # never checked inside a capture: the plain-Triton path
        self._gluon_checked.add(key)
        try:
            out = self._gluon.forward(x, topk_ids, topk_weights).clone()
            if on_gpu:
                torch.cuda.synchronize(self._device)
        except Exception as exc:  # noqa: BLE001
            self.gluon_reason = f"compile or launch failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            self._gluon = None
            return None
        ref = self._forward_triton(x, topk_ids, topk_weights)
        error = gluon_check_error(out, ref)
        self.gluon_error = error
        if error is None or error > GLUON_TOLERANCE:
            shown = "non-finite or unwritten output" if error is None else f"relative difference {error:.2e}"
            self.gluon_reason = (f"failed its correctness check at M={x.shape[0]}: {shown} against the "
                                 f"plain-Triton path (at most {GLUON_TOLERANCE:.0e})")
            self._gluon = None
            return None
        return out

    def _config(self, m: int) -> dict:
        cfg = _config_for(self.layer, m, self.table)
        if cfg["g1"].get("mma8"):
            reason = mma8_unavailable_reason(self.limits)
            if reason is not None:
                cfg = dict(_config_for(self.layer, m, [(1 << 62, TENSOR_BM16)]), mma8_fallback=reason)
        return fit_to_device(cfg, self.limits, self.layer, m) if self._fit_device else cfg

    def _buffers(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._workspace:
            self._workspace[dtype] = dict(
                inter=torch.empty((self._max_padded, self.shape.inter), dtype=dtype, device=self._device),
                slots=torch.empty((self.max_m * self.shape.topk, self.shape.hidden), dtype=dtype,
                                  device=self._device),
            )
        ws = self._workspace[dtype]
        return ws["inter"], ws["slots"]

    def release_workspace(self) -> None:
        """Drop the activation-sized buffers (the sorted rows' intermediate, the slot rows, the
        Gluon path's gathered rows); the next call makes them again at the same sizes, so every
        kernel compiles and runs as before. For a caller that runs other device work in between
        (the correctness check's float32 reference), never while a captured graph that uses
        them is alive. Nothing the caller got back from a call lives in them."""
        self._workspace.clear()
        if self._gluon is not None:
            self._gluon.release_buffers()

    def _size_gemv_splits(self, gemv_max_m: int) -> None:
        """The partials and arrival counts of the one-row GEMMs that run split up to gemv_max_m
        (made here, not on first use inside a graph's capture)."""
        shape = self.shape
        for m in range(1, gemv_max_m + 1):
            cfg = self._config(m)
            if not cfg["g1"].get("gemv"):
                continue
            slots = m * shape.topk
            self._gemv1_split_buffers(gemv_split(cfg["g1"], shape.hidden), slots, cfg["g1"]["bn"])
            split2 = gemv_split(cfg["g2"], shape.inter)
            if split2 > 1 and not cfg["g2"].get("fsum"):
                self._partial("g2", split2 * slots * shape.hidden)

    def _gemv1_split_buffers(self, split: int, slots: int, bn: int) -> tuple:
        """A split one-row GEMM1's float32 partials and its arrival counts (zero, a slot and
        column tile each), grown if needed; (None, None) unsplit."""
        if split == 1:
            return None, None
        tiles = slots * (self.shape.inter // bn)
        if self._gemv_sem.numel() < tiles:
            self._gemv_sem = torch.zeros(tiles, dtype=torch.int32, device=self._device)
        return self._partial("g1", split * slots * 2 * self.shape.inter), self._gemv_sem

    def _partial(self, which: str, elems: int) -> torch.Tensor:
        if self._partials[which].numel() < elems:
            self._partials[which] = torch.empty(elems, dtype=torch.float32, device=self._device)
        return self._partials[which]

    def configs_used(self, m: int) -> dict:
        """The table row for M; once a GEMM of it has run on the GPU, its options say which
        MMA form ran ("mma_overlap": True for the overlapped form, see _launch)."""
        cfg = dict(self._config(m))
        for which in ("g1", "g2"):
            ran = self._overlap.get((which, cfg["block_m"], json.dumps(cfg[which], sort_keys=True)))
            if ran is not None:
                cfg[which] = dict(cfg[which], mma_overlap=ran)
        # Which kernels run this M, and where their table came from (results say so).
        cfg["path"] = ("mma8" if cfg["g1"].get("mma8") else "one-row" if cfg["g1"].get("gemv")
                       else "tensor-core")
        if cfg["path"] == "tensor-core" and self._gluon_can_run(m):
            from . import gluon_moe

            if self._gluon is not None and not gluon_moe.selected(self.layer, m):
                cfg["gluon_fallback"] = gluon_moe.not_selected_reason(self.layer, m)
            elif self._gluon is not None:
                # What runs once the first call's check has passed (before it: expected to).
                cfg["path"] = gluon_moe.PATH_NAME
                checked = self._gluon_key(m) in self._gluon_checked
                cfg["gluon"] = dict(gluon_moe.tiles_for(self.layer, m), checked=checked, check_error=self.gluon_error)
            else:
                cfg["gluon_fallback"] = self.gluon_reason
        # Whether the kernels launch with programmatic dependent launch, and if not why.
        cfg["pdl"] = self._pdl and not cfg["path"].startswith("gluon")
        if not self._pdl:
            cfg["pdl_off"] = self.pdl_reason
        if not self._fit_device:
            cfg["table"] = "given"
        else:
            cfg["table"] = "preset" if self.layer in PRESET_TABLES else "rule"
            if self.limits is not None:
                cfg["device"] = self.limits.name
        return cfg

    def _launch(self, which: str, block_m: int, g: dict, k: int, launch):
        """One GEMM launch; launch(k_const) launches the kernel and returns what Triton returns
        (the compiled kernel).

        Swapped rows on the GPU use the warp-group MMA with the weights in registers. With the
        reduction length K a compile-time constant (k_const = K) the compiler lets the MMAs
        that end a step run on while the next step loads and converts (about 4% faster at
        M=2048, PERFORMANCE.md round 11); with K at run time (k_const = 0) it waits for every
        MMA before the next instruction. The overlapped form is correct only if no instruction
        writes an MMA's register operand before the wait that retires it, which the compiler
        does not check and the kernel's order is written to ensure (see _step). So the first
        launch of each configuration compiles the overlapped form and reads its SASS: the form
        is kept when it holds warp-group MMAs (HGMMA: the MMA the check knows) and
        moe_bench.sass finds no such write; otherwise (another GPU generation's MMAs, a write
        found, SASS that cannot be read) the kernel runs again with K at run time and keeps
        that form. Decided once per configuration, before any graph capture (the harness's
        warm-up and correctness check run every configuration first)."""
        if self._device.type != "cuda" or not g.get("swap") or (self.limits and self.limits.capability != (9, 0)):
            # The overlapped form is only ever kept with Hopper's warp-group MMAs (the check
            # knows no other): elsewhere compile the form that runs and nothing more.
            return launch(0)
        key = (which, block_m, json.dumps(g, sort_keys=True))
        ok = self._overlap.get(key)
        if ok is False:
            return launch(0)
        kernel = launch(k)
        if ok is None:
            verdict = sass.cached_verdict(kernel)
            if verdict is None:
                code = sass.kernel_sass(kernel)
                verdict = code is not None and "HGMMA" in code and not sass.wgmma_operand_hazards(code)
                sass.store_verdict(kernel, verdict)
            self._overlap[key] = verdict
            if not self._overlap[key]:
                kernel = launch(0)
        return kernel

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self._check_inputs(x, topk_ids, topk_weights)
        x = x.contiguous()
        topk_ids = topk_ids.to(torch.int32).contiguous()
        topk_weights = topk_weights.to(torch.float32).contiguous()
        out = self._gluon_runs(x, topk_ids, topk_weights)
        if out is not None:
            return out
        return self._forward_triton(x, topk_ids, topk_weights)

    def _forward_triton(self, x, topk_ids, topk_weights):
        cfg = self._config(x.shape[0])
        if cfg["g1"].get("mma8"):
            self.mma8(x, topk_ids, topk_weights, cfg["g1"], cfg["g2"])
        elif cfg["g1"].get("gemv"):
            self.word_order(x, topk_ids, by_expert=cfg["g1"].get("sort", False), raw=cfg["g1"].get("fx", False))
            self.gemv1(x, cfg["g1"])
            out = self.gemv2(x, topk_weights, cfg["g2"])
            if out is not None:
                return out
        else:
            self.align(topk_ids, cfg["block_m"])
            self.gemm1(x, cfg["block_m"], cfg["g1"])
            self.gemm2(x, topk_weights, cfg["block_m"], cfg["g2"])
        return self.topk_sum(x)

    def _check_inputs(self, x, topk_ids, topk_weights) -> None:
        shape = self.shape
        m = x.shape[0]
        if m < 1 or m > self.max_m:
            raise ValueError(f"M={m} is outside 1..{self.max_m} (max_m given at construction)")
        if x.dim() != 2 or x.shape[1] != shape.hidden:
            raise ValueError(f"x must be [M, {shape.hidden}], got {list(x.shape)}")
        if tuple(topk_ids.shape) != (m, shape.topk) or tuple(topk_weights.shape) != (m, shape.topk):
            raise ValueError(f"topk_ids and topk_weights must be [{m}, {shape.topk}]")

    # The stages below are public so a tuning script can time each one alone; each reads
    # what the one before it left in the workspace.

    def align(self, topk_ids: torch.Tensor, block_m: int) -> None:
        """Group the M * topk slots by expert into blocks of block_m sorted rows."""
        shape = self.shape
        slots = topk_ids.numel()
        self._m = slots // shape.topk
        padded = _padded_rows(shape, self._m, block_m)
        if block_m < 16:
            raise ValueError(f"block_m={block_m}: the tensor-core kernels take blocks of at least 16 rows")
        self._group_slots(topk_ids, block_m)
        self._blocks_now = triton.cdiv(padded, block_m)

    def _group_slots(self, topk_ids: torch.Tensor, block_m: int) -> None:
        """The slots grouped by expert into self._sorted_slot, each expert's range padded to a
        multiple of block_m (1: no padding), with the per-expert counts, starts and ends."""
        shape = self.shape
        slots = topk_ids.numel()
        if _padded_rows(shape, slots // shape.topk, block_m) > self._max_padded:
            raise ValueError(f"block_m={block_m} at M={slots // shape.topk} needs more workspace than was allocated")
        programs = triton.cdiv(slots, ALIGN_CHUNK)
        _align_kernel[(programs,)](
            topk_ids, slots, shape.experts, self._counts, self._starts, self._ends, self._cursor,
            self._align_parts, self._align_ticket, BLOCK_M=block_m, NUM_BINS=self._num_bins, CHUNK=ALIGN_CHUNK,
            ONE_PROGRAM=programs == 1, PDL=self._pdl, num_warps=8, **self._pdl_kw,
        )
        _scatter_kernel[(triton.cdiv(slots, 1024),)](
            topk_ids, slots, self._cursor, self._sorted_slot, self._counts, self._starts, self._ends, BLOCK=1024,
            BLOCK_M=block_m, NUM_BINS=self._num_bins, PDL=self._pdl, num_warps=4, **self._pdl_kw,
        )

    def gemm1(self, x: torch.Tensor, block_m: int, g1: dict) -> None:
        """SiLU(x @ gate) * (x @ up) per sorted row, into the intermediate buffer."""
        shape = self.shape
        w13 = self.weights.w13
        inter_buf, _ = self._buffers(x.dtype)
        split = g1.get("split", 1)
        rows = self._blocks_now * block_m
        part = self._partial("g1", split * rows * 2 * shape.inter) if split > 1 else inter_buf
        stride_ps = rows * 2 * shape.inter
        grid = (self._blocks_now * (shape.inter // g1["bn"]) * split,)

        def launch(k_const: int):
            return _gemm1_kernel[grid](
                x, w13.packed, w13.scales, inter_buf, self._sorted_slot, self._counts, self._starts, self._ends,
                shape.experts, shape.hidden, shape.inter,
                x.stride(0), w13.packed.stride(0), w13.packed.stride(1), w13.scales.stride(0), w13.scales.stride(1),
                inter_buf.stride(0), part, stride_ps,
                TOPK=shape.topk, GROUP=shape.group_size, BLOCK_M=block_m, BLOCK_N=g1["bn"],
                GROUPS_PER_STEP=g1["bk"] // shape.group_size, NUM_BINS=self._num_bins,
                POST_SCALE=g1["post"], WHOLE_TILE=g1.get("whole", False), SWAP_AB=g1["swap"],
                CONVERT_ASM=_asm_enabled(g1), SPLIT_K=split, FUSE_GU=bool(g1.get("gu", False)), K_CONST=k_const,
                PDL=self._pdl, num_warps=g1["warps"], num_stages=g1["stages"], **self._pdl_kw,
            )

        self.last_gemm1 = self._launch("g1", block_m, g1, shape.hidden, launch)
        if split > 1:
            block_n = _largest_dividing(128, shape.inter, 32)
            _silu_mul_kernel[(self._blocks_now, shape.inter // block_n)](
                part, inter_buf, self._counts, self._starts, self._ends, shape.experts, shape.inter, stride_ps,
                inter_buf.stride(0), SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BINS=self._num_bins,
                PDL=self._pdl, num_warps=4, **self._pdl_kw,
            )

    def gemm2(self, x: torch.Tensor, topk_weights: torch.Tensor, block_m: int, g2: dict) -> None:
        """Intermediate @ w2 per sorted row, times the slot's top-k weight, into the per-slot buffer."""
        shape = self.shape
        w2 = self.weights.w2
        inter_buf, slot_buf = self._buffers(x.dtype)
        split = g2.get("split", 1)
        stride_ps = self._m * shape.topk * shape.hidden
        part = self._partial("g2", split * stride_ps) if split > 1 else slot_buf
        self._g2_split = split
        grid = (self._blocks_now * (shape.hidden // g2["bn"]) * split,)

        def launch(k_const: int):
            return _gemm2_kernel[grid](
                inter_buf, w2.packed, w2.scales, slot_buf, topk_weights, self._sorted_slot,
                self._counts, self._starts, self._ends, shape.experts,
                shape.inter, shape.hidden,
                inter_buf.stride(0), w2.packed.stride(0), w2.packed.stride(1), w2.scales.stride(0),
                w2.scales.stride(1), slot_buf.stride(0), part, stride_ps,
                GROUP=shape.group_size, BLOCK_M=block_m, BLOCK_N=g2["bn"],
                GROUPS_PER_STEP=g2["bk"] // shape.group_size, NUM_BINS=self._num_bins,
                POST_SCALE=g2["post"], WHOLE_TILE=g2.get("whole", False), SWAP_AB=g2["swap"],
                CONVERT_ASM=_asm_enabled(g2), SPLIT_K=split, K_CONST=k_const,
                PDL=self._pdl, num_warps=g2["warps"], num_stages=g2["stages"], **self._pdl_kw,
            )

        self.last_gemm2 = self._launch("g2", block_m, g2, shape.inter, launch)

    def word_order(self, x: torch.Tensor, topk_ids: torch.Tensor, by_expert: bool = False, raw: bool = False) -> None:
        """One-row kernels, step 1: x's rows as float32 in their operand order (and the slots'
        experts for the next two steps). by_expert (the table's `sort`): also group the slots
        by expert (no padding), the order the next two steps take them in. raw (GEMM1's `fx`):
        no word-order buffer, GEMM1 reads x's rows itself (no launch here unless by_expert)."""
        shape = self.shape
        self._m = x.shape[0]
        self._ids = topk_ids
        self._by_expert = bool(by_expert)
        if self._by_expert:
            self._group_slots(topk_ids, 1)
        if raw:
            self._xw = None
            return
        kw = shape.hidden // 8
        xw = self._partial("xw", _word_order_elems(shape, self._m)[0]).view(-1)[: self._m * 9 * kw].view(self._m, 9 * kw)
        chunks = _largest_dividing(32, shape.hidden // 32, 1)
        _word_order_kernel[(self._m, shape.hidden // 32 // chunks)](
            x, xw, shape.hidden, x.stride(0), xw.stride(0), CHUNKS=chunks, PDL=self._pdl, num_warps=4, **self._pdl_kw,
        )
        self._xw = xw

    def _packed_words(self, linear: quant.PackedLinear) -> torch.Tensor:
        return linear.packed.view(torch.int32)  # the stored tiles, four bytes per word

    def gemv1(self, x: torch.Tensor, g1: dict) -> None:
        """One-row kernels, step 2: SiLU(x @ gate) * (x @ up) per slot, into the float32
        intermediate in operand order."""
        shape = self.shape
        slots = self._m * shape.topk
        kw = shape.inter // 8
        hw = self._partial("hw", _word_order_elems(shape, self._m)[1]).view(-1)[: slots * 9 * kw].view(slots, 9 * kw)
        words = self._packed_words(self.weights.w13)
        scales = self.weights.w13.scales
        raw = self._xw is None  # GEMM1's `fx`: x's rows read as they are (word_order)
        a = x if raw else self._xw
        # K's slices (gemv_split), the last to arrive of each tile adding them up (_gemv_kernel).
        split = gemv_split(g1, shape.hidden)
        part, sem = self._gemv1_split_buffers(split, slots, g1["bn"])
        self.last_gemm1 = _gemv_kernel[(split * slots * (shape.inter // g1["bn"]),)](
            a, words, scales, hw, self._ids, self._ids, self._sorted_slot,
            shape.hidden, shape.inter, a.stride(0), words.stride(0), words.stride(1), scales.stride(0),
            scales.stride(1), hw.stride(0),
            TOPK=shape.topk, GROUP=shape.group_size, BLOCK_N=g1["bn"], BLOCK_KW=g1["bkw"], GATE_UP=True,
            CONVERT_ASM=_asm_enabled(g1), INTER_DTYPE=_TL_DTYPES[x.dtype], BY_EXPERT=self._by_expert,
            RAW_A=raw, PREFETCH=bool(g1.get("pf", False)), PDL=self._pdl, num_warps=g1["warps"],
            num_stages=g1.get("stages", 1), SPLIT=split, part_ptr=part, sem_ptr=sem, **self._pdl_kw,
        )
        self._hw = hw

    def gemv2(self, x: torch.Tensor, topk_weights: torch.Tensor, g2: dict) -> torch.Tensor | None:
        """One-row kernels, step 3: intermediate @ w2 per slot, times the slot's top-k weight,
        into the per-slot buffer (then topk_sum). With the table's `fsum` each program takes
        a token's columns over all its slots and writes the output itself, which it returns
        (no top-k sum step); otherwise None."""
        shape = self.shape
        words = self._packed_words(self.weights.w2)
        scales = self.weights.w2.scales
        self._g2_split = 1
        if g2.get("fsum"):
            out = torch.empty((self._m, shape.hidden), dtype=x.dtype, device=x.device)
            self.last_gemm2 = _gemv_kernel[(self._m * (shape.hidden // g2["bn"]),)](
                self._hw, words, scales, out, self._ids, topk_weights, self._sorted_slot,
                shape.inter, shape.hidden, self._hw.stride(0), words.stride(0), words.stride(1), scales.stride(0),
                scales.stride(1), out.stride(0),
                TOPK=shape.topk, GROUP=shape.group_size, BLOCK_N=g2["bn"], BLOCK_KW=g2["bkw"], GATE_UP=False,
                CONVERT_ASM=_asm_enabled(g2), INTER_DTYPE=_TL_DTYPES[x.dtype], BY_EXPERT=False, SUM_TOPK=True,
                PREFETCH=bool(g2.get("pf", False)), PDL=self._pdl, num_warps=g2["warps"], num_stages=g2.get("stages", 1),
                **self._pdl_kw,
            )
            return out
        _, slot_buf = self._buffers(x.dtype)
        slots = self._m * shape.topk
        split = gemv_split(g2, shape.inter)
        stride_split = slots * shape.hidden
        if split > 1:  # K's slices into float32 partial rows, added up by topk_sum
            slot_buf = self._partial("g2", split * stride_split)[: split * stride_split].view(split * slots, shape.hidden)
        self.last_gemm2 = _gemv_kernel[(split * slots * (shape.hidden // g2["bn"]),)](
            self._hw, words, scales, slot_buf, self._ids, topk_weights, self._sorted_slot,
            shape.inter, shape.hidden, self._hw.stride(0), words.stride(0), words.stride(1), scales.stride(0),
            scales.stride(1), slot_buf.stride(0),
            TOPK=shape.topk, GROUP=shape.group_size, BLOCK_N=g2["bn"], BLOCK_KW=g2["bkw"], GATE_UP=False,
            CONVERT_ASM=_asm_enabled(g2), INTER_DTYPE=_TL_DTYPES[x.dtype], BY_EXPERT=self._by_expert,
            PREFETCH=bool(g2.get("pf", False)), PDL=self._pdl, num_warps=g2["warps"],
            num_stages=g2.get("stages", 1), SPLIT=split, stride_split=stride_split, **self._pdl_kw,
        )
        self._g2_split = split
        return None

    def mma8(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, g1: dict, g2: dict) -> None:
        """Block_m 8 rows: the slots grouped by expert into blocks of 8 sorted rows, then both
        GEMMs on mma.sync with a block's rows as the MMA's 8 columns (_mma8_kernel), into the
        per-slot buffer (then topk_sum)."""
        shape = self.shape
        self._m = x.shape[0]
        self._group_slots(topk_ids, 8)
        self._blocks_now = triton.cdiv(_padded_rows(shape, self._m, 8), 8)
        inter_buf, slot_buf = self._buffers(x.dtype)
        self._g2_split = 1
        for which, g, a, w, out, k, n in (
                ("g1", g1, x, self.weights.w13, inter_buf, shape.hidden, shape.inter),
                ("g2", g2, inter_buf, self.weights.w2, slot_buf, shape.inter, shape.hidden)):
            words = self._packed_words(w)
            a64 = a.view(torch.int64)
            gate_up = which == "g1"
            tile = (8 if gate_up else 16) * g["rt"]
            kernel = _mma8_kernel[(self._blocks_now * (n // tile),)](
                a64, words, w.scales, out, topk_weights, self._sorted_slot, self._counts, self._starts, self._ends,
                shape.experts, k, n, a64.stride(0), words.stride(0), words.stride(1), w.scales.stride(0),
                w.scales.stride(1), out.stride(0),
                TOPK=shape.topk, NUM_BINS=self._num_bins, RT=g["rt"], KSPLIT=g["ksplit"], GATE_UP=gate_up,
                PDL=self._pdl, num_warps=g["ksplit"], num_stages=1, **self._pdl_kw,
            )
            if gate_up:
                self.last_gemm1 = kernel
            else:
                self.last_gemm2 = kernel

    def topk_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Each token's output: the sum of its top-k weighted slot rows."""
        shape = self.shape
        _, slot_buf = self._buffers(x.dtype)
        split = self._g2_split
        stride_split = self._m * shape.topk * shape.hidden
        if split > 1:
            slot_buf = self._partial("g2", split * stride_split)
        out = torch.empty((self._m, shape.hidden), dtype=x.dtype, device=x.device)
        sum_block = min(1024, triton.next_power_of_2(shape.hidden))
        _topk_sum_kernel[(self._m, triton.cdiv(shape.hidden, sum_block))](
            slot_buf, out, shape.hidden, stride_split, TOPK=shape.topk, SPLIT_K=split, BLOCK_N=sum_block,
            PDL=self._pdl, num_warps=4, **self._pdl_kw,
        )
        return out
