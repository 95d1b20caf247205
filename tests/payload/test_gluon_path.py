"""The Gluon warp-specialised Hopper path (moe_bench.gluon_moe): which path runs where, the
fallback when it fails to compile or fails its check, and what the results say. The selection
and the fallback run on the CPU with stand-ins for the Gluon launches (its kernels need an sm_90
GPU); the `gpu` test runs the real kernels."""

from __future__ import annotations

import os

import pytest
import torch

from moe_bench import cli, gluon_moe, presets, quant
from moe_bench import triton_moe as tm
from moe_bench.backends import reference_moe

KIMI = presets.PRESETS["kimi-k2.6"].shape()


@pytest.mark.parametrize("capability, expected", [
    ((12, 0), "sm_120 has no warp-group MMA"),
    ((8, 9), "sm_89 has no warp-group MMA"),
    ((10, 0), "sm_100 has no warp-group MMA"),
    (None, "no CUDA device"),
])
def test_only_sm_90_runs_the_gluon_path(capability, expected):
    assert expected in gluon_moe.path_unavailable_reason(capability, None, env={})


def test_sm_90_runs_it_unless_the_api_differs_or_it_is_turned_off():
    assert gluon_moe.path_unavailable_reason((9, 0), None, env={}) is None
    assert gluon_moe.path_unavailable_reason((9, 0), "Gluon not importable (x)", env={}) == "Gluon not importable (x)"
    assert "MOE_BENCH_GLUON=0" in gluon_moe.path_unavailable_reason((9, 0), None, env={"MOE_BENCH_GLUON": "0"})
    assert "interpreter" in gluon_moe.path_unavailable_reason((9, 0), None, env={"TRITON_INTERPRET": "1"})


def test_installed_gluon_api_is_recognised():
    # .venv-payload's Triton ships Gluon with the API the module is written against (as the GPU
    # host's 3.6 does); a version whose warp_specialize differs is refused, not crashed on.
    assert gluon_moe.api_error() is None or "warp_specialize" in gluon_moe.api_error() \
        or "not importable" in gluon_moe.api_error()


@pytest.mark.parametrize("name, tp", [(n, tp) for n in ("kimi-k2.6", "deepseek-v3", "qwen3-235b-a22b", "mixtral-8x7b")
                                      for tp in (1, 8)])
def test_every_preset_shape_fits_the_gluon_tiles_or_says_why(name, tp):
    shape = presets.PRESETS[name].shape(tp)
    reason = gluon_moe.shape_unavailable_reason(shape)
    if shape.inter % 128 == 0:
        assert reason is None
    else:  # qwen3-235b-a22b --tp 8: inter 192
        assert "GEMM1's N=192" in reason


def test_a_shape_off_the_tiles_is_named():
    odd = quant.MoEShape(experts=8, hidden=4096 + 32, inter=1024, topk=2, group_size=32)
    assert gluon_moe.shape_unavailable_reason(odd).startswith("GEMM1's K=4128 is not a multiple of 128")


def test_selection_by_slots_per_expert_and_by_the_switch():
    assert not gluon_moe.can_run_at(KIMI, 383)  # 7.98 slots per expert: mostly padding even 16 wide
    assert gluon_moe.can_run_at(KIMI, 384)  # 8
    assert gluon_moe.selected(KIMI, 384, env={"MOE_BENCH_GLUON": "force"})
    bound = gluon_moe.SELECT_SLOTS_PER_EXPERT
    assert gluon_moe.select_slots_per_expert(KIMI) == bound
    for m in (384, 512, 767, 768, 1024, 1152, 1536, 2048, 2560, 3072, 4096, 8192):
        spe = m * KIMI.topk / KIMI.experts
        assert gluon_moe.selected(KIMI, m, env={}) == (bound is not None and spe >= bound)
        reason = gluon_moe.not_selected_reason(KIMI, m, env={})
        assert reason == (None if spe >= bound else gluon_moe.NOT_SELECTED.format(bound=bound))
        assert reason is None or f"below {bound:g} slots per expert" in reason
    assert gluon_moe.selected(KIMI, 768, env={}) and not gluon_moe.selected(KIMI, 767, env={})  # 16, 15.98
    # The --tp 8 shard's narrow intermediate: not selected at any M, and the reason names the layer.
    tp8 = presets.PRESETS["kimi-k2.6"].shape(8)
    assert tp8.inter < gluon_moe.SELECT_MIN_INTER
    assert gluon_moe.not_selected_reason(tp8, 8192, env={}) == gluon_moe.NOT_SELECTED_SHAPE
    assert gluon_moe.not_selected_reason(tp8, 512, env={}) == gluon_moe.NOT_SELECTED.format(bound=bound)
    assert gluon_moe.selected(tp8, 8192, env={"MOE_BENCH_GLUON": "force"})


def test_a_wide_layer_selects_the_path_from_fewer_slots_per_expert():
    """mixtral-8x7b (intermediate 14336) from SELECT_SLOTS_PER_EXPERT_WIDE, the narrower presets
    from SELECT_SLOTS_PER_EXPERT; the reason names the bound of the layer it is given."""
    mixtral = presets.PRESETS["mixtral-8x7b"].shape()
    wide = gluon_moe.SELECT_SLOTS_PER_EXPERT_WIDE
    assert mixtral.inter >= gluon_moe.SELECT_WIDE_INTER > KIMI.inter
    assert wide < gluon_moe.SELECT_SLOTS_PER_EXPERT and gluon_moe.select_slots_per_expert(mixtral) == wide
    first = int(wide * mixtral.experts / mixtral.topk)  # M=32: 8 slots per expert
    assert gluon_moe.selected(mixtral, first, env={}) and gluon_moe.can_run_at(mixtral, first)
    assert gluon_moe.not_selected_reason(mixtral, first - 1, env={}) == gluon_moe.NOT_SELECTED.format(bound=wide)
    assert "below 8 slots per expert on this layer" in gluon_moe.not_selected_reason(mixtral, first - 1, env={})
    for name in ("deepseek-v3", "qwen3-235b-a22b", "kimi-k2.6"):
        shape = presets.PRESETS[name].shape()
        assert shape.inter < gluon_moe.SELECT_WIDE_INTER
        m = int(wide * shape.experts / shape.topk)  # 8 slots per expert: not selected on these layers
        assert not gluon_moe.selected(shape, m, env={}) and gluon_moe.can_run_at(shape, m)
    # A layer exactly at the width is a wide one.
    assert gluon_moe.select_slots_per_expert(quant.MoEShape(8, 4096, gluon_moe.SELECT_WIDE_INTER, 2, 32)) == wide


def test_narrowed_tiles_are_checked_before_any_launch():
    assert gluon_moe.TILES_BM128["g1"]["narrow"] == 32 and gluon_moe.TILES_BM128["g2"]["narrow"] == 32
    # the 96-wide body in GEMM2 (in GEMM1 it spills: PERFORMANCE.md round 26)
    assert gluon_moe.TILES_BM128["g2"]["mid"] and not gluon_moe.TILES_BM128["g1"].get("mid")
    path = gluon_moe.GluonHopperPath.__new__(gluon_moe.GluonHopperPath)
    path.moe = type("M", (), {"shape": SMALL})()
    bad = {"g1": dict(gluon_moe.TILES_BM128["g1"], narrow=48), "g2": gluon_moe.TILES_BM128["g2"]}
    x = torch.zeros((4, SMALL.hidden), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="narrow 48 is not 0 or a power of two"):
        path.forward(x, None, None, tiles=bad)
    bad = {"g1": gluon_moe.TILES_BM128["g1"], "g2": dict(gluon_moe.TILES_BM128["g2"], narrow=64)}
    with pytest.raises(ValueError, match="g2's mid .* needs a narrow of at most bm / 4 = 32, not 64"):
        path.forward(x, None, None, tiles=bad)


def test_the_consumers_take_unroll_steps_a_turn_where_they_divide_k():
    """The consumers' K loop takes a tile's "unroll" steps a turn (UNROLL where it does not
    say), halved until it divides the GEMM's K / 64 steps: the bm64 tiles one step a turn, the
    bm128 tiles UNROLL, in both GEMMs of every preset's layer; an unroll that is not a power of
    two fails before any launch."""
    assert gluon_moe.TILES_BM64["g1"]["unroll"] == gluon_moe.TILES_BM64["g2"]["unroll"] == 1
    assert "unroll" not in gluon_moe.TILES_BM128["g1"] and "unroll" not in gluon_moe.TILES_BM128["g2"]
    tile = gluon_moe.TILES_BM128["g1"]
    assert [gluon_moe.unroll_for(dict(tile, unroll=8), k) for k in (2048, 1536, 768, 384)] == [8, 8, 4, 2]
    assert gluon_moe.unroll_for(dict(tile, unroll=1), 2048) == 1
    for name in ("kimi-k2.6", "deepseek-v3", "qwen3-235b-a22b", "mixtral-8x7b"):
        shape = presets.PRESETS[name].shape()
        for k in (shape.hidden, shape.inter):
            assert gluon_moe.unroll_for(gluon_moe.TILES_BM64["g1"], k) == 1
            assert gluon_moe.unroll_for(gluon_moe.TILES_BM128["g2"], k) == gluon_moe.UNROLL, name
    path = gluon_moe.GluonHopperPath.__new__(gluon_moe.GluonHopperPath)
    path.moe = type("M", (), {"shape": SMALL})()
    x = torch.zeros((4, SMALL.hidden), dtype=torch.bfloat16)
    for bad in (3, 0, 6):
        tiles = {"g1": gluon_moe.TILES_BM64["g1"], "g2": dict(gluon_moe.TILES_BM64["g2"], unroll=bad)}
        with pytest.raises(ValueError, match=rf"g2's unroll {bad} is not a power of two \(1, 2, 4, ...\)"):
            path.forward(x, None, None, tiles=tiles)
    with pytest.raises(ValueError, match="unroll 6 is not a power of two"):
        gluon_moe.unroll_for(dict(tile, unroll=6), 2048)


def test_tiles_by_slots_per_expert_and_the_workspace_for_the_largest(monkeypatch):
    small, large = gluon_moe.TILES_BM64, gluon_moe.TILES_BM128
    monkeypatch.setattr(gluon_moe, "GLUON_TILE_ROWS", [(96.0, small), (None, large)])
    assert gluon_moe.tiles_for(KIMI, 4608) is small  # 96 slots per expert
    assert gluon_moe.tiles_for(KIMI, 4609) is large
    assert gluon_moe.tile_sets() == [small, large]
    assert gluon_moe.max_block_m(KIMI, 4608) == 64 and gluon_moe.max_block_m(KIMI, 8192) == 128
    # The backend's sorted-slot workspace takes the larger blocks where the path can run.
    weights = quant.random_weights(SMALL, "cpu", seed=3)
    moe = tm.TritonW4A16MoE(weights, 512)
    assert moe._gluon is None  # off the GPU: no room asked for it
    assert moe._max_padded == tm._padded_rows(SMALL, 512, tm._max_block_m(512, moe.table))


# ---------------------------------------------------------------------------
# The fallback, on the CPU: stand-ins for the Gluon launches
# ---------------------------------------------------------------------------

SMALL = quant.MoEShape(experts=4, hidden=128, inter=128, topk=2, group_size=32)
M = 64  # 32 slots per expert: in the Gluon path's range


class _StandIn:
    """What TritonW4A16MoE asks of gluon_moe.GluonHopperPath: dtypes and forward."""

    dtypes = (torch.float32,)

    def __init__(self, moe, mode):
        self.moe, self.mode, self.calls = moe, mode, 0

    def forward(self, x, ids, wts):
        self.calls += 1
        if self.mode == "raise":
            raise RuntimeError("PassManager::run failed")
        out = self.moe._forward_triton(x, ids, wts)
        if self.mode == "wrong":
            out = out.clone()
            out[0] += 1.0
        if self.mode == "nan":
            out = out.clone()
            out[-1, -1] = float("nan")
        return out


def _backend(mode, monkeypatch):
    monkeypatch.setenv("MOE_BENCH_GLUON", "force")
    weights = quant.random_weights(SMALL, "cpu", seed=3)
    moe = tm.TritonW4A16MoE(weights, M)
    assert moe._gluon is None and "interpreter" in moe.gluon_reason  # what the CPU gives by itself
    moe._gluon = _StandIn(moe, mode)
    moe.gluon_reason = None
    gen = torch.Generator().manual_seed(5)
    x, ids, wts = cli.make_inputs(SMALL, M, torch.float32, torch.device("cpu"), gen)
    return moe, weights, (x, ids, wts)


def test_a_correct_path_runs_after_its_check_and_the_results_say_so(monkeypatch):
    moe, weights, (x, ids, wts) = _backend("ok", monkeypatch)
    assert moe.configs_used(M)["path"] == gluon_moe.PATH_NAME
    out = moe(x, ids, wts)
    assert moe._gluon is not None and moe._gluon_checked and moe.gluon_error == 0.0
    assert cli.relative_error(out, reference_moe(weights, x, ids, wts)) < 2e-3
    used = moe.configs_used(M)
    assert used["path"] == gluon_moe.PATH_NAME and used["gluon"]["checked"] and "gluon_fallback" not in used
    moe(x, ids, wts)
    assert moe._gluon.calls == 2  # checked once, then used
    # Below its range the plain-Triton rows run and nothing is said about Gluon.
    assert "gluon_fallback" not in moe.configs_used(8) and moe.configs_used(8)["path"] == "tensor-core"


@pytest.mark.parametrize("mode, reason", [
    ("raise", "compile or launch failed: RuntimeError: PassManager::run failed"),
    ("wrong", "failed its correctness check at M=64: relative difference"),
    ("nan", "failed its correctness check at M=64: non-finite or unwritten output"),
])
def test_a_failing_path_falls_back_and_the_results_say_why(mode, reason, monkeypatch):
    moe, weights, (x, ids, wts) = _backend(mode, monkeypatch)
    out = moe(x, ids, wts)  # never fails the run
    assert moe._gluon is None and reason in moe.gluon_reason
    assert cli.relative_error(out, reference_moe(weights, x, ids, wts)) < 2e-3  # the plain-Triton answer
    used = moe.configs_used(M)
    assert used["path"] == "tensor-core" and reason in used["gluon_fallback"]


def test_selected_by_default_only_from_its_slots_per_expert_and_the_results_say_so(monkeypatch):
    moe, _, (x, ids, wts) = _backend("ok", monkeypatch)
    monkeypatch.delenv("MOE_BENCH_GLUON", raising=False)
    monkeypatch.setattr(gluon_moe, "SELECT_MIN_INTER", SMALL.inter)  # the rule by slots per expert alone
    monkeypatch.setattr(gluon_moe, "SELECT_SLOTS_PER_EXPERT", 33.0)  # M=64 is 32 slots per expert
    moe(x, ids, wts)
    assert moe._gluon.calls == 0
    used = moe.configs_used(M)
    assert used["path"] == "tensor-core" and used["gluon_fallback"] == gluon_moe.NOT_SELECTED.format(bound=33)
    monkeypatch.setattr(gluon_moe, "SELECT_SLOTS_PER_EXPERT", 32.0)
    moe(x, ids, wts)
    assert moe._gluon.calls == 1 and moe.configs_used(M)["path"] == gluon_moe.PATH_NAME
    monkeypatch.setattr(gluon_moe, "SELECT_SLOTS_PER_EXPERT", None)  # never, unless forced
    assert moe.configs_used(M)["gluon_fallback"] == gluon_moe.NOT_SELECTED_NEVER


def test_asked_off_by_the_caller():
    weights = quant.random_weights(SMALL, "cpu", seed=3)
    assert tm.TritonW4A16MoE(weights, M, gluon=False).gluon_reason == "not asked for (gluon=False)"


# ---------------------------------------------------------------------------
# On an sm_90 GPU: the real kernels
# ---------------------------------------------------------------------------

needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                                or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                reason="needs an sm_90 GPU and compiled kernels (TRITON_INTERPRET=0)")


@pytest.mark.gpu
@needs_sm90
# 10, 24, 44, 50, 75, 88 and 150 slots per expert: both tile sets; bm64's blocks at MMA widths 16
# (10), 32 (24) and 64 (44: blocks of 33-49 rows); bm128's at widths 64 (50), 96 (a 64- and a
# 32-wide accumulator: most blocks at 75 and 88), 128 (the blocks over 96 rows at 88) and 128 with
# 32 in each expert's last block (150); and a layer whose K loops lap the ring of stages many
# times (GEMM1 32 steps, GEMM2 16: each stage refilled while the consumers' MMAs of the steps
# before it are still queued).
@pytest.mark.parametrize("m,hidden,inter", [(40, 512, 256), (96, 512, 256), (176, 512, 256), (200, 512, 256),
                                            (300, 512, 256), (352, 512, 256), (600, 512, 256), (300, 2048, 1024)])
def test_gluon_kernels_on_the_gpu(m, hidden, inter, monkeypatch):
    monkeypatch.setenv("MOE_BENCH_GLUON", "force")
    shape = quant.MoEShape(experts=8, hidden=hidden, inter=inter, topk=2, group_size=32)
    weights = quant.random_weights(shape, "cuda", seed=1)
    moe = tm.TritonW4A16MoE(weights, 1024)
    assert moe.gluon_reason is None, moe.gluon_reason
    gen = torch.Generator(device="cuda").manual_seed(m)
    x, ids, wts = cli.make_inputs(shape, m, torch.bfloat16, torch.device("cuda"), gen)
    out = cli.poisoned_call(moe, x, ids, wts, shape.hidden)
    assert moe.gluon_reason is None, moe.gluon_reason  # compiled and passed its check
    used = moe.configs_used(m)
    assert used["path"] == gluon_moe.PATH_NAME and used["gluon"]["checked"]
    assert used["gluon"]["g1"] == gluon_moe.tiles_for(shape, m)["g1"]
    assert cli.relative_error(out, reference_moe(weights, x, ids, wts)) < 1e-2
    x2, ids2, wts2 = cli.make_inputs(shape, m, torch.bfloat16, torch.device("cuda"), gen)  # fresh routing
    assert cli.relative_error(moe(x2, ids2, wts2), reference_moe(weights, x2, ids2, wts2)) < 1e-2


@pytest.mark.gpu
@needs_sm90
def test_a_wide_layer_runs_the_path_by_default_from_8_slots_per_expert(monkeypatch):
    """Not forced: at M=32 (8 slots per expert) a layer with an intermediate of SELECT_WIDE_INTER
    runs the Gluon path (compiled, checked, right against the reference on two routings) and a
    narrower one the plain rows, whose results name the bound."""
    monkeypatch.delenv("MOE_BENCH_GLUON", raising=False)
    m = 32
    for inter, path in ((gluon_moe.SELECT_WIDE_INTER, gluon_moe.PATH_NAME), (gluon_moe.SELECT_WIDE_INTER // 2, "tensor-core")):
        shape = quant.MoEShape(experts=8, hidden=512, inter=inter, topk=2, group_size=32)
        weights = quant.random_weights(shape, "cuda", seed=4)
        moe = tm.TritonW4A16MoE(weights, 256)
        gen = torch.Generator(device="cuda").manual_seed(inter)
        for _ in range(2):  # the second on a fresh routing
            x, ids, wts = cli.make_inputs(shape, m, torch.bfloat16, torch.device("cuda"), gen)
            out = cli.poisoned_call(moe, x, ids, wts, shape.hidden)
            assert cli.relative_error(out, reference_moe(weights, x, ids, wts)) < 1e-2
        assert moe.gluon_reason is None, moe.gluon_reason
        used = moe.configs_used(m)
        assert used["path"] == path, (inter, used)
        if path == gluon_moe.PATH_NAME:
            assert used["gluon"]["checked"]  # its first call was checked against the plain rows
        else:
            assert used["gluon_fallback"] == gluon_moe.NOT_SELECTED.format(bound=gluon_moe.SELECT_SLOTS_PER_EXPERT)


def _forced_path(m, hidden, inter, seed, monkeypatch):
    """An 8-expert layer's Gluon path (forced, compiled) and M rows' inputs."""
    monkeypatch.setenv("MOE_BENCH_GLUON", "force")
    shape = quant.MoEShape(experts=8, hidden=hidden, inter=inter, topk=2, group_size=32)
    weights = quant.random_weights(shape, "cuda", seed=seed)
    moe = tm.TritonW4A16MoE(weights, 1024)
    assert moe.gluon_reason is None, moe.gluon_reason
    gen = torch.Generator(device="cuda").manual_seed(m)
    x, ids, wts = cli.make_inputs(shape, m, torch.bfloat16, torch.device("cuda"), gen)
    return shape, weights, moe._gluon, x, ids, wts


@pytest.mark.gpu
@needs_sm90
# Three programs for every tile of both GEMMs: each program's ring of stages runs on from one
# tile into the next, across blocks of different MMA widths (16, 32, 64, 96, 128) and past the
# tiles of unused blocks; the result must be the one-program-a-tile result, bit for bit.
@pytest.mark.parametrize("m,hidden,inter", [(96, 512, 256), (176, 512, 256), (300, 512, 256), (352, 512, 256),
                                            (600, 512, 256), (300, 2048, 1024)])
def test_persistent_programs_give_the_one_program_a_tile_result(m, hidden, inter, monkeypatch):
    shape, weights, path, x, ids, wts = _forced_path(m, hidden, inter, 2, monkeypatch)
    tiles = gluon_moe.tiles_for(shape, m)
    one_each = {w: dict(tiles[w], persistent=False) for w in ("g1", "g2")}
    expected = path.forward(x, ids, wts, tiles=one_each).clone()
    path.sm_count = 3
    out = path.forward(x, ids, wts, tiles={w: dict(tiles[w], persistent=True) for w in ("g1", "g2")})
    torch.cuda.synchronize()
    assert torch.equal(out, expected), f"max difference {(out.float() - expected.float()).abs().max().item()}"
    assert cli.relative_error(out, reference_moe(weights, x, ids, wts)) < 1e-2


@pytest.mark.gpu
@needs_sm90
# GEMM1 8 or 32 steps, GEMM2 4, 6 (at most two a turn: 4 does not divide it) or
# 16; blocks at MMA widths 16-64 (bm64 tiles) and 64-128 (bm128, with the 96-wide body).
@pytest.mark.parametrize("m,hidden,inter", [(96, 512, 256), (176, 512, 384), (300, 2048, 1024), (600, 512, 256)])
def test_every_unroll_gives_the_two_step_result(m, hidden, inter, monkeypatch):
    """The consumers' loop at 1, 4 and 8 steps a turn runs the same MMAs in the same order as at
    2: the result must be the 2-step result, bit for bit, and right against the reference."""
    shape, weights, path, x, ids, wts = _forced_path(m, hidden, inter, 3, monkeypatch)
    tiles = gluon_moe.tiles_for(shape, m)
    expected = path.forward(x, ids, wts, tiles={w: dict(tiles[w], unroll=2) for w in ("g1", "g2")}).clone()
    assert cli.relative_error(expected, reference_moe(weights, x, ids, wts)) < 1e-2
    for unroll in (1, 4, 8):
        out = path.forward(x, ids, wts, tiles={w: dict(tiles[w], unroll=unroll) for w in ("g1", "g2")})
        torch.cuda.synchronize()
        assert torch.equal(out, expected), (unroll, (out.float() - expected.float()).abs().max().item())


def test_the_gather_writes_each_block_in_operand_order():
    """_gather_kernel (plain Triton, run by the interpreter here): each block's owner and rows,
    the rows in sorted order with every 64-value K block in _operand_pos's order, padding zero."""
    shape = quant.MoEShape(experts=4, hidden=256, inter=128, topk=2, group_size=32)
    weights = quant.random_weights(shape, "cpu", seed=2)
    moe = tm.TritonW4A16MoE(weights, 64, gluon=False)
    gen = torch.Generator().manual_seed(9)
    x, ids, _ = cli.make_inputs(shape, 40, torch.float32, torch.device("cpu"), gen)
    ids = ids.to(torch.int32)
    bm = 64
    moe._group_slots(ids, bm)
    blocks = -(-tm._padded_rows(shape, 40, bm) // bm)
    out = torch.full((blocks * bm, shape.hidden), float("nan"))
    block_expert = torch.full((blocks,), -7, dtype=torch.int32)
    block_rows = torch.full((blocks,), -7, dtype=torch.int32)
    gluon_moe._gather_kernel[(blocks, shape.hidden // 128)](
        x, out, moe._sorted_slot, moe._counts, moe._starts, moe._ends, block_expert, block_rows, shape.experts,
        shape.hidden, x.stride(0), out.stride(0), TOPK=shape.topk, BLOCK_M=bm, NUM_BINS=moe._num_bins, BK=128)
    pos = torch.tensor(gluon_moe.operand_positions(shape.hidden))
    assert sorted(pos.tolist()) == list(range(shape.hidden))  # a permutation
    counts = torch.bincount(ids.flatten().long(), minlength=shape.experts)
    seen = 0
    for b in range(blocks):
        rows = int(block_rows[b])
        if rows == 0:
            continue
        e = int(block_expert[b])
        start = int(moe._starts[e])
        assert 0 < rows <= bm and (b * bm - start) // bm * bm + rows <= int(counts[e]) + bm
        slots = moe._sorted_slot[b * bm: b * bm + rows].long()
        assert (ids.flatten()[slots] == e).all()
        expected = torch.empty(rows, shape.hidden)
        expected[:, pos] = x[slots // shape.topk]
        assert torch.equal(out[b * bm: b * bm + rows], expected)
        assert (out[b * bm + rows: (b + 1) * bm] == 0).all()  # padding rows zero, never stale
        seen += rows
    assert seen == ids.numel()
