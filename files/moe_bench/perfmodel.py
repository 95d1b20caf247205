"""The numbers a report shows, as pure functions of the layer shape and M.

Model of one MoE forward over M tokens (bf16 activations, INT4 weights with bf16 scales):
  bytes  = expected distinct experts * bytes of one expert + activations in and out
  flops  = 2 * M * topk * (hidden * 2 * inter + inter * hidden)
  floor  = max(bytes / bandwidth, flops / peak)  the fastest any kernel could run on the device
Intermediates (gate/up products, routing metadata) are not counted: a fused kernel can keep
them on chip, so the floor does not charge for them.

Also the device-memory estimate the playbook gates on before it stops the service.
Standard library only: the controller and `--estimate` use it without torch.
"""

from __future__ import annotations

from .quant import MoEShape, weights_bytes

ACTIVATION_BYTES = 2  # bf16
FLOAT32_BYTES = 4
GIB = 1024**3
MIB = 1024**2

# CUDA context, cuBLAS workspace, Triton/CUDA modules and allocator slack per process.
CONTEXT_BYTES = 1 * GIB
# Buffers the ceiling measurement uses (device copy source+destination, three matmul operands).
CEILING_COPY_BYTES = 512 * MIB
CEILING_MATMUL_SIZE = 8192


def expert_bytes(shape: MoEShape) -> int:
    """Bytes of one expert's packed int4 weights plus bf16 scales (w13 and w2)."""
    return weights_bytes(MoEShape(1, shape.hidden, shape.inter, 1, shape.group_size))


def expected_distinct_experts(shape: MoEShape, m: int) -> float:
    """Expected number of experts touched by m tokens, each picking topk distinct experts uniformly."""
    if m <= 0:
        return 0.0
    return shape.experts * (1.0 - (1.0 - shape.topk / shape.experts) ** m)


def activation_io_bytes(shape: MoEShape, m: int) -> int:
    """Tokens read in and the combined output written, bf16."""
    return 2 * m * shape.hidden * ACTIVATION_BYTES


def bytes_moved(shape: MoEShape, m: int) -> float:
    return expected_distinct_experts(shape, m) * expert_bytes(shape) + activation_io_bytes(shape, m)


def flops(shape: MoEShape, m: int) -> int:
    per_token_expert = shape.hidden * 2 * shape.inter + shape.inter * shape.hidden
    return 2 * m * shape.topk * per_token_expert


def floor_us(shape: MoEShape, m: int, bandwidth_gbps: float, tflops: float) -> float:
    if bandwidth_gbps <= 0 or tflops <= 0:
        raise ValueError("ceilings must be positive")
    memory_us = bytes_moved(shape, m) / (bandwidth_gbps * 1e9) * 1e6
    compute_us = flops(shape, m) / (tflops * 1e12) * 1e6
    return max(memory_us, compute_us)


def pct_of_floor(measured_us: float, floor: float) -> float:
    """How close a measurement is to the floor: 100 means the device limit was reached."""
    if measured_us <= 0:
        raise ValueError("measured time must be positive")
    return 100.0 * floor / measured_us


def result_row(shape: MoEShape, m: int, us: float, us_p20: float, us_p80: float, compile_s: float,
               bandwidth_gbps: float, tflops_ceiling: float) -> dict:
    """One row of the results table (schema RESULT_FIELDS) from a measured median time."""
    moved = bytes_moved(shape, m)
    work = flops(shape, m)
    floor = floor_us(shape, m, bandwidth_gbps, tflops_ceiling)
    return {
        "m": m,
        "us": round(us, 3),
        "us_p20": round(us_p20, 3),
        "us_p80": round(us_p80, 3),
        "us_per_token": round(us / m, 4),
        "bytes": int(round(moved)),
        "flops": work,
        "gbps": round(moved / (us * 1e-6) / 1e9, 2),
        "tflops": round(work / (us * 1e-6) / 1e12, 3),
        "floor_us": round(floor, 3),
        "pct_of_floor": round(pct_of_floor(us, floor), 2),
        "compile_s": round(compile_s, 3),
        "distinct_experts": round(expected_distinct_experts(shape, m), 2),
    }


# ---- device memory estimate -------------------------------------------------------------

def dequantized_weights_bytes(shape: MoEShape, element_bytes: int = ACTIVATION_BYTES) -> int:
    """All experts' weights dequantized (the torch backend's speed path keeps them so)."""
    return shape.experts * 3 * shape.hidden * shape.inter * element_bytes


def fused_moe_workspace_bytes(shape: MoEShape, m: int, block_m: int = 128) -> int:
    """Upper bound of a fused MoE's scratch for m tokens: token-to-expert sort padded to block_m
    per expert (int32 ids, block expert ids), the gate/up product and the activated product in
    bf16, and the per-(token, k) output before the top-k sum in fp32."""
    assignments = m * shape.topk
    padded = assignments + shape.experts * (block_m - 1)
    sort_bytes = 4 * (padded + padded // block_m + 1 + shape.experts + 1)
    gate_up = padded * 2 * shape.inter * ACTIVATION_BYTES
    activated = padded * shape.inter * ACTIVATION_BYTES
    down = assignments * shape.hidden * FLOAT32_BYTES
    return sort_bytes + gate_up + activated + down


# The correctness check (cli.check_correctness) calls the backend on a batch of its M values,
# hands the backend's workspace back, then computes the batch's float32 reference in one pass
# over the experts (each unpacked once per batch, not once per M), an expert's rows
# REFERENCE_SLICE_ROWS at a time. A batch holds at most check_batch_rows rows.
REFERENCE_SLICE_ROWS = 256
CHECK_BATCH_ROWS = 4096


def check_batch_rows(max_m: int, rehearse: bool = False) -> int:
    """The most rows (the sum of its M values) one check batch holds; an M above it is a batch
    alone. A run: CHECK_BATCH_ROWS (the default list's whole check, 3600 rows, in one reference
    pass) or its largest M. A rehearsal beside the live service: its largest M, so that the
    check never holds more than one largest-M set of inputs, outputs and reference."""
    return max_m if rehearse else max(max_m, CHECK_BATCH_ROWS)


def reference_check_bytes(shape: MoEShape, m: int, slice_rows: int = REFERENCE_SLICE_ROWS) -> int:
    """The float32 reference over m rows (backends.reference_moe) and the comparison after it:
    the float32 output, beside one expert unpacked at a time (float32 W13.T and W2.T, and the
    int8 values of W2 while they convert) and one slice of an expert's rows (the tokens
    gathered and upcast, gate/up, SiLU(gate) and activated, down and weighted down, in
    float32); then, the expert released, the comparison's float32 copies of the output
    (upcast, difference)."""
    hidden_inter = shape.hidden * shape.inter
    rows = min(slice_rows, m * shape.topk)
    one_slice = rows * (shape.hidden * (2 + 3 * FLOAT32_BYTES) + 4 * shape.inter * FLOAT32_BYTES)
    routing = 3 * m * shape.topk * 8  # sorted slot order, token and weight per slot
    expert = 3 * hidden_inter * FLOAT32_BYTES + max(hidden_inter, one_slice)
    output = m * shape.hidden * FLOAT32_BYTES
    return routing + max(output + expert, 3 * output)


def check_bytes(shape: MoEShape, rows: int, element: int = ACTIVATION_BYTES) -> int:
    """One check batch of `rows` rows with the backend's workspace handed back: its inputs (and
    their copy joined into one batch) and the backend's outputs, and the float32 reference over
    them."""
    inputs_outputs = rows * (3 * shape.hidden * element + 2 * shape.topk * (4 + 4))
    return inputs_outputs + reference_check_bytes(shape, rows)


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _weights_and_routing_bytes(shape: MoEShape, backend: str, max_m: int, element: int) -> tuple[int, int]:
    """(the weights a backend holds on the device, one routing's inputs and outputs at max_m)."""
    weights = weights_bytes(shape)
    if backend == "torch":
        weights += dequantized_weights_bytes(shape, element)
    elif backend.endswith("-marlin"):
        # Marlin's repacked copy beside ours (ours stays: the float32 reference reads it).
        weights += weights_bytes(shape)
    per_routing = (
        2 * max_m * shape.hidden * element  # tokens in, output
        + max_m * shape.topk * (4 + 4)  # int32 ids, float32 weights
    )
    return weights, per_routing


def estimate(shape: MoEShape, backend: str, max_m: int, routings: int, device_kind: str = "cuda",
             backend_workspace_bytes: int | None = None, config: dict | None = None,
             dtype: str = "bfloat16") -> dict:
    """Device bytes a run needs, without touching a device.

    weights: the packed int4 weights, plus a dequantized copy (activation dtype) for the torch
    backend, or Marlin's repacked copy for the Marlin adapters.
    activations: one set of inputs/outputs per rotated routing at the largest M.
    workspace: the larger of the backend's scratch for all routings' graphs and the phases that
    run alone (ceiling measurement, the correctness check's reference with the backend's
    workspace handed back).
    context: the CUDA context allowance (0 on the CPU).
    """
    element = DTYPE_BYTES[dtype]
    weights, per_routing = _weights_and_routing_bytes(shape, backend, max_m, element)
    activations = routings * per_routing
    if backend_workspace_bytes is None:
        backend_workspace_bytes = fused_moe_workspace_bytes(shape, max_m)
    ceiling_bytes = 2 * CEILING_COPY_BYTES + 3 * CEILING_MATMUL_SIZE**2 * ACTIVATION_BYTES
    workspace = max(
        # captured graphs share one memory pool and replay one after another: one scratch set
        backend_workspace_bytes + per_routing,
        check_bytes(shape, check_batch_rows(max_m), element),
        ceiling_bytes if device_kind == "cuda" else 0,
    )
    context = CONTEXT_BYTES if device_kind == "cuda" else 0
    total = weights + activations + workspace + context
    return {
        "weights_bytes": int(weights),
        "activations_bytes": int(activations),
        "workspace_bytes": int(workspace),
        "context_bytes": int(context),
        "total_bytes": int(total),
        "total_mib": int(-(-total // MIB)),
        "config": dict(config or {}),
    }


# The rehearsal beside a live service (cli --rehearse): fewer experts, two routings, check
# batches of at most its largest M (check_batch_rows), the ceilings measured on small buffers
# (REHEARSAL_CEILING_*), so that it needs little of the memory the service leaves free.
REHEARSAL_ROUTINGS = 2
REHEARSAL_CEILING_COPY_BYTES = 64 * MIB
REHEARSAL_CEILING_MATMUL_SIZE = 2048
# The largest device memory a rehearsal asks for by default (MiB, the CUDA context allowance
# included), and the share of the memory free beside the service it may take at most.
REHEARSAL_BUDGET_MIB = 2048
REHEARSAL_FREE_SHARE = 0.5


def rehearsal_estimate(shape: MoEShape, backend: str, max_m: int, device_kind: str = "cuda",
                       dtype: str = "bfloat16") -> dict:
    """Device bytes of a rehearsal holding shape.experts experts (same keys as estimate)."""
    element = DTYPE_BYTES[dtype]
    weights, per_routing = _weights_and_routing_bytes(shape, backend, max_m, element)
    activations = REHEARSAL_ROUTINGS * per_routing
    assignments = max_m * shape.topk
    padded = assignments + shape.experts * 127
    scratch = (4 * (padded + padded // 128 + shape.experts + 2) + 3 * padded * shape.inter * element
               + assignments * shape.hidden * element)
    ceilings = 2 * REHEARSAL_CEILING_COPY_BYTES + 3 * REHEARSAL_CEILING_MATMUL_SIZE**2 * ACTIVATION_BYTES
    workspace = max(scratch + per_routing,
                    check_bytes(shape, check_batch_rows(max_m, rehearse=True), element),
                    ceilings if device_kind == "cuda" else 0)
    context = CONTEXT_BYTES if device_kind == "cuda" else 0
    total = weights + activations + workspace + context
    return {"weights_bytes": int(weights), "activations_bytes": int(activations), "workspace_bytes": int(workspace),
            "context_bytes": int(context), "total_bytes": int(total), "total_mib": int(-(-total // MIB))}


def rehearsal_experts(candidates, shape_of, backend: str, max_m: int, device_kind: str, dtype: str,
                      budget_mib: float, free_mib: float | None, wanted: int) -> tuple[int | None, int]:
    """The expert count a rehearsal holds: the largest of `candidates` (ascending) up to `wanted`
    (or the smallest candidate above it when none is below) whose rehearsal_estimate fits
    min(budget_mib, REHEARSAL_FREE_SHARE * free_mib). Returns (experts or None when even the
    smallest does not fit, the MiB allowed)."""
    allowed = float(budget_mib) if free_mib is None else min(float(budget_mib), REHEARSAL_FREE_SHARE * float(free_mib))
    usable = [e for e in candidates if e <= wanted] or list(candidates)[:1]
    chosen = None
    for experts in usable:
        if rehearsal_estimate(shape_of(experts), backend, max_m, device_kind, dtype)["total_mib"] <= allowed:
            chosen = experts
    return chosen, int(allowed)
