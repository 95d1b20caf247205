"""The README documents every operator variable and the two set-up commands."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def test_variables_section_matches_the_argument_specs():
    generated = subprocess.run(
        [sys.executable, str(ROOT / "scripts/variables-table")], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert generated.count("\n") > 20
    assert generated in _section("Variables"), (
        "README's variable table is out of date: paste the output of scripts/variables-table"
    )


def test_readme_names_exactly_two_setup_commands_and_make_has_them():
    block = re.search(r"^## Two commands\n.*?```sh\n(.*?)```", README, re.S | re.M)
    assert block, "README lost its 'Two commands' block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
