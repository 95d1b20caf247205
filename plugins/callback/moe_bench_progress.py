# -*- coding: utf-8 -*-
"""Callback moe_bench_progress: show the benchmark's own progress while a task retries."""

from __future__ import annotations

DOCUMENTATION = r"""
name: moe_bench_progress
type: notification
short_description: Print a retrying task's moe_bench_progress text
description:
  - While a task loops with C(until), Ansible's output shows only retry counters. When the task's
    result carries C(moe_bench_progress) (the C(bench_job) module returns it), this callback prints
    it on every retry, so the operator sees which batch size M runs and for how long.
  - It only adds lines; it works beside any stdout callback and verbosity. When the stdout callback
    writes machine-readable output (C(json), C(jsonl)), the lines go to standard error instead, so
    standard output stays parseable.
requirements:
  - enabled in ansible.cfg (C(callbacks_enabled = moe_bench_progress)); the project's ansible.cfg does this.
"""

from ansible import constants as C
from ansible.plugins.callback import CallbackBase

PROGRESS_KEY = "moe_bench_progress"
MACHINE_READABLE_STDOUT = ("json", "jsonl")


def stdout_is_machine_readable(stdout_callback):
    """True for stdout callbacks whose output a program parses (ansible.builtin.json, ansible.posix.jsonl, ...)."""
    return str(stdout_callback or "").rsplit(".", 1)[-1] in MACHINE_READABLE_STDOUT


def _field(result, public, private):
    """Read a CallbackTaskResult property (ansible-core 2.19+) or the older TaskResult attribute."""
    value = getattr(result, public, None)
    return value if value is not None else getattr(result, private, None)


def progress_line(host_name, task_name, result_data):
    """'[host] task: progress (attempt a/r)', or None when the result carries no progress text."""
    if not isinstance(result_data, dict):
        return None
    progress = result_data.get(PROGRESS_KEY)
    if not progress:
        return None
    line = "[%s] %s: %s" % (host_name, task_name, str(progress).strip())
    # On a retry Ansible has already set "attempts" to the next attempt's number; the
    # progress shown was read by the attempt before it.
    attempts, retries = result_data.get("attempts"), result_data.get("retries")
    if isinstance(attempts, int) and isinstance(retries, int) and attempts > 1:
        line += " (attempt %d/%d)" % (attempts - 1, retries)
    return line


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "notification"
    CALLBACK_NAME = "moe_bench_progress"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super(CallbackModule, self).__init__(*args, **kwargs)
        self._to_stderr = stdout_is_machine_readable(C.config.get_config_value("DEFAULT_STDOUT_CALLBACK"))

    def v2_runner_retry(self, result):
        data = _field(result, "result", "_result")
        host = _field(result, "host", "_host")
        task = _field(result, "task", "_task")
        task_name = getattr(result, "task_name", None) or (task.get_name() if task is not None else "task")
        line = progress_line(host.get_name() if host is not None else "?", task_name, data)
        if line:
            self._display.display(line, stderr=self._to_stderr)
