"""The MoE implementations the harness can time, behind one calling convention.

    backend(x [M, hidden], topk_ids int32 [M, topk], topk_weights float32 [M, topk]) -> [M, hidden]

triton         the project's fused W4A16 kernel (moe_bench.triton_moe)
torch          the reference: weights dequantized once to the activation dtype, a loop over the
               experts that have tokens (per-expert matmul, SiLU(gate) * up, matmul, top-k sum)
sglang-marlin  SGLang's fused Marlin MoE, when SGLang is importable on the host
vllm-marlin    vLLM's fused Marlin MoE, when vLLM is importable on the host

`reference_moe` is the float32 ground truth every backend is checked against. Triton, SGLang and
vLLM are imported only when their backend is chosen, so the torch backend runs without them.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

import torch

from . import quant

BACKEND_NAMES = ("triton", "torch", "sglang-marlin", "vllm-marlin")


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this host (package missing, unsupported version): exit 3."""


# ---- the looped MoE forward shared by the reference and the torch backend -------------------

ExpertWeights = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # e -> (W13.T [H, 2I], W2.T [I, H])


def _looped_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: int,
                expert_weights: ExpertWeights, compute_dtype: torch.dtype,
                slice_rows: int | None = None) -> torch.Tensor:
    """Sum over k of topk_weights[:, k] * expert(topk_ids[:, k])(x), accumulated in float32.

    Each expert's weights are fetched once; its rows run slice_rows at a time (all at once when
    None), so the gathered tokens and products stay small whatever M is."""
    m, topk = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // topk
    weight_of = topk_weights.reshape(-1)[order].float()
    counts = torch.bincount(flat_ids, minlength=experts).tolist()  # host sync: not capturable
    out = torch.zeros((m, x.shape[1]), dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        w13_t, w2_t = expert_weights(expert)
        inter = w2_t.shape[0]
        step = count if slice_rows is None else max(1, slice_rows)
        for first in range(start, start + count, step):
            last = min(first + step, start + count)
            rows = token_of[first:last]
            gate_up = x[rows].to(compute_dtype) @ w13_t
            activated = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            del gate_up
            down = activated @ w2_t
            del activated
            out.index_add_(0, rows, down.float() * weight_of[first:last, None])
            del down
        # Released before the next expert's are made: one expert's weights at a time.
        del w13_t, w2_t
        start += count
    return out


def reference_moe(weights: quant.MoEWeights, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, slice_rows: int | None = None) -> torch.Tensor:
    """The float32 ground truth: each used expert dequantized to float32 on its own, once per
    call (bounded memory at any shape; the check batches several M into one call so that each
    expert is unpacked once), the same bf16/fp16 inputs the backend saw, float32 arithmetic.
    slice_rows: an expert's rows computed at most that many at a time (rows are independent)."""
    device = weights.w13.packed.device

    def expert_weights(expert: int):
        index = torch.tensor([expert], device=device)
        return (quant.dequantize(weights.w13, index, torch.float32)[0],
                quant.dequantize(weights.w2, index, torch.float32)[0])

    with _full_float32_matmul():
        return _looped_moe(x, topk_ids, topk_weights, weights.shape.experts, expert_weights, torch.float32,
                           slice_rows)


class _full_float32_matmul:
    """TF32 would make the 'float32' reference a 10-bit-mantissa one on recent GPUs."""

    def __enter__(self):
        self._saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self._saved
        return False


# ---- backends ------------------------------------------------------------------------------

class TorchBackend:
    """Plain torch on weights dequantized once to the activation dtype (about 4x the int4 bytes)."""

    name = "torch"
    capturable = False
    takes_out = True  # writes into a given output: the correctness check passes a NaN-filled one

    def __init__(self, weights: quant.MoEWeights, max_m: int, dtype: torch.dtype):
        shape = weights.shape
        device = weights.w13.packed.device
        self.experts = shape.experts
        self.dtype = dtype
        # One expert at a time, so the peak above the result is one expert in float32.
        self.w13_t = torch.empty((shape.experts, shape.hidden, 2 * shape.inter), dtype=dtype, device=device)
        self.w2_t = torch.empty((shape.experts, shape.inter, shape.hidden), dtype=dtype, device=device)
        for expert in range(shape.experts):
            index = torch.tensor([expert], device=device)
            self.w13_t[expert] = quant.dequantize(weights.w13, index, torch.float32)[0].to(dtype)
            self.w2_t[expert] = quant.dequantize(weights.w2, index, torch.float32)[0].to(dtype)

    def __call__(self, x, topk_ids, topk_weights, out=None):
        result = _looped_moe(x, topk_ids, topk_weights, self.experts,
                             lambda e: (self.w13_t[e], self.w2_t[e]), self.dtype)
        if out is None:
            return result.to(x.dtype)
        return out.copy_(result)

    def configs_used(self, m: int) -> dict:
        return {"path": "looped-experts"}


class TritonBackend:
    name = "triton"
    capturable = True

    def __init__(self, weights: quant.MoEWeights, max_m: int, dtype: torch.dtype, layer: quant.MoEShape | None = None):
        module = import_triton_moe()
        # layer: a rehearsal's full layer, whose kernels it compiles (fewer experts held).
        self.impl = module.TritonW4A16MoE(weights, max_m) if layer is None else \
            module.TritonW4A16MoE(weights, max_m, layer=layer)
        try:
            self.takes_out = "out" in inspect.signature(self.impl.__call__).parameters
        except (TypeError, ValueError):
            self.takes_out = False

    def __call__(self, x, topk_ids, topk_weights, out=None):
        if out is None:
            return self.impl(x, topk_ids, topk_weights)
        if not self.takes_out:
            raise TypeError("this triton_moe version does not take out=")
        return self.impl(x, topk_ids, topk_weights, out=out)

    def configs_used(self, m: int) -> dict:
        return dict(self.impl.configs_used(m))

    def release_workspace(self) -> None:
        """Hand the kernels' activation-sized buffers back until the next call (see
        TritonW4A16MoE.release_workspace); a triton_moe without it keeps them."""
        release = getattr(self.impl, "release_workspace", None)
        if release is not None:
            release()


def import_triton_moe():
    """moe_bench.triton_moe, or BackendUnavailable saying what is missing."""
    try:
        return importlib.import_module(f"{__package__}.triton_moe")
    except ModuleNotFoundError as error:
        if error.name in ("triton", f"{__package__}.triton_moe") or (error.name or "").startswith("triton."):
            raise BackendUnavailable(
                f"backend 'triton' needs the triton package and moe_bench/triton_moe.py: {error}"
            ) from None
        raise


# ---- Marlin adapters -------------------------------------------------------------------------

def gptq_qweight(linear: quant.PackedLinear) -> torch.Tensor:
    """Our packed int4 -> GPTQ's int32 [E, K / 8, N]: eight K-neighbours per word, low nibble
    first, stored unsigned with the symmetric zero point 8 (Marlin's uint4b8)."""
    experts, k = linear.packed.shape[0], linear.k
    if k % 8:
        raise BackendUnavailable(f"Marlin needs the reduction size ({k}) to be a multiple of 8")
    words = []
    for expert in range(experts):  # one expert at a time keeps the int64 scratch small
        unsigned = (quant.unpack_int4(linear.rows(expert)).to(torch.int64) + 8).view(k // 8, 8, -1)
        word = torch.zeros_like(unsigned[:, 0])
        for i in range(8):
            word |= unsigned[:, i] << (4 * i)
        word = torch.where(word >= 2**31, word - 2**32, word)
        words.append(word.to(torch.int32))
    return torch.stack(words)


def _first_import(candidates: list[tuple[str, str]], what: str, package: str):
    errors = []
    for module_name, attribute in candidates:
        try:
            return getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            errors.append(f"{module_name}.{attribute}: {error}")
    raise BackendUnavailable(f"{package} is not usable on this host ({what} not found: {'; '.join(errors)})")


class MarlinBackend:
    """SGLang's or vLLM's fused Marlin MoE on our weights, converted to GPTQ and repacked."""

    capturable = True
    takes_out = False
    PACKAGES = {
        "sglang-marlin": {
            "package": "sglang",
            "fused": [("sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe", "fused_marlin_moe"),
                      ("sglang.srt.layers.moe.fused_marlin_moe", "fused_marlin_moe")],
            "repack": [("sgl_kernel", "gptq_marlin_moe_repack"),
                       ("sglang.srt.layers.quantization.gptq", "gptq_marlin_moe_repack")],
            "scales": [("sglang.srt.layers.quantization.marlin_utils", "marlin_moe_permute_scales")],
            "scalar_types": [("sglang.srt.layers.quantization.scalar_type", "scalar_types"),
                             ("sgl_kernel.scalar_type", "scalar_types")],
        },
        "vllm-marlin": {
            "package": "vllm",
            "fused": [("vllm.model_executor.layers.fused_moe.fused_marlin_moe", "fused_marlin_moe")],
            "repack": [("vllm._custom_ops", "gptq_marlin_moe_repack")],
            "scales": [("vllm.model_executor.layers.quantization.utils.marlin_utils", "marlin_moe_permute_scales")],
            "scalar_types": [("vllm.scalar_type", "scalar_types")],
        },
    }

    def __init__(self, name: str, weights: quant.MoEWeights, max_m: int, dtype: torch.dtype):
        spec = self.PACKAGES[name]
        package = spec["package"]
        _import_marlin_package(name)
        if dtype not in (torch.bfloat16, torch.float16):
            raise BackendUnavailable(f"backend '{name}' runs bf16 or fp16 activations, not {dtype}")
        self.name = name
        self.fused = _first_import(spec["fused"], "fused_marlin_moe", package)
        repack = _first_import(spec["repack"], "gptq_marlin_moe_repack", package)
        permute_scales = _first_import(spec["scales"], "marlin_moe_permute_scales", package)
        scalar_types = _first_import(spec["scalar_types"], "scalar_types", package)
        shape = weights.shape
        self.shape = shape
        device = weights.w13.packed.device
        no_perm = torch.empty((shape.experts, 0), dtype=torch.int32, device=device)
        self.w1 = repack(gptq_qweight(weights.w13), no_perm, shape.hidden, 2 * shape.inter, 4)
        self.w2 = repack(gptq_qweight(weights.w2), no_perm, shape.inter, shape.hidden, 4)
        self.w1_scale = permute_scales(weights.w13.scales.to(dtype), shape.hidden, 2 * shape.inter, shape.group_size)
        self.w2_scale = permute_scales(weights.w2.scales.to(dtype), shape.inter, shape.hidden, shape.group_size)
        self.quant_type_id = scalar_types.uint4b8.id
        self.parameters = inspect.signature(self.fused).parameters
        supplied = set(self._arguments(torch.empty(1, shape.hidden, dtype=dtype, device=device),
                                       torch.zeros(1, shape.topk, dtype=torch.int32, device=device),
                                       torch.zeros(1, shape.topk, dtype=torch.float32, device=device)))
        required = [
            p.name for p in self.parameters.values()
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        unknown = [p for p in required if p not in supplied]
        if unknown:
            raise BackendUnavailable(
                f"this {package} version's fused_marlin_moe needs arguments the adapter does not know: {unknown}"
            )

    def _arguments(self, x, topk_ids, topk_weights) -> dict:
        candidates = {
            "hidden_states": x,
            "w1": self.w1,
            "w2": self.w2,
            "w1_scale": self.w1_scale,
            "w2_scale": self.w2_scale,
            "gating_output": torch.zeros((x.shape[0], self.shape.experts), dtype=x.dtype, device=x.device),
            "topk_weights": topk_weights,
            "topk_ids": topk_ids,
            "quant_type_id": self.quant_type_id,
            "num_bits": 4,
            "global_num_experts": self.shape.experts,
            "is_k_full": True,
            "bias1": None,
            "bias2": None,
            "g_idx1": None,
            "g_idx2": None,
            "sort_indices1": None,
            "sort_indices2": None,
            "w1_zeros": None,
            "w2_zeros": None,
        }
        return {name: value for name, value in candidates.items() if name in self.parameters}

    def __call__(self, x, topk_ids, topk_weights):
        return self.fused(**self._arguments(x, topk_ids, topk_weights))

    def configs_used(self, m: int) -> dict:
        return {"path": f"{self.name} (its own heuristics)"}


def create_backend(name: str, weights: quant.MoEWeights, max_m: int, dtype: torch.dtype,
                   layer: quant.MoEShape | None = None):
    """The backend for these weights; layer: the full layer a rehearsal (fewer experts held)
    stands for, so the triton backend compiles that layer's kernels (the others compile none)."""
    if name == "torch":
        return TorchBackend(weights, max_m, dtype)
    if name == "triton":
        return TritonBackend(weights, max_m, dtype, layer=layer)
    if name in MarlinBackend.PACKAGES:
        return MarlinBackend(name, weights, max_m, dtype)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


def check_backend_available(name: str) -> None:
    """Cheap import check (no weights) for --preflight."""
    if name == "triton":
        import_triton_moe()
    elif name in MarlinBackend.PACKAGES:
        _import_marlin_package(name)


def _import_marlin_package(name: str) -> None:
    package = MarlinBackend.PACKAGES[name]["package"]
    try:
        importlib.import_module(package)
    except Exception as error:  # a broken install is as unusable as a missing one
        raise BackendUnavailable(
            f"backend '{name}' needs the {package} package, which this Python cannot import "
            f"({type(error).__name__}: {error}); run the payload with the python of the host's {package} "
            f"environment, or choose --backend triton or torch"
        ) from None
