# -*- coding: utf-8 -*-
"""Maintenance-window arithmetic: RRULE + explicit time zone + duration.

A window spec is the same data that AWX schedules are made from, so the schedule that
launches a run and the guard that lets it stop the service cannot disagree:

    name: sunday-night                 # optional, for messages
    rrule: "DTSTART;TZID=Europe/Berlin:20260104T020000 RRULE:FREQ=WEEKLY;BYDAY=SU"
    timezone: Europe/Berlin            # must equal the TZID of DTSTART
    duration_s: 10800                  # how long each window stays open

The rrule may also be a bare rule ("FREQ=WEEKLY;BYDAY=SU;BYHOUR=2", with or without the
"RRULE:" prefix): it is then anchored at DTSTART 2024-01-01T00:00:00 in the window's time
zone, so hours and minutes not given by BYHOUR/BYMINUTE are 00. `maintenance_window_awx_rrule`
turns either form into the one-line string AWX schedules take.

Occurrences are wall-clock times in the window's time zone (02:00 stays 02:00 across a
daylight-saving change). A wall-clock start that does not exist on a spring-forward day
(02:30 in Europe/Berlin on the last Sunday of March) opens at the instant the clocks jump
to, read with the offset in force before the jump, as zoneinfo does with fold=0.
"""

from __future__ import annotations

import datetime as dt
import re
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

_AWX_RRULE = re.compile(
    r"^\s*DTSTART;TZID=(?P<tzid>[^:\s]+):(?P<start>\d{8}T\d{6})\s+RRULE:(?P<rule>\S+)\s*$"
)
_BARE_RRULE = re.compile(r"^FREQ=[A-Z]+(;[A-Z]+=[^;\s]+)*$", re.IGNORECASE)
_BARE_RRULE_DTSTART = "20240101T000000"
_UTC = dt.timezone.utc
# An occurrence search never needs to look further back than one window length, and a
# rule that yields nothing within this horizon is almost certainly a typo (e.g. BYMONTHDAY=31
# with FREQ=MONTHLY;BYMONTH=2).
_SEARCH_HORIZON = dt.timedelta(days=366 * 5)


class MaintenanceWindowError(ValueError):
    """A window spec or an argument that cannot be used; the message says which and why."""


def _error(spec_name, message):
    prefix = f"maintenance window '{spec_name}': " if spec_name else "maintenance window: "
    return MaintenanceWindowError(prefix + message)


def parse_window(spec):
    """Validate a window spec and return (name, ZoneInfo, rrule object, timedelta duration)."""
    # Imported here so a controller without python-dateutil gets a clear message
    # from the filter, not an import error while Ansible loads every filter plugin.
    try:
        from dateutil.rrule import rrulestr
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MaintenanceWindowError(
            "python-dateutil is required on the controller (pip install python-dateutil)"
        ) from exc

    if not isinstance(spec, dict):
        raise _error(None, f"the spec must be a mapping with rrule, timezone and duration_s, got {type(spec).__name__}")
    name = spec.get("name")
    missing = [key for key in ("rrule", "timezone", "duration_s") if spec.get(key) in (None, "")]
    if missing:
        raise _error(name, f"missing {', '.join(missing)} (a window needs rrule, timezone and duration_s)")

    timezone_name = spec["timezone"]
    try:
        zone = ZoneInfo(str(timezone_name))
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise _error(name, f"unknown time zone {timezone_name!r} (use an IANA name such as Europe/Berlin)") from exc

    duration = spec["duration_s"]
    if isinstance(duration, bool) or not isinstance(duration, (int, float, str)):
        raise _error(name, f"duration_s must be a number of seconds, got {duration!r}")
    try:
        duration_s = float(duration)
    except ValueError as exc:
        raise _error(name, f"duration_s must be a number of seconds, got {duration!r}") from exc
    if duration_s <= 0:
        raise _error(name, f"duration_s must be positive, got {duration!r}")

    rule_text, start_text = _split_rrule(name, spec["rrule"], timezone_name)
    if re.search(r"(^|;)UNTIL=\d{8}(T\d{6})?(;|$)", rule_text):
        raise _error(name, "UNTIL must be given in UTC with a trailing Z (RFC 5545 for a DTSTART with TZID)")
    dtstart = dt.datetime.strptime(start_text, "%Y%m%dT%H%M%S").replace(tzinfo=zone)
    try:
        rule = rrulestr("RRULE:" + rule_text, dtstart=dtstart)
    except (ValueError, TypeError) as exc:
        raise _error(name, f"rrule {rule_text!r} does not parse: {exc}") from exc
    return name, zone, rule, dt.timedelta(seconds=duration_s)


def _split_rrule(name, rrule_text, timezone_name):
    """Return (rule, DTSTART as YYYYmmddTHHMMSS) from either accepted rrule form."""
    text = str(rrule_text).strip()
    match = _AWX_RRULE.match(text)
    if match:
        if match["tzid"] != timezone_name:
            raise _error(
                name, f"rrule DTSTART is in {match['tzid']!r} but timezone is {timezone_name!r}; they must be the same"
            )
        return match["rule"], match["start"]
    bare = text[len("RRULE:"):] if text.upper().startswith("RRULE:") else text
    if "DTSTART" in bare.upper() or not _BARE_RRULE.match(bare):
        raise _error(
            name,
            f"rrule {rrule_text!r} is neither 'DTSTART;TZID=<zone>:YYYYMMDDTHHMMSS RRULE:<rule>' "
            "nor a bare rule such as 'FREQ=WEEKLY;BYDAY=SU;BYHOUR=2' (a DTSTART needs an explicit TZID)",
        )
    return bare, _BARE_RRULE_DTSTART


def awx_rrule(spec):
    """The one-line 'DTSTART;TZID=... RRULE:...' string for an AWX schedule."""
    name, _zone, _rule, _duration = parse_window(spec)
    rule_text, start_text = _split_rrule(name, spec["rrule"], spec["timezone"])
    return f"DTSTART;TZID={spec['timezone']}:{start_text} RRULE:{rule_text}"


def _parse_now(now):
    if now is None or now == "":
        return dt.datetime.now(_UTC)
    if isinstance(now, dt.datetime):
        moment = now
    else:
        text = str(now).strip()
        try:
            moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
        except ValueError as exc:
            raise MaintenanceWindowError(f"now {now!r} is not an ISO-8601 time") from exc
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise MaintenanceWindowError(f"now {now!r} has no UTC offset; give it with Z or +HH:MM")
    return moment


def _occurrence_instant(occurrence):
    """Turn a wall-clock occurrence into a real instant (UTC)."""
    # Round-tripping through UTC normalises a non-existent wall time (inside a
    # spring-forward gap) to the instant it denotes with fold=0.
    return occurrence.astimezone(_UTC)


def _occurrences_after(rule, moment, zone, inclusive=False):
    """Yield occurrence instants (UTC) at or after `moment`, in order."""
    local = moment.astimezone(zone)
    # Step back a day so that wall-clock gaps and folds near `moment` cannot hide one.
    cursor = rule.after(local - dt.timedelta(days=1), inc=True)
    horizon = moment + _SEARCH_HORIZON
    while cursor is not None:
        instant = _occurrence_instant(cursor)
        if instant > horizon:
            return
        if instant > moment or (inclusive and instant == moment):
            yield instant
        cursor = rule.after(cursor, inc=False)


def _iso(instant, zone=None):
    if zone is None:
        return instant.astimezone(_UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return instant.astimezone(zone).isoformat(timespec="seconds")


def next_windows(spec, after=None, count=1):
    """The next `count` window openings strictly after `after`, as UTC ISO strings."""
    name, zone, rule, duration = parse_window(spec)
    moment = _parse_now(after)
    try:
        count = int(count)
    except (TypeError, ValueError) as exc:
        raise _error(name, f"count must be an integer, got {count!r}") from exc
    starts = []
    for instant in _occurrences_after(rule, moment, zone):
        starts.append(_iso(instant))
        if len(starts) >= count:
            break
    return starts


def _current_window(rule, zone, duration, moment):
    """The (start, end) of the window open at `moment`, or None."""
    # The latest opening at or before `moment`; only openings within one duration matter.
    earliest = (moment - duration).astimezone(zone)
    latest_open = None
    cursor = rule.after(earliest - dt.timedelta(days=1), inc=True)
    while cursor is not None:
        instant = _occurrence_instant(cursor)
        if instant > moment:
            break
        if instant + duration > moment:
            # Overlapping windows: keep the one that stays open longest.
            if latest_open is None or instant + duration > latest_open[1]:
                latest_open = (instant, instant + duration)
        cursor = rule.after(cursor, inc=False)
    return latest_open


def check_window(spec, planned_downtime_s, now=None):
    """Decide whether `now + planned_downtime_s` fits inside the window open at `now`."""
    name, zone, rule, duration = parse_window(spec)
    moment = _parse_now(now)
    if isinstance(planned_downtime_s, bool):
        raise _error(name, f"planned_downtime_s must be a number of seconds, got {planned_downtime_s!r}")
    try:
        downtime_s = float(planned_downtime_s)
    except (TypeError, ValueError) as exc:
        raise _error(name, f"planned_downtime_s must be a number of seconds, got {planned_downtime_s!r}") from exc
    if downtime_s < 0:
        raise _error(name, f"planned_downtime_s must not be negative, got {planned_downtime_s!r}")

    planned_end = moment + dt.timedelta(seconds=downtime_s)
    current = _current_window(rule, zone, duration, moment)
    upcoming = next(_occurrences_after(rule, moment, zone), None)
    label = f"'{name}' " if name else ""

    result = {
        "name": name,
        "rrule": spec["rrule"],
        "timezone": spec["timezone"],
        "duration_s": duration.total_seconds(),
        "now": _iso(moment),
        "now_local": _iso(moment, zone),
        "planned_downtime_s": downtime_s,
        "planned_end": _iso(planned_end),
        "in_window": current is not None,
        "fits": False,
        "window_start": None,
        "window_end": None,
        "window_end_local": None,
        "remaining_s": 0.0,
        "next_window_start": _iso(upcoming) if upcoming else None,
        "next_window_start_local": _iso(upcoming, zone) if upcoming else None,
        "next_window_end": _iso(upcoming + duration) if upcoming else None,
        "next_window_fits": bool(upcoming) and duration.total_seconds() >= downtime_s,
    }
    next_text = (
        f"the next window opens {result['next_window_start_local']} ({result['next_window_start']})"
        if upcoming
        else "the rule has no further windows"
    )
    if current is not None:
        start, end = current
        remaining = (end - moment).total_seconds()
        result.update(
            window_start=_iso(start),
            window_end=_iso(end),
            window_end_local=_iso(end, zone),
            remaining_s=remaining,
            fits=planned_end <= end,
        )
        if result["fits"]:
            result["reason"] = (
                f"inside window {label}until {result['window_end_local']}: planned downtime "
                f"{downtime_s:.0f} s ends {result['planned_end']}, {remaining - downtime_s:.0f} s to spare"
            )
        else:
            result["reason"] = (
                f"window {label}closes {result['window_end_local']}, {remaining:.0f} s from now, but the "
                f"planned downtime is {downtime_s:.0f} s (until {result['planned_end']}); {next_text}"
            )
    else:
        result["reason"] = f"outside window {label}at {result['now_local']}; {next_text}"
    if upcoming and not result["next_window_fits"]:
        result["reason"] += (
            f"; note: the window lasts {duration.total_seconds():.0f} s, shorter than the planned "
            f"downtime, so no window of this rule can fit this run"
        )
    return result


def maintenance_window_check(spec, planned_downtime_s, now=None):
    return check_window(spec, planned_downtime_s, now=now)


def maintenance_window_next(spec, after=None, count=1):
    return next_windows(spec, after=after, count=count)


def maintenance_window_awx_rrule(spec):
    return awx_rrule(spec)


def maintenance_window_validate(spec):
    """Return the spec unchanged when it is valid; raise with the reason otherwise."""
    parse_window(spec)
    return spec


class FilterModule:
    """Maintenance-window filters."""

    def filters(self):
        # Ansible shows the exception text to the operator, so errors surface as
        # AnsibleFilterError with the spec's own message.
        from ansible.errors import AnsibleFilterError

        def wrap(function):
            def run(*args, **kwargs):
                try:
                    return function(*args, **kwargs)
                except MaintenanceWindowError as exc:
                    raise AnsibleFilterError(str(exc)) from exc

            run.__name__ = function.__name__
            run.__doc__ = function.__doc__
            return run

        return {
            "maintenance_window_check": wrap(maintenance_window_check),
            "maintenance_window_next": wrap(maintenance_window_next),
            "maintenance_window_validate": wrap(maintenance_window_validate),
            "maintenance_window_awx_rrule": wrap(maintenance_window_awx_rrule),
        }
