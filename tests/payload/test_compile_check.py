"""tools/compile_check.py's race check on hand-written SASS (no compiler involved).

The check must find a warp-group MMA whose register operand is overwritten, following the
loop back to its start, before a wait retires it -- the race that gave wrong and NaN results
on the H200 -- and must accept the same loop once a wait sits in between.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import compile_check  # noqa: E402


def loop(*body: str) -> str:
    lines = [f"        /*{0x100 + 16 * i:04x}*/                   {text} ;" for i, text in enumerate(body)]
    lines.append(f"        /*{0x100 + 16 * len(body):04x}*/              @!P2 BRA 0x100 ;")
    return "\n".join(lines)


def test_operand_overwritten_on_the_next_iteration_is_found():
    sass = loop("LDS.U16 R41, [R78+UR4+0x6000]", "WARPGROUP.ARRIVE",
                "HGMMA.64x32x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0", "BAR.SYNC.DEFER_BLOCKING 0x0")
    hazards = compile_check.wgmma_operand_hazards(sass)
    assert len(hazards) == 1 and "R40" in hazards[0] and "0x100" in hazards[0]


def test_wait_before_the_overwrite_is_safe():
    sass = loop("LDS.U16 R41, [R78+UR4+0x6000]", "WARPGROUP.ARRIVE",
                "HGMMA.64x32x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert compile_check.wgmma_operand_hazards(sass) == []


def test_wide_writes_and_registers_outside_the_operand():
    # A 128-bit load into R36..R39 does not touch the operand R40..R43; one into R38..R41 does.
    clean = loop("LDS.128 R36, [R2]", "HGMMA.64x32x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0", "IADD3 R44, R1, 1, RZ")
    dirty = loop("LDS.128 R38, [R2]", "HGMMA.64x32x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0")
    assert compile_check.wgmma_operand_hazards(clean) == []
    assert compile_check.wgmma_operand_hazards(dirty)
    # A store reads its first register (an address), it does not write it.
    store = loop("STS [R40], R2", "HGMMA.64x32x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0")
    assert compile_check.wgmma_operand_hazards(store) == []
