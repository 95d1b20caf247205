"""The results file: one versioned JSON document, written after every M, and its one loader.

The payload writes it (ResultsWriter); the report, the run history and AWX's set_stats read
it through load_results(), which upgrades every older schema_version to the current one, so
a reader only ever sees the current layout.

Writes are atomic (temporary file in the same folder, fsync, rename): a crash or a SIGKILL at
any moment leaves either the previous complete document or the new one on disk, never a
half-written file. The CSV beside it (same stem, .csv) carries the per-M rows; a tensor-parallel
run (--tp-ranks) also writes its per-phase rows to STEM-phases.csv.

Version 2 added the tensor-parallel layer: config.tp_ranks, the `tp` section (ranks, the
collective backend, the devices) and `tp_results` (per M: the shard's MoE, the all-reduce and
the whole layer, and the all-reduce's bus bandwidth); correctness checks name their worst row.
In a tensor-parallel run `results` holds the shard's MoE per M (the slowest rank's), so every
reader of `results` keeps working.

Version 3 added `phases`: where the payload process spent its time, in seconds from the process's
start (PHASE_FIELDS), written through as each phase ends, so the downtime's benchmark part can be
itemised from the payload's own clock. Older documents read with `phases` None.
Version 4 added `gpu_at_start` (the GPU's utilisation and memory as the run starts, from nvidia-smi;
None off CUDA) and `rehearsal` (None for a run of the whole layer; for `--rehearse`, the reduced run
beside the live service: {"reduced": true, "layer_experts", "experts" held, "smallest_experts",
"need_mib", "allowed_mib", "free_mib", "budget_mib"}). Older documents read with both None.

Only the standard library is imported here, so the controller can load results without torch.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

SCHEMA_NAME = "moe_bench.results"
SCHEMA_VERSION = 4

STATUSES = ("running", "complete", "failed")
ERROR_KINDS = ("environment", "correctness", "runtime", "no-room")  # no-room: --rehearse only

# Columns of one timed M, in the order the CSV shows them.
RESULT_FIELDS = (
    "m",
    "us",
    "us_p20",
    "us_p80",
    "us_per_token",
    "bytes",
    "flops",
    "gbps",
    "tflops",
    "floor_us",
    "pct_of_floor",
    "compile_s",
    "distinct_experts",
)

ENVIRONMENT_FIELDS = ("hostname", "gpu_name", "driver", "cuda", "torch", "triton", "python", "device")
CONFIG_FIELDS = (
    "preset",
    "experts",
    "hidden",
    "inter",
    "topk",
    "group_size",
    "tp",
    "backend",
    "dtype",
    "m_list",
    "seed",
    "tp_ranks",  # None: one device; N: the layer over N ranks (each holding the --tp N shard)
)

# Columns of one M of a tensor-parallel run, in the order STEM-phases.csv shows them. Times are the
# slowest rank's medians (the layer waits for it); the all-reduce moves allreduce_bytes per rank.
# algbw = bytes / time; busbw = algbw * 2 (n - 1) / n, nccl-tests' bus bandwidth of an
# all-reduce (the traffic each link carries in a ring), comparable across rank counts.
TP_RESULT_FIELDS = (
    "m",
    "ranks",
    "layer_us",
    "layer_us_p20",
    "layer_us_p80",
    "moe_us",
    "moe_us_p20",
    "moe_us_p80",
    "allreduce_us",
    "allreduce_us_p20",
    "allreduce_us_p80",
    "allreduce_bytes",
    "algbw_gbps",
    "busbw_gbps",
    "moe_us_by_rank",
    "allreduce_us_by_rank",
    "samples",
)
# The payload process's phases, in the order they run (seconds each): importing torch and the
# backend's packages, opening the device and measuring its ceilings, building the weights and
# preparing the backend, the correctness check, and the timed M values. The first calls that
# compile (the check's and each M's untimed first call) are inside check_s and timing_s and summed
# in compile_s (as compile_seconds); first_result_s is the process's age at its first timed figure,
# process_s its age when the document was last written.
PHASE_FIELDS = ("import_s", "device_s", "weights_s", "check_s", "timing_s")
PHASE_SUMMARY_FIELDS = ("compile_s", "first_result_s", "process_s")

TOP_LEVEL_FIELDS = (
    "schema",
    "schema_version",
    "status",
    "started_at",
    "finished_at",
    "error",
    "environment",
    "config",
    "ceilings",
    "correctness",
    "compile_seconds",
    "results",
)


class ResultsFormatError(ValueError):
    """A results file that is not a moe_bench results document this loader can read."""


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def csv_path_for(json_path: str | os.PathLike) -> Path:
    """The CSV that lives beside a results JSON: same folder, same stem, .csv."""
    return Path(json_path).with_suffix(".csv")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Replace `path` with `text` so that readers see the old or the new file, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as tmp:
            tmp.write(text)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    # The rename itself is durable only once the folder is synced.
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def phases_csv_path_for(json_path: str | os.PathLike) -> Path:
    """The per-phase CSV of a tensor-parallel run: same folder, STEM-phases.csv."""
    path = Path(json_path)
    return path.with_name(f"{path.stem}-phases.csv")


def results_csv_text(rows: list[dict[str, Any]], fields: tuple[str, ...] = RESULT_FIELDS) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(fields), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({field: _csv_cell(row.get(field)) for field in fields})
    return buffer.getvalue()


def _csv_cell(value):
    # Per-rank lists as one cell a spreadsheet keeps whole: 12.5;13.1
    if isinstance(value, list):
        return ";".join(str(item) for item in value)
    return value


def new_document(environment: dict, config: dict, ceilings: dict | None = None) -> dict:
    return {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "status": "running",
        "started_at": utc_now(),
        "finished_at": None,
        "error": None,
        "environment": {field: environment.get(field) for field in ENVIRONMENT_FIELDS},
        "config": {field: config.get(field) for field in CONFIG_FIELDS},
        "ceilings": ceilings,
        "correctness": [],
        "compile_seconds": 0.0,
        "timing": None,
        "results": [],
        "tp": None,
        "tp_results": [],
        "phases": {},
        "gpu_at_start": None,
        "rehearsal": None,
    }


class ResultsWriter:
    """Owns one run's results JSON + CSV; every mutation is written through at once."""

    def __init__(self, path: str | os.PathLike | None, environment: dict, config: dict, ceilings: dict | None = None):
        # path None keeps the document in memory only (a run without --out).
        self.path = Path(path) if path is not None else None
        self.document = new_document(environment, config, ceilings)
        self.write()

    @property
    def csv_path(self) -> Path | None:
        return csv_path_for(self.path) if self.path is not None else None

    def write(self) -> None:
        # The CSVs first, the JSON (the document of record) last: a process killed between two
        # writes leaves CSV rows for every M the JSON calls completed, never fewer.
        if self.path is None:
            return
        atomic_write_text(self.csv_path, results_csv_text(self.document["results"]))
        if self.document["tp"] is not None:
            atomic_write_text(phases_csv_path_for(self.path), results_csv_text(self.document["tp_results"], TP_RESULT_FIELDS))
        atomic_write_text(self.path, json.dumps(self.document, indent=2, sort_keys=False) + "\n")

    def set_environment(self, environment: dict) -> None:
        self.document["environment"] = {field: environment.get(field) for field in ENVIRONMENT_FIELDS}
        self.write()

    def set_ceilings(self, ceilings: dict) -> None:
        self.document["ceilings"] = dict(ceilings)
        self.write()

    def set_timing(self, timing: dict) -> None:
        """How the figures were taken: method (cuda-graph, cuda-events-eager, cpu-perf-counter),
        routings rotated, notes such as a graph capture that fell back to eager timing."""
        self.document["timing"] = dict(timing)
        self.write()

    def set_config(self, config: dict) -> None:
        self.document["config"] = {field: config.get(field) for field in CONFIG_FIELDS}
        self.write()

    def set_gpu_at_start(self, gpu: dict | None) -> None:
        self.document["gpu_at_start"] = gpu
        self.write()

    def set_rehearsal(self, rehearsal: dict | None) -> None:
        self.document["rehearsal"] = None if rehearsal is None else dict(rehearsal)
        self.write()

    def set_phase(self, name: str, seconds: float, process_s: float) -> None:
        """One phase ended (PHASE_FIELDS): its seconds and the process's age now."""
        if name not in PHASE_FIELDS:
            raise ValueError(f"unknown phase {name!r}")
        phases = self.document["phases"]
        phases[name] = round(float(seconds), 3)
        phases["compile_s"] = self.document["compile_seconds"]
        phases["process_s"] = round(float(process_s), 3)
        self.write()

    def set_first_result(self, process_s: float) -> None:
        """The process's age at its first timed figure (kept from the first call)."""
        self.document["phases"].setdefault("first_result_s", round(float(process_s), 3))
        self.document["phases"]["process_s"] = round(float(process_s), 3)
        self.write()

    def add_correctness(self, check: dict) -> None:
        self.document["correctness"].append(dict(check))
        self._update_compile_seconds()
        self.write()

    def add_result(self, row: dict) -> None:
        missing = [field for field in RESULT_FIELDS if field not in row]
        if missing:
            raise ValueError(f"result row lacks {missing}")
        self.document["results"].append({field: row[field] for field in RESULT_FIELDS})
        self._update_compile_seconds()
        self.write()

    def set_tp(self, tp: dict) -> None:
        """The tensor-parallel run's set-up: ranks, collective backend, devices, environment."""
        self.document["tp"] = dict(tp)
        self.write()

    def add_tp_result(self, row: dict) -> None:
        missing = [field for field in TP_RESULT_FIELDS if field not in row]
        if missing:
            raise ValueError(f"tensor-parallel result row lacks {missing}")
        self.document["tp_results"].append({field: row[field] for field in TP_RESULT_FIELDS})
        self.write()

    def _update_compile_seconds(self) -> None:
        # First calls compile: the correctness check's (one per tile config, before timing) and
        # each timed M's untimed first call.
        seconds = sum(float(check.get("call_s") or 0.0) for check in self.document["correctness"])
        seconds += sum(float(row["compile_s"] or 0.0) for row in self.document["results"])
        self.document["compile_seconds"] = round(seconds, 3)

    def complete(self) -> None:
        self.document["status"] = "complete"
        self.document["finished_at"] = utc_now()
        self.write()

    def fail(self, kind: str, message: str, exit_code: int) -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown error kind {kind!r}")
        self.document["status"] = "failed"
        self.document["finished_at"] = utc_now()
        self.document["error"] = {"kind": kind, "message": message, "exit_code": exit_code}
        self.write()


# Upgrades from version N to N + 1, applied in order by load_results. A schema change adds one
# entry here and bumps SCHEMA_VERSION; old files on controllers keep loading.
def _v1_to_v2(document: dict) -> dict:
    """Version 1 had no tensor-parallel run and judged correctness by one norm only."""
    document.setdefault("tp", None)
    document.setdefault("tp_results", [])
    if isinstance(document.get("config"), dict):
        document["config"].setdefault("tp_ranks", None)
    for check in document.get("correctness") or []:
        check.setdefault("worst_row_rel_err", None)
        check.setdefault("worst_row", None)
    return document


def _v2_to_v3(document: dict) -> dict:
    """Version 2 did not record the process's phases."""
    document.setdefault("phases", None)
    return document


def _v3_to_v4(document: dict) -> dict:
    """Version 3 had no rehearsal (fewer experts than the layer, beside the live service) and
    did not record the GPU's utilisation and memory at the start."""
    document.setdefault("gpu_at_start", None)
    document.setdefault("rehearsal", None)
    return document


_UPGRADES: dict[int, Callable[[dict], dict]] = {1: _v1_to_v2, 2: _v2_to_v3, 3: _v3_to_v4}


def upgrade_document(document: dict) -> dict:
    """Bring a parsed results document to SCHEMA_VERSION; raise ResultsFormatError if impossible."""
    if not isinstance(document, dict) or document.get("schema") != SCHEMA_NAME:
        raise ResultsFormatError(f"not a {SCHEMA_NAME} document (schema={document.get('schema') if isinstance(document, dict) else None!r})")
    version = document.get("schema_version")
    if not isinstance(version, int) or version < 1:
        raise ResultsFormatError(f"bad schema_version {version!r}")
    if version > SCHEMA_VERSION:
        raise ResultsFormatError(
            f"schema_version {version} is newer than this loader ({SCHEMA_VERSION}); update files/moe_bench on the controller"
        )
    while version < SCHEMA_VERSION:
        document = _UPGRADES[version](document)
        version += 1
        document["schema_version"] = version
    document.setdefault("timing", None)  # optional: absent in documents of interrupted early runs
    missing = [field for field in TOP_LEVEL_FIELDS if field not in document]
    if missing:
        raise ResultsFormatError(f"results document lacks {missing}")
    if document["status"] not in STATUSES:
        raise ResultsFormatError(f"unknown status {document['status']!r}")
    for row in document["results"]:
        lacking = [field for field in RESULT_FIELDS if field not in row]
        if lacking:
            raise ResultsFormatError(f"result row for m={row.get('m')!r} lacks {lacking}")
    for row in document.get("tp_results") or []:
        lacking = [field for field in TP_RESULT_FIELDS if field not in row]
        if lacking:
            raise ResultsFormatError(f"tensor-parallel result row for m={row.get('m')!r} lacks {lacking}")
    return document


def load_results(path: str | os.PathLike) -> dict:
    """Read a results JSON of any known schema_version, returned in the current layout.

    Adds `completed_m` (the M values timed so far) and `total_m` (how many were asked for), the
    two numbers a progress display needs.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ResultsFormatError(f"{path}: not valid JSON ({error})") from None
    try:
        document = upgrade_document(document)
    except ResultsFormatError as error:
        raise ResultsFormatError(f"{path}: {error}") from None
    document["completed_m"] = [row["m"] for row in document["results"]]
    m_list = (document.get("config") or {}).get("m_list") or []
    document["total_m"] = len(m_list)
    return document
