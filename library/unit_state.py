#!/usr/bin/python
# -*- coding: utf-8 -*-
"""Ansible module unit_state: read systemd units' state, optionally wait for an ActiveState."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: unit_state
short_description: Read the state of systemd units (systemctl show); optionally wait for an ActiveState
description:
  - Reads the chosen properties of one or more units with one C(systemctl show) and returns them
    typed (V(MainPID), V(NRestarts) as integers). Every role of this project reads units through it.
  - With O(wait_for) it looks every O(interval) seconds, for up to O(wait_s) seconds, until the
    first unit's C(ActiveState) is one of O(wait_for), and returns as soon as it is (or when the
    time is up, with RV(reached) false: the caller decides what that means).
  - With O(cgroup_pids) it also returns the PIDs in the first unit's cgroup.
  - It only reads, so it runs normally in check mode.
version_added: "1.0.0"
author:
  - moe-bench-ops maintainers
options:
  name:
    description:
      - The units (C(fake-inference.service), C(moe-bench-deadman-x.timer) ...). The first one is
        the one RV(state), O(wait_for) and O(cgroup_pids) refer to.
    type: list
    elements: str
    required: true
  properties:
    description:
      - C(systemctl show) properties to read. V(ControlGroup) is added when O(cgroup_pids) is set.
    type: list
    elements: str
    default: [LoadState, ActiveState, SubState, Result, MainPID, NRestarts]
  wait_for:
    description:
      - C(ActiveState) values to wait for on the first unit. Empty reads once.
    type: list
    elements: str
    default: []
  wait_s:
    description:
      - Longest wait for O(wait_for), in seconds.
    type: float
    default: 0
  interval:
    description:
      - Seconds between two reads while waiting.
    type: float
    default: 0.5
  cgroup_pids:
    description:
      - Also return the PIDs in the first unit's cgroup (RV(cgroup_pids)).
    type: bool
    default: false
"""

EXAMPLES = r"""
- name: Read the unit's load state and stop timeout
  unit_state:
    name: [sglang-k26.service]
    properties: [LoadState, TimeoutStopUSec]
  register: unit

- name: Wait up to 40 s for the unit to be down
  unit_state:
    name: [sglang-k26.service]
    wait_for: [inactive, failed]
    wait_s: 40
  register: stopped
"""

RETURN = r"""
state:
  description: The properties of the first unit.
  returned: always
  type: dict
  sample: {LoadState: loaded, ActiveState: active, SubState: running, Result: success, MainPID: 812, NRestarts: 0}
units:
  description: The properties of every unit, by unit name.
  returned: always
  type: dict
  sample: {sglang-k26.service: {ActiveState: active}}
reached:
  description: Whether the first unit's ActiveState was one of O(wait_for) (true when O(wait_for) is empty).
  returned: always
  type: bool
  sample: true
waited_s:
  description: Seconds spent waiting.
  returned: always
  type: float
  sample: 3.5
cgroup_pids:
  description: PIDs in the first unit's cgroup (empty when O(cgroup_pids) is false or the unit has none).
  returned: always
  type: list
  elements: int
  sample: [812, 813]
"""

import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.systemd_unit import cgroup_pids, read_units


def read_text(path):
    try:
        with open(path) as handle:
            return handle.read()
    except (IOError, OSError):
        return ""


def main():
    module = AnsibleModule(
        argument_spec=dict(
            name=dict(type="list", elements="str", required=True),
            properties=dict(type="list", elements="str",
                            default=["LoadState", "ActiveState", "SubState", "Result", "MainPID", "NRestarts"]),
            wait_for=dict(type="list", elements="str", default=[]),
            wait_s=dict(type="float", default=0),
            interval=dict(type="float", default=0.5),
            cgroup_pids=dict(type="bool", default=False),
        ),
        supports_check_mode=True,
    )
    params = module.params
    units = params["name"]
    if not units:
        module.fail_json(msg="name must list at least one unit")
    properties = list(params["properties"])
    for needed in (["ActiveState"] if params["wait_for"] else []) + (["ControlGroup"] if params["cgroup_pids"] else []):
        if needed not in properties:
            properties.append(needed)
    started = time.monotonic()
    deadline = started + max(0.0, params["wait_s"])
    while True:
        states = read_units(module, units, properties)
        first = states[units[0]]
        reached = not params["wait_for"] or first.get("ActiveState") in params["wait_for"]
        if reached or time.monotonic() >= deadline:
            break
        time.sleep(max(0.05, min(params["interval"], deadline - time.monotonic())))
    pids = cgroup_pids(first.get("ControlGroup"), read_text) if params["cgroup_pids"] else []
    module.exit_json(changed=False, state=first, units=states, reached=reached,
                     waited_s=round(time.monotonic() - started, 3), cgroup_pids=pids)


if __name__ == "__main__":
    main()
