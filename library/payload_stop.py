#!/usr/bin/python
# -*- coding: utf-8 -*-
"""Ansible module payload_stop: stop the benchmark processes that outlived their job."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: payload_stop
short_description: Stop every benchmark payload still running from a host's run folders
description:
  - Finds the processes whose command line writes its results under O(under) (an argument
    C(--out) followed by, or C(--out=), a path inside that folder), sends them C(SIGTERM), waits
    up to O(term_grace_s) seconds, sends C(SIGKILL) to those still alive and waits up to
    O(kill_wait_s) seconds for them to be gone.
  - The unit must not start beside a benchmark that still holds the GPU. A job that Ansible's
    async wrapper reports as ended can leave its payload behind - the wrapper kills the job's
    process group at the time limit, and a payload outside that group (the wrapper's own
    C(setpgid) race, a shell of several payloads killed under them) keeps running.
  - The payload catches C(SIGTERM) and records the failure in its results, so what it measured
    is kept.
  - A process is gone once its C(/proc) entry is, or it is a zombie (it has exited; only its
    parent's C(wait) is missing), or its pid was reused by another process.
version_added: "1.0.0"
author:
  - moe-bench-ops maintainers
options:
  under:
    description: The folder the payloads write into (a run folder, or the folder of all runs).
    type: path
    required: true
  term_grace_s:
    description: Seconds to wait after C(SIGTERM) before C(SIGKILL).
    type: float
    default: 10
  kill_wait_s:
    description: Seconds to wait after C(SIGKILL) for the processes to be gone.
    type: float
    default: 10
notes:
  - Supports check mode - it only looks then (RV(found)), and signals nothing.
  - Runs as the user the payload runs as, or as root.
"""

EXAMPLES = r"""
- name: Stop whatever benchmark still runs before the unit starts
  payload_stop:
    under: /var/lib/moe-bench/runs
  register: leftovers

- name: Say which were stopped
  ansible.builtin.debug:
    msg: "stopped {{ leftovers.found | map(attribute='pid') | list }}"
  when: leftovers.found | length > 0
"""

RETURN = r"""
found:
  description: The payload processes found (pid and command line), before any signal.
  returned: always
  type: list
  elements: dict
  sample: [{"pid": 4242, "args": "/opt/bench-venv/bin/python -m moe_bench --out /var/lib/moe-bench/runs/x/results.json"}]
terminated:
  description: Pids that were gone within O(term_grace_s) of C(SIGTERM).
  returned: always
  type: list
  elements: int
killed:
  description: Pids that needed C(SIGKILL).
  returned: always
  type: list
  elements: int
left:
  description: Pids still alive after C(SIGKILL) and O(kill_wait_s) (a process stuck in the kernel).
  returned: always
  type: list
  elements: int
waited_s:
  description: Seconds spent waiting for the processes to end.
  returned: always
  type: float
"""

import os
import signal
import time

from ansible.module_utils.basic import AnsibleModule

CHECK_INTERVAL_S = 0.1


def _read(path):
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return None


def process_identity(pid):
    """(start time, state) of a process from /proc/<pid>/stat, or None when it is gone."""
    stat = _read("/proc/%d/stat" % pid)
    if stat is None:
        return None
    # The command name is in parentheses and may hold spaces or ')': split after the last ')'.
    fields = stat[stat.rfind(b")") + 2:].split()
    if len(fields) < 20:
        return None
    return fields[19], fields[0].decode("ascii", "replace")


def output_path(argv):
    """The path given to --out in an argv, or None."""
    for index, arg in enumerate(argv):
        if arg == "--out" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--out="):
            return arg[len("--out="):]
    return None


def inside(path, folder):
    path = os.path.normpath(path)
    folder = os.path.normpath(folder)
    return path.startswith(folder.rstrip("/") + "/")


def find_payloads(folder):
    own = {os.getpid(), os.getppid()}
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in own:
            continue
        pid = int(name)
        raw = _read("/proc/%d/cmdline" % pid)
        if not raw:
            continue  # a kernel thread, a zombie, or gone
        argv = [part.decode("utf-8", "surrogateescape") for part in raw.rstrip(b"\0").split(b"\0")]
        path = output_path(argv)
        identity = process_identity(pid)
        if path is None or identity is None or identity[1] == "Z" or not inside(path, folder):
            continue
        found.append({"pid": pid, "args": " ".join(argv), "identity": identity[0]})
    return sorted(found, key=lambda item: item["pid"])


def alive(process):
    identity = process_identity(process["pid"])
    return identity is not None and identity[0] == process["identity"] and identity[1] != "Z"


def signal_all(processes, signum):
    for process in processes:
        try:
            os.kill(process["pid"], signum)
        except ProcessLookupError:
            pass


def wait_gone(processes, seconds):
    deadline = time.monotonic() + seconds
    living = [process for process in processes if alive(process)]
    while living and time.monotonic() < deadline:
        time.sleep(CHECK_INTERVAL_S)
        living = [process for process in living if alive(process)]
    return living


def main():
    module = AnsibleModule(
        argument_spec=dict(
            under=dict(type="path", required=True),
            term_grace_s=dict(type="float", default=10),
            kill_wait_s=dict(type="float", default=10),
        ),
        supports_check_mode=True,
    )
    folder = module.params["under"]
    if not os.path.isabs(folder) or os.path.normpath(folder) == "/":
        module.fail_json(msg="under must be an absolute folder other than /, got %r" % folder)
    found = find_payloads(folder)
    shown = [{"pid": process["pid"], "args": process["args"]} for process in found]
    if module.check_mode or not found:
        module.exit_json(changed=False, found=shown, terminated=[], killed=[], left=[], waited_s=0.0)

    started = time.monotonic()
    signal_all(found, signal.SIGTERM)
    stubborn = wait_gone(found, module.params["term_grace_s"])
    signal_all(stubborn, signal.SIGKILL)
    left = wait_gone(stubborn, module.params["kill_wait_s"])
    stubborn_pids = {process["pid"] for process in stubborn}
    module.exit_json(
        changed=True,
        found=shown,
        terminated=[process["pid"] for process in found if process["pid"] not in stubborn_pids],
        killed=sorted(stubborn_pids),
        left=[process["pid"] for process in left],
        waited_s=round(time.monotonic() - started, 2),
    )


if __name__ == "__main__":
    main()
