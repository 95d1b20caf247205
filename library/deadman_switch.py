#!/usr/bin/python
# -*- coding: utf-8 -*-
"""Ansible module deadman_switch: arm or disarm the host's dead-man timer in one round trip."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: deadman_switch
short_description: Arm the transient systemd timer that starts a unit if the controller never returns, or disarm it
description:
  - O(state=armed) reads the unit's C(ActiveState) and decides whether the switch is needed: it is
    when O(enabled), the restore policy is not V(never), and the unit will be started afterwards
    (policy V(always), or the unit runs now). Then it clears a timer left by an earlier run and arms
    C(moe-bench-deadman-<unit>.timer) with C(systemd-run --on-active), whose service runs
    C(systemctl start <unit>) and stays loaded after it ran (so the disarm can tell that it fired).
    It writes C(deadman.json) in the run folder either way, with the reason.
  - O(state=disarmed) reads the timer and its service, stops what is loaded, forgets their last
    result and, when O(run_id) is given, writes C(deadman.disarmed.json). RV(fired) says whether
    the timer had fired (the host started the unit itself).
  - Unit states are read through the project's one reader of C(systemctl show)
    (module_utils/systemd_unit.py). Check mode changes nothing and returns what a real call would do.
version_added: "1.0.0"
author:
  - moe-bench-ops maintainers
options:
  unit:
    description: The inference unit the timer starts.
    type: str
    required: true
  state:
    description: V(armed) or V(disarmed).
    type: str
    choices: [armed, disarmed]
    default: armed
  run_id:
    description: The run's id; its folder under O(state_dir) gets the record. Empty writes no record (disarm only).
    type: str
    default: ""
  state_dir:
    description: The host's state folder.
    type: path
    required: true
  delay_s:
    description: Seconds from the arming until the timer starts the unit.
    type: int
    default: 3600
  enabled:
    description: Arm it at all.
    type: bool
    default: true
  restore:
    description: The run's restore policy; the switch is armed only when the unit will be started afterwards.
    type: str
    choices: [previous, always, never]
    default: previous
"""

EXAMPLES = r"""
- name: Arm the dead-man switch
  deadman_switch:
    unit: sglang-k26.service
    run_id: 20261201T120000Z-abc123
    state_dir: /var/lib/moe-bench
    delay_s: 1500
  register: deadman

- name: Disarm it once the unit is back
  deadman_switch:
    unit: sglang-k26.service
    run_id: 20261201T120000Z-abc123
    state_dir: /var/lib/moe-bench
    state: disarmed
"""

RETURN = r"""
name:
  description: The timer's name without its suffix (C(moe-bench-deadman-<unit>)).
  returned: always
  type: str
armed:
  description: Whether the timer was armed (state=armed).
  returned: state=armed
  type: bool
unit_state:
  description: The unit's ActiveState before arming (state=armed).
  returned: state=armed
  type: str
record:
  description: What deadman.json (or deadman.disarmed.json) holds.
  returned: always
  type: dict
was_armed:
  description: Whether the timer was loaded when the disarm came (state=disarmed).
  returned: state=disarmed
  type: bool
fired:
  description: Whether the timer had fired and its service started the unit (state=disarmed).
  returned: state=disarmed
  type: bool
"""

import json
import os
import re
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.run_files import write_private
from ansible.module_utils.systemd_unit import RUNNING_STATES, read_units


def timer_name(unit):
    base = unit[:-len(".service")] if unit.endswith(".service") else unit
    return "moe-bench-deadman-" + re.sub(r"[^A-Za-z0-9:_.-]", "_", base)


def _iso(epoch):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def _write_record(module, params, name, record):
    if not params["run_id"] or module.check_mode:
        return
    run_dir = os.path.join(params["state_dir"], "runs", params["run_id"])
    if not os.path.isdir(run_dir):
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
    write_private(os.path.join(run_dir, name), json.dumps(record, indent=4, sort_keys=True) + "\n")


def _systemctl(module, *args, check=True):
    systemctl = module.get_bin_path("systemctl", required=True)
    rc, stdout, stderr = module.run_command([systemctl] + list(args), environ_update={"LC_ALL": "C"})
    if check and rc != 0:
        module.fail_json(msg="systemctl %s exited %d: %s" % (" ".join(args), rc, (stderr or stdout).strip()), rc=rc)
    return rc


def arm(module, params):
    unit, name = params["unit"], timer_name(params["unit"])
    active = read_units(module, [unit], ["ActiveState"])[unit]["ActiveState"]
    armed = bool(params["enabled"] and params["restore"] != "never"
                 and (params["restore"] == "always" or active in RUNNING_STATES))
    if armed and not module.check_mode:
        timer, service = name + ".timer", name + ".service"
        # A timer of an earlier run that never disarmed, and its service's last result.
        _systemctl(module, "stop", timer, service, check=False)
        _systemctl(module, "reset-failed", timer, service, check=False)
        systemd_run = module.get_bin_path("systemd-run", required=True)
        argv = [systemd_run, "--unit=%s" % name,
                "--description=moe-bench dead-man switch: start %s if run %s never recovers it" % (unit, params["run_id"]),
                "--on-active=%ds" % params["delay_s"], "--timer-property=AccuracySec=1s",
                # The service stays loaded after it ran, so the disarm can tell that it fired.
                "--remain-after-exit", "systemctl", "start", unit]
        rc, stdout, stderr = module.run_command(argv, environ_update={"LC_ALL": "C"})
        if rc != 0:
            module.fail_json(msg="could not arm the dead-man timer %s.timer: systemd-run exited %d: %s"
                             % (name, rc, (stderr or stdout).strip()), rc=rc)
    armed_epoch = int(time.time())
    if armed:
        reason = "armed"
    elif not params["enabled"]:
        reason = "disabled"
    elif params["restore"] == "never":
        reason = "restore policy never"
    else:
        reason = "unit was %s before the run: it stays stopped" % active
    record = {"armed": armed, "timer": name + ".timer", "unit": unit, "delay_s": params["delay_s"],
              "armed_at": _iso(armed_epoch), "deadline": _iso(armed_epoch + params["delay_s"]),
              "deadline_epoch": armed_epoch + params["delay_s"], "reason": reason}
    _write_record(module, params, "deadman.json", record)
    return {"changed": armed, "armed": armed, "name": name, "unit_state": active, "record": record}


def disarm(module, params):
    name = timer_name(params["unit"])
    timer, service = name + ".timer", name + ".service"
    units = read_units(module, [timer, service], ["LoadState", "ActiveState", "Result"])
    was_armed = units[timer]["LoadState"] == "loaded"
    # The transient service is loaded as soon as the timer is armed; it has run once it is
    # active (RemainAfterExit) or failed.
    fired = units[service]["ActiveState"] in ("active", "activating", "failed")
    changed = was_armed or fired
    if changed and not module.check_mode:
        # Only the loaded units: `systemctl stop` fails on a unit that is not.
        _systemctl(module, "stop", *([timer] if was_armed else []) + ([service] if fired else []))
        _systemctl(module, "reset-failed", timer, service, check=False)
    record = {"timer": timer, "was_armed": was_armed, "fired": fired, "disarmed_at": _iso(time.time())}
    _write_record(module, params, "deadman.disarmed.json", record)
    return {"changed": changed, "was_armed": was_armed, "fired": fired, "name": name, "record": record}


def main():
    module = AnsibleModule(
        argument_spec=dict(
            unit=dict(type="str", required=True),
            state=dict(type="str", choices=["armed", "disarmed"], default="armed"),
            run_id=dict(type="str", default=""),
            state_dir=dict(type="path", required=True),
            delay_s=dict(type="int", default=3600),
            enabled=dict(type="bool", default=True),
            restore=dict(type="str", choices=["previous", "always", "never"], default="previous"),
        ),
        supports_check_mode=True,
    )
    params = module.params
    if params["state"] == "armed" and not params["run_id"]:
        module.fail_json(msg="run_id is empty: the dead-man switch is armed for a run")
    if params["delay_s"] <= 0:
        module.fail_json(msg="delay_s must be a positive number of seconds, got %s" % params["delay_s"])
    try:
        result = arm(module, params) if params["state"] == "armed" else disarm(module, params)
    except OSError as error:
        module.fail_json(msg="%s: %s" % (getattr(error, "filename", None) or params["state_dir"], error.strerror or error))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
