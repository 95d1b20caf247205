"""The rehearsal beside the live service (`--rehearse`): fewer experts than the layer, every M of
the list checked and timed, the same compiled kernels as the layer's run (the Triton cache the
full run reuses), a refusal when not even top-k experts fit."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moe_bench import perfmodel, quant, sass
from moe_bench.cli import EXIT_NO_ROOM
from moe_bench.schema import load_results

KIMI = quant.MoEShape(experts=384, hidden=7168, inter=2048, topk=8, group_size=32)


def test_the_held_experts_keep_the_layers_jit_specialisation():
    # The expert count is a kernel argument: Triton compiles 1 and multiples of 16 apart.
    assert quant.rehearsal_expert_counts(KIMI)[:3] == [16, 32, 48]
    assert quant.rehearsal_layer_error(dataclasses.replace(KIMI, experts=8), KIMI) is not None
    mixtral = quant.MoEShape(experts=8, hidden=4096, inter=14336, topk=2, group_size=32)
    assert quant.rehearsal_expert_counts(mixtral) == [2, 3, 4, 5, 6, 7, 8]
    assert "more than the experts" in quant.rehearsal_layer_error(
        dataclasses.replace(KIMI, experts=16, inter=1024), KIMI)
    assert "top-k" in quant.rehearsal_layer_error(dataclasses.replace(mixtral, experts=1), mixtral)


def test_a_backend_holding_fewer_experts_makes_every_compile_time_choice_of_its_layer():
    triton_moe = pytest.importorskip("moe_bench.triton_moe")
    layer = quant.MoEShape(experts=256, hidden=256, inter=128, topk=8, group_size=32)
    held = dataclasses.replace(layer, experts=16)
    full = triton_moe.TritonW4A16MoE(quant.random_weights(layer, "cpu", seed=0), 2048)
    rehearsal = triton_moe.TritonW4A16MoE(quant.random_weights(held, "cpu", seed=0), 2048, layer=layer)
    alone = triton_moe.TritonW4A16MoE(quant.random_weights(held, "cpu", seed=0), 2048)
    m_list = [1, 2, 3, 4, 8, 16, 64, 256, 512, 768, 1024, 2048]
    assert rehearsal._num_bins == full._num_bins == triton_moe.num_bins(layer)
    for m in m_list:
        assert rehearsal._config(m) == full._config(m), m
        assert rehearsal._gluon_can_run(m) == full._gluon_can_run(m), m
        assert {k: v for k, v in rehearsal.configs_used(m).items() if k != "gluon"} == \
            {k: v for k, v in full.configs_used(m).items() if k != "gluon"}, m
    # Without the layer, 16 experts choose other tiles and other bins: a cache it filled would
    # not hold the layer's kernels (what the decoupling is for).
    assert alone._num_bins != full._num_bins
    assert any(alone._config(m) != full._config(m) for m in m_list)
    with pytest.raises(ValueError, match="specialises"):
        triton_moe.TritonW4A16MoE(quant.random_weights(dataclasses.replace(layer, experts=8), "cpu", seed=0), 64,
                                  layer=layer)


def test_a_released_workspace_is_made_again_at_its_sizes_and_the_output_is_unchanged():
    triton_moe = pytest.importorskip("moe_bench.triton_moe")
    import torch

    layer = quant.MoEShape(experts=32, hidden=128, inter=64, topk=2, group_size=32)
    held = dataclasses.replace(layer, experts=16)
    weights = quant.random_weights(held, "cpu", seed=0)
    moe = triton_moe.TritonW4A16MoE(weights, 8, layer=layer)
    generator = torch.Generator().manual_seed(1)
    from moe_bench.cli import make_inputs

    x, topk_ids, topk_weights = make_inputs(held, 8, torch.float32, "cpu", generator)
    first = moe(x, topk_ids, topk_weights).clone()
    sizes = {name: tuple(buffer.shape) for name, buffer in moe._workspace[torch.float32].items()}
    moe.release_workspace()
    assert moe._workspace == {}
    assert torch.equal(moe(x, topk_ids, topk_weights), first)
    assert {name: tuple(buffer.shape) for name, buffer in moe._workspace[torch.float32].items()} == sizes


def test_the_rehearsals_check_holds_at_most_its_largest_m_and_a_runs_check_is_one_pass():
    assert perfmodel.check_batch_rows(2048, rehearse=True) == 2048
    assert perfmodel.check_batch_rows(2048) == perfmodel.CHECK_BATCH_ROWS >= 1 + 3 + 4 + 8 + 512 + 1024 + 2048
    # The estimate covers one largest-M batch with its reference, the expert unpacked in float32.
    held = dataclasses.replace(KIMI, experts=16)
    assert perfmodel.check_bytes(held, 2048) > 3 * KIMI.hidden * KIMI.inter * 4 + 2048 * KIMI.hidden * (2 + 2 + 4)
    estimate = perfmodel.rehearsal_estimate(held, "triton", 2048)
    assert estimate["workspace_bytes"] >= perfmodel.check_bytes(held, 2048)
    assert estimate["total_mib"] <= perfmodel.REHEARSAL_BUDGET_MIB


def test_the_rehearsal_picks_the_most_experts_that_fit_and_none_when_topk_does_not():
    shape_of = lambda e: dataclasses.replace(KIMI, experts=e)  # noqa: E731
    candidates = quant.rehearsal_expert_counts(KIMI)
    chosen, allowed = perfmodel.rehearsal_experts(candidates, shape_of, "triton", 2048, "cuda", "bfloat16",
                                                  perfmodel.REHEARSAL_BUDGET_MIB, 29302, 16)
    assert chosen == 16 and allowed == perfmodel.REHEARSAL_BUDGET_MIB
    # Half of what is free beside the service, at most: 3000 MiB free allows 1500.
    chosen, allowed = perfmodel.rehearsal_experts(candidates, shape_of, "triton", 2048, "cuda", "bfloat16",
                                                  perfmodel.REHEARSAL_BUDGET_MIB, 3000, 16)
    assert chosen is None and allowed == 1500


def test_sass_verdicts_are_kept_beside_the_triton_cache(tmp_path, monkeypatch):
    kernel = type("Kernel", (), {"hash": "abc123"})()
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    sass.store_verdict(kernel, True)
    assert sass.cached_verdict(kernel) is None  # no cache folder: nothing kept
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert sass.cached_verdict(kernel) is None
    sass.store_verdict(kernel, False)
    assert sass.cached_verdict(kernel) is False
    record = tmp_path / "moe_bench_sass" / "abc123.json"
    record.write_text(json.dumps({"check_version": sass.CHECK_VERSION + 1, "overlap_ok": True}))
    assert sass.cached_verdict(kernel) is None  # another check's verdict is never trusted


def test_a_torch_rehearsal_checks_and_times_every_m_with_fewer_experts(run_payload, without_triton, tmp_path):
    out = tmp_path / "rehearsal.json"
    result = run_payload("--rehearse", "--device", "cpu", "--backend", "torch", "--preset", "tiny",
                         "--m-list", "1,4,8", "--out", str(out), path_first=without_triton)
    assert result.returncode == 0, result.stdout + result.stderr
    loaded = load_results(out)
    assert loaded["status"] == "complete" and loaded["completed_m"] == [1, 4, 8]
    rehearsal = loaded["rehearsal"]
    assert rehearsal["reduced"] is True and rehearsal["layer_experts"] == 16
    assert loaded["config"]["experts"] == rehearsal["experts"] == 8  # twice top-k (4), fewer than the layer
    assert [c["m"] for c in loaded["correctness"]] == [1, 3, 4, 8] and all(c["ok"] for c in loaded["correctness"])
    assert loaded["timing"]["routings"] == perfmodel.REHEARSAL_ROUTINGS
    assert loaded["gpu_at_start"] is None  # the CPU: no GPU to describe


def test_a_rehearsal_with_a_wrong_result_names_the_m_and_the_configuration_and_times_nothing(
        run_payload, without_triton, tmp_path):
    out = tmp_path / "rehearsal.json"
    result = run_payload("--rehearse", "--device", "cpu", "--backend", "torch", "--preset", "tiny",
                         "--m-list", "1,4,8", "--out", str(out), path_first=without_triton,
                         env_extra={"MOE_BENCH_INTERNAL_WRONG_AT_M": "4"})
    assert result.returncode == 4, result.stdout + result.stderr  # EXIT_CORRECTNESS
    loaded = load_results(out)
    assert loaded["status"] == "failed" and loaded["error"]["kind"] == "correctness" and loaded["results"] == []
    message = loaded["error"]["message"]
    assert "is wrong at M=4 (tile config {" in message and "no timing was done" in message, message
    assert "(rehearsal with 8 of the layer's 16 experts)" in message, message
    assert [(c["m"], c["ok"]) for c in loaded["correctness"]] == [(1, True), (3, True), (4, False)]


def test_a_rehearsal_that_cannot_fit_topk_experts_runs_nothing_and_says_so(run_payload, without_triton, tmp_path):
    out = tmp_path / "rehearsal.json"
    result = run_payload("--rehearse", "--rehearse-budget-mib", "0.001", "--device", "cpu", "--backend", "torch",
                         "--preset", "tiny", "--m-list", "1,2", "--out", str(out), path_first=without_triton)
    assert result.returncode == EXIT_NO_ROOM, result.stdout + result.stderr
    loaded = load_results(out)
    assert loaded["status"] == "failed" and loaded["error"]["kind"] == "no-room" and loaded["results"] == []
    assert "4 experts (top-k 4) need about" in loaded["error"]["message"]
    assert "nothing was run" in loaded["error"]["message"]
    assert loaded["rehearsal"]["experts"] is None and loaded["rehearsal"]["smallest_experts"] == 4


def test_a_triton_rehearsal_under_the_interpreter_holds_the_fewest_experts_that_compile_the_layers_kernels(
        run_payload, tmp_path):
    pytest.importorskip("moe_bench.triton_moe")
    out = tmp_path / "rehearsal.json"
    result = run_payload("--rehearse", "--device", "cpu", "--backend", "triton", "--experts", "32", "--hidden", "128",
                         "--inter", "64", "--topk", "2", "--m-list", "2", "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    loaded = load_results(out)
    assert loaded["status"] == "complete" and loaded["completed_m"] == [2]
    assert loaded["rehearsal"]["layer_experts"] == 32 and loaded["config"]["experts"] == 16
    check = loaded["correctness"][0]
    assert check["ok"] and check["config"]["table"] == "rule"
