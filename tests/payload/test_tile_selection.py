"""Tiles by shape and device (triton_moe: PRESET_TABLES, table_by_slots_per_expert,
fit_to_device): pure Python, no kernel runs."""

from __future__ import annotations

import pytest

from moe_bench import presets, quant
from moe_bench import triton_moe as tm

PRESET_SHAPES = [presets.PRESETS[name].shape(tp) for name in ("kimi-k2.6", "deepseek-v3", "qwen3-235b-a22b",
                                                                "mixtral-8x7b") for tp in (1, 8)]


@pytest.mark.parametrize("shape", PRESET_SHAPES, ids=lambda s: f"E{s.experts}-H{s.hidden}-I{s.inter}-k{s.topk}")
def test_every_preset_shape_ships_a_table_the_rule_agrees_with(shape):
    assert shape in tm.PRESET_TABLES
    assert tm.table_for(shape) is tm.PRESET_TABLES[shape]
    # Round 15 measured each preset's winners to follow slots per expert: the shipped table is
    # that rule's output (a change of the rule must be measured on the presets first).
    assert tm.PRESET_TABLES[shape] == tm.table_by_slots_per_expert(shape)


def test_kimi_table_is_the_tile_table_and_its_limits():
    kimi = presets.PRESETS["kimi-k2.6"].shape()
    assert tm.PRESET_TABLES[kimi] is tm.TILE_TABLE
    assert [limit for limit, _ in tm.TILE_TABLE][:-1] == [7, 192, 576, 1152]
    assert [entry["block_m"] for _, entry in tm.TILE_TABLE] == [1, 8, 16, 32, 64]


def test_rule_for_another_shape_follows_slots_per_expert():
    shape = quant.MoEShape(experts=64, hidden=2048, inter=768, topk=4, group_size=32)  # 16 tokens per slot/expert
    table = tm.table_for(shape)
    assert shape not in tm.PRESET_TABLES
    assert [(limit, entry["block_m"]) for limit, entry in table] == [(4, 1), (192, 16), (384, 32), (1 << 62, 64)]
    # Few experts, top-2: every M has slots that share an expert: no one-row row at all.
    few = quant.MoEShape(experts=4, hidden=256, inter=256, topk=2, group_size=32)
    assert all(entry["block_m"] >= 16 for _, entry in tm.table_for(few))


def test_fit_to_device_drops_stages_to_the_shared_memory_and_narrows_small_grids():
    shape = presets.PRESETS["kimi-k2.6"].shape()
    cfg = tm._config_for(shape, 2048)
    small = tm.DeviceLimits("made-up GPU", (8, 9), 100, 40 * 1024)
    fitted = tm.fit_to_device(cfg, small, shape, 2048)
    for which, gate_up in (("g1", True), ("g2", False)):
        g = fitted[which]
        assert g["stages"] * tm._stage_bytes(cfg["block_m"], g, gate_up) <= small.smem_per_block or g["stages"] == 2
        assert g["stages"] <= cfg[which]["stages"]
    assert fitted["g2"]["stages"] < cfg["g2"]["stages"]
    assert tm.fit_to_device(cfg, tm.H200_LIMITS, shape, 2048) == cfg  # an H200 fits every shipped row
    assert tm.fit_to_device(cfg, None, shape, 2048) == cfg  # the CPU: as the table has it
    # One-row rows: bn 64 halves when it would give fewer than four programs per SM.
    wide = dict(cfg, block_m=1, g1=dict(tm.ONE_ROW["g1"], bn=64), g2=tm.ONE_ROW["g2"])
    tp8 = presets.PRESETS["kimi-k2.6"].shape(8)
    assert tm.fit_to_device(wide, tm.H200_LIMITS, tp8, 1)["g1"]["bn"] == 32
    assert tm.fit_to_device(wide, tm.H200_LIMITS, shape, 64)["g1"]["bn"] == 64


def test_fit_to_device_gives_the_prefetching_one_row_gemm1_longer_steps_on_small_grids():
    """bkw 64 instead of 32 where GEMM1's grid (slots x inter / bn) has fewer than three
    programs per SM: the --tp 8 shards up to M=4, qwen3-235b-a22b at M=1; not kimi-k2.6 --tp 1
    (512 programs at M=1), nor a row without pf, nor on the CPU."""
    def g1_bkw(name, tp, m, limits=tm.H200_LIMITS, row=tm.ONE_ROW):
        shape = presets.PRESETS[name].shape(tp)
        cfg = dict(tm._config_for(shape, m, [(1 << 62, row)]))
        return tm.fit_to_device(cfg, limits, shape, m)["g1"]["bkw"]

    assert tm.ONE_ROW["g1"]["bkw"] == 32
    assert [g1_bkw("kimi-k2.6", 8, m) for m in (1, 2, 4, 8)] == [64, 64, 64, 32]
    assert g1_bkw("kimi-k2.6", 1, 1) == 32  # (at M >= 2 the grid takes two warps and bkw 16, below)
    assert g1_bkw("qwen3-235b-a22b", 1, 1) == 64
    assert g1_bkw("kimi-k2.6", 8, 1, limits=None) == 32
    plain = dict(tm.ONE_ROW, g1=dict(tm.ONE_ROW["g1"], pf=False))
    assert g1_bkw("kimi-k2.6", 8, 1, row=plain) == 32
    few_sms = tm.DeviceLimits("made-up GPU", (9, 0), 16, 232448)
    assert g1_bkw("kimi-k2.6", 8, 1, limits=few_sms) == 32  # 64 programs: four per SM


def test_fit_to_device_gives_prefetching_one_row_gemms_two_warps_on_large_grids():
    """Each one-row GEMM with pf takes two warps and 16 words a step where its grid (slots x
    columns / bn) has at least five programs per SM, four warps elsewhere (GEMM1 with 64 words
    below three per SM); not on the CPU, nor for a row without pf."""
    def warps_bkw(name, tp, m, limits=tm.H200_LIMITS, row=tm.ONE_ROW):
        shape = presets.PRESETS[name].shape(tp)
        cfg = tm.fit_to_device(dict(tm._config_for(shape, m, [(1 << 62, row)])), limits, shape, m)
        return [(cfg[g]["warps"], cfg[g]["bkw"]) for g in ("g1", "g2")]

    assert tm.ONE_ROW["g1"]["warps"] == tm.ONE_ROW["g2"]["warps"] == 4
    # kimi-k2.6 M=1: GEMM1 8 x 64 = 512 programs (four warps), GEMM2 8 x 112 = 896 (two).
    assert warps_bkw("kimi-k2.6", 1, 1) == [(4, 32), (2, 16)]
    assert warps_bkw("kimi-k2.6", 1, 2) == [(2, 16), (2, 16)]
    # --tp 8: GEMM1 8 programs a slot: 64 words up to M=4, four warps at M=8 (512), two at 12.
    assert [warps_bkw("kimi-k2.6", 8, m)[0] for m in (4, 8, 12)] == [(4, 64), (4, 32), (2, 16)]
    assert warps_bkw("kimi-k2.6", 8, 1)[1] == (2, 16)
    # qwen3-235b-a22b M=1: 384 and 512 programs; M=2: 768 and 1024.
    assert warps_bkw("qwen3-235b-a22b", 1, 1) == [(4, 64), (4, 32)]
    assert warps_bkw("qwen3-235b-a22b", 1, 2) == [(2, 16), (2, 16)]
    assert warps_bkw("kimi-k2.6", 1, 2, limits=None) == [(4, 32), (4, 32)]
    plain = dict(tm.ONE_ROW, g1=dict(tm.ONE_ROW["g1"], pf=False), g2=dict(tm.ONE_ROW["g2"], pf=False))
    assert warps_bkw("kimi-k2.6", 1, 2, row=plain) == [(4, 32), (4, 32)]
    many_sms = tm.DeviceLimits("made-up GPU", (9, 0), 264, 232448)
    assert warps_bkw("kimi-k2.6", 1, 2, limits=many_sms) == [(4, 32), (2, 16)]  # 1024 programs: < 5 x 264


def test_fit_to_device_splits_k_of_one_row_gemms_on_fewer_programs_than_sms():
    """A one-row GEMM whose grid has fewer programs than the device has SMs takes its K in 2 (or
    4) slices until it has as many, where the slices are whole steps (gemv_split): the --tp 8
    shards' GEMM1 at M=1-2 (8 x 8 = 64 and 128 programs of 64 words a step; 896 words: 4 slices
    would not be whole), qwen3-235b-a22b --tp 8 (48 at M=1: 4 slices), mixtral-8x7b's GEMM2 at M=1
    (2 x 64 = 128 programs). Not on grids of at least one program per SM (kimi-k2.6 --tp 1, --tp 8
    from M=3), not on the CPU, not for a row that names its split."""
    def splits(name, tp, m, limits=tm.H200_LIMITS, row=tm.ONE_ROW):
        shape = presets.PRESETS[name].shape(tp)
        cfg = tm.fit_to_device(dict(tm._config_for(shape, m, [(1 << 62, row)])), limits, shape, m)
        return [cfg[g].get("split", 1) for g in ("g1", "g2")]

    assert [splits("kimi-k2.6", 8, m) for m in (1, 2, 3, 4)] == [[2, 1], [2, 1], [1, 1], [1, 1]]
    assert splits("deepseek-v3", 8, 1) == [2, 1]
    assert [splits("qwen3-235b-a22b", 8, m) for m in (1, 2)] == [[4, 1], [2, 1]]
    assert splits("mixtral-8x7b", 1, 1) == [1, 2]
    assert [splits("kimi-k2.6", 1, m) for m in (1, 2, 4)] == [[1, 1]] * 3
    assert splits("qwen3-235b-a22b", 1, 1) == [1, 1]
    assert splits("kimi-k2.6", 8, 1, limits=None) == [1, 1]
    named = dict(tm.ONE_ROW, g1=dict(tm.ONE_ROW["g1"], split=1))
    assert splits("kimi-k2.6", 8, 1, row=named) == [1, 1]
    few_sms = tm.DeviceLimits("made-up GPU", (9, 0), 64, 232448)
    assert splits("kimi-k2.6", 8, 1, limits=few_sms) == [1, 1]  # 64 programs: one per SM
    # The backend sizes the slices' partials and GEMM1's arrival counts when it is made.
    shape = presets.PRESETS["kimi-k2.6"].shape(8)
    cfg = tm.fit_to_device(dict(tm._config_for(shape, 2, [(1 << 62, tm.ONE_ROW)])), tm.H200_LIMITS, shape, 2)
    assert tm.gemv_split(cfg["g1"], shape.hidden) == 2 and cfg["g1"]["bn"] == 32


def test_configs_used_names_the_path_and_the_table():
    shape = quant.MoEShape(experts=64, hidden=256, inter=128, topk=2, group_size=32)  # one-row up to M=8
    moe = tm.TritonW4A16MoE(quant.random_weights(shape, "cpu"), max_m=64)
    assert moe.configs_used(1)["path"] == "one-row" and moe.configs_used(1)["table"] == "rule"
    assert moe.configs_used(64)["path"] == "tensor-core"
    given = tm.TritonW4A16MoE(quant.random_weights(shape, "cpu"), max_m=4, table=[(1 << 62, tm.TENSOR_BM16)])
    assert given.configs_used(4)["table"] == "given"


def test_fit_to_device_widens_the_grid_of_block_m_16_rows_on_few_column_tiles():
    """bn 32 for GEMM1 of a block_m 16 row where inter / 64 <= 8 column tiles, <= 0.5 slots per
    expert and bn 64 would give fewer than four programs per SM (the --tp 8 shards at small M);
    elsewhere, and on a device with fewer SMs, the row as the table has it."""
    def g1_bn(name, tp, m, limits=tm.H200_LIMITS):
        shape = presets.PRESETS[name].shape(tp)
        return tm.fit_to_device(tm._config_for(shape, m), limits, shape, m)["g1"]["bn"]

    for name, m in (("kimi-k2.6", 16), ("deepseek-v3", 12), ("qwen3-235b-a22b", 8)):
        assert tm._config_for(presets.PRESETS[name].shape(8), m)["block_m"] == 16
    assert [g1_bn("kimi-k2.6", 8, m) for m in (16, 32, 64)] == [32, 64, 64]
    assert [g1_bn("deepseek-v3", 8, m) for m in (12, 16, 32)] == [32, 32, 64]
    assert [g1_bn("qwen3-235b-a22b", 8, m) for m in (8, 16)] == [32, 64]  # 1 slot per expert at M=16
    assert g1_bn("mixtral-8x7b", 8, 32) == 64  # 28 column tiles (its M=4 is a block_m 8 row now)
    assert g1_bn("qwen3-235b-a22b", 1, 128) == 64 and g1_bn("kimi-k2.6", 1, 256) == 64
    few_sms = tm.DeviceLimits("made-up GPU", (9, 0), 16, 232448)
    assert g1_bn("kimi-k2.6", 8, 16, few_sms) == 64  # 460 programs fill 16 SMs


def test_block_m_8_rows_run_from_64_slots_to_4_slots_per_expert_on_wide_layers():
    """Round 20's rule: the block_m 8 (mma.sync) rows take over from the one-row rows at 64 slots
    (or past 0.25 slots per expert, whichever comes later) up to 4 slots per expert, on layers
    of at least 1024 intermediate columns; the --tp 8 shards of 256 and 192 keep their rows."""
    def ranges(name, tp):
        table = tm.table_for(presets.PRESETS[name].shape(tp))
        return [(limit, entry["block_m"]) for limit, entry in table][:-1]

    assert ranges("kimi-k2.6", 1) == [(7, 1), (192, 8), (576, 16), (1152, 32)]
    assert ranges("deepseek-v3", 1) == [(7, 1), (128, 8), (384, 16), (768, 32)]
    assert ranges("qwen3-235b-a22b", 1) == [(4, 1), (64, 8), (192, 16), (384, 32)]  # 0.25 per expert first
    assert ranges("mixtral-8x7b", 1) == ranges("mixtral-8x7b", 8) == [(1, 1), (16, 8), (48, 16), (96, 32)]
    for name in ("kimi-k2.6", "deepseek-v3", "qwen3-235b-a22b"):  # inter 256 / 256 / 192
        assert all(block_m != 8 for _, block_m in ranges(name, 8))
    assert ranges("kimi-k2.6", 8)[0] == (12, 1)  # the one-row range as before where no block_m 8 row follows
    narrow = quant.MoEShape(experts=64, hidden=2048, inter=960, topk=4, group_size=32)
    assert all(entry["block_m"] != 8 for _, entry in tm.table_for(narrow))
    odd_k = quant.MoEShape(experts=64, hidden=2080, inter=2048, topk=4, group_size=32)  # hidden not 64-divisible
    assert all(entry["block_m"] != 8 for _, entry in tm.table_for(odd_k))


def test_block_m_8_rows_fit_k_and_n_or_say_why():
    g1 = dict(tm.MMA8["g1"])
    g2 = dict(tm.MMA8["g2"])
    assert tm._fit(g1, 7168, 2048, 32) == dict(g1, rt=4, ksplit=4)  # 112 blocks of K, 4 warps
    assert tm._fit(g2, 192, 4096, 32)["ksplit"] == 1  # 3 blocks of K: one warp takes them all
    assert tm._fit(g2, 256, 7168, 32)["ksplit"] == 4
    assert tm._fit(g1, 4096, 1792, 32)["rt"] == 4  # 1792 = 56 x 32 columns
    assert tm._fit(dict(g1, rt=8), 4096, 1760, 32)["rt"] == 4  # 64 columns do not divide 1760 = 55 x 32
    assert tm._fit(dict(g2, rt=8), 1024, 7168 - 16, 32)["rt"] == 1  # 7152 = 447 x 16
    with pytest.raises(ValueError, match="whole 64-value blocks"):
        tm._fit(g1, 96, 160, 32)


@pytest.mark.parametrize("capability, env, expected", [
    ((9, 0), {}, None),
    ((8, 0), {}, None),
    ((12, 0), {}, None),
    ((7, 5), {}, "sm_75 has no bf16 mma.sync"),
    ((9, 0), {"TRITON_INTERPRET": "1"}, "interpreter runs no PTX"),
])
def test_where_the_block_m_8_rows_can_run(capability, env, expected):
    limits = tm.DeviceLimits("a GPU", capability, 132, 232448)
    reason = tm.mma8_unavailable_reason(limits, env=env)
    assert (reason is None) if expected is None else (expected in reason)
    assert "no CUDA device" in tm.mma8_unavailable_reason(None, env={})


@pytest.mark.parametrize("capability, env, expected", [
    ((9, 0), {}, None),
    ((10, 0), {}, None),
    ((12, 0), {}, None),
    ((8, 9), {}, "sm_89 has no programmatic dependent launch"),
    ((9, 0), {"MOE_BENCH_PDL": "0"}, "MOE_BENCH_PDL=0"),
    ((9, 0), {"TRITON_INTERPRET": "1"}, "interpreter runs no PTX"),
])
def test_where_the_kernels_launch_with_pdl(capability, env, expected):
    limits = tm.DeviceLimits("a GPU", capability, 132, 232448)
    reason = tm.pdl_unavailable_reason(limits, env=env)
    assert (reason is None) if expected is None else (expected in reason)
    assert "no CUDA device" in tm.pdl_unavailable_reason(None, env={})


def test_off_a_gpu_the_kernels_launch_without_pdl_and_the_results_say_why():
    shape = quant.MoEShape(experts=8, hidden=128, inter=64, topk=2, group_size=32)
    import torch

    moe = tm.TritonW4A16MoE(quant.random_weights(shape, "cpu", seed=8), max_m=4)
    used = moe.configs_used(1)
    assert used["pdl"] is False and "interpreter runs no PTX" in used["pdl_off"]
    assert moe._pdl_kw == {}  # the interpreter is never handed a launch option it does not know
    off = tm.TritonW4A16MoE(quant.random_weights(shape, "cpu", seed=8), max_m=4, pdl=False)
    assert off.configs_used(1)["pdl_off"] == "turned off by the caller"
    assert torch.equal(moe(*_inputs(shape)), off(*_inputs(shape)))


def _inputs(shape):
    import torch

    from moe_bench import cli

    gen = torch.Generator().manual_seed(5)
    return cli.make_inputs(shape, 3, torch.float32, torch.device("cpu"), gen)


def test_off_a_gpu_the_block_m_16_row_runs_in_their_place_and_the_results_say_so():
    """Under the interpreter (these tests) a block_m 8 row's M runs the block_m 16 row, with the
    workspace sized for it even where the table's largest block is 8, and configs_used says so."""
    import torch

    from moe_bench import cli
    from moe_bench.backends import reference_moe

    shape = quant.MoEShape(experts=8, hidden=128, inter=64, topk=2, group_size=32)
    weights = quant.random_weights(shape, "cpu", seed=8)
    moe = tm.TritonW4A16MoE(weights, max_m=9, table=[(1 << 62, tm.MMA8)])
    used = moe.configs_used(9)
    assert used["path"] == "tensor-core" and used["block_m"] == 16 and not used["g1"].get("mma8")
    assert "interpreter runs no PTX" in used["mma8_fallback"]
    gen = torch.Generator().manual_seed(3)
    x, ids, wts = cli.make_inputs(shape, 9, torch.float32, torch.device("cpu"), gen)  # 18 slots on 8 experts
    out = moe(x, ids, wts)
    assert cli.relative_error(out, reference_moe(weights, x, ids, wts)) < 1e-4
    # A shape the block_m 8 kernel cannot take (K not in 64-value blocks) falls back the same way.
    odd = quant.MoEShape(experts=8, hidden=96, inter=64, topk=2, group_size=32)
    cfg = tm._config_for(odd, 4, [(1 << 62, tm.MMA8)])
    assert cfg["block_m"] == 16 and "hidden 96 is not a multiple of 64" in cfg["mma8_fallback"]
    # Nor a group other than 32 (its scale rows are read per 32-value chunk).
    wide_groups = quant.MoEShape(experts=8, hidden=2048, inter=2048, topk=2, group_size=64)
    cfg = tm._config_for(wide_groups, 4, [(1 << 62, tm.MMA8)])
    assert cfg["block_m"] == 16 and "group size 64" in cfg["mma8_fallback"]
    assert all(entry["block_m"] != 8 for _, entry in tm.table_for(wide_groups))
