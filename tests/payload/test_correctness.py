"""CPU correctness of the reference, the torch backend and the triton backend (Triton's
interpreter, fp32/fp16 operands), and of the harness's check itself."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from moe_bench import backends, cli, quant
from moe_bench.cli import CorrectnessFailure, make_inputs, relative_error

# Kimi K2.6's layer scaled down: 384/12 experts, top-8, hidden/inter 3.5 as 7168/2048, group 32.
K26_LIKE = quant.MoEShape(experts=32, hidden=224, inter=64, topk=8, group_size=32)
# Odd sizes: 5 experts, top-3, hidden 96 = 3 groups, inter 160 = 5 groups (no power of two).
ODD = quant.MoEShape(experts=5, hidden=96, inter=160, topk=3, group_size=32)
# A wider quantisation group and top-2 (Mixtral-like routing).
GROUP64 = quant.MoEShape(experts=8, hidden=256, inter=192, topk=2, group_size=64)
SHAPES = {"k26-like": K26_LIKE, "odd": ODD, "group64": GROUP64}


def inputs(shape, m, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return make_inputs(shape, m, dtype, "cpu", generator)


def dense_moe(weights: quant.MoEWeights, x, topk_ids, topk_weights) -> torch.Tensor:
    """The layer written straight from its definition, token by token, in float64."""
    w13 = quant.dequantize(weights.w13, dtype=torch.float64)  # [E, H, 2I] = W13.T
    w2 = quant.dequantize(weights.w2, dtype=torch.float64)  # [E, I, H] = W2.T
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
    # Outputs have a sensible magnitude (the weights' scales keep unit-variance activations).
    assert 0.05 < float(ref.std()) < 20


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
    bound = cli.RELATIVE_ERROR_BOUND[str(dtype).removeprefix("torch.")]
    for m in (1, 7, 33):
        x, topk_ids, topk_weights = inputs(shape, m, dtype, seed=m)
        out = backend(x, topk_ids, topk_weights)
        assert out.dtype == dtype and out.shape == (m, shape.hidden)
        error = relative_error(out, backends.reference_moe(weights, x, topk_ids, topk_weights))
        assert error is not None and error < bound
        if dtype == torch.float32:
            assert error < 1e-5


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


def _check_triton(backend, weights, shape, m, dtype):
    bound = cli.RELATIVE_ERROR_BOUND[str(dtype).removeprefix("torch.")]
    x, topk_ids, topk_weights = inputs(shape, m, dtype, seed=100 + m)
    out = cli.poisoned_call(backend, x, topk_ids, topk_weights, shape.hidden)
    assert out.dtype == dtype and out.shape == (m, shape.hidden)
    error = relative_error(out, backends.reference_moe(weights, x, topk_ids, topk_weights))
    assert error is not None, f"NaN/Inf in the triton output at M={m}"
    assert error < bound, f"M={m}: relative error {error:.2e} above {bound:.0e}"


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
            assert impl.configs_used(7)["block_m"] == entry["block_m"]
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


def test_check_passes_a_correct_backend_at_every_config():
    weights = quant.random_weights(ODD, "cpu", seed=2)
    backend = _Wrapped(weights, _correct)
    recorder = _Recorder()
    cli.check_correctness(_Settings([1, 2, 4, 8, 16]), backend, weights, torch.float32, torch.device("cpu"),
                          recorder)
    assert [c["m"] for c in recorder.checks] == [1, 3, 4, 8, 16]  # each config's ends, and odd M=3
    assert {json.dumps(c["config"]) for c in recorder.checks} == {'{"block": "small"}', '{"block": "large"}'}
    assert all(c["ok"] and c["rel_err"] < 1e-5 and c["bound"] == 2e-3 for c in recorder.checks)


@pytest.mark.parametrize("defect", [_leave_last_row_unwritten, _drop_the_last_expert_of_each_token])
def test_check_stops_a_wrong_backend(defect):
    weights = quant.random_weights(ODD, "cpu", seed=2)
    recorder = _Recorder()
    with pytest.raises(CorrectnessFailure, match="wrong at M=") as caught:
        cli.check_correctness(_Settings([2, 16]), _Wrapped(weights, defect), weights, torch.float32,
                              torch.device("cpu"), recorder)
    assert recorder.checks and recorder.checks[-1]["ok"] is False
    assert "no timing was done" in str(caught.value)


def test_poisoned_output_row_reads_as_nan():
    weights = quant.random_weights(ODD, "cpu", seed=2)
    backend = _Wrapped(weights, _leave_last_row_unwritten)
    x, topk_ids, topk_weights = inputs(ODD, 16, torch.float32)
    out = cli.poisoned_call(backend, x, topk_ids, topk_weights, ODD.hidden)
    assert bool(torch.isnan(out[-1]).all()) and not bool(torch.isnan(out[:-1]).any())
    assert relative_error(out, backends.reference_moe(weights, x, topk_ids, topk_weights)) is None


def test_torch_backend_writes_every_row_of_a_given_output():
    weights = quant.random_weights(ODD, "cpu", seed=2)
    backend = backends.TorchBackend(weights, 16, torch.float32)
    x, topk_ids, topk_weights = inputs(ODD, 16, torch.float32)
    out = cli.poisoned_call(backend, x, topk_ids, topk_weights, ODD.hidden)
    assert relative_error(out, backends.reference_moe(weights, x, topk_ids, topk_weights)) < 1e-6


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


def test_marlin_adapter_refuses_without_its_package():
    weights = quant.random_weights(ODD, "cpu", seed=1)
    for name, package in (("vllm-marlin", "vllm"), ("sglang-marlin", "sglang")):
        try:
            __import__(package)
            continue
        except ImportError:
            pass
        with pytest.raises(backends.BackendUnavailable, match=f"needs the {package} package"):
            backends.create_backend(name, weights, 8, torch.bfloat16)
