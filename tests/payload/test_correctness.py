"""CPU correctness of the reference, the torch backend and the triton backend (Triton's
interpreter, fp32/fp16 operands), and of the harness's check itself."""

from __future__ import annotations

import inspect
import json
import sys
import types

import pytest
import torch

from moe_bench import backends, cli, quant
from moe_bench.cli import CorrectnessFailure, make_inputs

# Kimi K2.6's layer scaled down: 384/12 experts, top-8, hidden/inter 3.5 as 7168/2048, group 32.
K26_LIKE = quant.MoEShape(experts=32, hidden=224, inter=64, topk=8, group_size=32)
# Odd sizes: 5 experts, top-3, hidden 96 = 3 groups, inter 160 = 5 groups (no power of two).
ODD = quant.MoEShape(experts=5, hidden=96, inter=160, topk=3, group_size=32)
# A wider quantisation group and top-2 (Mixtral-like routing).
GROUP64 = quant.MoEShape(experts=8, hidden=256, inter=192, topk=2, group_size=64)
SHAPES = {"k26-like": K26_LIKE, "odd": ODD, "group64": GROUP64}


# Allowed worst-row relative error ||out[r] - ref[r]|| / ||ref[r]|| of a backend against the
# float32 reference, by activation dtype. Written here, not taken from cli.RELATIVE_ERROR_BOUND,
# so that loosening the payload's bound cannot loosen these tests. bf16 rounds the inputs, the
# intermediate and the output (2^-9 each, about 0.4% together); a wrong scale group or a missing
# expert moves a row by O(1).
ROW_BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def inputs(shape, m, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return make_inputs(shape, m, dtype, "cpu", generator)


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """||out[r] - ref[r]|| / ||ref[r]|| for every row r; NaN/Inf in out fails the test."""
    out = out.double()
    assert bool(torch.isfinite(out).all()), "the output holds NaN/Inf: a row was never written"
    return (out - ref.double()).norm(dim=1) / ref.double().norm(dim=1)


def assert_rows_close(out, ref, bound, what=""):
    errors = row_errors(out, ref)
    worst = int(errors.argmax())
    assert float(errors[worst]) < bound, f"{what} row {worst}: relative error {float(errors[worst]):.2e} above {bound:.0e}"


def dequantize_from_layout(linear: quant.PackedLinear) -> torch.Tensor:
    """W.T [E, K, N] in float64, read from the stored tiles as quant.py's docstring documents
    them, using none of quant's unpacking: row n's byte b lies at
    stored[e, n // 32, b // 32, n % 32, b % 32]; in a whole 32-value chunk c, byte 16c + j holds
    value 32c + j in its low nibble and 32c + 16 + j in its high nibble; a shorter last chunk of r
    values pairs value j with r / 2 + j; a value is its nibble minus 8 times its group's scale."""
    stored, scales, group = linear.packed, linear.scales.double(), linear.group_size
    experts, k, n = stored.shape[0], scales.shape[1] * group, scales.shape[2]
    column = torch.arange(n)[:, None]  # [N, 1]
    byte_index = torch.arange(k // 2)[None, :]  # [1, K / 2]
    byte = stored[:, column // 32, byte_index // 32, column % 32, byte_index % 32].long()  # [E, N, K / 2]
    b = torch.arange(k // 2)
    whole_bytes = k // 32 * 16
    low_k = torch.where(b < whole_bytes, 32 * (b // 16) + b % 16, k // 32 * 32 + (b - whole_bytes))
    high_k = torch.where(b < whole_bytes, low_k + 16, low_k + (k % 32) // 2)
    w = torch.full((experts, k, n), float("nan"), dtype=torch.float64)
    w[:, low_k] = ((byte & 0xF) - 8).double().transpose(1, 2) * scales[:, low_k // group]
    w[:, high_k] = ((byte >> 4) - 8).double().transpose(1, 2) * scales[:, high_k // group]
    assert not bool(torch.isnan(w).any()), "some K value has no nibble: the index arithmetic above is wrong"
    return w


def dense_moe(weights: quant.MoEWeights, x, topk_ids, topk_weights) -> torch.Tensor:
    """The layer written straight from its definition, token by token, in float64, on weights
    read from the documented layout (not through quant.dequantize)."""
    w13 = dequantize_from_layout(weights.w13)  # [E, H, 2I] = W13.T
    w2 = dequantize_from_layout(weights.w2)  # [E, I, H] = W2.T
    inter = weights.shape.inter
    out = torch.zeros(x.shape, dtype=torch.float64)
    for token in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            expert = int(topk_ids[token, k])
            h = x[token].double() @ w13[expert]
            gate, up = h[:inter], h[inter:]
            activated = gate * torch.sigmoid(gate) * up
            out[token] += float(topk_weights[token, k]) * (activated @ w2[expert])
    return out


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_reference_matches_the_layer_definition(name):
    shape = SHAPES[name]
    weights = quant.random_weights(shape, "cpu", seed=3)
    x, topk_ids, topk_weights = inputs(shape, 7, torch.float32)
    ref = backends.reference_moe(weights, x, topk_ids, topk_weights)
    expected = dense_moe(weights, x, topk_ids, topk_weights)
    assert ref.dtype == torch.float32
    assert torch.allclose(ref.double(), expected, rtol=1e-4, atol=1e-5)
    assert_rows_close(ref, expected, 1e-5, "reference against the definition:")
    # Outputs have a sensible magnitude (the weights' scales keep unit-variance activations).
    assert 0.05 < float(ref.std()) < 20


def _stored_tiles(n: int, k: int, bytes_at: dict) -> torch.Tensor:
    """One expert's stored tiles, every byte 0x88 (both nibbles 8: value 0) except
    bytes_at[(row, byte)], placed where the layout puts row n's byte b."""
    stored = torch.full((1, -(-n // 32), -(-k // 64), 32, 32), 0x88, dtype=torch.uint8)
    for (row, byte), value in bytes_at.items():
        stored[0, row // 32, byte // 32, row % 32, byte % 32] = value
    return stored


def test_dequantize_reads_nibbles_minus_8_times_the_group_scale():
    """Values written out by hand from quant.py's layout: K = 48 is one whole chunk of 32 and a
    last chunk of 16, groups of 16 rows, N = 2 columns."""
    k, n, group = 48, 2, 16
    stored = _stored_tiles(n, k, {
        (0, 0): 0x3A,  # column 0, byte 0: low nibble 10 -> +2 at K=0, high nibble 3 -> -5 at K=16
        (1, 5): 0xF0,  # column 1, byte 5: low 0 -> -8 at K=5, high 15 -> +7 at K=21
        (0, 17): 0x9C,  # column 0, byte 17 of the last chunk (value j with 8 + j): +4 at K=33, +1 at K=41
    })
    scales = torch.tensor([[[0.5, 2.0], [0.25, 1.0], [4.0, 0.125]]], dtype=torch.bfloat16)  # [E, K / 16, N]
    linear = quant.PackedLinear(packed=stored, scales=scales, group_size=group)
    expected = torch.zeros(1, k, n, dtype=torch.float64)
    expected[0, 0, 0] = 2 * 0.5
    expected[0, 16, 0] = -5 * 0.25
    expected[0, 5, 1] = -8 * 2.0
    expected[0, 21, 1] = 7 * 1.0
    expected[0, 33, 0] = 4 * 4.0
    expected[0, 41, 0] = 1 * 4.0
    assert torch.equal(quant.dequantize(linear, dtype=torch.float64), expected)
    assert torch.equal(dequantize_from_layout(linear), expected)
    assert torch.equal(quant.dequantize(linear, torch.tensor([0]), dtype=torch.float64), expected)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_dequantize_matches_the_documented_layout_on_random_weights(name):
    shape = SHAPES[name]
    weights = quant.random_weights(shape, "cpu", seed=6)
    for linear in (weights.w13, weights.w2):
        expected = dequantize_from_layout(linear)
        assert torch.equal(quant.dequantize(linear, dtype=torch.float64), expected)
        some = torch.tensor([shape.experts - 1, 0])
        assert torch.equal(quant.dequantize(linear, some, dtype=torch.float64), expected[some])


def test_quantized_weights_round_trip_through_the_packed_layout():
    q = torch.randint(-8, 8, (3, 64, 32), dtype=torch.int8)
    assert torch.equal(quant.unpack_int4(quant.pack_int4(q)), q)
    # K = 80: two whole 32-value chunks and a shorter last one of 16.
    q = torch.randint(-8, 8, (2, 80, 6), dtype=torch.int8)
    assert torch.equal(quant.unpack_int4(quant.pack_int4(q)), q)


def test_packed_layout_pairs_value_j_with_value_16_plus_j_of_each_chunk():
    """The packed rows (before tile_packed): [E, N, K / 2], byte 16c + j = (q[32c + j] + 8) |
    (q[32c + 16 + j] + 8) << 4; a shorter last chunk of r values pairs j with r / 2 + j."""
    k, n = 72, 3
    q = (torch.arange(k * n).reshape(k, n) % 16 - 8).to(torch.int8)
    packed = quant.pack_int4(q)
    assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8
    for col in range(n):
        for c in range(2):
            for j in range(16):
                byte = int(packed[col, 16 * c + j])
                assert byte & 0xF == int(q[32 * c + j, col]) + 8
                assert byte >> 4 == int(q[32 * c + 16 + j, col]) + 8
        for j in range(4):  # the last chunk: 8 values, value j with value 4 + j
            byte = int(packed[col, 32 + j])
            assert (byte & 0xF, byte >> 4) == (int(q[64 + j, col]) + 8, int(q[68 + j, col]) + 8)


def test_stored_tiles_hold_32_rows_of_64_values_per_1kb_block():
    """The layout in memory (quant.tile_packed): row n's byte b at [n // 32, b // 32, n % 32,
    b % 32]; rows past N and bytes past K / 2 are zero padding; untile_packed undoes it."""
    k, n = 96, 40  # K / 2 = 48 bytes: one whole block and half of one; one whole row group and 8 rows
    rows = torch.randint(0, 256, (2, n, k // 2), dtype=torch.uint8)
    stored = quant.tile_packed(rows)
    assert stored.shape == (2, 2, 2, 32, 32) and stored.is_contiguous()
    row = torch.arange(n)[:, None].expand(n, k // 2)
    byte = torch.arange(k // 2)[None, :].expand(n, k // 2)
    for e in range(2):
        assert torch.equal(stored[e, row // 32, byte // 32, row % 32, byte % 32], rows[e])
    assert torch.equal(quant.untile_packed(stored, n, k), rows)
    assert int(stored[:, 1, :, 8:, :].sum()) == 0  # rows 40-63
    assert int(stored[:, :, 1, :, 16:].sum()) == 0  # bytes 48-63
    # One block is 1 KB of contiguous memory: 32 rows of 32 bytes.
    assert stored.stride()[-3:] == (1024, 32, 1)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_random_weights_are_stored_in_the_tiles_the_estimate_counts(name):
    shape = SHAPES[name]
    weights = quant.random_weights(shape, "cpu", seed=2)
    for linear, k, n in ((weights.w13, shape.hidden, 2 * shape.inter), (weights.w2, shape.inter, shape.hidden)):
        assert (linear.k, linear.n) == (k, n)
        assert linear.packed.shape == (shape.experts, -(-n // 32), -(-k // 64), 32, 32)
        rows = linear.rows()
        assert rows.shape == (shape.experts, n, k // 2)
        assert torch.equal(linear.rows(1), rows[1])
        assert torch.equal(quant.tile_packed(rows)[..., : k // 2 % 32 or 32], linear.packed[..., : k // 2 % 32 or 32])
    assert weights.nbytes() == quant.weights_bytes(shape)


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_backend_matches_the_reference(name, dtype):
    shape = SHAPES[name]
    weights = quant.random_weights(shape, "cpu", seed=5)
    backend = backends.create_backend("torch", weights, max_m=33, dtype=dtype)
    for m in (1, 7, 33):
        x, topk_ids, topk_weights = inputs(shape, m, dtype, seed=m)
        out = backend(x, topk_ids, topk_weights)
        assert out.dtype == dtype and out.shape == (m, shape.hidden)
        assert_rows_close(out, dense_moe(weights, x, topk_ids, topk_weights), ROW_BOUND[dtype], f"M={m}")


# ---- the triton backend, under Triton's interpreter -----------------------------------------

def triton_moe_module():
    try:
        return backends.import_triton_moe()
    except backends.BackendUnavailable as error:
        pytest.skip(f"triton backend not present: {error}")


TRITON_CASES = [
    # (name, shape, M values, dtype) at the kernel's own tile choice for those M
    ("k26-like", K26_LIKE, (3,), torch.float32),
    ("odd", ODD, (7,), torch.float32),
    ("odd", ODD, (5,), torch.float16),
    ("group64", GROUP64, (2,), torch.float32),
]


# The triton kernels under the interpreter: float32 sums of exact bf16-scaled values (about 1e-6
# per row), float16 rounds the intermediate once more (about 4e-4).
TRITON_ROW_BOUND = {torch.float32: 1e-4, torch.float16: 3e-3}


def _check_triton(backend, weights, shape, m, dtype):
    x, topk_ids, topk_weights = inputs(shape, m, dtype, seed=100 + m)
    out = cli.poisoned_call(backend, x, topk_ids, topk_weights, shape.hidden)
    assert out.dtype == dtype and out.shape == (m, shape.hidden)
    assert_rows_close(out, dense_moe(weights, x, topk_ids, topk_weights), TRITON_ROW_BOUND[dtype], f"M={m}")


@pytest.mark.parametrize("name,shape,ms,dtype", TRITON_CASES,
                         ids=[f"{n}-{'-'.join(map(str, ms))}-{str(d)[6:]}" for n, _, ms, d in TRITON_CASES])
def test_triton_backend_matches_the_reference(name, shape, ms, dtype):
    triton_moe_module()
    weights = quant.random_weights(shape, "cpu", seed=11)
    backend = backends.create_backend("triton", weights, max_m=max(ms), dtype=dtype)
    for m in ms:
        _check_triton(backend, weights, shape, m, dtype)


def test_triton_backend_is_correct_with_every_row_of_its_tile_table():
    """Every tile configuration the kernel can choose, each forced at a small odd M (the large-M
    rows would take minutes under the interpreter at the M that selects them)."""
    triton_moe = triton_moe_module()
    table = getattr(triton_moe, "TILE_TABLE", None)
    if table is None or "table" not in inspect.signature(triton_moe.TritonW4A16MoE).parameters:
        pytest.skip("triton_moe does not expose its tile table")
    for shape in (ODD,):
        weights = quant.random_weights(shape, "cpu", seed=12)
        for _, entry in table:
            impl = triton_moe.TritonW4A16MoE(weights, 7, table=[(1 << 62, entry)])
            used = impl.configs_used(7)
            if entry["g1"].get("mma8"):
                # The block_m 8 rows are PTX: under the interpreter the block_m 16 row runs instead,
                # and says so (tests/payload/test_triton_kernel.py runs them on the GPU).
                assert used["block_m"] == 16 and used["mma8_fallback"]
            else:
                assert used["block_m"] == entry["block_m"]
            backend = backends.TritonBackend.__new__(backends.TritonBackend)
            backend.impl, backend.takes_out = impl, False
            _check_triton(backend, weights, shape, 7, torch.float32)


# ---- the harness's check ----------------------------------------------------------------------

class _Settings:
    """The few settings check_correctness reads, for a CPU float32 run."""

    def __init__(self, m_list):
        self.dtype_name = "float32"
        self.shape = ODD
        self.m_list = m_list
        self.args = type("Args", (), {"seed": 0})()


class _Recorder:
    def __init__(self):
        self.checks = []

    def add_correctness(self, check):
        self.checks.append(check)


class _Wrapped:
    """A real torch backend with one defect applied to its output."""

    name = "defective"
    capturable = False
    takes_out = True

    def __init__(self, weights, defect):
        self.inner = backends.TorchBackend(weights, 64, torch.float32)
        self.defect = defect

    def __call__(self, x, topk_ids, topk_weights, out=None):
        result = self.defect(self.inner, x, topk_ids, topk_weights, out)
        return result

    def configs_used(self, m):
        return {"block": "small" if m < 8 else "large"}


def _correct(inner, x, topk_ids, topk_weights, out):
    return inner(x, topk_ids, topk_weights, out=out)


def _leave_last_row_unwritten(inner, x, topk_ids, topk_weights, out):
    # Like a kernel whose grid misses the tail block: the last output row is never written.
    if out is None:
        out = torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype)
    out[:-1] = inner(x[:-1], topk_ids[:-1], topk_weights[:-1])
    return out


def _drop_the_last_expert_of_each_token(inner, x, topk_ids, topk_weights, out):
    return inner(x, topk_ids, topk_weights * torch.tensor([1.0] * (topk_ids.shape[1] - 1) + [0.0]), out=out)


def _one_tile_off_by_one_percent_at_large_m(inner, x, topk_ids, topk_weights, out):
    # Like one program of a large-M tile config reading a slightly wrong scale: a 16-row x
    # 32-column tile of the output 1% off, everything else right.
    result = inner(x, topk_ids, topk_weights, out=out)
    if x.shape[0] >= 64:
        result[32:48, 32:64] *= 1.01
    return result


def test_check_passes_a_correct_backend_at_every_config():
    weights = quant.random_weights(ODD, "cpu", seed=2)
    backend = _Wrapped(weights, _correct)
    recorder = _Recorder()
    cli.check_correctness(_Settings([1, 2, 4, 8, 16]), backend, weights, torch.float32, torch.device("cpu"),
                          recorder)
    assert [c["m"] for c in recorder.checks] == [1, 3, 4, 8, 16]  # each config's ends, and odd M=3
    assert {json.dumps(c["config"]) for c in recorder.checks} == {'{"block": "small"}', '{"block": "large"}'}
    assert all(c["ok"] and c["rel_err"] <= c["worst_row_rel_err"] < 1e-5 and c["bound"] == 2e-3
               for c in recorder.checks)


def test_check_batches_keep_the_order_and_the_row_budget():
    # The default list's run check in one reference pass; a rehearsal's largest M alone.
    assert cli.check_batches([1, 3, 4, 8, 512, 1024, 2048], 4096) == [[1, 3, 4, 8, 512, 1024, 2048]]
    assert cli.check_batches([1, 2, 3, 512, 1024, 2048], 2048) == [[1, 2, 3, 512, 1024], [2048]]
    assert cli.check_batches([1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048], 2048) == \
        [[1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512], [1024], [2048]]
    assert cli.check_batches([5000, 1, 2], 4096) == [[5000], [1, 2]]


class _Releasing(_Wrapped):
    """A correct backend that logs its calls and its workspace's hand-backs."""

    def __init__(self, weights, events):
        super().__init__(weights, _correct)
        self.events = events

    def __call__(self, x, topk_ids, topk_weights, out=None):
        self.events.append(("call", x.shape[0]))
        return super().__call__(x, topk_ids, topk_weights, out=out)

    def release_workspace(self):
        self.events.append(("release",))


def test_the_check_hands_the_workspace_back_and_unpacks_each_expert_once_per_batch(monkeypatch):
    weights = quant.random_weights(ODD, "cpu", seed=2)
    events = []
    real_reference = backends.reference_moe

    def reference(weights, x, topk_ids, topk_weights, slice_rows=None):
        events.append(("reference", x.shape[0]))
        return real_reference(weights, x, topk_ids, topk_weights, slice_rows)

    monkeypatch.setattr(backends, "reference_moe", reference)
    recorder = _Recorder()
    cli.check_correctness(_Settings([1, 2, 4, 8, 16]), _Releasing(weights, events), weights, torch.float32,
                          torch.device("cpu"), recorder)
    # Every M's call, then the workspace handed back, then one reference over all their rows.
    assert events == [("call", 1), ("call", 3), ("call", 4), ("call", 8), ("call", 16), ("release",),
                      ("reference", 32)]
    assert [c["m"] for c in recorder.checks] == [1, 3, 4, 8, 16]
    assert all(c["ok"] and c["worst_row_rel_err"] < 1e-5 for c in recorder.checks)


def test_the_reference_in_slices_and_in_batches_is_each_ms_own_reference():
    weights = quant.random_weights(K26_LIKE, "cpu", seed=3)
    first = inputs(K26_LIKE, 40, torch.bfloat16, seed=4)
    second = inputs(K26_LIKE, 7, torch.bfloat16, seed=5)
    whole = backends.reference_moe(weights, *first)
    torch.testing.assert_close(backends.reference_moe(weights, *first, slice_rows=3), whole, rtol=1e-6, atol=1e-6)
    batch = backends.reference_moe(weights, *(torch.cat(pair) for pair in zip(first, second)), slice_rows=5)
    torch.testing.assert_close(batch[:40], whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(batch[40:], backends.reference_moe(weights, *second), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("defect", [_leave_last_row_unwritten, _drop_the_last_expert_of_each_token])
def test_check_stops_a_wrong_backend(defect):
    weights = quant.random_weights(ODD, "cpu", seed=2)
    recorder = _Recorder()
    with pytest.raises(CorrectnessFailure, match="wrong at M=") as caught:
        cli.check_correctness(_Settings([2, 16]), _Wrapped(weights, defect), weights, torch.float32,
                              torch.device("cpu"), recorder)
    assert recorder.checks and recorder.checks[-1]["ok"] is False
    assert "no timing was done" in str(caught.value)


def test_check_stops_one_wrong_tile_at_the_largest_m_that_one_norm_would_pass():
    """One 16 x 32 tile 1% off in a 256 x 96 output: over the whole output that is 1.4e-3,
    under the float32 bound of 2e-3; its rows are 5.8e-3 off, over it."""
    weights = quant.random_weights(ODD, "cpu", seed=2)
    backend = _Wrapped(weights, _one_tile_off_by_one_percent_at_large_m)
    x, topk_ids, topk_weights = inputs(ODD, 256, torch.float32, seed=9)
    out = backend(x, topk_ids, topk_weights)
    expected = dense_moe(weights, x, topk_ids, topk_weights)
    whole = float((out.double() - expected).norm() / expected.norm())
    assert whole < 2e-3, "the defect must be one a single norm over the output lets through"
    assert float(row_errors(out, expected).max()) > 4e-3
    recorder = _Recorder()
    with pytest.raises(CorrectnessFailure, match="wrong at M=256") as caught:
        cli.check_correctness(_Settings([2, 256]), backend, weights, torch.float32, torch.device("cpu"), recorder)
    assert "per row" in str(caught.value)
    assert [c["ok"] for c in recorder.checks] == [True, True, False]  # M=2, 3, then 256
    failed = recorder.checks[-1]
    assert 32 <= failed["worst_row"] < 48 and failed["worst_row_rel_err"] > failed["bound"] > failed["rel_err"]


def test_poisoned_output_row_reads_as_nan():
    weights = quant.random_weights(ODD, "cpu", seed=2)
    backend = _Wrapped(weights, _leave_last_row_unwritten)
    x, topk_ids, topk_weights = inputs(ODD, 16, torch.float32)
    out = cli.poisoned_call(backend, x, topk_ids, topk_weights, ODD.hidden)
    assert bool(torch.isnan(out[-1]).all()) and not bool(torch.isnan(out[:-1]).any())
    ref = backends.reference_moe(weights, x, topk_ids, topk_weights)
    assert cli.relative_error(out, ref) is None and cli.worst_row_error(out, ref) is None


def test_torch_backend_writes_every_row_of_a_given_output():
    weights = quant.random_weights(ODD, "cpu", seed=2)
    backend = backends.TorchBackend(weights, 16, torch.float32)
    x, topk_ids, topk_weights = inputs(ODD, 16, torch.float32)
    out = cli.poisoned_call(backend, x, topk_ids, topk_weights, ODD.hidden)
    assert_rows_close(out, dense_moe(weights, x, topk_ids, topk_weights), 1e-5)


def test_a_wrong_backend_exits_4_and_records_why(tmp_path, monkeypatch, capsys):
    def broken(name, weights, max_m, dtype):
        return _Wrapped(weights, _drop_the_last_expert_of_each_token)

    monkeypatch.setattr(backends, "create_backend", broken)
    out = tmp_path / "results.json"
    code = cli.main(["--device", "cpu", "--backend", "torch", "--preset", "tiny", "--m-list", "1,4",
                     "--out", str(out)])
    assert code == cli.EXIT_CORRECTNESS == 4
    err = capsys.readouterr().err
    assert "correctness" in err and "wrong at M=1" in err
    from moe_bench.schema import load_results

    loaded = load_results(out)
    assert loaded["status"] == "failed"
    assert loaded["error"]["kind"] == "correctness" and loaded["error"]["exit_code"] == 4
    assert loaded["results"] == []


# ---- Marlin adapters: the layout conversion they rely on --------------------------------------

def test_gptq_conversion_keeps_every_int4_value():
    shape = quant.MoEShape(experts=2, hidden=64, inter=32, topk=1, group_size=32)
    weights = quant.random_weights(shape, "cpu", seed=4)
    words = backends.gptq_qweight(weights.w13)  # [E, K / 8, N] int32
    assert words.dtype == torch.int32 and words.shape == (2, 64 // 8, 64)
    as_unsigned = words.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(as_unsigned >> (4 * i)) & 0xF for i in range(8)], dim=2)  # [E, K/8, 8, N]
    q = nibbles.reshape(2, 64, 64) - 8
    assert torch.equal(q.to(torch.int8), quant.unpack_int4(weights.w13.rows()))


MARLIN_PACKAGES = [("vllm-marlin", "vllm"), ("sglang-marlin", "sglang")]


@pytest.mark.parametrize("name,package", MARLIN_PACKAGES)
def test_marlin_adapter_refuses_without_its_package(monkeypatch, name, package):
    # Absent whether or not this Python has it: a None entry makes `import package` fail.
    monkeypatch.setitem(sys.modules, package, None)
    weights = quant.random_weights(ODD, "cpu", seed=1)
    with pytest.raises(backends.BackendUnavailable, match=f"needs the {package} package"):
        backends.create_backend(name, weights, 8, torch.bfloat16)


@pytest.mark.parametrize("name,package", MARLIN_PACKAGES)
def test_marlin_adapter_refuses_a_package_without_the_fused_marlin_moe(monkeypatch, name, package):
    """Importable, but not a version the adapter knows: refused naming what it looked for."""
    monkeypatch.setitem(sys.modules, package, types.ModuleType(package))
    weights = quant.random_weights(ODD, "cpu", seed=1)
    with pytest.raises(backends.BackendUnavailable, match=f"{package} is not usable on this host "
                                                           r"\(fused_marlin_moe not found"):
        backends.create_backend(name, weights, 8, torch.bfloat16)
