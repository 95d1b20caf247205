# -*- coding: utf-8 -*-
"""The one reader of systemd units' state (``systemctl show``) used by this project's modules.

``systemctl show --property=A,B unit1 unit2`` prints one block of ``Key=value`` lines per unit,
blocks separated by an empty line, in the order the units were named. Every role that needs a
unit's state calls the unit_state module, and service_health reads the unit through the same
functions, so the state is parsed in one place.
"""

from __future__ import annotations

# systemd's ActiveState values of a unit that runs or is about to (the restore policy
# `previous` brings such a unit back).
RUNNING_STATES = ("active", "activating", "reloading")
# Integer properties: returned as int, None when systemd prints nothing or "[not set]".
INT_PROPERTIES = ("MainPID", "NRestarts", "ExecMainPID", "ExecMainStatus", "ExecMainCode")
DEFAULT_PROPERTIES = ("LoadState", "ActiveState", "SubState", "Result", "MainPID", "NRestarts")


def _typed(key, value):
    value = value.strip()
    if key in INT_PROPERTIES:
        try:
            return int(value) if value not in ("", "[not set]") else None
        except ValueError:
            return None
    return value


def parse_show(text, properties):
    """``systemctl show`` text -> one dict per unit block, every asked property present (None if absent)."""
    blocks = []
    current = None
    for line in (text or "").splitlines():
        if not line.strip():
            if current is not None:
                blocks.append(current)
                current = None
            continue
        if "=" not in line:
            continue
        key, value = line.split("=", 1)
        if current is None:
            current = dict((name, None) for name in properties)
        if key in current:
            current[key] = _typed(key, value)
    if current is not None:
        blocks.append(current)
    return blocks


def cgroup_pids(control_group, read_file):
    """PIDs in a unit's cgroup: cgroup v2, or the unified / name=systemd trees of a hybrid v1 host."""
    if not control_group:
        return []
    pids = set()
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd"):
        text = read_file(root + control_group + "/cgroup.procs")
        if text:
            pids.update(int(word) for word in text.split() if word.isdigit())
    return sorted(pids)


def read_units(module, units, properties=DEFAULT_PROPERTIES, redact=None):
    """Read ``properties`` of every unit in ``units``: {unit: {property: value}}; fails the module on error."""
    properties = list(properties)
    systemctl = module.get_bin_path("systemctl", required=True)
    argv = [systemctl, "show", "--property=" + ",".join(properties)] + list(units)
    rc, stdout, stderr = module.run_command(argv, environ_update={"LC_ALL": "C"})
    if rc != 0:
        msg = "could not read the state of unit(s) %s: systemctl show exited %d: %s" % (
            ", ".join(units), rc, (stderr or stdout).strip())
        module.fail_json(msg=redact(msg) if redact else msg, rc=rc)
    blocks = parse_show(stdout, properties)
    if len(blocks) != len(units):
        module.fail_json(msg="systemctl show printed %d block(s) for %d unit(s): %s" % (
            len(blocks), len(units), stdout.strip()[:400]))
    return dict(zip(units, blocks))
