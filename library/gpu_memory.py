#!/usr/bin/python
# -*- coding: utf-8 -*-
"""Ansible module gpu_memory: report GPU memory and its holders, optionally wait until it is free."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_memory
short_description: Report GPU memory and the processes holding it; wait until it is released
description:
  - Reads C(nvidia-smi --query-gpu) and C(nvidia-smi --query-compute-apps) (CSV, no header, no units)
    and returns used, free and total MiB per GPU, and the processes holding GPU memory with the
    systemd unit that owns each of them (read from C(/proc/<pid>/cgroup)).
  - With O(timeout) greater than 0 it polls every O(interval) seconds until the chosen GPUs have
    at most O(max_used_mib) used and at least O(min_free_mib) free, and fails with a table of the
    processes still holding memory when the time runs out.
  - Called without thresholds or timeout it reports once and never waits.
  - It only reads, so it runs normally in check mode.
version_added: "1.0.0"
author:
  - moe-bench-ops maintainers
options:
  gpus:
    description:
      - Indices of the GPUs to look at (as in C(nvidia-smi --query-gpu=index)).
      - Default (omitted or empty) is every GPU of the host.
      - The module fails at once when one of them does not exist on the host.
    type: list
    elements: int
  max_used_mib:
    description:
      - Highest C(memory.used) in MiB accepted on each chosen GPU.
      - Not checked when omitted.
    type: int
  min_free_mib:
    description:
      - Lowest C(memory.free) in MiB accepted on each chosen GPU.
      - Not checked when omitted.
    type: int
  max_processes:
    description:
      - Highest number of compute processes accepted on the chosen GPUs (0 means none may hold memory).
      - Not checked when omitted.
    type: int
  timeout:
    description:
      - Seconds to wait for the thresholds to be met. V(0) reports once and does not fail when
        they are not met (see RV(ready)).
    type: float
    default: 0
  interval:
    description:
      - Seconds between two reads while waiting.
    type: float
    default: 5
  nvidia_smi:
    description:
      - The nvidia-smi executable, a name looked up on E(PATH) or an absolute path.
    type: str
    default: nvidia-smi
notes:
  - The C(used_mib) and the process list are the truth; an idle GPU reports some MiB less free
    than total (reserved by the driver), so never gate on free being equal to total.
seealso:
  - name: nvidia-smi documentation
    description: The query options this module reads.
    link: https://docs.nvidia.com/deploy/nvidia-smi/index.html
"""

EXAMPLES = r"""
- name: Report GPU memory and its holders
  gpu_memory:
  register: vram

- name: Wait until GPUs 0 and 1 are released (at most 1 GiB used, 90 GiB free)
  gpu_memory:
    gpus: [0, 1]
    max_used_mib: 1024
    min_free_mib: 92160
    timeout: 120
    interval: 5

- name: Use a specific nvidia-smi
  gpu_memory:
    nvidia_smi: /usr/local/bin/nvidia-smi
"""

RETURN = r"""
gpus:
  description: The chosen GPUs (all of them when O(gpus) is omitted), as last read.
  returned: success or timeout
  type: list
  elements: dict
  contains:
    index: {description: GPU index., type: int}
    uuid: {description: GPU UUID., type: str}
    name: {description: Product name., type: str}
    total_mib: {description: Total memory in MiB (null when unavailable)., type: int}
    used_mib: {description: Used memory in MiB (null when unavailable)., type: int}
    free_mib: {description: Free memory in MiB (null when unavailable)., type: int}
  sample:
    - {index: 0, uuid: GPU-33b36c28-f7d1-d867-b2a9-c29c88a09e61, name: NVIDIA H200,
       total_mib: 143771, used_mib: 61967, free_mib: 81190}
processes:
  description: Compute processes holding memory on the chosen GPUs, as last read.
  returned: success or timeout
  type: list
  elements: dict
  contains:
    pid: {description: Process id., type: int}
    gpu_index: {description: Index of the GPU the memory is on., type: int}
    gpu_uuid: {description: UUID of that GPU., type: str}
    name: {description: Process name as nvidia-smi prints it., type: str}
    used_mib: {description: MiB held by the process (null when unavailable)., type: int}
    unit: {description: The systemd unit owning the process, null when none or the pid is gone., type: str}
  sample:
    - {pid: 452, gpu_index: 0, gpu_uuid: GPU-33b36c28-f7d1-d867-b2a9-c29c88a09e61, name: python3,
       used_mib: 61958, unit: sglang-k26-ddtree.service}
ready:
  description: Whether the chosen GPUs meet every given threshold (true when none is given).
  returned: always
  type: bool
blocking:
  description: Why the GPUs are not ready, one sentence per unmet threshold (empty when ready).
  returned: always
  type: list
  elements: str
waited_s:
  description: Seconds spent waiting (0 for a single read).
  returned: always
  type: float
checks:
  description: How many times nvidia-smi was read.
  returned: always
  type: int
holders_table:
  description: The processes holding memory on the chosen GPUs as a fixed-width text table.
  returned: success or timeout
  type: str
gpus_table:
  description: The chosen GPUs' memory (used, free, total MiB) as a fixed-width text table, C([N/A]) where unreadable.
  returned: success or timeout
  type: str
"""

import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.nvidia_smi import (
    NvidiaSmiParseError,
    attach_gpu_index,
    compute_apps_query_argv,
    gpu_query_argv,
    parse_compute_apps,
    parse_gpu_query,
)

# Kept as a module attribute so tests can point it at a directory of fake /proc entries.
PROC_ROOT = "/proc"

_UNIT_SUFFIXES = (".service", ".scope")


def unit_from_cgroup(cgroup_text):
    """Return the systemd unit owning a process, from the text of /proc/<pid>/cgroup.

    cgroup v2 has one line "0::/system.slice/x.service"; cgroup v1 has one line per
    hierarchy, of which "name=systemd" (or the unified "0::" line) carries the unit.
    The innermost .service or .scope component wins, so a process in a sub-cgroup of
    a unit (Delegate=yes) or in a user's service is attributed to that unit.
    """
    paths_by_controller = {}
    for line in cgroup_text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _hierarchy, controllers, path = parts
        paths_by_controller.setdefault(controllers, path)
    preferred = [paths_by_controller.get(""), paths_by_controller.get("name=systemd")]
    candidates = [path for path in preferred if path] + list(paths_by_controller.values())
    for path in candidates:
        components = [component for component in path.split("/") if component]
        for component in reversed(components):
            if component.endswith(_UNIT_SUFFIXES):
                return component
    return None


def unit_of_pid(pid, proc_root=None):
    """The systemd unit owning pid, or None when the pid is gone or belongs to no unit."""
    if pid is None:
        return None
    path = os.path.join(proc_root or PROC_ROOT, str(pid), "cgroup")
    try:
        with open(path) as cgroup_file:
            return unit_from_cgroup(cgroup_file.read())
    except (IOError, OSError):
        return None


def blocking_reasons(gpus, processes, max_used_mib, min_free_mib, max_processes):
    """Sentences saying which threshold each chosen GPU misses; empty when all are met."""
    reasons = []
    for gpu in gpus:
        label = "GPU %d" % gpu["index"]
        if max_used_mib is not None:
            if gpu["used_mib"] is None:
                reasons.append("%s: memory.used is not readable ([N/A])" % label)
            elif gpu["used_mib"] > max_used_mib:
                reasons.append("%s: %d MiB used, more than the %d MiB allowed" % (label, gpu["used_mib"], max_used_mib))
        if min_free_mib is not None:
            if gpu["free_mib"] is None:
                reasons.append("%s: memory.free is not readable ([N/A])" % label)
            elif gpu["free_mib"] < min_free_mib:
                reasons.append("%s: %d MiB free, less than the %d MiB needed" % (label, gpu["free_mib"], min_free_mib))
    if max_processes is not None and len(processes) > max_processes:
        reasons.append("%d process(es) hold GPU memory, at most %d allowed" % (len(processes), max_processes))
    return reasons


def gpus_table(gpus):
    """Fixed-width table of the chosen GPUs' memory; [N/A] where nvidia-smi could not read it."""
    header = ("GPU", "NAME", "USED MiB", "FREE MiB", "TOTAL MiB")
    rows = [header]
    for gpu in gpus:
        rows.append((str(gpu["index"]), gpu.get("name") or "?",
                     *("[N/A]" if gpu.get(key) is None else str(gpu[key]) for key in ("used_mib", "free_mib", "total_mib"))))
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    return "\n".join("  ".join(cell.ljust(widths[i]) if i == 1 else cell.rjust(widths[i]) for i, cell in enumerate(row)).rstrip()
                     for row in rows)


def holders_table(processes):
    """Fixed-width table of the processes holding GPU memory, for an operator to read."""
    if not processes:
        return "no process holds memory on the chosen GPUs"
    header = ("GPU", "PID", "PROCESS", "MiB", "UNIT")
    rows = [header]
    for process in sorted(processes, key=lambda p: (p["gpu_index"] is None, p["gpu_index"], p["pid"] or 0)):
        rows.append((
            "?" if process["gpu_index"] is None else str(process["gpu_index"]),
            "?" if process["pid"] is None else str(process["pid"]),
            process["name"] or "?",
            "N/A" if process["used_mib"] is None else str(process["used_mib"]),
            process["unit"] or "-",
        ))
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = []
    for row in rows:
        cells = [cell.rjust(widths[i]) if i in (0, 1, 3) else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


class GpuMemoryReader(object):
    """Runs the two nvidia-smi queries through the module and parses them."""

    def __init__(self, module, executable):
        self.module = module
        self.executable = executable

    def _run(self, argv):
        rc, stdout, stderr = self.module.run_command(argv, environ_update={"LC_ALL": "C"})
        if rc != 0:
            detail = (stderr or stdout or "").strip() or "no output"
            self.module.fail_json(
                msg="nvidia-smi failed (exit code %d) running '%s': %s" % (rc, " ".join(argv), detail),
                rc=rc, stdout=stdout, stderr=stderr, cmd=argv,
            )
        return stdout

    def read(self):
        gpu_text = self._run(gpu_query_argv(self.executable))
        apps_text = self._run(compute_apps_query_argv(self.executable))
        try:
            gpus = parse_gpu_query(gpu_text)
            processes = parse_compute_apps(apps_text)
        except NvidiaSmiParseError as error:
            self.module.fail_json(
                msg="could not parse nvidia-smi output: %s" % error,
                gpu_query_output=gpu_text, compute_apps_output=apps_text,
            )
        if not gpus:
            self.module.fail_json(msg="nvidia-smi lists no GPU on this host (empty --query-gpu output)",
                                  gpu_query_output=gpu_text)
        processes = attach_gpu_index(processes, gpus)
        for process in processes:
            process["unit"] = unit_of_pid(process["pid"])
        return gpus, processes


def resolve_nvidia_smi(module, name):
    if os.sep in name:
        if os.path.isfile(name) and os.access(name, os.X_OK):
            return name
        module.fail_json(msg="nvidia-smi not found or not executable at %s: is the NVIDIA driver installed on this host?" % name)
    path = module.get_bin_path(name, required=False)
    if not path:
        module.fail_json(
            msg="%s not found on PATH (%s): is the NVIDIA driver installed on this host?" % (name, os.environ.get("PATH", ""))
        )
    return path


def choose_gpus(module, gpus, requested):
    if not requested:
        return gpus
    present = [gpu["index"] for gpu in gpus]
    missing = [index for index in requested if index not in present]
    if missing:
        module.fail_json(
            msg="GPU index %s requested, but this host has GPU(s) %s (nvidia-smi --query-gpu=index)"
            % (", ".join(str(index) for index in missing), present or "none"),
            gpus=gpus,
        )
    return [gpu for gpu in gpus if gpu["index"] in requested]


def main():
    module = AnsibleModule(
        argument_spec=dict(
            gpus=dict(type="list", elements="int"),
            max_used_mib=dict(type="int"),
            min_free_mib=dict(type="int"),
            max_processes=dict(type="int"),
            timeout=dict(type="float", default=0),
            interval=dict(type="float", default=5),
            nvidia_smi=dict(type="str", default="nvidia-smi"),
        ),
        supports_check_mode=True,
    )
    params = module.params
    for name in ("max_used_mib", "min_free_mib", "max_processes"):
        if params[name] is not None and params[name] < 0:
            module.fail_json(msg="%s must be 0 or more, got %s" % (name, params[name]))
    if params["timeout"] < 0:
        module.fail_json(msg="timeout must be 0 or more seconds, got %s" % params["timeout"])
    if params["interval"] <= 0:
        module.fail_json(msg="interval must be more than 0 seconds, got %s" % params["interval"])

    reader = GpuMemoryReader(module, resolve_nvidia_smi(module, params["nvidia_smi"]))
    started = time.monotonic()
    checks = 0
    while True:
        all_gpus, all_processes = reader.read()
        checks += 1
        gpus = choose_gpus(module, all_gpus, params["gpus"])
        chosen_uuids = set(gpu["uuid"] for gpu in gpus)
        processes = [process for process in all_processes if process["gpu_uuid"] in chosen_uuids]
        reasons = blocking_reasons(gpus, processes, params["max_used_mib"], params["min_free_mib"], params["max_processes"])
        waited = time.monotonic() - started
        if not reasons or params["timeout"] == 0 or waited >= params["timeout"]:
            break
        time.sleep(min(params["interval"], max(params["timeout"] - waited, 0.01)))

    result = dict(
        changed=False,
        gpus=gpus,
        processes=processes,
        ready=not reasons,
        blocking=reasons,
        waited_s=round(waited, 1),
        checks=checks,
        holders_table=holders_table(processes),
        gpus_table=gpus_table(gpus),
    )
    if reasons and params["timeout"] > 0:
        module.fail_json(
            msg="GPU memory was not released within %g s (%d checks): %s.\nProcesses holding memory:\n%s"
            % (params["timeout"], checks, "; ".join(reasons), result["holders_table"]),
            **result
        )
    module.exit_json(**result)


if __name__ == "__main__":
    main()
