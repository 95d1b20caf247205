"""tools/compile_check.py's portability check (issue 17, item 5), without a GPU.

The fast test compiles every configuration kimi-k2.6's table uses on every architecture the
tool knows of the five issue 17 names, plus mixtral-8x7b's (another expert count and top-k,
so other kernel constants) on sm_90: about 45 compiles, about a minute on two cores. The whole
check (every preset at --tp 1 and 8, about 160 compiles) runs with MOE_BENCH_FULL_COMPILE_CHECK=1
or as `make compile-check`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_bench import gluon_moe

REPO_ROOT = Path(__file__).resolve().parents[2]
ARCHS = "sm_80,sm_89,sm_90,sm_100,sm_120"


def _triton_nvidia_tools() -> bool:
    try:
        import triton
    except ImportError:
        return False
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return (tools / "ptxas").exists() and (tools / "cuobjdump").exists()


pytestmark = pytest.mark.skipif(not _triton_nvidia_tools(), reason="Triton with its NVIDIA backend tools is needed")


# The lowest Triton the payload supports (the GPU host's), installed beside the venv's own by
# scripts/bootstrap (requirements/triton-floor.txt).
TRITON_FLOOR_DIR = REPO_ROOT / ".venv-payload" / "triton-floor"
TRITON_FLOOR_VERSION = next(line.split("==")[1].strip() for line in
                            (REPO_ROOT / "requirements" / "triton-floor.txt").read_text().splitlines()
                            if line.startswith("triton=="))


def _tool_env(triton_floor: bool = False) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the tool compiles for real GPU targets
    paths = [str(REPO_ROOT / "files"), str(REPO_ROOT / "tools")]
    env["PYTHONPATH"] = os.pathsep.join(([str(TRITON_FLOOR_DIR)] if triton_floor else []) + paths)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default, stated (newer Triton warns otherwise)
    return env


def run_check(*args: str, timeout: float = 900, triton_floor: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "compile_check.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=_tool_env(triton_floor), cwd=REPO_ROOT)


def run_code(code: str, timeout: float) -> subprocess.CompletedProcess:
    """Python code against the tool's module, in a process of its own: this one runs Triton's
    interpreter (conftest.py), which does not compile."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                            env=_tool_env(), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _assert_clean(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " 0 failed" in result.stdout
    assert "FAIL" not in result.stdout


@pytest.mark.parametrize("triton_floor", [False, True], ids=["installed-triton", "triton-floor"])
def test_kimi_table_compiles_and_fits_on_every_architecture(triton_floor):
    """With the venv's Triton and with the lowest the payload supports (the GPU host's): each
    release's ptxas allocates registers its own way (Triton 3.6's spilled mixtral-8x7b's block_m 8
    GEMM1 on sm_90 where 3.9's did not, PERFORMANCE.md round 33)."""
    if triton_floor and not (TRITON_FLOOR_DIR / "triton").is_dir():
        pytest.skip(f"Triton {TRITON_FLOOR_VERSION} is not at {TRITON_FLOOR_DIR}: run scripts/bootstrap")
    jobs = str(min(2, os.cpu_count() or 1))
    result = run_check("--arch", ARCHS, "--preset", "kimi-k2.6", "--tp", "1", "--jobs", jobs, triton_floor=triton_floor)
    _assert_clean(result)
    if triton_floor:
        assert result.stdout.startswith(f"triton {TRITON_FLOOR_VERSION}:"), result.stdout[:200]
    # The Gluon path: compiled and checked on sm_90, reported (not dropped) everywhere else.
    gluon = [line for line in result.stdout.splitlines() if "Gluon warp-specialised" in line]
    per_arch = 2 * len(gluon_moe.tile_sets())  # both GEMMs, each tile set the path ships
    assert len(gluon) == per_arch * 5, result.stdout[-3000:]
    for arch in ("sm_80", "sm_89", "sm_100", "sm_120"):
        assert sum(line.startswith(f"n/a  {arch} ") for line in gluon) == per_arch, gluon
    sm90 = [line for line in gluon if " sm_90 " in f" {line}"]
    assert all(line.startswith("ok") or line.startswith("n/a") for line in sm90), sm90
    assert "not applicable on their architecture" in result.stdout
    # The block_m 8 rows (inline-PTX mma.sync): both GEMMs compiled and fitting on every architecture.
    mma8 = [line for line in result.stdout.splitlines() if " mma8 " in line]
    for arch in ARCHS.split(","):
        assert sum(line.startswith(f"ok   {arch} GEMM") for line in mma8) == 2, mma8
    _assert_clean(run_check("--arch", "sm_90", "--preset", "mixtral-8x7b", "--tp", "1", "--jobs", jobs,
                            triton_floor=triton_floor))


# Minutes on 2 cores: left out of `make test` by its marker (the payload phase runs
# -m "not full_compile_check"); `make compile-check` runs the same check as its own target.
@pytest.mark.full_compile_check
def test_every_preset_compiles_and_fits_on_every_architecture():
    _assert_clean(run_check("--arch", ARCHS, "--preset", "all", "--jobs", str(os.cpu_count() or 1), timeout=3600))


def test_a_configuration_over_the_shared_memory_of_an_architecture_fails():
    code = (
        "import json, compile_check\n"
        "deep = dict(bn=128, bk=128, warps=4, stages=6, post=False, whole=True, swap=True, split=1, asm=True)\n"
        "job = dict(arch=120, which=2, block_m=64, g=deep, group=32, topk=8, num_bins=512, k=0, overlap=False,\n"
        "           by_expert=None, used_by=['a made-up row'])\n"
        "print(json.dumps(compile_check.check_job(job)['problems']))\n"
    )
    result = run_code(code, timeout=300)
    problems = result.stdout.strip().splitlines()[-1]
    assert "shared memory" in problems and "over sm_120" in problems, problems


def test_unknown_architecture_and_preset_are_refused():
    result = run_check("--arch", "sm_70", "--preset", "all")
    assert result.returncode == 2 and "unknown architecture" in result.stderr
    result = run_check("--preset", "no-such-model")
    assert result.returncode == 2 and "unknown preset" in result.stderr




@pytest.mark.parametrize("arch, pdl", [(90, True), (100, True), (80, False)])
def test_the_compiled_forms_wait_for_the_kernel_before_where_pdl_runs(arch, pdl):
    """From sm_90 the check compiles the kernels as the backend launches them there, with
    programmatic dependent launch: each waits for the kernel before it (griddepcontrol.wait)
    and lets the next one launch; before sm_90 neither instruction is there."""
    code = (
        "import sys; sys.path[:0] = ['files', 'tools']\n"
        "import compile_check as cc\n"
        "from moe_bench import triton_moe as tm\n"
        "from triton.backends.compiler import GPUTarget\n"
        f"t = GPUTarget('cuda', {arch}, 32)\n"
        "for k in (cc.compile_gemv(2, tm.ONE_ROW['g2'], target=t), cc.compile_mma8(1, tm.MMA8['g1'], target=t),\n"
        "          cc.compile_gemm(2, 16, tm.TENSOR_BM16['g2'], target=t, overlap=False)):\n"
        "    ptx = k.asm['ptx']\n"
        "    print(int('griddepcontrol.wait' in ptx), int('griddepcontrol.launch_dependents' in ptx))\n")
    result = run_code(code, timeout=600)
    expected = "1 1" if pdl else "0 0"
    assert result.stdout.split("\n")[:3] == [expected] * 3, result.stdout


@pytest.mark.parametrize("arch", [80, 90, 120])
def test_the_grouping_count_hands_its_rows_to_the_last_program_in_order(arch):
    """The grouping's count in several programs (_align_kernel) compiled for a GPU: every
    thread's row stored before the ticket (a block barrier, then one gpu-scope acquire-release
    atomic), the rows read back past L1 (ld.global.cg), the ticket set back to 0; the
    one-program form takes no ticket. The interpreter runs programs one after another, so only
    the compiled form shows this ordering. The scatter after it compiles too, with the block
    table's stores at block_m 16 and 64 and without them at 8."""
    code = (
        "import json, re, sys; sys.path[:0] = ['files', 'tools']\n"
        "import compile_check as cc\n"
        "from triton.backends.compiler import GPUTarget\n"
        f"t = GPUTarget('cuda', {arch}, 32)\n"
        "out = []\n"
        "for one in (False, True):\n"
        "    ptx = cc.compile_align(one, target=t).asm['ptx']\n"
        "    ticket = [i for i, l in enumerate(ptx.splitlines()) if re.search(r'atom\\.global\\S*\\.add', l)]\n"
        "    lines = ptx.splitlines()\n"
        "    out.append(dict(tickets=[lines[i].split()[1] if lines[i].split()[0].startswith('@') else lines[i].split()[0]\n"
        "                             for i in ticket],\n"
        "                    barrier_before=[any('bar.sync' in l for l in lines[max(0, i - 12): i]) for i in ticket],\n"
        "                    cg='ld.global.cg' in ptx))\n"
        "stores = [len(re.findall(r'st\\.global', cc.compile_scatter(bm, target=t).asm['ptx'])) for bm in (8, 16, 64)]\n"
        "print(json.dumps(out + [stores]))\n")
    many, one, stores = json.loads(run_code(code, timeout=300).stdout.strip().splitlines()[-1])
    assert len(many["tickets"]) == 1, many
    assert "acq_rel" in many["tickets"][0] and ".gpu" in many["tickets"][0], many
    assert many["barrier_before"] == [True] and many["cg"], many
    assert one["tickets"] == [] and not one["cg"], one
    # The scatter writes the block table for blocks of 16 rows and more, not for the block_m 8 rows.
    assert stores[1] == stores[2] > stores[0] > 0, stores


def test_split_one_row_gemms_are_compiled_as_launched_with_16_byte_loads():
    """The --tp 8 shards' GEMM1 at M=1-2 runs in 2 K slices on an H100/H200 (fit_to_device): the
    check compiles it so (the split the launch takes at that K, named in the label), and the
    split kernel loads its weights 16 bytes at a time like the unsplit one (the slice bounds
    are said to be multiples of the step; without that the loads fall to 4 bytes)."""
    code = (
        "import json, re, sys; sys.path[:0] = ['files', 'tools']\n"
        "import compile_check as cc\n"
        "jobs = cc.portability_jobs([90], cc.shapes_for(['kimi-k2.6'], [8]))\n"
        "g1 = [j for j in jobs if j.get('which') == 1 and j['g'].get('gemv') and 'kimi-k2.6 tp8 M=1' in j['used_by']]\n"
        "label = cc.check_job(dict(g1[0], used_by=list(g1[0]['used_by'])))['label']\n"
        "wide = [len(re.findall(r'LDG\\.E\\.128', cc.describe(cc.compile_gemv(1, dict(g1[0]['g'], split=s)))['sass']))\n"
        "        for s in (1, g1[0]['g']['split'])]\n"
        "print(json.dumps([len(g1), g1[0]['g']['split'], g1[0]['used_by'], label, wide]))\n")
    count, split, used_by, label, wide = json.loads(run_code(code, timeout=600).stdout.strip().splitlines()[-1])
    assert count == 1 and split == 2
    assert used_by == ["kimi-k2.6 tp8 M=1", "kimi-k2.6 tp8 M=2"]
    assert "split=2" in label
    assert wide[0] > 0 and wide[1] == wide[0], wide


def test_serialised_warp_group_mmas_are_a_problem():
    # Nothing is compiled: the counts are the Gluon
    # GEMM1's as shipped (96 HGMMA, 12 waits) and with its MMAs left in flight across the K loop's
    # back edge, which ptxas serialised (a wait after each: PERFORMANCE.md round 24).
    code = (
        "import json, compile_check as cc\n"
        "print(json.dumps([cc.wgmma_serialised({'HGMMA': 96, 'WARPGROUP.DEPBAR': 12}),\n"
        "                  cc.wgmma_serialised({'HGMMA': 96, 'WARPGROUP.DEPBAR': 96}),\n"
        "                  cc.wgmma_serialised({'HMMA': 16})]))\n"
    )
    result = run_code(code, timeout=120)
    shipped, serialised, no_wgmma = json.loads(result.stdout.strip().splitlines()[-1])
    assert shipped is None and no_wgmma is None
    assert "serialised" in serialised and "96 waits for 96 HGMMA" in serialised


def test_the_check_compiles_the_histogram_bins_the_backend_launches():
    """The kernels that find a block's expert take NUM_BINS as a constant: the check compiles
    the count the backend launches with (triton_moe.num_bins), at least MIN_BINS even where a
    layer has few experts (mixtral-8x7b's 8: with 16 bins its block_m 8 GEMM1 spilled on sm_90
    with Triton 3.6, PERFORMANCE.md round 33)."""
    code = (
        "import json, sys; sys.path[:0] = ['files', 'tools']\n"
        "import compile_check as cc\n"
        "from moe_bench import triton_moe as tm\n"
        "shapes = cc.shapes_for(['mixtral-8x7b', 'kimi-k2.6'], [1])\n"
        "jobs = cc.portability_jobs([90], shapes)\n"
        "print(json.dumps([sorted({j['num_bins'] for j in jobs if 'num_bins' in j and any(label in u for u in j['used_by'])})\n"
        "                  for label, _ in shapes] + [[tm.num_bins(shape) for _, shape in shapes], tm.MIN_BINS]))\n")
    mixtral, kimi, launched, least = json.loads(run_code(code, timeout=300).stdout.strip().splitlines()[-1])
    assert least == 128
    assert launched == [128, 512]
    assert mixtral == [128] and kimi == [512]
