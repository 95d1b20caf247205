"""Shared setup of the payload tests: files/ on sys.path, Triton's interpreter for CPU kernels."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Must precede the first `import triton` anywhere in the session: @triton.jit reads it then.
os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[2]
PAYLOAD_PARENT = REPO_ROOT / "files"
if str(PAYLOAD_PARENT) not in sys.path:
    sys.path.insert(0, str(PAYLOAD_PARENT))

import pytest  # noqa: E402


def payload_env(**extra: str) -> dict:
    """Environment for running `python -m moe_bench` as the hosts do: files/ on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PAYLOAD_PARENT)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


@pytest.fixture
def run_payload():
    """Run the payload the way the playbook does; returns CompletedProcess (text)."""
    import subprocess

    def run(*args: str, timeout: float = 120, env_extra: dict | None = None, path_first: Path | None = None):
        env = payload_env(**(env_extra or {}))
        if path_first is not None:
            env["PYTHONPATH"] = f"{path_first}{os.pathsep}{env['PYTHONPATH']}"
        return subprocess.run([sys.executable, "-m", "moe_bench", *args], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=REPO_ROOT)

    return run


@pytest.fixture
def without_triton(tmp_path):
    """A folder to put first on PYTHONPATH so that `import triton` fails as on a host without it."""
    folder = tmp_path / "no_triton"
    folder.mkdir()
    (folder / "triton.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'triton'\", name='triton')\n"
    )
    return folder
