"""One property of a compiled GPU kernel that its compiler does not guarantee, read from the
machine code (SASS): a warp-group MMA (`HGMMA`, Hopper) reads its register operand while it
runs, so nothing may write those registers until a wait (`WARPGROUP.DEPBAR`) retires it. A
write in between is a race: results that vary run to run, NaN among them (seen on an H200).
The triton backend checks each GEMM it compiles before trusting it with MMAs left in flight
(TritonW4A16MoE._launch); tools/compile_check.py and tools/kernel_sweep.py use the same check.
Standard library only.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# Bumped whenever wgmma_operand_hazards changes what it finds: older cached verdicts are ignored.
CHECK_VERSION = 1


def kernel_sass(kernel) -> str | None:
    """A compiled Triton kernel's SASS (Triton disassembles its cubin with the cuobjdump it
    ships), or None when it cannot be read."""
    try:
        sass = kernel.asm["sass"]
    except Exception:  # no cuobjdump, an interpreter launch, a Triton without the key
        return None
    return sass if isinstance(sass, str) and sass.strip() else None


def _verdict_path(kernel) -> Path | None:
    """Where the check's verdict on this compiled kernel is kept: beside Triton's own cache
    (TRITON_CACHE_DIR, as a rehearsal hands it to the full run), keyed by the kernel's compile
    hash; None without TRITON_CACHE_DIR or a hash."""
    folder = os.environ.get("TRITON_CACHE_DIR", "")
    digest = getattr(kernel, "hash", None) or getattr(getattr(kernel, "metadata", None), "hash", None)
    if not folder or not isinstance(digest, str) or not re.fullmatch(r"[0-9A-Za-z_-]+", digest):
        return None
    return Path(folder) / "moe_bench_sass" / f"{digest}.json"


def cached_verdict(kernel) -> bool | None:
    """The overlapped-MMA verdict kept for this kernel (store_verdict), or None: disassembling
    the cubin costs a cuobjdump call per kernel, about a second of a run that found every
    kernel in the cache."""
    path = _verdict_path(kernel)
    try:
        record = json.loads(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("check_version") != CHECK_VERSION:
        return None
    verdict = record.get("overlap_ok")
    return verdict if isinstance(verdict, bool) else None


def store_verdict(kernel, verdict: bool) -> None:
    """Keep the verdict beside Triton's cache; a cache that cannot be written only costs time."""
    path = _verdict_path(kernel)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"check_version": CHECK_VERSION, "overlap_ok": bool(verdict)}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def dest_registers(text: str) -> set[int]:
    """Registers an instruction writes (its first operand), widened for 64/128-bit results."""
    parts = text.split(None, 1)
    if parts and parts[0].startswith("@"):
        parts = parts[1].split(None, 1)
    if len(parts) < 2 or parts[0].startswith(("ST", "RED", "BRA", "BAR", "WARPGROUP", "HGMMA")):
        return set()
    match = re.match(r"R(\d+)\b", parts[1])
    if not match:
        return set()
    width = 4 if ".128" in parts[0] else 2 if (".64" in parts[0] or ".WIDE" in parts[0]) else 1
    return set(range(int(match.group(1)), int(match.group(1)) + width))


def wgmma_operand_hazards(sass: str) -> list[str]:
    """Warp-group MMAs whose register operand (A: four registers) may be overwritten before a
    wait retires it: on the path straight on from the MMA (through a loop's exit) and, inside
    a loop, around its back-edge to the MMA again. [] when there is none."""
    ins = []
    for line in sass.splitlines():
        match = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if match:
            ins.append((int(match.group(1), 16), match.group(2).strip()))
    loops = []
    for addr, text in ins:
        target = re.search(r"BRA 0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    found = []
    for idx, (addr, text) in enumerate(ins):
        operand = re.search(r"HGMMA\S*\s+R\d+,\s+R(\d+),", text)
        if not operand:
            continue
        regs = set(range(int(operand.group(1)), int(operand.group(1)) + 4))
        paths = [ins[idx + 1:]]
        for start, end in loops:
            if start <= addr <= end:
                body = [(a, t) for a, t in ins if start <= a <= end]
                i = body.index((addr, text))
                paths.append(body[i + 1:] + body[:i])
        for path in paths:
            hit = _first_write_before_wait(path, regs)
            if hit is not None:
                found.append(f"{hex(addr)} {text.split(',')[1].strip()} overwritten at {hex(hit[0])} ({hit[1].split()[0]})")
                break
    return found


def _first_write_before_wait(path: list[tuple[int, str]], regs: set[int]) -> tuple[int, str] | None:
    for other_addr, other in path:
        if "WARPGROUP.DEPBAR" in other or other.split()[0] in ("EXIT", "RET"):
            return None
        if regs & dest_registers(other):
            return other_addr, other
    return None
