"""Where the rehearsal's device memory goes (issue 15): runs moe_bench in this process and logs,
at the end of each step (each check batch, each timed M) and around each float32 reference,
the device's used memory (all processes: run it on an otherwise idle GPU, where the difference
to torch's reserved memory is this process's CUDA context and modules) and torch's reserved
and allocated peaks since the previous record.

  PROBE_OUT=probe.json PYTHONPATH=files python3 tools/rehearsal_memory_probe.py --rehearse \
      --preset kimi-k2.6 --backend triton --device cuda:0 --out rehearsal.json

The arguments are moe_bench's; the records go to $PROBE_OUT (JSON) and, one line each, to stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from moe_bench import backends, cli

records: list[dict] = []


def record(tag: str) -> None:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    records.append({"tag": tag, "t": round(time.perf_counter() - cli.PROCESS_STARTED, 2),
                    "device_used_mib": round((total - free) / 2**20),
                    "reserved_mib": round(torch.cuda.memory_reserved() / 2**20),
                    "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20),
                    "peak_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20)})
    torch.cuda.reset_peak_memory_stats()


def main() -> int:
    release_cached, reference_moe = cli._release_cached, backends.reference_moe

    def release(settings, device):
        record("step end")
        release_cached(settings, device)

    def reference(weights, x, *args, **kwargs):
        record(f"before reference, {x.shape[0]} rows")
        out = reference_moe(weights, x, *args, **kwargs)
        record(f"after reference, {x.shape[0]} rows")
        return out

    cli._release_cached = release
    backends.reference_moe = reference
    code = cli.main(sys.argv[1:])
    record("end")
    with open(os.environ.get("PROBE_OUT", "probe.json"), "w", encoding="utf-8") as out:
        json.dump(records, out, indent=1)
    for r in records:
        print(f"{r['t']:7.2f} s {r['tag']:28s} device used {r['device_used_mib']:6d}  reserved {r['reserved_mib']:6d}"
              f"  peak reserved {r['peak_reserved_mib']:6d}  peak allocated {r['peak_allocated_mib']:6d} MiB")
    return code


if __name__ == "__main__":
    sys.exit(main())
