#!/usr/bin/python
# -*- coding: utf-8 -*-
"""Ansible module host_lock: take or release a host's moe-bench lock in one round trip."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: host_lock
short_description: Take the host's moe-bench lock (and set up the run folder), or release it
description:
  - O(state=held) takes C(<state_dir>/lock) for a run, on the host, in one call. The caller has
    read and judged the lock first (it may take only a free lock, or one it judged stale). A free
    lock is taken with a hard link, which fails when another run got there first: then this
    module fails and touches nothing else. A stale lock (O(stale_run_id)) is replaced. When the
    stale run stopped the unit and never recovered it (its run folder has C(prior_state.json)
    and no C(recover.json)), this run re-attaches to it: its run id becomes RV(active_run_id).
  - Once the lock is held it creates the run folder, writes the plan there (C(plan.json), or
    C(plan.reattach.json) when re-attaching), points C(<state_dir>/current) at the run folder and
    says whether the run's benchmark job was already launched (RV(job_exists)).
  - O(state=absent) removes the lock when it belongs to O(run_id) (or to anyone with
    O(release_any)); a lock of another run is left in place and returned in RV(lock).
  - Files are written root-only (0600, folders 0700). Check mode changes nothing and returns what
    a real call would do.
version_added: "1.0.0"
author:
  - moe-bench-ops maintainers
options:
  state_dir:
    description: The host's state folder.
    type: path
    required: true
  run_id:
    description: This run's id.
    type: str
    required: true
  state:
    description: V(held) takes the lock, V(absent) releases it.
    type: str
    choices: [held, absent]
    default: held
  stale_run_id:
    description:
      - The run id of the stale lock the caller judged may be taken over. Empty when the lock was
        free (then only a free lock is taken).
    type: str
    default: ""
  record:
    description: The lock record to write (run_id is set to RV(active_run_id)).
    type: dict
    default: {}
  plan:
    description: The plan, kept in the run folder.
    type: dict
    default: {}
  release_any:
    description: With O(state=absent), remove the lock whoever holds it.
    type: bool
    default: false
  host:
    description: The host's name as the operator knows it, for messages.
    type: str
    default: this host
"""

EXAMPLES = r"""
- name: Take the free lock
  host_lock:
    state_dir: /var/lib/moe-bench
    run_id: 20261201T120000Z-abc123
    record: {owner: ops, controller: awx-1, pid: 4242}
    plan: "{{ moe_bench_plan }}"
  register: lock

- name: Release it
  host_lock:
    state_dir: /var/lib/moe-bench
    run_id: 20261201T120000Z-abc123
    state: absent
"""

RETURN = r"""
active_run_id:
  description: The run this host works on (this run, or the unfinished run re-attached to).
  returned: state=held
  type: str
reattach:
  description: Whether this run re-attached to an unfinished run behind a stale lock.
  returned: state=held
  type: bool
job_exists:
  description: Whether the active run's benchmark job was already launched (its job.json exists).
  returned: state=held
  type: bool
run_dir:
  description: The active run's folder on the host.
  returned: state=held
  type: str
lock:
  description: The lock record found (state=absent), empty when there was none.
  returned: state=absent
  type: dict
released:
  description: Whether the lock was removed.
  returned: state=absent
  type: bool
"""

import errno
import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.run_files import write_private


def _read_json(path):
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _private_dir(path):
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def take(module, params):
    state_dir = params["state_dir"]
    run_id = params["run_id"]
    stale = params["stale_run_id"]
    runs = os.path.join(state_dir, "runs")
    # An unfinished run behind the stale lock: it stopped the unit and never recovered it.
    reattach = bool(stale) and os.path.exists(os.path.join(runs, stale, "prior_state.json")) \
        and not os.path.exists(os.path.join(runs, stale, "recover.json"))
    active = stale if reattach else run_id
    run_dir = os.path.join(runs, active)
    lock = os.path.join(state_dir, "lock")
    result = {"changed": True, "active_run_id": active, "reattach": reattach, "run_dir": run_dir,
              "job_exists": os.path.exists(os.path.join(run_dir, "job.json"))}
    if module.check_mode:
        return result
    for folder in (state_dir, runs, os.path.join(state_dir, "async")):
        _private_dir(folder)
    record = dict(params["record"])
    record["run_id"] = active
    candidate = "%s.%s" % (lock, active)
    write_private(candidate, json.dumps(record, indent=4, sort_keys=True) + "\n")
    try:
        if stale:
            os.rename(candidate, lock)
        else:
            try:
                os.link(candidate, lock)
            except OSError as error:
                if error.errno != errno.EEXIST:
                    raise
    finally:
        if os.path.exists(candidate):
            os.unlink(candidate)
    holder = _read_json(lock) or {}
    if holder.get("run_id") != active:
        module.fail_json(
            msg="Another run took the lock on %s at the same moment (%s). This run touched nothing; "
                "the service is as that run leaves it." % (params["host"], holder.get("run_id", "?")),
            lock=holder, **{key: value for key, value in result.items() if key != "changed"})
    _private_dir(run_dir)
    plan_name = "plan.reattach.json" if reattach else "plan.json"
    write_private(os.path.join(run_dir, plan_name), json.dumps(params["plan"], indent=4, sort_keys=True) + "\n")
    # current -> runs/<active>, replaced atomically.
    current = os.path.join(state_dir, "current")
    link = "%s.tmp-%d" % (current, os.getpid())
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(os.path.join("runs", active), link)
    os.rename(link, current)
    result["job_exists"] = os.path.exists(os.path.join(run_dir, "job.json"))
    return result


def release(module, params):
    lock = os.path.join(params["state_dir"], "lock")
    holder = _read_json(lock)
    if holder is None and not os.path.lexists(lock):
        return {"changed": False, "released": False, "lock": {}}
    holder = holder or {}
    mine = holder.get("run_id", "") == params["run_id"]
    if not (mine or params["release_any"]):
        return {"changed": False, "released": False, "lock": holder}
    if not module.check_mode:
        os.unlink(lock)
    return {"changed": True, "released": True, "lock": holder}


def main():
    module = AnsibleModule(
        argument_spec=dict(
            state_dir=dict(type="path", required=True),
            run_id=dict(type="str", required=True),
            state=dict(type="str", choices=["held", "absent"], default="held"),
            stale_run_id=dict(type="str", default=""),
            record=dict(type="dict", default={}),
            plan=dict(type="dict", default={}),
            release_any=dict(type="bool", default=False),
            host=dict(type="str", default="this host"),
        ),
        supports_check_mode=True,
    )
    params = module.params
    if not params["run_id"] and params["state"] == "held":
        module.fail_json(msg="run_id is empty: a lock needs the id of the run that holds it")
    try:
        result = take(module, params) if params["state"] == "held" else release(module, params)
    except OSError as error:
        module.fail_json(msg="%s: %s" % (getattr(error, "filename", None) or params["state_dir"], error.strerror or error))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
