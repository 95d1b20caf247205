"""--preflight: can this host run the benchmark? Answered in seconds, with the service still up.

Checks that torch imports, that the backend's packages import (triton for the triton backend),
that the requested device exists, and reports its free memory against the estimate. Low free
memory is not a failure here: the service still holds the GPU; the memory gate comes after the
service is stopped.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata

EXIT_OK = 0
EXIT_ENVIRONMENT = 3
MIB = 1024**2


class PreflightFailure(Exception):
    pass


def _cpu_memory_mib() -> tuple[int, int]:
    values = {}
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    return values.get("MemAvailable", values.get("MemFree", 0)) // MIB, values["MemTotal"] // MIB


def preflight_report(settings) -> dict:
    try:
        import torch
    except Exception as error:
        raise PreflightFailure(f"torch does not import with {sys.executable}: {error}") from None

    from .backends import BackendUnavailable, check_backend_available

    backend = settings.args.backend
    if backend == "triton" and settings.device_kind == "cpu":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        check_backend_available(backend)
    except BackendUnavailable as error:
        raise PreflightFailure(str(error)) from None
    except Exception as error:  # the module exists but is broken: same answer for the operator
        raise PreflightFailure(f"backend '{backend}' does not import: {type(error).__name__}: {error}") from None
    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = None

    estimate = settings.estimate()
    need_mib = estimate["total_mib"]
    if settings.device_kind == "cpu":
        free_mib, total_mib = _cpu_memory_mib()
        device_name = "cpu"
        device = "cpu"
    else:
        if not torch.cuda.is_available():
            raise PreflightFailure(
                f"{settings.device} requested but torch {torch.__version__} sees no CUDA device "
                "(CPU-only torch build, driver problem, or CUDA_VISIBLE_DEVICES empty)"
            )
        index = torch.device(settings.device).index or 0
        count = torch.cuda.device_count()
        if index >= count:
            raise PreflightFailure(f"{settings.device} requested but only {count} CUDA device(s) are visible")
        ranks = getattr(settings.args, "tp_ranks", None)
        if ranks and count < ranks:
            raise PreflightFailure(f"--tp-ranks {ranks} needs {ranks} CUDA devices (one per rank) but {count} are "
                                   "visible; set CUDA_VISIBLE_DEVICES to the GPUs to use or lower --tp-ranks")
        try:
            free_bytes, total_bytes = torch.cuda.mem_get_info(index)
        except RuntimeError as error:
            raise PreflightFailure(f"cannot query {settings.device}: {error}") from None
        free_mib, total_mib = free_bytes // MIB, total_bytes // MIB
        device_name = torch.cuda.get_device_name(index)
        device = f"cuda:{index}"
    if need_mib > total_mib:
        raise PreflightFailure(
            f"the run needs {need_mib} MiB but {device} ({device_name}) has {total_mib} MiB in all: "
            "choose a smaller shape, --m-list, or a larger --tp"
        )
    report = {
        "ok": True,
        "device": device,
        "device_name": device_name,
        "free_mib": int(free_mib),
        "total_mib": int(total_mib),
        "need_mib": int(need_mib),
        "fits_now": bool(free_mib >= need_mib),
        "torch": torch.__version__,
        "triton": triton_version,
        "backend": backend,
        # The whole --estimate object: the playbook reads it from here instead of starting the
        # payload a second time (an import of torch, a few seconds of CPU on the host).
        "estimate": estimate,
    }
    ranks = getattr(settings.args, "tp_ranks", None)
    if ranks:
        # need_mib is per rank; every rank's GPU is reported (free memory is information only).
        report["ranks"] = [_rank_memory(torch, rank, need_mib, settings.device_kind) for rank in range(ranks)]
    return report


def _rank_memory(torch, rank: int, need_mib: int, device_kind: str) -> dict:
    if device_kind == "cpu":
        free_mib, total_mib = _cpu_memory_mib()
        return {"rank": rank, "device": "cpu", "free_mib": int(free_mib), "total_mib": int(total_mib),
                "fits_now": bool(free_mib >= need_mib)}
    free_bytes, total_bytes = torch.cuda.mem_get_info(rank)
    if need_mib > total_bytes // MIB:
        raise PreflightFailure(f"each rank needs {need_mib} MiB but cuda:{rank} has {total_bytes // MIB} MiB in all: "
                               "choose a smaller shape or --m-list")
    return {"rank": rank, "device": f"cuda:{rank}", "free_mib": int(free_bytes // MIB),
            "total_mib": int(total_bytes // MIB), "fits_now": bool(free_bytes // MIB >= need_mib)}


def run_preflight(settings) -> int:
    try:
        report = preflight_report(settings)
    except PreflightFailure as error:
        print(f"preflight failed: {error}", file=sys.stderr, flush=True)
        return EXIT_ENVIRONMENT
    print(json.dumps(report, sort_keys=True), flush=True)
    return EXIT_OK
