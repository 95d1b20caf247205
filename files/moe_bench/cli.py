"""Command line and run sequence of the benchmark: build inputs, check, time, report.

Exit codes (docs/design.md): 0 success, 2 bad arguments, 3 environment or preflight failure,
4 correctness check failed, 5 runtime failure (out of memory, CUDA error, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
import traceback

from . import perfmodel, presets
from .quant import MoEShape, triton_shape_error

EXIT_OK = 0
EXIT_BAD_ARGUMENTS = 2
EXIT_ENVIRONMENT = 3
EXIT_CORRECTNESS = 4
EXIT_RUNTIME = 5
# --rehearse only: not even top-k experts fit in the memory the service leaves free (nothing ran).
EXIT_NO_ROOM = 6



def process_age_s() -> float:
    """Seconds since this process started, by the kernel's record (/proc/self/stat's start time
    against /proc/uptime, 10 ms ticks), so the interpreter's start and the import of torch count;
    0 where /proc cannot say."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as uptime:
            uptime_s = float(uptime.read().split()[0])
        return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


# The process's start on the perf_counter clock: the results' phases count from it, so the
# interpreter's start and the import of torch and Triton are the first phase.
PROCESS_STARTED = time.perf_counter() - process_age_s()

DEFAULT_M_LIST = tuple(2**i for i in range(12))  # 1, 2, 4, ..., 2048
# Routings rotated through while timing one M: each reads its own expert set, so consecutive
# replays do not find the previous one's experts in L2 (50 MB on an H200, under one M=1 set).
# The CPU has no such cache to defeat at these shapes and Triton's interpreter is slow: two.
ROUTINGS = {"cuda": 8, "cpu": 2}
# Ceilings used on the CPU when none are given: nominal figures, marked "default" in results.
CPU_DEFAULT_CEILINGS = {"bandwidth_gbps": 20.0, "tflops": 0.5}

# ||out - ref|| / ||ref|| allowed against the float32 reference, by activation dtype, for every
# output row on its own (worst_row_error): one norm over a whole M=2048 output dilutes one wrong
# tile of 16-64 rows x 32-128 columns by the other 2 million values, a row sees it. bf16 keeps
# 8 mantissa bits: rounding the inputs' products, the intermediate and the output each costs about
# 2^-9 relative, about 0.4% together; 1e-2 leaves room without letting a wrong tile through (a
# missing expert or a wrong scale group is an O(1) error). fp16: 3 more mantissa bits. fp32: a GPU
# dot may run as TF32 (10-bit mantissa).
RELATIVE_ERROR_BOUND = {"bfloat16": 1e-2, "float16": 5e-3, "float32": 2e-3}

# Test hook, not an operator option: raise a runtime failure when this M is reached, so tests
# can show that a crash mid-run leaves the finished M on disk.
_FAULT_INJECTION_ENV = "MOE_BENCH_INTERNAL_FAIL_AT_M"
# Test hook: the backend's output at this M is made wrong (its last row negated and shifted)
# before the correctness check compares it, so the check's failure path runs end to end.
_WRONG_RESULT_ENV = "MOE_BENCH_INTERNAL_WRONG_AT_M"


class HarnessError(Exception):
    exit_code = EXIT_RUNTIME
    kind = "runtime"


class EnvironmentFailure(HarnessError):
    exit_code = EXIT_ENVIRONMENT
    kind = "environment"


class CorrectnessFailure(HarnessError):
    exit_code = EXIT_CORRECTNESS
    kind = "correctness"


class RuntimeFailure(HarnessError):
    exit_code = EXIT_RUNTIME
    kind = "runtime"


class NoRoomFailure(HarnessError):
    exit_code = EXIT_NO_ROOM
    kind = "no-room"


def log(message: str) -> None:
    print(f"[moe_bench] {message}", flush=True)


# ---- arguments ---------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _m_list(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        values.append(_positive_int(part))
    if not values:
        raise argparse.ArgumentTypeError("empty M list")
    return sorted(set(values))


def _device(text: str) -> str:
    if text == "cpu" or re.fullmatch(r"cuda(:\d+)?", text):
        return "cuda:0" if text == "cuda" else text
    raise argparse.ArgumentTypeError(f"expected cuda:N or cpu, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    from .backends import BACKEND_NAMES

    parser = argparse.ArgumentParser(
        prog="python -m moe_bench",
        description="Benchmark one W4A16 MoE layer forward (INT4 weights, bf16 scales) on one device.",
    )
    parser.add_argument("--preset", choices=sorted(presets.PRESETS), default=presets.DEFAULT_PRESET,
                        help="layer shape of a public model (default %(default)s)")
    parser.add_argument("--experts", type=_positive_int, help="routed experts (overrides the preset)")
    parser.add_argument("--hidden", type=_positive_int, help="hidden size (overrides the preset)")
    parser.add_argument("--inter", type=_positive_int, help="expert intermediate size before --tp (overrides the preset)")
    parser.add_argument("--topk", type=_positive_int, help="experts per token (overrides the preset)")
    parser.add_argument("--group-size", type=_positive_int, help="int4 quantisation group (overrides the preset)")
    parser.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel shards: inter is divided by N")
    parser.add_argument("--tp-ranks", type=_positive_int,
                        help="run the layer over N ranks, one process per device (cuda:0..N-1 of the visible GPUs "
                             "with NCCL, or N processes on the CPU with gloo), each holding the --tp N shard; "
                             "times the shard's MoE, the all-reduce of its output and the whole layer")
    parser.add_argument("--backend", choices=BACKEND_NAMES, default="triton")
    parser.add_argument("--device", type=_device, default="cuda:0", help="cuda:N or cpu (default %(default)s)")
    parser.add_argument("--dtype", choices=sorted(RELATIVE_ERROR_BOUND),
                        help="activation dtype (default bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--m-list", type=_m_list, default=list(DEFAULT_M_LIST),
                        help="comma-separated token counts (default 1,2,4,...,2048)")
    parser.add_argument("--out", help="results JSON, written after every M; the CSV goes beside it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bandwidth-gbps", type=_positive_float, help="memory ceiling instead of measuring it")
    parser.add_argument("--tflops", type=_positive_float, help="bf16 matmul ceiling instead of measuring it")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--estimate", action="store_true", help="print the device-memory estimate JSON and exit")
    action.add_argument("--preflight", action="store_true",
                        help="check imports, device and free memory in seconds; exit 0 or 3")
    parser.add_argument("--rehearse", action="store_true",
                        help="rehearse beside a live service: the same layer with as few experts as fit (at least "
                             "top-k), every M of --m-list checked and timed, compiling exactly the layer's kernels "
                             "(keep TRITON_CACHE_DIR for the full run); exit 6 when not even top-k experts fit")
    parser.add_argument("--rehearse-experts", type=_positive_int,
                        help="experts the rehearsal holds at most (default: twice top-k, or the fewest that compile "
                             "the layer's kernels)")
    parser.add_argument("--rehearse-budget-mib", type=_positive_float, default=None,
                        help="device MiB the rehearsal may take at most (default 2048, never more than half the "
                             "memory free at its start)")
    return parser


class Settings:
    """Validated arguments plus what they imply."""

    def __init__(self, args: argparse.Namespace, shape: MoEShape):
        self.args = args
        self.shape = shape
        self.device = args.device
        self.device_kind = "cpu" if args.device == "cpu" else "cuda"
        self.dtype_name = args.dtype or ("float32" if self.device_kind == "cpu" else "bfloat16")
        self.m_list = args.m_list
        self.max_m = max(args.m_list)
        # A rehearsal runs the layer's kernels with fewer experts held: shape becomes the held
        # shape once the device says how many fit (choose_rehearsal_experts); layer stays.
        self.layer = shape
        self.rehearsal: dict | None = None

    def config(self) -> dict:
        a = self.args
        return {
            "preset": a.preset,
            "experts": self.shape.experts,
            "hidden": self.shape.hidden,
            "inter": self.shape.inter,
            "topk": self.shape.topk,
            "group_size": self.shape.group_size,
            "tp": a.tp,
            "backend": a.backend,
            "dtype": self.dtype_name,
            "m_list": list(self.m_list),
            "seed": a.seed,
            "tp_ranks": a.tp_ranks,
        }

    def routings(self) -> int:
        return perfmodel.REHEARSAL_ROUTINGS if self.args.rehearse else ROUTINGS[self.device_kind]

    def estimate(self) -> dict:
        if self.args.rehearse:
            return dict(perfmodel.rehearsal_estimate(self.shape, self.args.backend, self.max_m, self.device_kind,
                                                     self.dtype_name), config=dict(self.config(), device=self.device))
        if self.args.tp_ranks:
            from .tp import estimate_per_rank

            return estimate_per_rank(self)
        return perfmodel.estimate(self.shape, self.args.backend, self.max_m, ROUTINGS[self.device_kind],
                                  self.device_kind, config=dict(self.config(), device=self.device),
                                  dtype=self.dtype_name)


def parse_settings(argv: list[str] | None) -> Settings:
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = presets.PRESETS[args.preset]
    full = MoEShape(
        experts=args.experts or preset.experts,
        hidden=args.hidden or preset.hidden,
        inter=args.inter or preset.inter,
        topk=args.topk or preset.topk,
        group_size=args.group_size or preset.group_size,
    )
    if args.tp_ranks is not None:
        if args.tp_ranks < 2:
            parser.error("--tp-ranks needs at least 2 ranks; for one device leave it out (--tp N models a shard)")
        if args.tp not in (1, args.tp_ranks):
            parser.error(f"--tp {args.tp} with --tp-ranks {args.tp_ranks}: each rank holds the --tp-ranks shard, "
                         "leave --tp out")
        if args.device not in ("cpu", "cuda:0"):
            parser.error(f"--tp-ranks puts rank r on cuda:r of the visible GPUs, so --device {args.device} cannot "
                         "choose them: give --device cuda:0 and CUDA_VISIBLE_DEVICES=<the GPUs>")
        args.tp = args.tp_ranks
    try:
        shape = presets.shard_shape(full, args.tp)
        shape.validate()
    except ValueError as error:
        parser.error(str(error))
    if (args.bandwidth_gbps is None) != (args.tflops is None):
        parser.error("give both --bandwidth-gbps and --tflops, or neither (then they are measured)")
    if args.backend == "triton" and (error := triton_shape_error(shape)):
        parser.error(error)
    settings = Settings(args, shape)
    if args.backend == "triton" and settings.device_kind == "cpu" and settings.dtype_name == "bfloat16":
        parser.error("--backend triton on the CPU runs under Triton's interpreter, which computes bf16 dots "
                     "wrongly: use --dtype float16 or float32")
    if args.backend.endswith("-marlin") and settings.device_kind == "cpu":
        parser.error(f"--backend {args.backend} runs on CUDA devices only")
    if args.rehearse and args.tp_ranks:
        parser.error("--rehearse runs on one device; leave --tp-ranks out")
    if (args.rehearse_experts or args.rehearse_budget_mib) and not args.rehearse:
        parser.error("--rehearse-experts and --rehearse-budget-mib go with --rehearse")
    return settings


# ---- the run -----------------------------------------------------------------------------

def collect_environment(device) -> dict:
    """Versions and the device's identity; device None before the device is opened."""
    import platform
    import socket
    import subprocess
    from importlib import metadata

    import torch

    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = None
    gpu_name = driver = None
    if device is not None and device.type == "cuda":
        gpu_name = torch.cuda.get_device_name(device)
        try:
            result = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(_physical_index(device))],
                capture_output=True, text=True, timeout=10, check=False,
            )
            driver = result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            driver = None
    return {
        "hostname": socket.gethostname(),
        "gpu_name": gpu_name,
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "device": str(device) if device is not None else None,
    }


def _physical_index(device) -> int:
    """nvidia-smi's index of a torch CUDA device (CUDA_VISIBLE_DEVICES of plain indices mapped)."""
    index = device.index or 0
    visible = [part.strip() for part in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if part.strip()]
    if index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index


def gpu_at_start(device) -> dict | None:
    """The GPU's utilisation and memory as this run starts (nvidia-smi; a run beside a live
    service shares the GPU, its figures say so): None off CUDA or where nvidia-smi cannot say."""
    import subprocess

    if device is None or device.type != "cuda":
        return None
    index = _physical_index(device)
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used,memory.free,memory.total",
             "--format=csv,noheader,nounits", "-i", str(index)],
            capture_output=True, text=True, timeout=10, check=False)
        fields = [part.strip() for part in result.stdout.strip().splitlines()[0].split(",")]
        utilisation, used, free, total = (float(field) for field in fields[:4])
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None
    return {"gpu": index, "utilization_pct": utilisation, "memory_used_mib": used, "memory_free_mib": free,
            "memory_total_mib": total, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def free_mib(device) -> float | None:
    """Device memory free now (MiB): CUDA's own count, the host's MemAvailable on the CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 2**20
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def choose_rehearsal_experts(settings: Settings, device) -> None:
    """Set settings.shape to the rehearsal's held experts (and settings.rehearsal), or raise
    NoRoomFailure when not even top-k experts fit beside the service."""
    import dataclasses

    from .quant import rehearsal_expert_counts

    layer = settings.layer
    candidates = rehearsal_expert_counts(layer) if settings.args.backend == "triton" \
        else list(range(layer.topk, layer.experts + 1))
    wanted = settings.args.rehearse_experts or max(2 * layer.topk, candidates[0] if candidates else layer.topk)
    budget = settings.args.rehearse_budget_mib or perfmodel.REHEARSAL_BUDGET_MIB
    free = free_mib(device)
    experts, allowed = perfmodel.rehearsal_experts(
        candidates, lambda e: dataclasses.replace(layer, experts=e), settings.args.backend, settings.max_m,
        settings.device_kind, settings.dtype_name, budget, free, wanted)
    smallest = candidates[0] if candidates else layer.topk
    need = perfmodel.rehearsal_estimate(dataclasses.replace(layer, experts=smallest), settings.args.backend,
                                        settings.max_m, settings.device_kind, settings.dtype_name)["total_mib"]
    settings.rehearsal = {"layer_experts": layer.experts, "experts": experts, "smallest_experts": smallest,
                          "need_mib": need, "allowed_mib": allowed, "free_mib": None if free is None else round(free),
                          "budget_mib": budget, "reduced": True}
    if experts is None:
        raise NoRoomFailure(
            f"the rehearsal does not fit: {smallest} experts (top-k {layer.topk}"
            + (", the fewest that compile the layer's kernels" if smallest > layer.topk else "")
            + f") need about {need} MiB, {allowed} MiB allowed ({'%d' % free if free is not None else '?'} MiB free on "
            f"{device}, at most {REHEARSAL_FREE_SHARE_TEXT} of it and {budget:g} MiB); nothing was run")
    settings.shape = dataclasses.replace(layer, experts=experts)
    log(f"rehearsal: {experts} of the layer's {layer.experts} experts (about "
        f"{perfmodel.rehearsal_estimate(settings.shape, settings.args.backend, settings.max_m, settings.device_kind, settings.dtype_name)['total_mib']}"
        f" MiB of {allowed} allowed), every M of the list checked and timed")


REHEARSAL_FREE_SHARE_TEXT = f"{int(perfmodel.REHEARSAL_FREE_SHARE * 100)}%"


def _rehearsing(settings) -> bool:
    return bool(getattr(settings.args, "rehearse", False))


def check_ms(settings: Settings, backend) -> list[int]:
    """The M values the correctness check runs: a rehearsal checks every M of the list (each
    compiles its own kernels) and the check's odd M; a run the configurations' ends."""
    chosen = correctness_ms(backend, settings.m_list)
    if _rehearsing(settings):
        chosen = sorted(set(chosen) | set(settings.m_list))
    return chosen


def check_batches(ms: list[int], rows: int) -> list[list[int]]:
    """The check's M values, in order, in batches whose rows (the sum of their M) stay within
    `rows`; an M above it is a batch alone. Each batch's float32 reference is one pass over the
    experts (each unpacked once per batch), so few batches make a short check."""
    batches: list[list[int]] = []
    held = 0
    for m in ms:
        if batches and held + m <= rows:
            batches[-1].append(m)
            held += m
        else:
            batches.append([m])
            held = m
    return batches


def make_inputs(shape: MoEShape, m: int, dtype, device, generator):
    """Tokens with unit variance and a uniform random top-k routing (distinct experts per token)."""
    import torch

    x = torch.randn((m, shape.hidden), generator=generator, device=device, dtype=torch.float32).to(dtype)
    logits = torch.rand((m, shape.experts), generator=generator, device=device)
    topk_ids = torch.topk(logits, shape.topk, dim=-1).indices.to(torch.int32)
    topk_weights = torch.rand((m, shape.topk), generator=generator, device=device, dtype=torch.float32) + 0.1
    topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return x, topk_ids, topk_weights


def correctness_ms(backend, m_list: list[int]) -> list[int]:
    """M values to check: the smallest and largest M of every tile configuration the run uses,
    and an odd M (ragged blocks) when the list goes that far."""
    by_config: dict[str, list[int]] = {}
    for m in m_list:
        by_config.setdefault(json.dumps(backend.configs_used(m), sort_keys=True), []).append(m)
    chosen = set()
    for ms in by_config.values():
        chosen.update((min(ms), max(ms)))
    if max(m_list) >= 3:
        chosen.add(3)
    return sorted(chosen)


def relative_error(out, ref) -> float | None:
    """||out - ref|| / ||ref||, or None when out holds NaN/Inf (an unwritten poisoned row, say)."""
    import torch

    out32 = out.float()
    if not bool(torch.isfinite(out32).all()):
        return None
    return float(torch.linalg.vector_norm(out32 - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


def worst_row_error(out, ref) -> tuple[float, int] | None:
    """(largest ||out[r] - ref[r]|| / ||ref[r]|| over the rows r, that row), or None when out
    holds NaN/Inf. Every row is a weighted sum of top-k experts' outputs of unit-variance
    scale, so no row's norm is near zero and each row's own norm is a fair denominator."""
    import torch

    out32 = out.float()
    if not bool(torch.isfinite(out32).all()):
        return None
    per_row = torch.linalg.vector_norm(out32 - ref, dim=1) / torch.linalg.vector_norm(ref, dim=1).clamp_min(1e-30)
    row = int(torch.argmax(per_row))
    return float(per_row[row]), row


def poisoned_call(backend, x, topk_ids, topk_weights, hidden: int):
    """Run the backend so that output rows it never writes read NaN and fail the check.

    A backend taking `out=` gets a NaN-filled output. Otherwise an output-sized NaN block is
    filled and released just before the call: CUDA's caching allocator hands that same block to
    the next allocation of its size, the backend's output (best effort elsewhere)."""
    import torch

    poison = torch.full((x.shape[0], hidden), float("nan"), dtype=x.dtype, device=x.device)
    if getattr(backend, "takes_out", False):
        return backend(x, topk_ids, topk_weights, out=poison)
    del poison
    return backend(x, topk_ids, topk_weights)


def check_correctness(settings: Settings, backend, weights, dtype, device, writer) -> None:
    """Every M of check_ms on fresh inputs against the float32 reference, row by row.

    The M values run in batches (check_batches): the backend's calls of a batch first (each
    timed: a configuration's first call compiles it), then, with the backend's workspace handed
    back, one reference pass over the experts for all of the batch's rows (the reference's rows
    are independent, so each M's rows are exactly its own reference), then each M's comparison
    in order. The first M over the bound stops the check; the M values after it in its batch
    are not recorded."""
    import torch

    from .backends import reference_moe

    bound = RELATIVE_ERROR_BOUND[settings.dtype_name]
    shape = settings.shape
    generator = torch.Generator(device=device)
    rows = perfmodel.check_batch_rows(max(settings.m_list), _rehearsing(settings))
    wrong_at = os.environ.get(_WRONG_RESULT_ENV)
    for batch in check_batches(check_ms(settings, backend), rows):
        calls = []
        for m in batch:
            # Fresh inputs, never the ones timed, seeded apart from them.
            generator.manual_seed(settings.args.seed * 1_000_003 + 7919 * m + 1)
            x, topk_ids, topk_weights = make_inputs(shape, m, dtype, device, generator)
            # The first call of a tile configuration compiles it (Triton JIT): its time is recorded,
            # because the timing phase later finds that configuration compiled already.
            _synchronize(device)
            call_started = time.perf_counter()
            out = poisoned_call(backend, x, topk_ids, topk_weights, shape.hidden)
            _synchronize(device)
            call_s = time.perf_counter() - call_started
            if tuple(out.shape) != (m, shape.hidden):
                raise CorrectnessFailure(f"backend {backend.name} returned shape {tuple(out.shape)} for M={m}, "
                                         f"expected {(m, shape.hidden)}")
            if wrong_at is not None and m == int(wrong_at):
                out[-1].neg_().add_(1.0)
            calls.append((m, x, topk_ids, topk_weights, out, call_s))
        _release_workspace(backend, settings, device)
        # One M alone (a rehearsal's largest) is not copied: its inputs are the batch's.
        joined = [calls[0][i] if len(calls) == 1 else torch.cat([c[i] for c in calls]) for i in (1, 2, 3)]
        ref = reference_moe(weights, *joined, perfmodel.REFERENCE_SLICE_ROWS)
        del joined
        first = 0
        for m, x, topk_ids, topk_weights, out, call_s in calls:
            _compare(settings, backend, m, out, ref[first:first + m], bound, call_s, writer)
            first += m
        del calls, ref, x, topk_ids, topk_weights, out
        _release_cached(settings, device)


def _compare(settings: Settings, backend, m: int, out, ref, bound: float, call_s: float, writer) -> None:
    """Record one M's check and raise CorrectnessFailure when its worst row is over the bound."""
    shape = settings.shape
    error = relative_error(out, ref)
    worst = worst_row_error(out, ref)
    # The whole output's error never exceeds its worst row's: the row bound decides.
    ok = worst is not None and worst[0] <= bound
    config = backend.configs_used(m)
    writer.add_correctness({"m": m, "rel_err": error, "worst_row_rel_err": None if worst is None else worst[0],
                            "worst_row": None if worst is None else worst[1], "bound": bound, "ok": ok,
                            "config": config, "call_s": round(call_s, 3)})
    shown = ("NaN/Inf in the output" if worst is None
             else f"relative error {error:.2e}, worst row {worst[1]} {worst[0]:.2e}")
    log(f"check M={m}: {shown} (bound {bound:.0e} per row) {'ok' if ok else 'FAILED'}")
    if not ok:
        raise CorrectnessFailure(
            f"backend {backend.name} is wrong at M={m} (tile config {json.dumps(config, sort_keys=True)}): "
            f"{shown} against the float32 reference, bound {bound:.0e} per row; no timing was done"
            + (f" (rehearsal with {shape.experts} of the layer's {settings.layer.experts} experts)"
               if _rehearsing(settings) else "")
        )


def resolve_ceilings(settings: Settings, device) -> dict:
    args = settings.args
    if args.bandwidth_gbps is not None:
        return {"bandwidth_gbps": args.bandwidth_gbps, "tflops": args.tflops, "source": "given"}
    if settings.device_kind == "cpu":
        return dict(CPU_DEFAULT_CEILINGS, source="default")
    from .timing import measure_ceilings

    log("measuring ceilings (device copy, bf16 matmul) ...")
    if settings.args.rehearse:
        # Small buffers beside the live service (which shares the GPU: the figures are a trend).
        ceilings = measure_ceilings(device, perfmodel.REHEARSAL_CEILING_COPY_BYTES,
                                    perfmodel.REHEARSAL_CEILING_MATMUL_SIZE)
        return dict(ceilings, source="measured")
    return measure_ceilings(device)


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release_workspace(backend, settings: Settings, device) -> None:
    """Hand the backend's activation-sized workspace back while other device work runs (the
    check's reference), so that the two never add up; the backend makes it again, the same
    size, on its next call. A rehearsal also gives the allocator's cached blocks back."""
    release = getattr(backend, "release_workspace", None)
    if release is not None:
        _synchronize(device)
        release()
        _release_cached(settings, device)


def _release_cached(settings: Settings, device) -> None:
    """A rehearsal beside the live service hands the allocator's cached blocks back after each
    step, so it holds at most one step's memory (a run's caching costs nothing: the GPU is its own)."""
    if _rehearsing(settings) and device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def time_one_m(settings: Settings, backend, m: int, dtype, device):
    """(compile seconds, Timing) for one M over fresh routings rotated while timing."""
    import torch

    from . import timing

    generator = torch.Generator(device=device)
    generator.manual_seed(settings.args.seed * 1_000_003 + m)
    routings = settings.routings()
    inputs = [make_inputs(settings.shape, m, dtype, device, generator) for _ in range(routings)]

    def call(r: int):
        return backend(*inputs[r])

    # The first call at an M compiles what this M's tile config needs (Triton JIT): timed apart.
    _synchronize(device)
    started = time.perf_counter()
    call(0)
    _synchronize(device)
    compile_s = time.perf_counter() - started
    if device.type == "cuda":
        # A rehearsal's figures are a trend taken beside the live service: as short as they can be.
        result = timing.time_cuda(call, routings, device, capture=backend.capturable,
                                  min_time_s=0.0 if _rehearsing(settings) else None)
    else:
        result = timing.time_cpu(call, routings)
    del inputs
    if _rehearsing(settings):
        # Beside the live service the workspace is held only while an M is timed (the
        # captured graphs that used it are gone by now).
        _release_workspace(backend, settings, device)
    _release_cached(settings, device)
    return compile_s, result


def _raise_on_sigterm(signum, frame):
    raise RuntimeFailure(f"stopped by signal {signal.Signals(signum).name}")


def run_benchmark(settings: Settings) -> int:
    from .schema import ResultsWriter

    started = time.perf_counter()
    writer = None
    phase = "starting"  # named in a runtime failure's message: where the run was when it broke
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        log(f"starting: backend {settings.args.backend} on {settings.device}, shape {settings.shape}, "
            f"dtype {settings.dtype_name}, M {','.join(map(str, settings.m_list))}")
        if settings.args.backend == "triton" and settings.device_kind == "cpu":
            # Must be set before triton is first imported; CPU tensors need the interpreter.
            os.environ.setdefault("TRITON_INTERPRET", "1")
        import torch

        from .backends import BackendUnavailable, check_backend_available, create_backend

        writer = ResultsWriter(settings.args.out, collect_environment(None), settings.config())
        # Refuse a backend whose packages are missing before any device is touched.
        try:
            check_backend_available(settings.args.backend)
        except BackendUnavailable as error:
            raise EnvironmentFailure(str(error)) from None
        phase_started = PROCESS_STARTED

        def end_phase(name: str) -> None:
            nonlocal phase_started
            now = time.perf_counter()
            writer.set_phase(name, now - phase_started, now - PROCESS_STARTED)
            phase_started = now

        end_phase("import_s")
        phase = f"opening {settings.device}"
        device = _open_device(settings)
        dtype = getattr(torch, settings.dtype_name)
        writer.set_environment(collect_environment(device))
        writer.set_gpu_at_start(gpu_at_start(device))
        if settings.args.rehearse:
            phase = "choosing the rehearsal's experts"
            try:
                choose_rehearsal_experts(settings, device)
            finally:
                writer.set_rehearsal(settings.rehearsal)
            writer.set_config(settings.config())
        phase = "measuring ceilings"
        ceilings = resolve_ceilings(settings, device)
        writer.set_ceilings(ceilings)
        log(f"ceilings: {ceilings['bandwidth_gbps']} GB/s, {ceilings['tflops']} TFLOP/s ({ceilings['source']})")
        end_phase("device_s")

        from . import quant

        phase = "building weights"
        log("building weights ...")
        t0 = time.perf_counter()
        weights = quant.random_weights(settings.shape, device, seed=settings.args.seed)
        _synchronize(device)
        log(f"weights: {weights.nbytes() / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s")
        phase = f"preparing backend {settings.args.backend}"
        try:
            # A rehearsal's backend compiles its layer's kernels (fewer experts held).
            layer = {"layer": settings.layer} if settings.layer != settings.shape else {}
            backend = create_backend(settings.args.backend, weights, settings.max_m, dtype, **layer)
        except BackendUnavailable as error:
            raise EnvironmentFailure(str(error)) from None
        except ValueError as error:
            raise EnvironmentFailure(f"backend {settings.args.backend} cannot run this shape: {error}") from None
        timing_info = {"method": None, "routings": settings.routings(), "notes": []}
        end_phase("weights_s")

        phase = "checking correctness"
        log("checking correctness ...")
        check_correctness(settings, backend, weights, dtype, device, writer)
        end_phase("check_s")
        timing_started = phase_started

        fail_at = os.environ.get(_FAULT_INJECTION_ENV)
        total = len(settings.m_list)
        for index, m in enumerate(settings.m_list, start=1):
            if fail_at is not None and m == int(fail_at):
                raise RuntimeFailure(f"injected failure at M={m} ({_FAULT_INJECTION_ENV})")
            phase = f"timing M={m}"
            compile_s, measured = time_one_m(settings, backend, m, dtype, device)
            row = perfmodel.result_row(settings.shape, m, measured.us, measured.us_p20, measured.us_p80, compile_s,
                                       ceilings["bandwidth_gbps"], ceilings["tflops"])
            timing_info["method"] = measured.method
            for note in measured.notes:
                timing_info["notes"].append(f"M={m}: {note}")
                log(f"note M={m}: {note}")
            writer.set_timing(timing_info)
            writer.add_result(row)
            if index == 1:
                writer.set_first_result(time.perf_counter() - PROCESS_STARTED)
            log(f"M={m} ({index}/{total}) {row['us']:.1f} us {row['us_per_token']:.2f} us/token "
                f"{row['pct_of_floor']:.1f}% of floor elapsed {time.perf_counter() - started:.1f} s")
        phase_started = timing_started
        end_phase("timing_s")
        writer.complete()
        log(f"complete: {total} M values in {time.perf_counter() - started:.1f} s"
            + (f", results in {settings.args.out}" if settings.args.out else ""))
        return EXIT_OK
    except HarnessError as error:
        return _fail(writer, error.kind, str(error), error.exit_code)
    except KeyboardInterrupt:
        return _fail(writer, "runtime", "interrupted", EXIT_RUNTIME)
    except Exception as error:  # anything else on the device: out of memory, CUDA errors
        traceback.print_exc(file=sys.stderr)
        kind_text = "out of memory" if "out of memory" in str(error).lower() else type(error).__name__
        return _fail(writer, "runtime", f"{kind_text} while {phase}: {error}".strip(), EXIT_RUNTIME)
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)


def _open_device(settings: Settings):
    import torch

    device = torch.device(settings.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise EnvironmentFailure(
                f"{settings.device} requested but torch {torch.__version__} sees no CUDA device "
                "(CPU-only torch build, driver problem, or CUDA_VISIBLE_DEVICES empty)"
            )
        count = torch.cuda.device_count()
        index = device.index or 0
        if index >= count:
            raise EnvironmentFailure(f"{settings.device} requested but only {count} CUDA device(s) are visible")
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    return device


def _fail(writer, kind: str, message: str, exit_code: int) -> int:
    print(f"moe_bench failed ({kind}, exit {exit_code}): {message}", file=sys.stderr, flush=True)
    log(f"failed ({kind}): {message}")
    if writer is not None:
        try:
            writer.fail(kind, message, exit_code)
        except OSError as error:
            print(f"moe_bench: could not record the failure in the results file: {error}", file=sys.stderr)
    return exit_code


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_settings(argv)
    except SystemExit as exit_:  # argparse: 0 for --help, 2 for bad arguments
        return int(exit_.code or 0)
    if settings.args.estimate:
        print(json.dumps(settings.estimate(), sort_keys=True))
        return EXIT_OK
    if settings.args.preflight:
        from .preflight import run_preflight

        return run_preflight(settings)
    if settings.args.tp_ranks:
        from .tp import run_tensor_parallel

        return run_tensor_parallel(settings)
    return run_benchmark(settings)
