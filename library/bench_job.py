#!/usr/bin/python
# -*- coding: utf-8 -*-
"""Ansible module bench_job: status and progress of the benchmark payload's async job."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: bench_job
short_description: Status and progress of the benchmark's async job, for an until loop
description:
  - Reads the status file that Ansible's async wrapper keeps for a job launched with C(async) and
    C(poll=0) (C(<async_dir>/<jid>)), the same way C(ansible.builtin.async_status) does, and adds the
    benchmark's own progress - the last C([moe_bench]) line of its log and the number of batch sizes
    (M) done according to its results JSON.
  - Returns RV(finished) so that C(until) with the C(finished) test works, and RV(moe_bench_progress),
    which the C(moe_bench_progress) callback prints while the task retries.
  - Never fails because the job failed; the caller decides (RV(job_failed), RV(exit_code), RV(log_tail)).
  - The payload's exit code is returned as RV(exit_code), not C(rc), because Ansible marks any result
    carrying a non-zero C(rc) as failed.
  - A missing job file is reported as RV(job_missing) and counts as finished, since polling it again
    cannot help.
  - With O(wait_s) it long-polls - looks at the job's status file a few times a second for up to
    O(wait_s) seconds and returns as soon as the job has finished, so a C(until) loop with C(delay 0)
    notices the end within a fraction of a second instead of at its next poll, and still returns
    the latest progress line every O(wait_s) seconds while the job runs.
version_added: "1.0.0"
author:
  - moe-bench-ops maintainers
options:
  jid:
    description: The job id returned by the launching task (C(ansible_job_id)).
    type: str
    required: true
  async_dir:
    description: The absolute C(ansible_async_dir) the job was launched with.
    type: path
    required: true
  log:
    description: The payload's log file (stdout and stderr).
    type: path
  results:
    description: The payload's results JSON, written after every M.
    type: path
  tail_lines:
    description: Lines of the log returned in RV(log_tail) when the job failed.
    type: int
    default: 30
  wait_s:
    description:
      - Long poll - keep looking for up to this many seconds and return as soon as the job has
        finished (or its status file is missing). V(0) looks once.
    type: float
    default: 0
  check_interval_s:
    description: Seconds between two looks at the status file while O(wait_s) runs.
    type: float
    default: 0.25
  record_file:
    description:
      - A file that keeps O(record) on the host (the job id for a later controller to re-attach
        to). Written before the first look, atomically (a temporary file renamed over it), mode
        0600, only when it does not exist yet - a re-attached run keeps the first record. Saves
        the launching run a separate write between the launch and the first poll.
    type: path
  record:
    description: What O(record_file) keeps (JSON); required with O(record_file).
    type: dict
notes:
  - Supports check mode - it only reads then (no O(record_file) is written).
seealso:
  - module: ansible.builtin.async_status
"""

EXAMPLES = r"""
- name: Wait for the benchmark and show which M runs (long poll - noticed within a second)
  bench_job:
    jid: "{{ launch.ansible_job_id }}"
    async_dir: /var/lib/moe-bench/async
    log: /var/lib/moe-bench/runs/{{ run_id }}/bench.log
    results: /var/lib/moe-bench/runs/{{ run_id }}/results.json
    wait_s: "{{ plan.poll_interval_s }}"
  register: job
  until: job is finished
  retries: "{{ plan.poll_retries }}"
  delay: 0

- name: Fail with the payload's exit code and log tail
  ansible.builtin.fail:
    msg: "benchmark exited {{ job.exit_code }}: {{ job.log_tail }}"
  when: job.job_failed
"""

RETURN = r"""
finished:
  description: True when the job has ended (successfully or not) or its status file is missing.
  returned: always
  type: bool
started:
  description: True when the job has started.
  returned: always
  type: bool
ansible_job_id:
  description: The job id.
  returned: always
  type: str
job_missing:
  description: No status file for this job id in O(async_dir).
  returned: always
  type: bool
job_failed:
  description: The job ended with a non-zero exit code, was killed at its time limit, or its status file is missing.
  returned: always
  type: bool
timed_out:
  description: The async wrapper killed the job at its time limit.
  returned: always
  type: bool
exit_code:
  description: The payload's exit code (null while running, or when it was killed before exiting).
  returned: always
  type: int
job_msg:
  description: The message of the job's final record (for example C(Timeout exceeded)), else null.
  returned: always
  type: str
progress:
  description: The last C([moe_bench]) line of the log, or a sentence on the job's state when there is none.
  returned: always
  type: str
  sample: "[moe_bench] M=256 (9/12) 2204.1 us 8.61 us/token 52.3% of floor elapsed 123.4 s"
moe_bench_progress:
  description: Same as RV(progress); the key the progress callback prints.
  returned: always
  type: str
completed_m:
  description: Number of M values with a result in the results JSON (null when it cannot be read).
  returned: always
  type: int
total_m:
  description: Number of M values the run was asked for (C(config.m_list)), null when unknown.
  returned: always
  type: int
results_status:
  description: The C(status) field of the results JSON (running, complete, failed), null when unknown.
  returned: always
  type: str
log_tail:
  description: The last O(tail_lines) lines of the log when the job failed, else an empty string.
  returned: always
  type: str
waited_s:
  description: Seconds this call waited on the host (at most O(wait_s)).
  returned: always
  type: float
record_written:
  description: Whether this call wrote O(record_file) (false when it existed or none was asked for).
  returned: always
  type: bool
"""

import json
import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.common.text.converters import to_text
from ansible.module_utils.run_files import write_private

PROGRESS_PREFIX = "[moe_bench]"
# Progress lines are short; the end of the log is enough and keeps each poll cheap on a long log.
_LOG_READ_BYTES = 256 * 1024


def read_job_status(path):
    """Read an async status file as async_status does: (job_missing, record dict).

    The record is {"started": True, "finished": False} while the file is empty or partly
    written (the wrapper writes it with a rename, but a copy may be mid-way), and the
    module's final result once the job ended (a record without "started" is final).
    """
    if not os.path.exists(path):
        return True, {}
    try:
        with open(path) as status_file:
            text = status_file.read()
        record = json.loads(text)
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
    except (ValueError, IOError, OSError):
        return False, {"started": True, "finished": False}
    if "started" not in record:
        record["finished"] = True
    elif "finished" not in record:
        record["finished"] = False
    return False, record


def read_log_end(path):
    """The last lines of the log (decoded leniently), [] when there is no log."""
    if not path or not os.path.exists(path):
        return []
    with open(path, "rb") as log_file:
        log_file.seek(0, os.SEEK_END)
        size = log_file.tell()
        log_file.seek(max(0, size - _LOG_READ_BYTES))
        data = log_file.read()
    lines = to_text(data, errors="surrogate_or_replace").replace("\r", "\n").splitlines()
    if size > _LOG_READ_BYTES and lines:
        lines = lines[1:]  # the first line read is probably cut
    return lines


def last_progress_line(lines):
    for line in reversed(lines):
        stripped = line.strip()
        if stripped.startswith(PROGRESS_PREFIX):
            return stripped
    return None


def results_progress(path):
    """(completed_m, total_m, status) from the payload's results JSON; None for what cannot be read.

    The payload replaces the file atomically, but a copy or an older payload may leave a
    partial file; that only means no count this time.
    """
    if not path or not os.path.exists(path):
        return None, None, None
    try:
        with open(path) as results_file:
            document = json.load(results_file)
    except (ValueError, IOError, OSError):
        return None, None, None
    if not isinstance(document, dict):
        return None, None, None
    results = document.get("results")
    completed = len(results) if isinstance(results, list) else None
    config = document.get("config") if isinstance(document.get("config"), dict) else {}
    m_list = config.get("m_list")
    total = len(m_list) if isinstance(m_list, list) else None
    status = document.get("status") if isinstance(document.get("status"), str) else None
    return completed, total, status


def write_record(path, record):
    """Write record (JSON, mode 0600, atomically) to path unless it exists. True when written."""
    if os.path.exists(path):
        return False
    write_private(path, json.dumps(record, indent=4, sort_keys=True) + "\n")
    return True


def describe(job_missing, finished, rc, timed_out, job_msg, progress_line, completed, total, log):
    """The one progress sentence an operator sees while polling."""
    counts = " [%s/%s M done]" % (completed, total) if completed is not None and total else ""
    if job_missing:
        return "job status file missing: the job was never launched here, or its file was removed"
    if not finished:
        if progress_line:
            return progress_line + counts
        return "running, no progress line yet in %s%s" % (log or "the log", counts)
    if timed_out:
        state = "killed at its async time limit"
    elif rc is None:
        state = "ended without an exit code (%s)" % (job_msg or "no message")
    else:
        state = "exited %d" % rc
    return "finished, %s%s%s" % (state, counts, ": " + progress_line if progress_line else "")


def main():
    module = AnsibleModule(
        argument_spec=dict(
            jid=dict(type="str", required=True),
            async_dir=dict(type="path", required=True),
            log=dict(type="path"),
            results=dict(type="path"),
            tail_lines=dict(type="int", default=30),
            wait_s=dict(type="float", default=0),
            check_interval_s=dict(type="float", default=0.25),
            record_file=dict(type="path"),
            record=dict(type="dict"),
        ),
        required_by=dict(record_file=["record"]),
        supports_check_mode=True,
    )
    params = module.params
    jid = params["jid"]
    if os.sep in jid or jid in (".", ".."):
        module.fail_json(msg="jid must be a job id, not a path: %s" % jid)

    if params["wait_s"] < 0:
        module.fail_json(msg="wait_s must be 0 or more seconds, got %s" % params["wait_s"])
    if params["check_interval_s"] <= 0:
        module.fail_json(msg="check_interval_s must be more than 0 seconds, got %s" % params["check_interval_s"])

    record_written = False
    if params["record_file"] and not module.check_mode:
        try:
            record_written = write_record(params["record_file"], params["record"])
        except (IOError, OSError) as error:
            module.fail_json(msg="could not write the job record %s: %s" % (params["record_file"], to_text(error)))

    status_path = os.path.join(params["async_dir"], jid)
    started_wait = time.monotonic()
    job_missing, record = read_job_status(status_path)
    finished = True if job_missing else bool(record.get("finished"))
    while not finished:
        left = params["wait_s"] - (time.monotonic() - started_wait)
        if left <= 0:
            break
        time.sleep(min(params["check_interval_s"], left))
        job_missing, record = read_job_status(status_path)
        finished = True if job_missing else bool(record.get("finished"))
    waited_s = round(time.monotonic() - started_wait, 2)
    started = False if job_missing else bool(record.get("started", True))
    rc = record.get("rc") if finished else None
    if rc is not None:
        try:
            rc = int(rc)
        except (TypeError, ValueError):
            rc = None
    job_msg = to_text(record["msg"]) if finished and record.get("msg") else None
    timed_out = bool(finished and record.get("failed") and job_msg == "Timeout exceeded")
    job_failed = bool(job_missing or (finished and (record.get("failed") or rc is None or rc != 0)))

    lines = read_log_end(params["log"])
    completed, total, results_status = results_progress(params["results"])
    progress = describe(job_missing, finished, rc, timed_out, job_msg, last_progress_line(lines),
                        completed, total, params["log"])

    log_tail = ""
    if job_failed and not job_missing:
        tail = lines[-params["tail_lines"]:] if lines else []
        if not tail:
            # No log file: fall back on the job's own captured output.
            captured = "\n".join(to_text(record.get(key) or "") for key in ("stdout", "stderr")).strip()
            tail = captured.splitlines()[-params["tail_lines"]:]
        log_tail = "\n".join(tail)

    module.exit_json(
        changed=False,
        ansible_job_id=jid,
        finished=finished,
        started=started,
        job_missing=job_missing,
        job_failed=job_failed,
        timed_out=timed_out,
        exit_code=rc,
        job_msg=job_msg,
        progress=progress,
        moe_bench_progress=progress,
        completed_m=completed,
        total_m=total,
        results_status=results_status,
        log_tail=log_tail,
        waited_s=waited_s,
        record_written=record_written,
    )


if __name__ == "__main__":
    main()
