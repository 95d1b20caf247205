"""Shared helpers of the report tests: the results fixture and runs derived from it."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "files") not in sys.path:
    sys.path.insert(0, str(REPO / "files"))
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FIXTURES = REPO / "tests" / "fixtures"
# One real run of the payload on an H200 (Triton kernel), and one of the torch backend on the
# same GPU: the report is tested on what the payload really writes.
REAL_H200 = FIXTURES / "h200" / "h200_kimi-k2.6_triton.json"
REAL_H200_TORCH = FIXTURES / "h200" / "h200_kimi-k2.6_torch.json"


def results_fixture() -> Path:
    return REAL_H200


def load_fixture_document() -> dict:
    return json.loads(results_fixture().read_text(encoding="utf-8"))


def slowed(document: dict, m: int, factor: float, started_at: str | None = None) -> dict:
    """A copy of a results document whose M=`m` took `factor` times as long, every derived
    figure of that row (per token, GB/s, TFLOP/s, % of floor) recomputed to match."""
    changed = copy.deepcopy(document)
    if started_at is not None:
        changed["started_at"] = started_at
    rows = [row for row in changed["results"] if row["m"] == m]
    assert rows, f"the fixture has no M={m}"
    for row in rows:
        for key in ("us", "us_p20", "us_p80"):
            row[key] = row[key] * factor
        row["us_per_token"] = row["us"] / row["m"]
        row["gbps"] = row["bytes"] / (row["us"] * 1e-6) / 1e9
        row["tflops"] = row["flops"] / (row["us"] * 1e-6) / 1e12
        row["pct_of_floor"] = row["floor_us"] / row["us"] * 100.0
    return changed


def write_run(results_root: Path, host: str, run_id: str, document: dict | None) -> Path:
    run_dir = results_root / host / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    if document is not None:
        (run_dir / "results.json").write_text(json.dumps(document, indent=2), encoding="utf-8")
    return run_dir
