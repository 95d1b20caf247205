"""How the harness measures: device ceilings, and the time of one MoE forward at a fixed M.

On a CUDA device each rotated routing gets its own captured CUDA graph (one memory pool shared
by all), and CUDA events bracket each replay; the routings are replayed in turn so consecutive
replays read different expert sets and the L2 cache cannot hold the working set. A backend that
cannot be captured is timed eagerly with the same events (the result says which). On the CPU,
time.perf_counter brackets each call. Warm-up calls are never part of the figures.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

# Sampling budget per M: at least MIN_SAMPLES replays (and every routing at least once), then
# stop at MAX_SAMPLES or once TIME_BUDGET_S of measured time has passed.
# The CPU mode exists to exercise the harness, not to rank CPUs: one warm-up round, a short budget.
MIN_SAMPLES = 40
MAX_SAMPLES = 400
TIME_BUDGET_S = {"cuda": 2.0, "cpu": 0.25}
WARMUP_ROUNDS = {"cuda": 2, "cpu": 1}


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(samples_us: Sequence[float]) -> dict:
    return {
        "us": statistics.median(samples_us),
        "us_p20": percentile(samples_us, 20),
        "us_p80": percentile(samples_us, 80),
        "samples": len(samples_us),
    }


@dataclass
class Timing:
    us: float
    us_p20: float
    us_p80: float
    samples: int
    method: str  # "cuda-graph", "cuda-events-eager" or "cpu-perf-counter"
    notes: list[str] = field(default_factory=list)


def _enough(samples: int, routings: int, elapsed_s: float, budget_s: float) -> bool:
    if samples < routings:
        return False
    if samples >= MAX_SAMPLES or elapsed_s >= budget_s:
        return True
    return samples >= MIN_SAMPLES


def time_cpu(call: Callable[[int], object], routings: int) -> Timing:
    """call(r) runs the forward on routing r."""
    for _ in range(WARMUP_ROUNDS["cpu"]):
        for r in range(routings):
            call(r)
    samples: list[float] = []
    started = time.perf_counter()
    while not _enough(len(samples), routings, time.perf_counter() - started, TIME_BUDGET_S["cpu"]):
        r = len(samples) % routings
        t0 = time.perf_counter()
        call(r)
        samples.append((time.perf_counter() - t0) * 1e6)
    s = summarize(samples)
    return Timing(s["us"], s["us_p20"], s["us_p80"], s["samples"], "cpu-perf-counter")


def _time_with_events(replay: Callable[[int], object], routings: int, device: torch.device) -> list[float]:
    budget = TIME_BUDGET_S["cuda"]
    samples: list[float] = []
    wall = time.perf_counter()
    # Events are recorded in batches of one round over all routings, then read back: reading
    # after every replay would put a host sync between replays.
    while not _enough(len(samples), routings, time.perf_counter() - wall, budget):
        pairs = []
        for r in range(routings):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            replay(r)
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize(device)
        samples.extend(start.elapsed_time(end) * 1e3 for start, end in pairs)
    return samples


def time_cuda(call: Callable[[int], object], routings: int, device: torch.device, capture: bool) -> Timing:
    """call(r) runs the forward on routing r's static inputs; returns the output tensor."""
    notes: list[str] = []
    with torch.cuda.device(device):
        graphs: list[torch.cuda.CUDAGraph] = []
        outputs = []  # keep captured outputs alive for the graphs' lifetime
        if capture:
            try:
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for r in range(routings):
                        call(r)
                torch.cuda.current_stream(device).wait_stream(side)
                pool = torch.cuda.graph_pool_handle()
                for r in range(routings):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        outputs.append(call(r))
                    graphs.append(graph)
                torch.cuda.synchronize(device)
            except Exception as error:  # capture failed: fall back to eager, say so in the results
                graphs.clear()
                outputs.clear()
                torch.cuda.synchronize(device)
                notes.append(f"CUDA graph capture failed ({type(error).__name__}: {error}); timed eagerly")
        if graphs:
            replay = lambda r: graphs[r].replay()  # noqa: E731
            method = "cuda-graph"
        else:
            replay = call
            method = "cuda-events-eager"
        for _ in range(WARMUP_ROUNDS["cuda"]):
            for r in range(routings):
                replay(r)
        torch.cuda.synchronize(device)
        samples = _time_with_events(replay, routings, device)
        del graphs, outputs
    s = summarize(samples)
    return Timing(s["us"], s["us_p20"], s["us_p80"], s["samples"], method, notes)


def measure_ceilings(device: torch.device, copy_bytes: int | None = None, matmul_size: int | None = None) -> dict:
    """Device copy bandwidth (read + write counted) and bf16 matmul throughput, best of a few
    (smaller buffers than the defaults for a rehearsal beside a live service)."""
    from .perfmodel import CEILING_COPY_BYTES, CEILING_MATMUL_SIZE

    with torch.cuda.device(device):
        n = (copy_bytes or CEILING_COPY_BYTES) // 2
        source = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
        destination = torch.empty_like(source)
        copy_us = _best_event_time(lambda: destination.copy_(source), device)
        bandwidth_gbps = 2 * n / (copy_us * 1e-6) / 1e9
        del source, destination
        size = matmul_size or CEILING_MATMUL_SIZE
        a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
        b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
        c = torch.empty(size, size, dtype=torch.bfloat16, device=device)
        matmul_us = _best_event_time(lambda: torch.matmul(a, b, out=c), device)
        tflops = 2 * size**3 / (matmul_us * 1e-6) / 1e12
        del a, b, c
        torch.cuda.empty_cache()
    return {"bandwidth_gbps": round(bandwidth_gbps, 1), "tflops": round(tflops, 1), "source": "measured"}


def _best_event_time(work: Callable[[], object], device: torch.device, repeats: int = 20) -> float:
    for _ in range(3):
        work()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    # The median, not the minimum: a ceiling the harness reports must be reproducible.
    return statistics.median(times)
