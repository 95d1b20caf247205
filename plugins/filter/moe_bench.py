# -*- coding: utf-8 -*-
"""Filters moe_bench_plan, moe_bench_m_list and moe_bench_run_id: the one place for timeout arithmetic;
moe_bench_inputs: the one place that gives every input its type (AWX sends survey answers as strings)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
name: moe_bench_plan
short_description: Compute every timeout of a benchmark run from its budgets
description:
  - Takes the budgets (seconds) and returns the run id, the async time limit, the retry counts of every
    poll loop, the planned downtime, the dead-man delay and the lock's time to live.
  - Raises a clear error for a missing, non-numeric, non-positive or inconsistent value, so a bad
    input stops the play before any host is touched.
  - Companion filters - C(moe_bench_m_list) (validate an M list given as a list or C("1,2,4")),
    C(moe_bench_run_id) (a run id C(YYYYmmddTHHMMSSZ-xxxxxx) for a given epoch) and
    C(moe_bench_inputs) (check the inputs against a role's argument spec and give them their types -
    C("0,1") becomes C([0, 1]), C("true") C(true), C("1800") C(1800), as the command line's typed values;
    returns C(inputs), without the options marked C(no_log), and C(errors), each naming its variable).
options:
  _input:
    description:
      - The budgets, in seconds - bench_budget_s, async_margin_s, poll_interval_s, stop_timeout_s,
        load_budget_s, health_poll_s, vram_wait_s, vram_interval_s, deadman_margin_s, lock_ttl_margin_s.
      - The margins may be 0, every other value must be more than 0. Numeric strings are accepted.
    type: dict
    required: true
  now_epoch:
    description: The time of the plan (seconds since the epoch, UTC). Default is now.
    type: float
"""

EXAMPLES = r"""
- name: Plan the run
  ansible.builtin.set_fact:
    bench_plan: "{{ {'bench_budget_s': 600, 'async_margin_s': 120, 'poll_interval_s': 10,
                     'stop_timeout_s': 120, 'load_budget_s': 900, 'health_poll_s': 10,
                     'vram_wait_s': 120, 'vram_interval_s': 5, 'deadman_margin_s': 600,
                     'lock_ttl_margin_s': 600} | moe_bench_plan }}"

- name: Validate the M list
  ansible.builtin.set_fact:
    m_list: "{{ '1,2,4,8' | moe_bench_m_list }}"
"""

RETURN = r"""
_value:
  description:
    - run_id, started_at (ISO 8601, UTC), started_epoch, every input as given (normalised to int or float),
      async_limit_s, poll_retries, health_retries, vram_retries, vram_timeout_s, planned_downtime_s,
      deadman_delay_s, lock_ttl_s.
  type: dict
"""

import math
import os
import re
import time
from datetime import datetime, timezone

from ansible.errors import AnsibleFilterError
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

BUDGET_KEYS = (
    "bench_budget_s", "async_margin_s", "poll_interval_s", "stop_timeout_s", "load_budget_s",
    "health_poll_s", "vram_wait_s", "vram_interval_s", "deadman_margin_s", "lock_ttl_margin_s",
)
MARGIN_KEYS = ("async_margin_s", "deadman_margin_s", "lock_ttl_margin_s")
M_MAX = 65536
RUN_ID_PATTERN = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{6}$")


def _number(key, value):
    """int or float from an int, float or numeric string; AnsibleFilterError otherwise."""
    if isinstance(value, bool):
        raise AnsibleFilterError("moe_bench_plan: %s must be a number of seconds, got %r" % (key, value))
    if isinstance(value, (int, float)):
        number = value
    else:
        text = str(value).strip()
        try:
            number = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                raise AnsibleFilterError(
                    "moe_bench_plan: %s must be a number of seconds, got %r" % (key, value)) from None
    if isinstance(number, float):
        if math.isnan(number) or math.isinf(number):
            raise AnsibleFilterError("moe_bench_plan: %s must be a finite number of seconds, got %r" % (key, value))
        if number.is_integer():
            number = int(number)
    return number


def _retries(total_s, interval_s):
    """Retries of an until loop polling every interval_s that must cover total_s (one more for the edge)."""
    return int(math.ceil(float(total_s) / interval_s)) + 1


def moe_bench_retries(total_s, interval_s):
    """The plan's retry count for one until loop, for roles used outside a planned run."""
    return _retries(_number("total_s", total_s), _number("interval_s", interval_s))


def _iso(epoch):
    return datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def moe_bench_run_id(now_epoch=None, suffix=None):
    """Run id YYYYmmddTHHMMSSZ-xxxxxx: UTC time of now_epoch and 6 random hex characters."""
    epoch = time.time() if now_epoch is None else float(_number("now_epoch", now_epoch))
    if suffix is None:
        suffix = os.urandom(3).hex()
    if not re.match(r"^[0-9a-f]{6}$", str(suffix)):
        raise AnsibleFilterError("moe_bench_run_id: suffix must be 6 lowercase hex characters, got %r" % (suffix,))
    return datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + suffix


def moe_bench_plan(settings, now_epoch=None):
    """Every timeout of a run, from its budgets (see DOCUMENTATION)."""
    if not isinstance(settings, dict):
        raise AnsibleFilterError("moe_bench_plan: expects a dict of budgets, got %s" % type(settings).__name__)
    missing = [key for key in BUDGET_KEYS if settings.get(key) in (None, "")]
    if missing:
        raise AnsibleFilterError("moe_bench_plan: missing budget(s): %s" % ", ".join(missing))
    value = dict((key, _number(key, settings[key])) for key in BUDGET_KEYS)
    for key in BUDGET_KEYS:
        if key in MARGIN_KEYS and value[key] < 0:
            raise AnsibleFilterError("moe_bench_plan: %s must be 0 or more seconds, got %s" % (key, value[key]))
        if key not in MARGIN_KEYS and value[key] <= 0:
            raise AnsibleFilterError("moe_bench_plan: %s must be more than 0 seconds, got %s" % (key, value[key]))

    async_limit_s = int(math.ceil(value["bench_budget_s"] + value["async_margin_s"]))
    inconsistencies = [
        ("poll_interval_s", value["poll_interval_s"], "bench_budget_s", value["bench_budget_s"]),
        ("health_poll_s", value["health_poll_s"], "load_budget_s", value["load_budget_s"]),
        ("vram_interval_s", value["vram_interval_s"], "vram_wait_s", value["vram_wait_s"]),
    ]
    for name, interval, budget_name, budget in inconsistencies:
        if interval > budget:
            raise AnsibleFilterError(
                "moe_bench_plan: %s (%s s) is longer than %s (%s s): the first poll would come after the deadline"
                % (name, interval, budget_name, budget))

    epoch = time.time() if now_epoch is None else float(_number("now_epoch", now_epoch))
    planned_downtime_s = int(math.ceil(
        value["stop_timeout_s"] + value["vram_wait_s"] + async_limit_s + value["load_budget_s"]))
    deadman_delay_s = int(math.ceil(planned_downtime_s + value["deadman_margin_s"]))
    plan = dict(value)
    plan.update({
        "run_id": moe_bench_run_id(epoch),
        "started_epoch": epoch,
        "started_at": _iso(epoch),
        "async_limit_s": async_limit_s,
        "poll_retries": _retries(async_limit_s, value["poll_interval_s"]),
        "health_retries": _retries(value["load_budget_s"], value["health_poll_s"]),
        "vram_retries": _retries(value["vram_wait_s"], value["vram_interval_s"]),
        "planned_downtime_s": planned_downtime_s,
        "deadman_delay_s": deadman_delay_s,
        "lock_ttl_s": int(math.ceil(deadman_delay_s + value["lock_ttl_margin_s"])),
    })
    return plan


def moe_bench_m_list(value):
    """A list of batch sizes M from a list or a "1,2,4" string: positive, strictly increasing, at most 65536."""
    if isinstance(value, str):
        items = [item.strip() for item in value.split(",")]
        if items == [""]:
            items = []
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        items = [value]
    else:
        raise AnsibleFilterError("moe_bench_m_list: expects a list or a comma-separated string such as "
                                 "'1,2,4', got %r" % (value,))
    if not items:
        raise AnsibleFilterError("moe_bench_m_list: the M list is empty; give at least one batch size, e.g. '1,2,4'")
    m_list = []
    for item in items:
        if isinstance(item, bool):
            raise AnsibleFilterError("moe_bench_m_list: %r is not a whole number" % (item,))
        try:
            text = str(item).strip()
            if not re.match(r"^[-+]?\d+$", text):
                raise ValueError(text)
            m = int(text)
        except ValueError:
            raise AnsibleFilterError("moe_bench_m_list: %r in %r is not a whole number" % (item, value)) from None
        if m < 1 or m > M_MAX:
            raise AnsibleFilterError("moe_bench_m_list: M=%d is outside 1..%d" % (m, M_MAX))
        if m_list and m == m_list[-1]:
            raise AnsibleFilterError("moe_bench_m_list: M=%d appears twice" % m)
        if m_list and m < m_list[-1]:
            raise AnsibleFilterError("moe_bench_m_list: the M list must be increasing, but %d comes after %d"
                                     % (m, m_list[-1]))
        m_list.append(m)
    return m_list


def moe_bench_inputs(argument_specs, given, entry_point="main"):
    """Check `given` (variable -> value) against a role's argument spec and convert each value the way
    the spec says (AWX passes survey answers and schedule data as strings: "0,1", "true", "1800").

    `argument_specs` is the role's meta/argument_specs.yml as data. Returns {"inputs": {...}, "errors":
    [...]}: the converted values of every option (options marked no_log are left out, so the result can be
    printed and stored) and the validator's messages, which name the variable. Never raises for a bad
    value, so that the caller can refuse it with its own message."""
    if not isinstance(argument_specs, dict) or "argument_specs" not in argument_specs:
        raise AnsibleFilterError("moe_bench_inputs: expects a role's argument_specs.yml as data")
    options = argument_specs["argument_specs"][entry_point]["options"]
    spec = dict((name, dict((key, value) for key, value in option.items() if key != "description"))
                for name, option in options.items())
    values = dict((name, given[name]) for name in spec if name in given and given[name] is not None)
    result = ArgumentSpecValidator(spec).validate(values, validate_role_argument_spec=True)
    inputs = dict((name, value) for name, value in result.validated_parameters.items()
                  if not spec[name].get("no_log"))
    return {"inputs": inputs, "errors": list(result.error_messages)}


class FilterModule(object):
    def filters(self):
        return {
            "moe_bench_plan": moe_bench_plan,
            "moe_bench_m_list": moe_bench_m_list,
            "moe_bench_run_id": moe_bench_run_id,
            "moe_bench_retries": moe_bench_retries,
            "moe_bench_inputs": moe_bench_inputs,
        }
