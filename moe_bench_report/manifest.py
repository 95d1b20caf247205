"""The run manifest: what ran where, from which project revision, when, and who launched it.

The timeline comes from the playbook (facts the roles set on each host, handed over as a JSON
object or key=value pairs); nothing here guesses a timestamp. The downtime of the window is
`service ready again - service stopped`.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

from . import REPORT_VERSION
from .figures import downtime_parts, iso_utc, parse_time, seconds_between

MANIFEST_SCHEMA = "moe_bench_report.manifest"

# Facts the roles set on each host (docs/design.md, "The report").
TIMELINE_KEYS = (
    "service_stop_stopped_at",
    "bench_run_async_started_at",
    "bench_run_async_finished_at",
    "service_recover_ready_at",
    "service_recover_time_to_ready_s",
    # The downtime's parts (epoch seconds on the controller; the memory check's own wait).
    "service_stop_issued_epoch",
    "service_stop_stopped_epoch",
    "vram_check_waited_s",
    "bench_run_async_launched_epoch",
    "bench_run_async_finished_epoch",
    "bench_fetch_started_epoch",
    "bench_fetch_finished_epoch",
    "service_recover_start_issued_epoch",
    "service_recover_ready_epoch",
)

# Extra variables AWX (and Tower before it) adds to every job it launches.
AWX_LAUNCH_KEYS = (
    "awx_job_id",
    "awx_job_launch_type",
    "awx_job_template_id",
    "awx_job_template_name",
    "awx_schedule_id",
    "awx_schedule_name",
    "awx_user_name",
    "awx_workflow_job_id",
    "awx_workflow_job_name",
)


def project_revision(project_dir: str | os.PathLike, environ: dict | None = None) -> dict:
    """The project's commit and whether the working tree differs from it.

    A git checkout answers through git. Without .git (an AWX project sync copies the files
    only), AWX's PROJECT_REVISION environment variable names the synced commit; otherwise the
    commit is "unknown".
    """
    environ = os.environ if environ is None else environ
    project_dir = Path(project_dir)
    commit = _git(project_dir, "rev-parse", "--verify", "HEAD")
    if commit:
        status = _git(project_dir, "status", "--porcelain")
        return {"commit": commit, "dirty": bool(status), "source": "git", "path": str(project_dir)}
    if environ.get("PROJECT_REVISION"):
        return {"commit": environ["PROJECT_REVISION"], "dirty": None, "source": "PROJECT_REVISION", "path": str(project_dir)}
    inside_git = _git(project_dir, "rev-parse", "--is-inside-work-tree") == "true"
    return {
        "commit": "unknown",
        "dirty": None,
        "source": "git checkout without commits" if inside_git else "not a git checkout",
        "path": str(project_dir),
    }


def _git(project_dir: Path, *args: str) -> str | None:
    try:
        completed = subprocess.run(
            ["git", "-C", str(project_dir), *args],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if completed.returncode != 0:
        return None
    return completed.stdout.strip()


def launch_info(given: dict, environ: dict | None = None) -> dict:
    """Who launched the run: an AWX job (id, template, schedule, user) or a person by hand."""
    environ = os.environ if environ is None else environ
    values = {key: given.get(key) for key in AWX_LAUNCH_KEYS if given.get(key) not in (None, "")}
    # Tower-era names of the same extra variables.
    for key in AWX_LAUNCH_KEYS:
        tower_key = "tower_" + key[len("awx_"):]
        if key not in values and given.get(tower_key) not in (None, ""):
            values[key] = given[tower_key]
    if "awx_job_id" not in values and environ.get("JOB_ID"):
        values["awx_job_id"] = environ["JOB_ID"]
    if "awx_job_id" in values:
        launch_type = values.get("awx_job_launch_type") or "unknown"
        return {
            "by": "awx",
            "job_id": str(values["awx_job_id"]),
            "launch_type": launch_type,
            "scheduled": launch_type == "scheduled" or "awx_schedule_id" in values,
            "template": values.get("awx_job_template_name"),
            "schedule": values.get("awx_schedule_name"),
            "schedule_id": values.get("awx_schedule_id"),
            "user": values.get("awx_user_name"),
            "workflow_job_id": values.get("awx_workflow_job_id"),
        }
    return {
        "by": "manual",
        "user": given.get("launched_by") or _login_name(environ),
        "controller": given.get("controller") or socket.gethostname(),
    }


def _login_name(environ: dict) -> str:
    for key in ("SUDO_USER", "USER", "LOGNAME"):
        if environ.get(key):
            return environ[key]
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def timeline(given: dict, document: dict | None = None) -> dict:
    """The window's timestamps in UTC, the durations between them, and the downtime itemised
    (the payload's own phases from its results document)."""
    stopped = parse_time(given.get("service_stop_stopped_at"))
    started = parse_time(given.get("bench_run_async_started_at"))
    finished = parse_time(given.get("bench_run_async_finished_at"))
    ready = parse_time(given.get("service_recover_ready_at"))
    time_to_ready = given.get("service_recover_time_to_ready_s")
    try:
        time_to_ready = None if time_to_ready in (None, "") else round(float(time_to_ready), 1)
    except (TypeError, ValueError):
        time_to_ready = None
    return {
        "service_stopped_at": iso_utc(stopped),
        "benchmark_started_at": iso_utc(started),
        "benchmark_finished_at": iso_utc(finished),
        "service_ready_at": iso_utc(ready),
        "downtime_s": seconds_between(stopped, ready),
        "benchmark_s": seconds_between(started, finished),
        "time_to_ready_s": time_to_ready,
        "downtime_parts": downtime_parts(given, (document or {}).get("phases")),
    }


def rehearsal_section(document: dict | None, error: str | None, record: dict | None) -> dict | None:
    """The rehearsal's reduced trend result: fewer experts than the layer, measured beside the
    live service (zero downtime); never comparable with a run of the whole layer."""
    if document is None and error is None and record is None:
        return None
    reduced = (document or {}).get("rehearsal") or (record or {}).get("rehearsal") or {}
    return {
        "reduced": True,
        "note": "fewer experts than the layer, measured beside the live service: a trend, not the layer's figures",
        "outcome": (record or {}).get("outcome") or ((document or {}).get("status")),
        "status": (document or {}).get("status"),
        "error": ((document or {}).get("error") or {}).get("message") or (record or {}).get("error") or error,
        "experts": reduced.get("experts"),
        "layer_experts": reduced.get("layer_experts"),
        "allowed_mib": reduced.get("allowed_mib"),
        "free_mib": reduced.get("free_mib"),
        "gpu_at_start": (document or {}).get("gpu_at_start"),
        "phases": (document or {}).get("phases"),
        "config": (document or {}).get("config"),
        "results": [{"m": row.get("m"), "us": row.get("us"), "us_per_token": row.get("us_per_token"),
                     "pct_of_floor": row.get("pct_of_floor")} for row in (document or {}).get("results") or []],
        "checked_m": [check.get("m") for check in (document or {}).get("correctness") or [] if check.get("ok")],
    }


def validity(given: dict) -> dict:
    """Whether the figures of a run can be trusted. A run during which the host's dead-man timer
    fired had the unit started beside (or before the end of) the benchmark: its figures shared
    the GPU with the model's load, so they are kept but marked invalid."""
    reasons = []
    fired = given.get("deadman_fired")
    if fired is True or str(fired).lower() == "true":
        reasons.append("the dead-man timer fired during the run and started the unit itself "
                       "(the benchmark may have shared the GPU with the model's load)")
    return {"valid": not reasons, "reasons": reasons}


def sha256_of(path: Path) -> str | None:
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_manifest(
    *,
    run_id: str,
    host: str,
    run_dir: Path,
    document: dict | None,
    given: dict,
    project: dict,
    launch: dict,
    generated_at: str,
    rehearsal_document: dict | None = None,
    rehearsal_error: str | None = None,
) -> dict[str, Any]:
    environment = (document or {}).get("environment") or {}
    plan = given.get("moe_bench_plan") if isinstance(given.get("moe_bench_plan"), dict) else None
    fetched = {name: sha256_of(run_dir / name)
               for name in ("results.json", "results.csv", "bench.log", "results-tp.json", "results-tp.csv",
                            "results-tp-phases.csv", "rehearsal.json", "rehearsal.csv", "rehearsal.log")}
    return {
        "schema": MANIFEST_SCHEMA,
        "version": REPORT_VERSION,
        "run_id": run_id,
        "host": host,
        "generated_at": generated_at,
        "project": project,
        "gpu": {
            "name": environment.get("gpu_name"),
            "driver": environment.get("driver"),
            "cuda": environment.get("cuda"),
            "device": environment.get("device"),
            "hostname": environment.get("hostname"),
        },
        "software": {
            "torch": environment.get("torch"),
            "triton": environment.get("triton"),
            "python": environment.get("python"),
        },
        "payload": None
        if document is None
        else {
            "status": document.get("status"),
            "started_at": document.get("started_at"),
            "finished_at": document.get("finished_at"),
            "error": document.get("error"),
            "config": document.get("config"),
            "ceilings": document.get("ceilings"),
            "schema_version": document.get("schema_version"),
            # The GPU as the payload started: a run beside a live service shares it.
            "gpu_at_start": document.get("gpu_at_start"),
        },
        "timeline": timeline(given, document),
        "validity": validity(given),
        "launch": launch,
        "maintenance_window": given.get("maintenance_window") if isinstance(given.get("maintenance_window"), dict) else None,
        "plan": plan,
        "prewarm": given.get("prewarm") if isinstance(given.get("prewarm"), dict) else None,
        "stop": given.get("stop_decision") if isinstance(given.get("stop_decision"), dict) else None,
        "rehearsal": rehearsal_section(rehearsal_document, rehearsal_error,
                                       given.get("rehearsal") if isinstance(given.get("rehearsal"), dict) else None),
        "files_sha256": {name: digest for name, digest in fetched.items() if digest},
    }
