# -*- coding: utf-8 -*-
"""Filters moe_bench_plan, moe_bench_m_list and moe_bench_run_id: the one place for timeout arithmetic;
moe_bench_inputs: the one place that gives every input its type (AWX sends survey answers as strings)."""

from __future__ import annotations

# Each filter's documentation is the YAML file of its name beside this one (ansible-doc -t filter NAME).

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
MARGIN_KEYS = ("async_margin_s", "deadman_margin_s", "lock_ttl_margin_s", "stop_margin_s", "settle_s")
# Optional keys and their defaults.
# gpu_runs: payload runs one after the other on the host (one per GPU when they run in turn, 1 when
# every GPU's payload runs at once): the benchmark budget is per payload run.
OPTIONAL_KEYS = {"stop_margin_s": 0, "settle_s": 0, "vram_waits": 1, "gpu_runs": 1}
# The variable an operator sets for each key: every refusal names it as the operator writes it.
VARIABLE_OF = {
    "bench_budget_s": "moe_bench_bench_budget_s",
    "async_margin_s": "moe_bench_async_margin_s",
    "poll_interval_s": "moe_bench_bench_poll_s",
    "stop_timeout_s": "moe_bench_stop_timeout_s",
    "stop_margin_s": "moe_bench_stop_margin_s",
    "load_budget_s": "moe_bench_load_budget_s",
    "health_poll_s": "moe_bench_health_poll_s",
    "vram_wait_s": "moe_bench_vram_timeout_s",
    "vram_interval_s": "moe_bench_vram_interval_s",
    "deadman_margin_s": "moe_bench_deadman_margin_s",
    "lock_ttl_margin_s": "moe_bench_lock_ttl_margin_s",
    "settle_s": "moe_bench_health_settle_s",
    "vram_waits": "vram_waits",
    "gpu_runs": "moe_bench_gpus (with moe_bench_gpu_parallel false)",
    "unit_stop_timeout_s": "the unit's TimeoutStopSec",
}
TIMESPAN_UNITS = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1, "sec": 1, "min": 60,
                  "h": 3600, "hr": 3600, "d": 86400, "w": 604800}
M_MAX = 65536
# Ansible's async wrapper looks at its job's time limit every 5 s and writes the job's final record
# 1 s after the kill: a job at its limit reads as ended up to 6 s after the limit.
ASYNC_KILL_SLACK_S = 6
# Before the unit starts, whatever of the benchmark outlived its job is stopped: SIGTERM, this
# grace, SIGKILL, then this wait for it to be gone (service_recover, through the payload_stop module).
PAYLOAD_TERM_GRACE_S = 10
PAYLOAD_KILL_WAIT_S = 10
RUN_ID_PATTERN = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{6}$")


def _name(key):
    return VARIABLE_OF.get(key, key)


def _number(key, value):
    """int or float from an int, float or numeric string; AnsibleFilterError otherwise."""
    if isinstance(value, bool):
        raise AnsibleFilterError("%s must be a number of seconds, got %r" % (_name(key), value))
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
                    "%s must be a number of seconds, got %r" % (_name(key), value)) from None
    if isinstance(number, float):
        if math.isnan(number) or math.isinf(number):
            raise AnsibleFilterError("%s must be a finite number of seconds, got %r" % (_name(key), value))
        if number.is_integer():
            number = int(number)
    return number


def _retries(total_s, interval_s):
    """Retries of an until loop polling every interval_s that must cover total_s (one more for the edge)."""
    return int(math.ceil(float(total_s) / interval_s)) + 1


def moe_bench_timespan_s(value):
    """Seconds of a systemd timespan as `systemctl show` prints it ("1min 30s", "90s", "500ms",
    "infinity") or a number of seconds; None for infinity or an empty value."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    if text in ("", "infinity"):
        return None
    if re.match(r"^[0-9.]+$", text):
        return _number("timespan", text)
    parts = re.findall(r"([0-9.]+)\s*([a-z]+)", text)
    if not parts or re.sub(r"[0-9.]+\s*[a-z]+", "", text).strip():
        raise AnsibleFilterError("moe_bench_timespan_s: %r is not a systemd timespan" % (value,))
    total = 0.0
    for amount, unit in parts:
        if unit not in TIMESPAN_UNITS:
            raise AnsibleFilterError("moe_bench_timespan_s: unknown unit %r in %r" % (unit, value))
        total += float(amount) * TIMESPAN_UNITS[unit]
    return int(total) if float(total).is_integer() else total


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


STOP_MODES = ("always", "auto", "never")
REHEARSE_WORDS = {"true": "true", "yes": "true", "on": "true", "1": "true",
                  "false": "false", "no": "false", "off": "false", "0": "false", "required": "required"}


def moe_bench_rehearse_mode(value):
    """moe_bench_rehearse as 'true', 'false' or 'required', from a bool or a string (AWX sends
    strings; YAML's true arrives as a bool)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = "" if value is None else str(value).strip().lower()
    if text not in REHEARSE_WORDS:
        raise AnsibleFilterError("moe_bench_rehearse must be true, false or required, got %r" % (value,))
    return REHEARSE_WORDS[text]


def moe_bench_stop_mode(value):
    """moe_bench_stop as 'always', 'auto' or 'never'."""
    text = "" if value is None else str(value).strip().lower()
    if text not in STOP_MODES:
        raise AnsibleFilterError("moe_bench_stop must be always, auto or never, got %r" % (value,))
    return text


def moe_bench_stop_decision(mode, gpus, chosen, need_mib, reattach=False):
    """Whether this run stops the unit (moe_bench_stop), and why, from the memory read beside the
    serving unit: {"mode", "stop", "beside", "why", "need_mib", "gpus_beside"}. always stops;
    never runs only the rehearsal (no stop, no full run); auto runs the full benchmark beside the
    unit when every chosen GPU has need_mib free (the estimate plus the margin), and falls back to
    stopping when one is short or unread. A re-attached run stopped the unit already."""
    mode = moe_bench_stop_mode(mode)
    need = int(_number("need_mib", need_mib))
    chosen = [int(index) for index in chosen or []]
    seen = [gpu for gpu in gpus or [] if int(gpu.get("index", -1)) in chosen]
    free = ", ".join("GPU %s %s MiB free" % (gpu["index"], gpu.get("free_mib")) for gpu in seen)
    short = [gpu for gpu in seen if float(gpu.get("free_mib") or 0) < need]
    decision = {"mode": mode, "need_mib": need, "gpus_beside": seen if mode == "auto" else []}
    if reattach:
        decision.update(stop=True, beside=False, why="re-attached to an unfinished run that stopped the unit")
    elif mode == "never":
        decision.update(stop=False, beside=False,
                        why="moe_bench_stop is never: only the rehearsal ran (a reduced run beside the live service), "
                            "the unit was not stopped")
    elif mode == "always":
        decision.update(stop=True, beside=False, why="moe_bench_stop is always")
    elif len(seen) == len(chosen) and chosen and not short:
        decision.update(stop=False, beside=True,
                        why="moe_bench_stop is auto and the run fits beside the serving unit (%s; it needs %d MiB: "
                            "the estimate plus moe_bench_vram_margin_mib), so the unit was not stopped" % (free, need))
    else:
        missing = sorted(set(chosen) - set(int(gpu["index"]) for gpu in seen))
        decision.update(stop=True, beside=False,
                        why="moe_bench_stop is auto but the run does not fit beside the serving unit (%s; it needs %d "
                            "MiB: the estimate plus moe_bench_vram_margin_mib): falling back to stopping it"
                            % (free + ("; GPU %s unread" % ",".join(map(str, missing)) if missing else ""), need))
    return decision


def moe_bench_plan(settings, now_epoch=None):
    """Every timeout of a run, from its budgets (see DOCUMENTATION)."""
    if not isinstance(settings, dict):
        raise AnsibleFilterError("moe_bench_plan: expects a dict of budgets, got %s" % type(settings).__name__)
    missing = [key for key in BUDGET_KEYS if settings.get(key) in (None, "")]
    if missing:
        raise AnsibleFilterError("missing budget(s): %s" % ", ".join(_name(key) for key in missing))
    value = dict((key, _number(key, settings[key])) for key in BUDGET_KEYS)
    for key, default in OPTIONAL_KEYS.items():
        given = settings.get(key)
        value[key] = default if given in (None, "") else _number(key, given)
    for key in BUDGET_KEYS + tuple(OPTIONAL_KEYS):
        if key in MARGIN_KEYS and value[key] < 0:
            raise AnsibleFilterError("%s must be 0 or more seconds, got %s" % (_name(key), value[key]))
        if key not in MARGIN_KEYS and value[key] <= 0:
            raise AnsibleFilterError("%s must be more than 0 seconds, got %s" % (_name(key), value[key]))
    try:
        unit_stop_s = moe_bench_timespan_s(settings.get("unit_stop_timeout_s"))
    except AnsibleFilterError as error:
        raise AnsibleFilterError("the unit's TimeoutStopSec cannot be read: %s" % error) from None

    # One payload per chosen GPU: all at once take one budget, one after the other one budget each.
    bench_total_s = value["bench_budget_s"] * value["gpu_runs"]
    async_limit_s = int(math.ceil(bench_total_s + value["async_margin_s"]))
    inconsistencies = [
        ("poll_interval_s", value["poll_interval_s"], "bench_budget_s", value["bench_budget_s"]),
        ("health_poll_s", value["health_poll_s"], "load_budget_s", value["load_budget_s"]),
        ("vram_interval_s", value["vram_interval_s"], "vram_wait_s", value["vram_wait_s"]),
    ]
    for name, interval, budget_name, budget in inconsistencies:
        if interval > budget:
            raise AnsibleFilterError(
                "%s (%s s) is longer than %s (%s s): the first poll would come after the deadline"
                % (_name(name), interval, _name(budget_name), budget))

    # The stop really lasts as long as the unit's own TimeoutStopSec allows, whatever the
    # configured stop timeout says: the longer of the two is the one in force.
    stop_s = value["stop_timeout_s"]
    corrected = unit_stop_s is not None and unit_stop_s > stop_s
    if corrected:
        stop_s = unit_stop_s
    stop_wait_s = int(math.ceil(stop_s + value["stop_margin_s"]))
    vram_total_s = int(math.ceil(value["vram_wait_s"] * value["vram_waits"]))
    epoch = time.time() if now_epoch is None else float(_number("now_epoch", now_epoch))
    # Downtime: from the stop to the first healthy answer, each part at its limit (the benchmark's
    # limit with the wrapper's lag past it and the stop of a payload that outlived its job).
    planned_downtime_s = int(math.ceil(
        stop_wait_s
        + vram_total_s
        + async_limit_s + ASYNC_KILL_SLACK_S + value["poll_interval_s"]
        + PAYLOAD_TERM_GRACE_S + PAYLOAD_KILL_WAIT_S
        + value["load_budget_s"] + value["health_poll_s"]))
    # The dead-man switch must never fire inside a legitimate run: the settle period after the
    # first healthy answer still belongs to the run.
    deadman_delay_s = int(math.ceil(planned_downtime_s + value["settle_s"] + value["deadman_margin_s"]))
    # Whether the unit is stopped at all: never runs only the rehearsal beside the live service,
    # so it plans no downtime; auto may stop (the deadline above is the one armed then) or run
    # beside the service. moe_bench_stop_decision decides, once the memory beside it is read; a
    # run it does not stop arms no dead-man switch.
    stop_mode = moe_bench_stop_mode(settings.get("stop_mode", "always"))
    rehearse = moe_bench_rehearse_mode(settings.get("rehearse", "true"))
    if stop_mode == "never" and rehearse == "false":
        raise AnsibleFilterError("moe_bench_stop never runs only the rehearsal beside the service, "
                                 "so moe_bench_rehearse cannot be false")
    if stop_mode == "never":
        planned_downtime_s = 0
    plan = dict(value)
    plan.update({
        "run_id": moe_bench_run_id(epoch),
        "started_epoch": epoch,
        "started_at": _iso(epoch),
        "bench_total_s": bench_total_s,
        "async_limit_s": async_limit_s,
        # The polls cover the limit and the wrapper's lag past it, so a job killed at its limit
        # is reported as such (not as still running when the polls run out).
        "poll_retries": _retries(async_limit_s + ASYNC_KILL_SLACK_S, value["poll_interval_s"]),
        "payload_term_grace_s": PAYLOAD_TERM_GRACE_S,
        "payload_kill_wait_s": PAYLOAD_KILL_WAIT_S,
        "health_retries": _retries(value["load_budget_s"], value["health_poll_s"]),
        "vram_retries": _retries(value["vram_wait_s"], value["vram_interval_s"]),
        "unit_stop_timeout_s": unit_stop_s,
        "stop_s": stop_s,
        "stop_corrected_from_unit": corrected,
        "stop_wait_s": stop_wait_s,
        "vram_total_s": vram_total_s,
        "planned_downtime_s": planned_downtime_s,
        "deadman_delay_s": deadman_delay_s,
        "lock_ttl_s": int(math.ceil(deadman_delay_s + value["lock_ttl_margin_s"])),
        "stop_mode": stop_mode,
        "rehearse": rehearse,
        # The rehearsal is one reduced run of the payload: the benchmark budget bounds it.
        "rehearse_timeout_s": int(math.ceil(value["bench_budget_s"])),
    })
    return plan


# Folders the system owns whose every direct child is the system's too: a dedicated payload or
# state folder never is one of them, nor one of their children (/etc/foo, /usr/local, /var/lib).
SYSTEM_PARENTS = ("/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media",
                  "/mnt", "/proc", "/run", "/sbin", "/sys", "/usr", "/var")


def moe_bench_folder(path):
    """A dedicated host folder (payload, state): absolute, normalised, and neither /, a top-level
    folder, nor a direct child of one of the system's own folders. Returns the normalised path."""
    if not isinstance(path, str) or not path.strip():
        raise AnsibleFilterError("must be an absolute path, got %r" % (path,))
    text = path.strip()
    if not text.startswith("/"):
        raise AnsibleFilterError("must be an absolute path, got %r (relative to what on the host?)" % (text,))
    if ".." in text.split("/"):
        raise AnsibleFilterError("must not contain '..', got %r" % (text,))
    normal = "/" + "/".join(part for part in text.split("/") if part not in ("", "."))
    depth = normal.count("/") if normal != "/" else 0
    if depth <= 1:
        raise AnsibleFilterError(
            "%r is %s, not a dedicated folder: the payload is copied into it and the run state kept there; "
            "use a folder of its own such as /opt/moe-bench or /var/lib/moe-bench"
            % (text, "the root folder" if depth == 0 else "a top-level folder of the system"))
    parent = normal.rsplit("/", 1)[0]
    if depth == 2 and parent in SYSTEM_PARENTS:
        raise AnsibleFilterError(
            "%r is a folder of the system's own (a direct child of %s), not a dedicated folder; "
            "use a folder of its own such as /opt/moe-bench or /var/lib/moe-bench" % (text, parent))
    return normal


SERIAL_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def moe_bench_serial(value):
    """Ansible's serial as an operator gives it (a number, a percentage such as "25%", or a list of
    them; AWX sends strings, "1,2,50%" included): whole numbers of at least 1 and percentages in
    (0, 100]. Returns the value typed for the play's serial keyword."""
    if isinstance(value, str) and "," in value:
        value = [item.strip() for item in value.split(",")]
    if isinstance(value, (list, tuple)):
        if not value:
            raise AnsibleFilterError("moe_bench_serial: the list is empty; give at least one batch size such as 1")
        return [moe_bench_serial(item) for item in value]
    if isinstance(value, bool) or value is None:
        raise AnsibleFilterError("moe_bench_serial must be a number of hosts, a percentage or a list of them, got %r"
                                 % (value,))
    text = str(value).strip()
    match = SERIAL_PATTERN.match(text)
    if match:
        percent = float(match.group(1))
        if not 0 < percent <= 100:
            raise AnsibleFilterError("moe_bench_serial: %r is not a percentage in (0, 100]" % (value,))
        return text.replace(" ", "")
    if not re.match(r"^\d+$", text):
        raise AnsibleFilterError("moe_bench_serial must be a number of hosts, a percentage or a list of them, got %r"
                                 % (value,))
    number = int(text)
    if number < 1:
        # Ansible reads serial 0 as "every host at once": never what an operator who typed 0 meant.
        raise AnsibleFilterError("moe_bench_serial must be at least 1 (Ansible reads 0 as every host at once), got %r"
                                 % (value,))
    return number


def moe_bench_check(value, what="plan"):
    """The refusal message for a plan's budgets (what='plan'), an M list (what='m_list') or a
    dedicated host folder (what='folder'), or an empty string when the input is valid: lets a
    task fail with a message of its own."""
    check = {"plan": moe_bench_plan, "m_list": moe_bench_m_list, "folder": moe_bench_folder,
             "serial": moe_bench_serial}.get(what)
    if check is None:
        raise AnsibleFilterError("moe_bench_check: what must be plan, m_list, folder or serial, got %r" % (what,))
    try:
        check(value)
    except AnsibleFilterError as error:
        return str(error.message if hasattr(error, "message") else error)
    return ""


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
            "moe_bench_check": moe_bench_check,
            "moe_bench_folder": moe_bench_folder,
            "moe_bench_timespan_s": moe_bench_timespan_s,
            "moe_bench_inputs": moe_bench_inputs,
            "moe_bench_serial": moe_bench_serial,
            "moe_bench_rehearse_mode": moe_bench_rehearse_mode,
            "moe_bench_stop_mode": moe_bench_stop_mode,
            "moe_bench_stop_decision": moe_bench_stop_decision,
        }
