"""Read the model's files into the page cache while the benchmark runs (python -m moe_bench.prewarm).

The service's restart after the benchmark loads the model's weights; where the host has the
memory, reading them ahead lets that load start from RAM instead of the disk. The reader is
meant to run at the lowest priority (the caller starts it under `nice -n 19 ionice -c 3`), never
takes MemAvailable below the reserve (it stops reading once the next chunk would), and ends when
the benchmark's results say it ended (status complete or failed), when its time limit passes,
or when it has read everything. It writes what it did to --record: bytes, files, seconds and
why it stopped. It only reads; nothing it does can change the benchmark's results.

Standard library only: the host's python runs it without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CHUNK_BYTES = 16 * 1024 * 1024
MIB = 1024 * 1024
# How often (in chunks) the results file and MemAvailable are looked at: every 16 MiB.
CHECK_EVERY_CHUNKS = 1


def mem_available_mib(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable in MiB, None when the kernel does not say."""
    try:
        with open(meminfo, encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def benchmark_ended(results: str | None) -> bool:
    """The benchmark's results file says it ended (complete or failed)."""
    if not results:
        return False
    try:
        with open(results, encoding="utf-8") as handle:
            status = json.load(handle).get("status")
    except (OSError, ValueError, AttributeError):
        return False
    return status in ("complete", "failed")


def files_under(paths: list[str]) -> list[str]:
    """Every regular file under the paths (a file stands for itself), in a stable order."""
    found = []
    for path in paths:
        if os.path.isfile(path):
            found.append(path)
            continue
        for folder, subfolders, names in os.walk(path):
            subfolders.sort()
            for name in sorted(names):
                full = os.path.join(folder, name)
                if os.path.isfile(full) and not os.path.islink(full):
                    found.append(full)
    return found


def prewarm(paths: list[str], reserve_mib: int, results: str | None = None, limit_s: float = 3600.0,
            meminfo: str = "/proc/meminfo", chunk_bytes: int = CHUNK_BYTES) -> dict:
    """Read the files chunk by chunk until done, the reserve, the benchmark's end or the limit."""
    started = time.monotonic()
    record = {"paths": list(paths), "reserve_mib": reserve_mib, "bytes": 0, "files_read": 0,
              "files_total": 0, "bytes_total": 0, "seconds": 0.0, "stopped": "done", "error": None}
    files = files_under(paths)
    record["files_total"] = len(files)
    record["bytes_total"] = sum(os.path.getsize(name) for name in files)
    buffer = bytearray(chunk_bytes)
    try:
        for name in files:
            with open(name, "rb", buffering=0) as handle:
                while True:
                    if time.monotonic() - started >= limit_s:
                        record["stopped"] = "time limit"
                        return record
                    if benchmark_ended(results):
                        record["stopped"] = "benchmark ended"
                        return record
                    available = mem_available_mib(meminfo)
                    if available is not None and available - chunk_bytes / MIB < reserve_mib:
                        record["stopped"] = "memory reserve"
                        record["mem_available_mib"] = available
                        return record
                    count = handle.readinto(buffer)
                    if not count:
                        break
                    record["bytes"] += count
            record["files_read"] += 1
        return record
    except OSError as error:
        record["stopped"] = "error"
        record["error"] = f"{type(error).__name__}: {error}"
        return record
    finally:
        record["seconds"] = round(time.monotonic() - started, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_bench.prewarm", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="files or folders to read (the model's weights)")
    parser.add_argument("--reserve-mib", type=int, required=True, help="never take MemAvailable below this")
    parser.add_argument("--results", help="the benchmark's results JSON: stop once its status is complete or failed")
    parser.add_argument("--limit-s", type=float, default=3600.0, help="stop after this many seconds")
    parser.add_argument("--record", required=True, help="JSON file this run's record is written to")
    args = parser.parse_args(argv)
    record = prewarm(args.paths, args.reserve_mib, args.results, args.limit_s)
    temporary = args.record + ".tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=2)
        handle.write("\n")
    os.replace(temporary, args.record)
    print(json.dumps(record))
    return 0 if record["stopped"] != "error" else 1


if __name__ == "__main__":
    sys.exit(main())
