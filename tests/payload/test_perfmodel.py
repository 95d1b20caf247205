"""The numbers a report shows: bytes, FLOPs, floors, distinct experts, presets and --tp."""

from __future__ import annotations

import math

import pytest
import torch

from moe_bench import perfmodel, presets, quant
from moe_bench.cli import make_inputs

K26 = presets.PRESETS["kimi-k2.6"].shape()

# Field notes section 2: floor on one H200 (4.3 TB/s, 790 TFLOP/s), as published (0.1 us
# below 1000 us, whole us above).
K26_H200_FLOOR_US = {1: 46.1, 2: 91.2, 4: 178.7, 8: 343.0, 16: 632.8, 32: 1085, 64: 1638, 128: 2064,
                     256: 2204, 512: 2216, 1024: 2219, 2048: 2226}


def test_k26_expert_bytes_match_the_published_layer_sizes():
    int4 = (7168 * 4096 + 2048 * 7168) // 2
    scales = (7168 // 32 * 4096 + 2048 // 32 * 7168) * 2
    assert round(int4 / 1e6, 1) == 22.0
    assert round(scales / 1e6, 2) == 2.75
    assert perfmodel.expert_bytes(K26) == int4 + scales
    assert round(perfmodel.expert_bytes(K26) / 1e6, 2) == 24.77
    assert round(quant.weights_bytes(K26) / 1e9, 2) == 9.51


def test_k26_flops_per_token():
    assert perfmodel.flops(K26, 1) == 2 * 8 * (7168 * 4096 + 2048 * 7168)
    assert round(perfmodel.flops(K26, 1) / 1e6, 1) == 704.6
    assert perfmodel.flops(K26, 256) == 256 * perfmodel.flops(K26, 1)


@pytest.mark.parametrize("m,published", sorted(K26_H200_FLOOR_US.items()))
def test_k26_floor_matches_the_h200_table(m, published):
    floor = perfmodel.floor_us(K26, m, bandwidth_gbps=4300, tflops=790)
    shown = round(floor, 1) if published < 1000 else round(floor)
    assert shown == published


def test_k26_is_bandwidth_bound_up_to_2048_on_h200():
    for m in K26_H200_FLOOR_US:
        memory_us = perfmodel.bytes_moved(K26, m) / 4300e9 * 1e6
        assert perfmodel.floor_us(K26, m, 4300, 790) == pytest.approx(memory_us)


def test_floor_turns_compute_bound_when_bandwidth_is_plentiful():
    m = 2048
    compute_us = perfmodel.flops(K26, m) / 790e12 * 1e6
    assert perfmodel.floor_us(K26, m, bandwidth_gbps=1e9, tflops=790) == pytest.approx(compute_us)


def test_floor_rejects_non_positive_ceilings():
    with pytest.raises(ValueError):
        perfmodel.floor_us(K26, 1, 0, 790)


def test_expected_distinct_experts_formula_limits():
    assert perfmodel.expected_distinct_experts(K26, 0) == 0
    assert perfmodel.expected_distinct_experts(K26, 1) == pytest.approx(8)
    assert perfmodel.expected_distinct_experts(K26, 2) == pytest.approx(384 * (1 - (1 - 8 / 384) ** 2))
    values = [perfmodel.expected_distinct_experts(K26, m) for m in K26_H200_FLOOR_US]
    assert values == sorted(values)
    assert 383.9 < values[-1] <= 384


@pytest.mark.parametrize("experts,topk,m", [(384, 8, 16), (16, 4, 3), (5, 3, 2)])
def test_expected_distinct_experts_matches_the_routing_the_harness_draws(experts, topk, m):
    shape = quant.MoEShape(experts=experts, hidden=32, inter=32, topk=topk, group_size=32)
    generator = torch.Generator().manual_seed(1)
    trials = 1000
    total = 0
    for _ in range(trials):
        _, topk_ids, _ = make_inputs(shape, m, torch.float32, "cpu", generator)
        assert all(len(set(row.tolist())) == topk for row in topk_ids)  # distinct per token
        total += len(set(topk_ids.flatten().tolist()))
    assert total / trials == pytest.approx(perfmodel.expected_distinct_experts(shape, m), rel=0.03)


def test_result_row_is_self_consistent():
    row = perfmodel.result_row(K26, 256, us=4408.0, us_p20=4400.0, us_p80=4420.0, compile_s=1.5,
                               bandwidth_gbps=4300, tflops_ceiling=790)
    assert row["pct_of_floor"] == pytest.approx(100 * 2203.9 / 4408.0, abs=0.01)
    assert row["us_per_token"] == pytest.approx(4408.0 / 256, abs=1e-3)
    assert row["gbps"] == pytest.approx(row["bytes"] / 4408e-6 / 1e9, rel=1e-3)
    assert row["tflops"] == pytest.approx(row["flops"] / 4408e-6 / 1e12, rel=1e-3)
    assert row["floor_us"] == pytest.approx(2203.9, abs=0.05)
    at_floor = perfmodel.result_row(K26, 1, row_floor := perfmodel.floor_us(K26, 1, 4300, 790),
                                    row_floor, row_floor, 0.0, 4300, 790)
    assert at_floor["pct_of_floor"] == 100.0


def test_presets_are_valid_real_shapes():
    expected = {
        "kimi-k2.6": (384, 7168, 2048, 8),
        "deepseek-v3": (256, 7168, 2048, 8),
        "qwen3-235b-a22b": (128, 4096, 1536, 8),
        "mixtral-8x7b": (8, 4096, 14336, 2),
    }
    for name, (experts, hidden, inter, topk) in expected.items():
        shape = presets.PRESETS[name].shape()
        shape.validate()
        assert (shape.experts, shape.hidden, shape.inter, shape.topk) == (experts, hidden, inter, topk)
    presets.PRESETS["tiny"].shape().validate()


def test_tp_divides_the_intermediate_size():
    assert presets.PRESETS["kimi-k2.6"].shape(tp=8).inter == 256
    assert presets.PRESETS["kimi-k2.6"].shape(tp=8).experts == 384
    # A TP shard halves the weight bytes a GPU reads per expert, not the experts touched.
    tp2 = presets.PRESETS["kimi-k2.6"].shape(tp=2)
    assert perfmodel.expected_distinct_experts(tp2, 4) == perfmodel.expected_distinct_experts(K26, 4)
    assert perfmodel.expert_bytes(tp2) * 2 == perfmodel.expert_bytes(K26)


@pytest.mark.parametrize("tp,reason", [(3, "not divisible"), (128, "multiple of group size"), (0, "at least 1")])
def test_tp_rejects_impossible_shards(tp, reason):
    with pytest.raises(ValueError, match=reason):
        presets.PRESETS["kimi-k2.6"].shape(tp=tp)


def test_dequantized_copy_is_four_times_the_int4_bytes_roughly():
    ratio = perfmodel.dequantized_weights_bytes(K26) / quant.weights_bytes(K26)
    assert 3.4 < ratio < 4.0
    assert math.isclose(perfmodel.dequantized_weights_bytes(K26) / 1e9, 33.8, abs_tol=0.1)
