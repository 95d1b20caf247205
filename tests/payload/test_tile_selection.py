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
    assert [limit for limit, _ in tm.TILE_TABLE][:-1] == [12, 576, 1152]
    assert [entry["block_m"] for _, entry in tm.TILE_TABLE] == [1, 16, 32, 64]


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
    assert g1_bn("mixtral-8x7b", 8, 4) == 64  # 28 column tiles
    assert g1_bn("qwen3-235b-a22b", 1, 8) == 64 and g1_bn("kimi-k2.6", 1, 16) == 64
    few_sms = tm.DeviceLimits("made-up GPU", (9, 0), 16, 232448)
    assert g1_bn("kimi-k2.6", 8, 16, few_sms) == 64  # 460 programs fill 16 SMs
