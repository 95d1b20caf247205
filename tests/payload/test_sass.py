"""The payload's race check (moe_bench.sass) on hand-written SASS (no compiler involved).

The check must find a warp-group MMA whose register operand is overwritten before a wait
retires it -- around a loop's back-edge, or straight on through the loop's exit -- the race
that gave wrong and NaN results on the H200, and must accept the same code once a wait sits
in between. The triton backend trusts a kernel with MMAs left in flight only when it passes.
"""

from __future__ import annotations

from moe_bench import sass


def loop(*body: str) -> str:
    lines = [f"        /*{0x100 + 16 * i:04x}*/                   {text} ;" for i, text in enumerate(body)]
    lines.append(f"        /*{0x100 + 16 * len(body):04x}*/              @!P2 BRA 0x100 ;")
    return "\n".join(lines)


def test_operand_overwritten_on_the_next_iteration_is_found():
    code = loop("LDS.U16 R41, [R78+UR4+0x6000]", "WARPGROUP.ARRIVE",
                "HGMMA.64x32x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0", "BAR.SYNC.DEFER_BLOCKING 0x0")
    hazards = sass.wgmma_operand_hazards(code)
    assert len(hazards) == 1 and "R40" in hazards[0] and "0x100" in hazards[0]


def test_wait_before_the_overwrite_is_safe():
    code = loop("LDS.U16 R41, [R78+UR4+0x6000]", "WARPGROUP.ARRIVE",
                "HGMMA.64x32x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert sass.wgmma_operand_hazards(code) == []


def test_wide_writes_and_registers_outside_the_operand():
    # A 128-bit load into R36..R39 does not touch the operand R40..R43; one into R38..R41 does.
    clean = loop("LDS.128 R36, [R2]", "HGMMA.64x32x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0", "IADD3 R44, R1, 1, RZ")
    dirty = loop("LDS.128 R38, [R2]", "HGMMA.64x32x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0")
    assert sass.wgmma_operand_hazards(clean) == []
    assert sass.wgmma_operand_hazards(dirty)
    # A store reads its first register (an address), it does not write it.
    store = loop("STS [R40], R2", "HGMMA.64x32x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0")
    assert sass.wgmma_operand_hazards(store) == []


def test_overwrite_after_the_loop_exit_is_found():
    # The MMA that ends the last step is still running when the loop falls through.
    body = loop("LDS.U16 R50, [R78]", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
                "HGMMA.64x32x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0")
    after = [f"        /*{0x200 + 16 * i:04x}*/                   {t} ;"
             for i, t in enumerate(("IMAD.MOV.U32 R42, RZ, RZ, R7", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"))]
    hazards = sass.wgmma_operand_hazards(body + "\n" + "\n".join(after))
    assert len(hazards) == 1 and "0x200" in hazards[0]
    waited = [line.replace("IMAD.MOV.U32 R42, RZ, RZ, R7", "NOP") for line in after]
    assert sass.wgmma_operand_hazards(body + "\n" + "\n".join(waited)) == []


def test_straight_line_code_and_the_end_of_the_kernel():
    lines = ["        /*0100*/                   HGMMA.64x32x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0 ;",
             "        /*0110*/                   EXIT ;",
             "        /*0120*/                   MOV R41, R2 ;"]
    assert sass.wgmma_operand_hazards("\n".join(lines)) == []
    lines[1] = "        /*0110*/                   MOV R41, R2 ;"
    assert sass.wgmma_operand_hazards("\n".join(lines))


def test_unreadable_sass_is_none():
    class NoSass:
        asm = {"ptx": ""}

    class Blank:
        asm = {"sass": "  "}

    class Readable:
        asm = {"sass": "        /*0000*/ EXIT ;"}

    assert sass.kernel_sass(NoSass()) is None
    assert sass.kernel_sass(Blank()) is None
    assert sass.kernel_sass(object()) is None
    assert sass.kernel_sass(Readable()) == Readable.asm["sass"]
