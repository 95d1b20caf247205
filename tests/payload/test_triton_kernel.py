"""The Triton W4A16 MoE kernels under Triton's interpreter, against a float32 reference.

Runs on the CPU (conftest.py sets TRITON_INTERPRET=1 before triton is imported). The
interpreter computes tl.dot wrongly on bf16 operands, so activations here are float32 or
float16; the kernels' bf16 bit tricks are still exercised (the int4 -> number conversion
goes through bf16 bits on every path).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from moe_bench import cli, quant  # noqa: E402
from moe_bench import triton_moe as tm  # noqa: E402
from moe_bench.backends import reference_moe  # noqa: E402

# float32 activations: the only rounding is the bf16 scales (exact in both) and float32 sums.
# float16 activations round the intermediate once more. Bounds are well above what the
# kernels reach (about 1e-6 and 4e-4) and far below what any indexing mistake gives (~1).
BOUND = {torch.float32: 1e-4, torch.float16: 3e-3}


def reference(weights: quant.MoEWeights, x, topk_ids, topk_weights) -> torch.Tensor:
    """float32: dequantise, then per token and chosen expert SiLU(x W1g) * (x W1u) W2, weighted."""
    w13 = quant.dequantize(weights.w13)
    w2 = quant.dequantize(weights.w2)
    inter = weights.shape.inter
    xf = x.float()
    out = torch.zeros(x.shape[0], weights.shape.hidden)
    for m in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[m, j])
            h = xf[m] @ w13[e]
            out[m] += float(topk_weights[m, j]) * ((torch.nn.functional.silu(h[:inter]) * h[inter:]) @ w2[e])
    return out


def random_inputs(shape: quant.MoEShape, m: int, dtype, seed: int, experts=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, shape.hidden, generator=gen).to(dtype)
    pool = shape.experts if experts is None else experts
    ids = torch.stack([torch.randperm(pool, generator=gen)[: shape.topk] for _ in range(m)]).to(torch.int32)
    weights = torch.rand(m, shape.topk, generator=gen) + 0.1
    return x, ids, weights / weights.sum(dim=1, keepdim=True)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output holds NaN/Inf: a row was never written"
    return float((out.float() - ref).norm() / ref.norm())


def single_entry_table(block_m: int, **gemm) -> list:
    cfg = dict(bn=64, bk=64, warps=4, stages=2, post=False, whole=False, swap=False)
    cfg.update(gemm)
    return [(1 << 62, dict(block_m=block_m, g1=dict(cfg), g2=dict(cfg)))]


# Every entry of the shipped table, at a small shape its tiles fit unshrunk where they can.
TABLE_SHAPE = quant.MoEShape(experts=6, hidden=256, inter=128, topk=3, group_size=32)


@pytest.mark.parametrize("bucket", range(len(tm.TILE_TABLE)), ids=lambda i: f"table-row-{i}")
def test_every_shipped_tile_config_matches_reference(bucket):
    limit, entry = tm.TILE_TABLE[bucket]
    weights = quant.random_weights(TABLE_SHAPE, "cpu", seed=bucket)
    moe = tm.TritonW4A16MoE(weights, max_m=64, table=[(1 << 62, entry)])
    x, ids, wts = random_inputs(TABLE_SHAPE, 19, torch.float32, seed=100 + bucket)
    out = moe(x, ids, wts)
    assert out.shape == (19, TABLE_SHAPE.hidden) and out.dtype == torch.float32
    assert relative_error(out, reference(weights, x, ids, wts)) < BOUND[torch.float32]


# Odd shape: 5 experts, top-3, hidden 96 and inter 160 (multiples of 32, not powers of two),
# so the tiles shrink to fit and blocks are ragged.
ODD_SHAPE = quant.MoEShape(experts=5, hidden=96, inter=160, topk=3, group_size=32)
MODES = [
    dict(block_m=16, post=True, swap=False),
    dict(block_m=16, post=True, swap=True),
    dict(block_m=32, post=False, whole=False, swap=False),
    dict(block_m=64, post=False, whole=True, swap=True),
    # Split-K: GEMM1's K (96) is 3 steps, GEMM2's (160) 5, so split=5 shrinks to 3 and 5.
    dict(block_m=16, post=True, swap=False, split=5, asm=True),
    dict(block_m=32, post=False, whole=True, swap=False, split=5),
    # GEMM1 with gate and up as one operand tile, plain and split.
    dict(block_m=16, post=True, swap=False, gu=True),
    dict(block_m=32, post=False, whole=True, swap=True, gu=True, split=5),
]


@pytest.mark.parametrize("mode", MODES, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("dtype,m", [(torch.float32, 1), (torch.float16, 23)], ids=["fp32-M1", "fp16-M23"])
def test_odd_shape_every_mode(mode, dtype, m):
    mode = dict(mode)
    block_m = mode.pop("block_m")
    weights = quant.random_weights(ODD_SHAPE, "cpu", seed=3)
    moe = tm.TritonW4A16MoE(weights, max_m=32, table=single_entry_table(block_m, **mode))
    x, ids, wts = random_inputs(ODD_SHAPE, m, dtype, seed=m)
    out = moe(x, ids, wts)
    assert out.dtype == dtype
    assert relative_error(out, reference(weights, x, ids, wts)) < BOUND[dtype]
    if mode.get("split"):
        used = moe.configs_used(m)
        assert (used["g1"]["split"], used["g2"]["split"]) == (3, 5)


def test_split_k_shrinks_to_whole_steps_and_is_counted_in_the_workspace():
    shape = quant.MoEShape(experts=384, hidden=7168, inter=2048, topk=8, group_size=32)
    fitted = tm._fit(dict(bn=64, bk=128, warps=4, stages=4, post=True, swap=False, split=3), 7168, 2048, 32)
    assert fitted["split"] == 2  # 56 steps of 128: 3 slices would not be whole steps
    table = single_entry_table(16, split=4)
    unsplit = single_entry_table(16)
    moe = tm.TritonW4A16MoE(quant.random_weights(TABLE_SHAPE, "cpu"), max_m=9, table=table)
    g1_elems, g2_elems = tm._max_split_elems(TABLE_SHAPE, 9, table)
    assert moe._partials["g1"].numel() == g1_elems > 0 and moe._partials["g2"].numel() == g2_elems > 0
    assert tm._max_split_elems(TABLE_SHAPE, 9, unsplit) == (0, 0)
    # The shipped table splits at small M: its partial buffers are part of the workspace.
    if any(e["g1"].get("split", 1) > 1 or e["g2"].get("split", 1) > 1 for _, e in tm.TILE_TABLE):
        assert sum(tm._max_split_elems(shape, 2048)) > 0
        assert tm.workspace_bytes(shape, 2048) >= 4 * sum(tm._max_split_elems(shape, 2048))


def test_ptx_conversion_is_off_under_the_interpreter():
    """Triton's interpreter runs no PTX: a row asking for it falls back to the same bits."""
    assert tm._asm_enabled(dict(asm=True)) is (os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))
    assert tm._asm_enabled(dict(asm=False)) is False


def test_many_blocks_per_expert_and_large_group():
    """All tokens routed to 2 of 4 experts (several full blocks plus a ragged one each), group 128
    spanning several reduction steps' worth of rows, whole-tile and per-group dequantisation."""
    shape = quant.MoEShape(experts=4, hidden=256, inter=256, topk=2, group_size=128)
    weights = quant.random_weights(shape, "cpu", seed=5)
    x, ids, wts = random_inputs(shape, 37, torch.float32, seed=7, experts=2)
    ref = reference(weights, x, ids, wts)
    for whole in (False, True):
        moe = tm.TritonW4A16MoE(weights, max_m=40, table=single_entry_table(16, bn=128, bk=256, whole=whole))
        assert relative_error(moe(x, ids, wts), ref) < BOUND[torch.float32]


def test_alignment_groups_every_slot_under_its_expert():
    shape = quant.MoEShape(experts=7, hidden=64, inter=64, topk=3, group_size=32)
    weights = quant.random_weights(shape, "cpu", seed=0)
    moe = tm.TritonW4A16MoE(weights, max_m=50, table=single_entry_table(16))
    _, ids, _ = random_inputs(shape, 50, torch.float32, seed=11, experts=5)  # experts 5 and 6 unused
    moe.align(ids.contiguous(), 16)
    flat = ids.flatten()
    counts = torch.bincount(flat.long(), minlength=shape.experts)
    assert moe._counts.tolist() == counts.tolist()
    padded = (counts + 15) // 16 * 16
    starts = torch.cumsum(padded, 0) - padded
    assert moe._starts.tolist() == starts.tolist()
    for e in range(shape.experts):
        rows = moe._sorted_slot[starts[e]: starts[e] + counts[e]]
        assert sorted(rows.tolist()) == sorted((flat == e).nonzero().flatten().tolist())


def test_alignment_counts_in_several_programs_and_leaves_the_ticket_at_zero():
    """More slots than one program counts (ALIGN_CHUNK each): every program's counts reach the
    ranges, twice in a row with different routings (the ticket is back at 0 after each)."""
    shape = quant.MoEShape(experts=7, hidden=64, inter=64, topk=3, group_size=32)
    weights = quant.random_weights(shape, "cpu", seed=0)
    m = 3 * tm.ALIGN_CHUNK // shape.topk + 5  # four programs, the last one short
    moe = tm.TritonW4A16MoE(weights, max_m=m, table=single_entry_table(16))
    for seed, pool in ((3, 5), (4, 7)):
        _, ids, _ = random_inputs(shape, m, torch.float32, seed=seed, experts=pool)
        moe.align(ids.contiguous(), 16)
        flat = ids.flatten()
        counts = torch.bincount(flat.long(), minlength=shape.experts)
        padded = (counts + 15) // 16 * 16
        ends = torch.cumsum(padded, 0)
        assert moe._counts.tolist() == counts.tolist()
        assert moe._starts.tolist() == (ends - padded).tolist()
        assert moe._ends[: shape.experts].tolist() == ends.tolist()
        assert int(moe._align_ticket.item()) == 0
        for e in range(shape.experts):
            rows = moe._sorted_slot[ends[e] - padded[e]: ends[e] - padded[e] + counts[e]]
            assert sorted(rows.tolist()) == sorted((flat == e).nonzero().flatten().tolist())


def test_the_block_table_names_each_blocks_expert_and_rows_and_its_stale_entries_go_unused():
    """Blocks of at least TABLE_MIN_BLOCK_M rows take their owner from the table the scatter
    writes after the ends: one (expert, real rows) entry a used block. A forward on routings
    that fill fewer blocks than one before leaves that one's entries past the used rows: they
    must go unread (a block past the last expert's end has no rows), and the block_m 8 search
    writes no entry."""
    shape = quant.MoEShape(experts=7, hidden=64, inter=64, topk=3, group_size=32)
    weights = quant.random_weights(shape, "cpu", seed=0)
    m = tm.ALIGN_CHUNK // shape.topk + 40  # two counting programs
    for block_m in (16, 32):
        moe = tm.TritonW4A16MoE(weights, max_m=m, table=single_entry_table(block_m))
        bins = moe._num_bins
        for seed, pool in ((3, 7), (4, 3)):  # every expert, then three: fewer blocks, stale entries
            x, ids, wts = random_inputs(shape, m, torch.float32, seed=seed, experts=pool)
            out = moe(x, ids, wts)
            counts = torch.bincount(ids.flatten().long(), minlength=shape.experts)
            expected = []
            for e, c in enumerate(counts.tolist()):
                expected += [[e, min(block_m, c - r)] for r in range(0, c, block_m)]
            assert bins + 2 * len(expected) <= moe._ends.numel()  # the table holds every used block
            table = moe._ends[bins: bins + 2 * len(expected)].view(-1, 2).tolist()
            assert table == expected, (block_m, seed)
            if pool == 3:  # the first forward's entries stay past the used blocks
                stale = moe._ends[bins + 2 * len(expected): bins + 2 * len(expected) + 2].tolist()
                assert stale[1] > 0, stale
            assert relative_error(out, reference(weights, x, ids, wts)) < BOUND[torch.float32]
    before = torch.full((2 * 16,), -5, dtype=torch.int32)
    moe = tm.TritonW4A16MoE(weights, max_m=m, table=single_entry_table(16))
    moe._ends[moe._num_bins: moe._num_bins + before.numel()] = before
    moe._group_slots(random_inputs(shape, m, torch.float32, seed=5)[1].contiguous(), 8)
    assert moe._ends[moe._num_bins: moe._num_bins + before.numel()].tolist() == before.tolist()
    # Sized for the most blocks m tokens can fill at block_m 16: every expert's last block
    # holding one slot (7 experts x 16 + the rest in full blocks), and counted in the workspace.
    worst = 7 + (m * shape.topk - 7 + 15) // 16
    assert tm._block_table_elems(shape, m) == 2 * worst == moe._ends.numel() - moe._num_bins
    assert tm._block_table_elems(shape, m) * 4 <= tm.workspace_bytes(shape, m)


def test_tile_configs_fit_the_shape_and_cover_every_m():
    shape = quant.MoEShape(experts=384, hidden=7168, inter=2048, topk=8, group_size=32)
    m_list = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    configs = tm.tile_configs(shape, m_list)
    assert sorted(configs) == m_list
    for m, cfg in configs.items():
        if cfg["g1"].get("gemv"):
            # One-row kernels: whole chunks of 4 words per step, columns in runs of 32.
            assert cfg["block_m"] == 1 and cfg["g2"].get("gemv")
            assert shape.inter % cfg["g1"]["bn"] == 0 and cfg["g1"]["bn"] % 32 == 0
            assert shape.hidden % cfg["g2"]["bn"] == 0
            assert (shape.hidden // 8) % cfg["g1"]["bkw"] == 0 and (shape.inter // 8) % cfg["g2"]["bkw"] == 0
            assert cfg["g1"]["bkw"] % 4 == 0 and cfg["g2"]["bkw"] % 4 == 0
            continue
        if cfg["g1"].get("mma8"):
            # Block_m 8 rows: 8 * rt GEMM1 columns and 16 * rt GEMM2 columns a program, K in whole
            # 64-value blocks split evenly among the ksplit warps.
            assert cfg["block_m"] == 8 and cfg["g2"].get("mma8") and cfg["g1"]["gate_up"]
            assert shape.inter % (8 * cfg["g1"]["rt"]) == 0 and shape.hidden % (16 * cfg["g2"]["rt"]) == 0
            assert (shape.hidden // 64) % cfg["g1"]["ksplit"] == 0 and (shape.inter // 64) % cfg["g2"]["ksplit"] == 0
            continue
        assert cfg["block_m"] in (16, 32, 64)
        assert shape.inter % cfg["g1"]["bn"] == 0 and shape.hidden % cfg["g1"]["bk"] == 0
        assert shape.hidden % cfg["g2"]["bn"] == 0 and shape.inter % cfg["g2"]["bk"] == 0
        assert cfg["g1"]["bk"] % shape.group_size == 0 and cfg["g2"]["bk"] % shape.group_size == 0
    # Shrunk to fit a shape the table's tiles do not divide.
    odd = tm.tile_configs(ODD_SHAPE, [1, 2048])
    for cfg in odd.values():
        assert ODD_SHAPE.inter % cfg["g1"]["bn"] == 0 and ODD_SHAPE.hidden % cfg["g2"]["bn"] == 0
        if cfg["g1"].get("gemv"):
            assert (ODD_SHAPE.hidden // 8) % cfg["g1"]["bkw"] == 0 and (ODD_SHAPE.inter // 8) % cfg["g2"]["bkw"] == 0
        else:
            assert ODD_SHAPE.hidden % cfg["g1"]["bk"] == 0 and ODD_SHAPE.inter % cfg["g2"]["bk"] == 0


def test_workspace_bytes_counts_the_buffers_it_allocates():
    shape = quant.MoEShape(experts=384, hidden=7168, inter=2048, topk=8, group_size=32)
    small, large = tm.workspace_bytes(shape, 1), tm.workspace_bytes(shape, 2048)
    assert 0 < small < large
    # The two activation-sized buffers dominate: per-slot output rows and padded intermediate rows.
    assert large >= 2048 * 8 * 7168 * 2 + 2048 * 8 * 2048 * 2
    tiny = quant.MoEShape(experts=5, hidden=96, inter=160, topk=3, group_size=32)
    moe = tm.TritonW4A16MoE(quant.random_weights(tiny, "cpu"), max_m=9)
    inter_buf, slot_buf = moe._buffers(torch.bfloat16)
    allocated = sum(t.numel() * t.element_size() for t in
                    (inter_buf, slot_buf, moe._sorted_slot, moe._counts, moe._starts, moe._ends, moe._cursor,
                     *moe._partials.values()))
    assert allocated <= tm.workspace_bytes(tiny, 9)


GEMV = dict(gemv=True, bn=32, bkw=64, warps=4, stages=1, asm=True)


def gemv_table(**options) -> list:
    return [(1 << 62, dict(block_m=1, g1=dict(GEMV, **options), g2=dict(GEMV, **options)))]


@pytest.mark.parametrize("shape,dtype,m", [
    (ODD_SHAPE, torch.float32, 1),  # K = 96 and 160: steps shrink to 4 words (one chunk)
    # Several slots per expert (11 x 3 slots over 5 experts), each its own row; the interpreter
    # runs one program per slot and column tile, so a few slots more only cost time.
    (ODD_SHAPE, torch.float16, 11),
    (quant.MoEShape(experts=4, hidden=256, inter=128, topk=2, group_size=64), torch.float32, 5),  # 2 chunks/group
    (quant.MoEShape(experts=8, hidden=512, inter=256, topk=4, group_size=128), torch.float32, 3),
], ids=["odd-fp32-M1", "odd-fp16-M11", "group64", "group128"])
@pytest.mark.parametrize("sort", [False, True], ids=["slot-order", "by-expert"])
def test_one_row_kernels_match_reference(shape, dtype, m, sort):
    weights = quant.random_weights(shape, "cpu", seed=5)
    moe = tm.TritonW4A16MoE(weights, max_m=32, table=gemv_table(bn=64, sort=sort))
    x, ids, wts = random_inputs(shape, m, dtype, seed=m)
    out = moe(x, ids, wts)
    assert out.dtype == dtype and out.shape == (m, shape.hidden)
    # The float32 path loses a little to the nibbles' offsets (up to 2056 times an activation
    # taken off per word): about 5e-5, bounded at 2e-4 (a wrong nibble or activation gives ~1).
    bound = 2e-4 if dtype == torch.float32 else BOUND[dtype]
    assert relative_error(out, reference(weights, x, ids, wts)) < bound
    used = moe.configs_used(m)
    assert used["block_m"] == 1 and used["g1"]["gemv"] and used["g2"]["gemv"]


def test_one_row_kernels_by_expert_take_the_slots_grouped_and_give_the_same_rows():
    """sort: the programs take the slots grouped by expert (a permutation of all of them, the
    experts contiguous); each slot's row is computed the same way in either order, so the
    output is the same to the bit."""
    shape = quant.MoEShape(experts=6, hidden=96, inter=64, topk=3, group_size=32)
    weights = quant.random_weights(shape, "cpu", seed=2)
    x, ids, wts = random_inputs(shape, 13, torch.float32, seed=4, experts=4)  # ~10 slots per expert
    plain = tm.TritonW4A16MoE(weights, max_m=16, table=gemv_table())(x, ids, wts)
    moe = tm.TritonW4A16MoE(weights, max_m=16, table=gemv_table(sort=True))
    grouped = moe(x, ids, wts)
    assert torch.equal(grouped, plain)
    assert relative_error(grouped, reference(weights, x, ids, wts)) < 2e-4
    order = moe._sorted_slot[: ids.numel()].long()
    assert sorted(order.tolist()) == list(range(ids.numel()))
    experts = ids.flatten()[order].tolist()
    assert experts == sorted(experts)
    assert moe._counts.tolist() == torch.bincount(ids.flatten().long(), minlength=shape.experts).tolist()


def test_one_row_fusions_give_the_rows_of_the_three_step_form():
    """GEMM1's `fx` reads x's rows itself (the word order formed in registers: the same
    products summed in the same order, so the same bits and no word-order buffer); GEMM2's
    `fsum` sums each token's top-k weighted slots in the program (columns in runs of 16) and
    writes the output, rounded once instead of per slot."""
    shape = ODD_SHAPE
    weights = quant.random_weights(shape, "cpu", seed=3)
    x, ids, wts = random_inputs(shape, 2, torch.float16, seed=9)
    plain = tm.TritonW4A16MoE(weights, max_m=8, table=gemv_table(bn=64))(x, ids, wts)
    raw = tm.TritonW4A16MoE(weights, max_m=8, table=[(1 << 62, dict(block_m=1, g1=dict(GEMV, bn=64, fx=True),
                                                                           g2=dict(GEMV, bn=64)))])
    assert torch.equal(raw(x, ids, wts), plain) and raw._xw is None
    fused = tm.TritonW4A16MoE(weights, max_m=8, table=[(1 << 62, dict(block_m=1, g1=dict(GEMV, bn=64, fx=True),
                                                                             g2=dict(GEMV, bn=16, fsum=True)))])
    out = fused(x, ids, wts)
    assert fused.configs_used(2)["g2"]["bn"] == 16
    assert relative_error(out, reference(weights, x, ids, wts)) < BOUND[torch.float16]
    assert relative_error(out, plain) < 2e-3


@pytest.mark.parametrize("pf", [False, True], ids=["plain", "pf"])
@pytest.mark.parametrize("which", ["g1", "g2"])
def test_split_one_row_gemms_add_up_their_k_slices(which, pf):
    """A one-row GEMM's `split`: each program takes one of K's slices (a whole number of steps).
    GEMM2's slices go to float32 partial rows the top-k sum adds up; GEMM1's to float32 partials
    that the tile's last program to arrive adds up in slice order before SiLU, setting the
    tile's arrival count back to zero (a second forward gives the same bits; the counts and
    partials are made with the backend, not inside a graph's capture). Against the
    reference, and against the unsplit rows within float32 rounding of the partial sums. A split
    that does not divide K's steps is lowered until it does (steps of 4 words: GEMM2's K = 128
    takes 4 slices at most, GEMM1's K = 96 three)."""
    shape = quant.MoEShape(experts=6, hidden=96, inter=128, topk=3, group_size=32)
    weights = quant.random_weights(shape, "cpu", seed=5)
    x, ids, wts = random_inputs(shape, 3, torch.float32, seed=12)
    plain = tm.TritonW4A16MoE(weights, max_m=4, table=gemv_table(bkw=4, pf=pf))(x, ids, wts)
    ran_as = {"g1": ((2, 1), (3, 3), (4, 3)), "g2": ((2, 2), (4, 4), (3, 2), (8, 4))}[which]
    for split, ran in ran_as:
        row = gemv_table(bkw=4, pf=pf)[0][1]
        moe = tm.TritonW4A16MoE(weights, max_m=4, table=[(1 << 62, dict(row, **{which: dict(row[which], split=split)}))])
        out = moe(x, ids, wts)
        k = shape.hidden if which == "g1" else shape.inter
        assert tm.gemv_split(moe.configs_used(3)[which], k) == ran, (split, ran)
        assert relative_error(out, reference(weights, x, ids, wts)) < 2e-4
        assert relative_error(out, plain) < 1e-5
        if which == "g1" and ran > 1:
            # (sized when the backend was made, for max_m 4: a count per slot and column tile)
            assert moe._gemv_sem.numel() == 4 * 3 * (shape.inter // 32) and not moe._gemv_sem.any()
            assert torch.equal(moe(x, ids, wts), out)
    assert tm.gemv_split(dict(bkw=16), 2048) == 1 and tm.gemv_split(dict(bkw=16, split=2), 2048) == 2
    assert tm.gemv_split(dict(bkw=32, split=4), 768) == 3


@pytest.mark.parametrize("bkw", [4, 8, 64], ids=["bkw4", "bkw8", "bkw64"])
def test_prefetching_one_row_rows_give_the_bits_of_the_plain_ones(bkw):
    """`pf` loads each step's words, scales and activations one step ahead (register double
    buffering): the same products summed in the same order, so the same bits as without it, at
    a step of one chunk (K = 96: 12 words, three steps of 4), of two, and of the whole row (the
    last step's look-ahead masked off). The shipped one-row row prefetches."""
    shape = ODD_SHAPE
    weights = quant.random_weights(shape, "cpu", seed=6)
    x, ids, wts = random_inputs(shape, 3, torch.float16, seed=11)
    plain = tm.TritonW4A16MoE(weights, max_m=4, table=gemv_table(bkw=bkw))(x, ids, wts)
    moe = tm.TritonW4A16MoE(weights, max_m=4, table=gemv_table(bkw=bkw, pf=True))
    out = moe(x, ids, wts)
    assert torch.equal(out, plain)
    assert relative_error(out, reference(weights, x, ids, wts)) < BOUND[torch.float16]
    assert moe.configs_used(3)["g1"]["pf"] and moe.configs_used(3)["g2"]["pf"]
    assert tm.ONE_ROW["g1"]["pf"] and tm.ONE_ROW["g2"]["pf"]


def test_word_order_places_every_activation_at_its_nibble():
    """Position t of word i of chunk c holds value 32c + 4i + t//2 (t even, the low nibble of
    byte 4i + t//2) or 32c + 16 + 4i + t//2 (t odd, the high nibble); position 8 the bias."""
    shape = quant.MoEShape(experts=2, hidden=96, inter=64, topk=1, group_size=32)
    moe = tm.TritonW4A16MoE(quant.random_weights(shape, "cpu"), max_m=2, table=gemv_table())
    x = torch.arange(2 * 96, dtype=torch.float32).reshape(2, 96)
    moe.word_order(x, torch.zeros(2, 1, dtype=torch.int32))
    kw = 96 // 8
    got = moe._xw.view(2, 9, kw)
    for row in range(2):
        for w in range(kw):
            c, i = divmod(w, 4)
            low = [x[row, 32 * c + 4 * i + j] for j in range(4)]
            high = [x[row, 32 * c + 16 + 4 * i + j] for j in range(4)]
            assert got[row, 0:8:2, w].tolist() == low and got[row, 1:8:2, w].tolist() == high
            assert float(got[row, 8, w]) == pytest.approx(-(136 * sum(low) + 2056 * sum(high)))


def test_nibbles_read_as_offset_numbers_exactly():
    """The bit trick behind the one-row kernels, on every byte value: the low nibble masked
    into bits 16-19 under the exponent of 128 reads 128 + u, the high one in bits 12-15 under
    the exponent of 2048 reads 2048 + u (no rounding)."""
    b = torch.arange(256, dtype=torch.int64)
    low = ((b << 16) & 0xF0000) | 0x43000000
    high = ((b << 8) & 0xF000) | 0x45000000
    as_float = lambda v: v.to(torch.int32).view(torch.float32)  # noqa: E731
    assert torch.equal(as_float(low), 128.0 + (b & 0xF).float())
    assert torch.equal(as_float(high), 2048.0 + (b >> 4).float())


def test_one_row_workspace_only_where_the_table_uses_them():
    shape = quant.MoEShape(experts=384, hidden=7168, inter=2048, topk=8, group_size=32)
    assert tm._gemv_max_m(2048, gemv_table()) == 2048
    tensor_only = single_entry_table(16)
    assert tm._gemv_max_m(2048, tensor_only) == 0
    mixed = [(8, gemv_table()[0][1]), (1 << 62, tensor_only[0][1])]
    assert tm._gemv_max_m(4, mixed) == 4 and tm._gemv_max_m(2048, mixed) == 8
    # The shipped table runs them at small M: their operand buffers are in the workspace.
    limit = tm._gemv_max_m(2048)
    if limit:
        extra = 4 * sum(tm._word_order_elems(shape, limit))
        assert extra == 4 * limit * 9 * (7168 + 8 * 2048) // 8
        moe = tm.TritonW4A16MoE(quant.random_weights(ODD_SHAPE, "cpu"), max_m=3, table=mixed)
        assert moe._partials["xw"].numel() == 3 * 9 * 96 // 8
        assert moe._partials["hw"].numel() == 3 * 3 * 9 * 160 // 8


@pytest.mark.parametrize("shape,needle", [
    (quant.MoEShape(experts=4, hidden=96, inter=96, topk=2, group_size=24), "power-of-two group size"),
    (quant.MoEShape(experts=4, hidden=64, inter=64, topk=2, group_size=8), "power-of-two group size"),
    (quant.MoEShape(experts=4, hidden=80, inter=64, topk=2, group_size=16), "group size of at least 32"),
])
def test_unsupported_shapes_are_refused_with_a_reason(shape, needle):
    with pytest.raises(ValueError, match=needle):
        tm.tile_configs(shape, [1])
    if shape.group_size > 0 and shape.hidden % shape.group_size == 0 and shape.inter % shape.group_size == 0:
        with pytest.raises(ValueError, match=needle):
            tm.TritonW4A16MoE(quant.random_weights(shape, "cpu"), max_m=4)


def test_inputs_outside_the_contract_are_refused():
    weights = quant.random_weights(ODD_SHAPE, "cpu", seed=1)
    moe = tm.TritonW4A16MoE(weights, max_m=4)
    x, ids, wts = random_inputs(ODD_SHAPE, 5, torch.float32, seed=1)
    with pytest.raises(ValueError, match="outside 1..4"):
        moe(x, ids, wts)
    with pytest.raises(ValueError, match=r"x must be \[M, 96\]"):
        moe(x[:2, :64], ids[:2], wts[:2])
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        moe(x[:2], ids[:2, :2], wts[:2, :2])


# The overlapped MMA form (K a compile-time constant; TritonW4A16MoE._launch) computes the
# same as the serialised one: forced here for every swapped mode, split-K included.
@pytest.mark.parametrize("mode", [m for m in MODES if m.get("swap")],
                         ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_overlapped_form_matches_reference(mode):
    mode = dict(mode)
    block_m = mode.pop("block_m")
    weights = quant.random_weights(ODD_SHAPE, "cpu", seed=5)
    moe = tm.TritonW4A16MoE(weights, max_m=32, table=single_entry_table(block_m, **mode))
    forms = []

    def overlapped(which, bm, g, k, launch):
        forms.append(k)
        return launch(k)

    moe._launch = overlapped
    x, ids, wts = random_inputs(ODD_SHAPE, 23, torch.float32, seed=8)
    out = moe(x, ids, wts)
    assert forms == [ODD_SHAPE.hidden, ODD_SHAPE.inter]
    assert relative_error(out, reference(weights, x, ids, wts)) < BOUND[torch.float32]


def _sass(*lines: str) -> str:
    return "\n".join(f"        /*{0x100 + 16 * i:04x}*/                   {t} ;" for i, t in enumerate(lines))


SAFE_SASS = _sass("LDS.U16 R41, [R78]", "HGMMA.64x64x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0",
                  "WARPGROUP.DEPBAR.LE gsb0, 0x0", "@!P2 BRA 0x100")
RACY_SASS = _sass("LDS.U16 R41, [R78]", "HGMMA.64x64x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0",
                  "@!P2 BRA 0x100", "WARPGROUP.DEPBAR.LE gsb0, 0x0")


class _Compiled:
    def __init__(self, code):
        self.asm = {} if code is None else {"sass": code}


def test_overlapped_form_is_kept_only_when_its_sass_passes():
    weights = quant.random_weights(TABLE_SHAPE, "cpu", seed=1)
    moe = tm.TritonW4A16MoE(weights, max_m=128)
    # The decision logic alone: the launches below stand in for GPU launches and return the
    # SASS a compiler could have produced for each form.
    moe._device = torch.device("cuda")
    m = 128  # a tensor-core row of the shipped table (both GEMMs swapped)
    cfg = moe.configs_used(m)
    assert cfg["g1"]["swap"] and cfg["g2"]["swap"] and "mma_overlap" not in cfg["g1"]
    calls = []

    def launcher(overlapped_code):
        def launch(k_const):
            calls.append(k_const)
            return _Compiled(overlapped_code if k_const else SAFE_SASS)
        return launch

    # Clean SASS: the overlapped form stays, with no second launch, now and later.
    moe._launch("g1", cfg["block_m"], cfg["g1"], 7168, launcher(SAFE_SASS))
    moe._launch("g1", cfg["block_m"], cfg["g1"], 7168, launcher(SAFE_SASS))
    assert calls == [7168, 7168]
    # A racy overlapped form: relaunched serialised at once, and serialised from then on.
    calls.clear()
    moe._launch("g2", cfg["block_m"], cfg["g2"], 2048, launcher(RACY_SASS))
    moe._launch("g2", cfg["block_m"], cfg["g2"], 2048, launcher(RACY_SASS))
    assert calls == [2048, 0, 0]
    used = moe.configs_used(m)
    assert used["g1"]["mma_overlap"] is True and used["g2"]["mma_overlap"] is False
    # SASS that cannot be read counts as unsafe, and so does SASS without the warp-group MMA
    # the check knows (another GPU generation's MMAs); rows without the swapped dot never try.
    calls.clear()
    other = dict(cfg["g1"], bn=32)
    moe._launch("g1", cfg["block_m"], other, 7168, launcher(None))
    moe._launch("g1", cfg["block_m"], dict(other, bk=32), 7168, launcher(SAFE_SASS.replace("HGMMA", "HMMA")))
    moe._launch("g1", cfg["block_m"], dict(other, swap=False), 7168, launcher(SAFE_SASS))
    assert calls == [7168, 0, 7168, 0, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                    reason="needs a CUDA GPU and compiled kernels (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("row", ["fused", "prefetching"])
def test_one_row_fusions_on_the_gpu(m, row):
    """The fused and the prefetching (shipped) one-row rows compiled (PTX conversion included),
    against the float32 reference."""
    shape = quant.MoEShape(experts=16, hidden=1024, inter=512, topk=4, group_size=32)
    weights = quant.random_weights(shape, "cuda", seed=4)
    if row == "fused":
        row = dict(block_m=1, g1=dict(GEMV, fx=True), g2=dict(GEMV, bn=16, fsum=True))
    else:
        row = tm.ONE_ROW
    moe = tm.TritonW4A16MoE(weights, max_m=4, table=[(1 << 62, row)])
    for seed in (m, m + 10):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x, ids, wts = cli.make_inputs(shape, m, torch.bfloat16, torch.device("cuda"), gen)
        out = cli.poisoned_call(moe, x, ids, wts, shape.hidden)
        assert cli.relative_error(out, reference_moe(weights, x, ids, wts)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                    reason="needs a CUDA GPU and compiled kernels (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("m", [1, 3, 9, 24])
@pytest.mark.parametrize("row", ["shipped", "rt2-ksplit2", "ksplit1"])
def test_block_m_8_rows_on_the_gpu(m, row):
    """The block_m 8 rows (mma.sync, _mma8_kernel) against the float32 reference, the workspace
    poisoned first (padded rows read NaN: their MMA columns must never reach a stored value);
    M=24 puts more than 8 slots on some experts (several blocks an expert)."""
    shape = quant.MoEShape(experts=16, hidden=1024, inter=512, topk=4, group_size=32)
    weights = quant.random_weights(shape, "cuda", seed=5)
    rows = {"shipped": tm.MMA8,
            "rt2-ksplit2": dict(block_m=8, g1=dict(mma8=True, gate_up=True, rt=2, ksplit=2),
                                g2=dict(mma8=True, rt=2, ksplit=2)),
            "ksplit1": dict(block_m=8, g1=dict(mma8=True, gate_up=True, rt=8, ksplit=1),
                            g2=dict(mma8=True, rt=1, ksplit=1))}
    moe = tm.TritonW4A16MoE(weights, max_m=32, table=[(1 << 62, rows[row])])
    assert moe.configs_used(m)["path"] == "mma8"
    for seed in (m, m + 10):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x, ids, wts = cli.make_inputs(shape, m, torch.bfloat16, torch.device("cuda"), gen)
        for ws in moe._workspace.values():
            for buf in ws.values():
                buf.fill_(float("nan"))
        out = cli.poisoned_call(moe, x, ids, wts, shape.hidden)
        assert cli.relative_error(out, reference_moe(weights, x, ids, wts)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                    reason="needs a CUDA GPU and compiled kernels (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("row,m", [("one-row", 3), ("one-row-sorted", 3), ("one-row-split", 3), ("mma8", 9),
                                   ("bm16", 24), ("bm16", 700)])
def test_pdl_forwards_in_one_graph_equal_the_serial_ones(row, m):
    """With programmatic dependent launch each kernel may start before the one before it ends;
    a wait in the wrong place would read the previous forward's intermediate or routing. Eight
    forwards over eight inputs and routings in one CUDA graph, launched with PDL, must equal
    bitwise the same forwards launched one by one without it. "one-row-split": both one-row
    GEMMs in K slices (GEMM1's added up by the last program of a tile to arrive, its count back
    at zero for the next forward): a count left over, or a partial read before it was stored,
    would differ. "bm16" at M=700: 2800 slots, the grouping's counts in three programs (the
    last to take the ticket adds them up, the ticket back at zero)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    shape = quant.MoEShape(experts=16, hidden=1024, inter=1024, topk=4, group_size=32)
    weights = quant.random_weights(shape, "cuda", seed=6)
    # "one-row-sorted": the slots grouped by expert first (`sort`), so GEMM1 reads the forward's
    # own order and waits at once.
    by_expert = dict(block_m=1, g1=dict(tm.ONE_ROW["g1"], sort=True), g2=tm.ONE_ROW["g2"])
    split = dict(block_m=1, g1=dict(tm.ONE_ROW["g1"], split=2), g2=dict(tm.ONE_ROW["g2"], split=2))
    rows = {"one-row": tm.ONE_ROW, "one-row-sorted": by_expert, "one-row-split": split, "mma8": tm.MMA8,
            "bm16": tm.TENSOR_BM16}
    table = [(1 << 62, rows[row])]
    # (gluon=False: at M=700, 175 slots per expert, this layer would take the Gluon path.)
    fast = tm.TritonW4A16MoE(weights, max_m=max(32, m), table=table, gluon=False)
    serial = tm.TritonW4A16MoE(weights, max_m=max(32, m), table=table, pdl=False, gluon=False)
    assert fast.pdl_reason is None and fast.configs_used(m)["pdl"] is True
    assert serial.configs_used(m)["pdl"] is False
    inputs = []
    for seed in range(8):
        gen = torch.Generator(device="cuda").manual_seed(100 + seed)
        x, ids, wts = cli.make_inputs(shape, m, torch.bfloat16, torch.device("cuda"), gen)
        inputs.append((x, ids.to(torch.int32).contiguous(), wts.to(torch.float32).contiguous()))
    fast(*inputs[0])  # compiled and its buffers made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fast(*args) for args in inputs]
    for _ in range(3):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, args in enumerate(inputs):
            expected = serial(*args)
            torch.cuda.synchronize()
            assert torch.equal(outs[i], expected), f"forward {i} of the graph differs from the serial one"
    assert cli.relative_error(outs[0], reference_moe(weights, *inputs[0])) < 1e-2
    if row == "one-row-split":
        assert fast._g2_split == 2 and fast._gemv_sem.numel() and not fast._gemv_sem.any()
    if m * shape.topk > tm.ALIGN_CHUNK:
        assert not fast._align_ticket.any()
