"""How the harness measures: device ceilings, and the time of one MoE forward at a fixed M.

On a CUDA device one captured CUDA graph runs a forward of every rotated routing in turn, so
consecutive forwards read different expert sets and the L2 cache cannot hold the working set;
CUDA events bracket each replay, and a sample is the replay's time per forward (time_cuda,
_time_with_events). A backend that cannot be captured is timed eagerly with the same events,
a round of calls over the routings at a time (the result says which). On the CPU,
time.perf_counter brackets each call. Warm-up calls are never part of the figures.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

# Sampling budget per M: at least MIN_SAMPLES forwards (and every routing at least once). On the
# CPU: stop at MAX_SAMPLES or once TIME_BUDGET_S of measured time has passed. On a CUDA device:
# go on until MIN_TIME_S has passed as well (the rehearsal asks for none), never past
# TIME_BUDGET_S. Sustained work takes an H200 to its power limit within about a second, and its
# clock down with it: forty forwards at kimi-k2.6 M=16 are 36 ms, a burst at a clock no serving
# GPU keeps; half a second is what the independent timing (tools/graph_timing.py) samples too
# (PERFORMANCE.md round 18).
# The CPU mode exists to exercise the harness, not to rank CPUs: one warm-up round, a short budget.
MIN_SAMPLES = 40
MAX_SAMPLES = 400
TIME_BUDGET_S = {"cuda": 2.0, "cpu": 0.25}
MIN_TIME_S = {"cuda": 0.5, "cpu": 0.0}
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


def _enough(forwards: int, routings: int, elapsed_s: float, budget_s: float, min_time_s: float = 0.0,
            max_forwards: int | None = MAX_SAMPLES) -> bool:
    """The one stop rule: every routing timed at least once, then stop at the budget (or
    max_forwards), else once MIN_SAMPLES forwards and min_time_s have both passed."""
    if forwards < routings:
        return False
    if elapsed_s >= budget_s or (max_forwards is not None and forwards >= max_forwards):
        return True
    return forwards >= MIN_SAMPLES and elapsed_s >= min_time_s


def time_cpu(call: Callable[[int], object], routings: int) -> Timing:
    """call(r) runs the forward on routing r."""
    for _ in range(WARMUP_ROUNDS["cpu"]):
        for r in range(routings):
            call(r)
    samples: list[float] = []
    started = time.perf_counter()
    while not _enough(len(samples), routings, time.perf_counter() - started, TIME_BUDGET_S["cpu"],
                      MIN_TIME_S["cpu"]):
        r = len(samples) % routings
        t0 = time.perf_counter()
        call(r)
        samples.append((time.perf_counter() - t0) * 1e6)
    s = summarize(samples)
    return Timing(s["us"], s["us_p20"], s["us_p80"], s["samples"], "cpu-perf-counter")


# Timed rounds between two host synchronisations; each batch of them is led by one untimed round.
ROUNDS_PER_SYNC = 4


def _cuda_event():
    return torch.cuda.Event(enable_timing=True)


def _time_with_events(run_round: Callable[[], object], routings: int, device: torch.device,
                      min_time_s: float | None = None, event: Callable[[], object] = _cuda_event,
                      synchronize=None) -> list[float]:
    """Per-forward times in us, one sample per timed round: run_round() runs one forward of every
    routing in turn, a pair of events brackets it, and the round's time / routings is the sample.
    Sampling goes on for at least MIN_SAMPLES forwards and min_time_s seconds (default
    MIN_TIME_S), at most TIME_BUDGET_S.

    Each batch of ROUNDS_PER_SYNC timed rounds is queued behind one untimed round, so the GPU is
    busy while the host queues them and never waits for a launch inside a timed round; the host
    synchronises once per batch. event / synchronize: the event factory and the device wait
    (tests pass stand-ins)."""
    synchronize = synchronize or (lambda: torch.cuda.synchronize(device))
    min_time_s = MIN_TIME_S["cuda"] if min_time_s is None else min_time_s
    samples: list[float] = []
    wall = time.perf_counter()
    # A sample is a whole round of forwards: no cap on their count, the budget bounds it.
    while not _enough(len(samples) * routings, routings, time.perf_counter() - wall, TIME_BUDGET_S["cuda"],
                      min_time_s, max_forwards=None):
        run_round()  # the leading round: untimed
        pairs = []
        for _ in range(ROUNDS_PER_SYNC):
            start, end = event(), event()
            start.record()
            run_round()
            end.record()
            pairs.append((start, end))
        synchronize()
        samples.extend(start.elapsed_time(end) * 1e3 / routings for start, end in pairs)
    return samples


def time_cuda(call: Callable[[int], object], routings: int, device: torch.device, capture: bool,
              min_time_s: float | None = None) -> Timing:
    """call(r) runs the forward on routing r's static inputs; returns the output tensor.
    min_time_s: the least sampling time (default MIN_TIME_S; a rehearsal beside a live service
    takes none).

    One CUDA graph holds a forward of every routing in turn, as a serving engine's graph holds
    the layer among the model's other work: no graph launch sits between two forwards. Timed one
    graph per routing, each forward carried a replay's launch gap of its own (kimi-k2.6 --tp 8
    M=1 on an H200: 43.3 us a forward against 40.9 us inside one graph; PERFORMANCE.md round 18)."""
    notes: list[str] = []
    with torch.cuda.device(device):
        graph = None
        outputs = []  # keep captured outputs alive for the graph's lifetime
        if capture:
            try:
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for r in range(routings):
                        call(r)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for r in range(routings):
                        outputs.append(call(r))
                torch.cuda.synchronize(device)
            except Exception as error:  # capture failed: fall back to eager, say so in the results
                graph = None
                outputs.clear()
                torch.cuda.synchronize(device)
                notes.append(f"CUDA graph capture failed ({type(error).__name__}: {error}); timed eagerly")
        if graph is not None:
            run_round = graph.replay
            method = "cuda-graph"
        else:
            def run_round():
                for r in range(routings):
                    call(r)
            method = "cuda-events-eager"
        for _ in range(WARMUP_ROUNDS["cuda"]):
            run_round()
        torch.cuda.synchronize(device)
        samples = _time_with_events(run_round, routings, device, min_time_s)
        del graph, outputs
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
