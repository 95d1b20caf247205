"""Window arithmetic of plugins/filter/maintenance_window.py, with real time zones."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "maintenance_window", REPO / "plugins" / "filter" / "maintenance_window.py"
)
mw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mw)

# Sundays 02:00 Berlin wall-clock time, three hours. 2026: CEST starts 29 March, ends 25 October.
SUNDAY_BERLIN = {
    "name": "sunday-night",
    "rrule": "DTSTART;TZID=Europe/Berlin:20260104T020000 RRULE:FREQ=WEEKLY;BYDAY=SU",
    "timezone": "Europe/Berlin",
    "duration_s": 3 * 3600,
}


def test_next_windows_keep_wall_clock_time_across_spring_forward():
    # 02:00 does not exist on 29 March: the window opens at the jump (01:00Z), the next
    # Sunday it opens at 02:00 CEST = 00:00Z.
    assert mw.next_windows(SUNDAY_BERLIN, after="2026-03-20T00:00:00Z", count=3) == [
        "2026-03-22T01:00:00Z",
        "2026-03-29T01:00:00Z",
        "2026-04-05T00:00:00Z",
    ]


def test_next_windows_keep_wall_clock_time_across_fall_back():
    assert mw.next_windows(SUNDAY_BERLIN, after="2026-10-18T12:00:00Z", count=3) == [
        "2026-10-25T00:00:00Z",  # 02:00 happens twice; fold=0 is the first one, CEST (+02:00)
        "2026-11-01T01:00:00Z",
        "2026-11-08T01:00:00Z",
    ]


def test_next_windows_are_strictly_after_the_given_time():
    assert mw.next_windows(SUNDAY_BERLIN, after="2026-04-05T00:00:00Z", count=1) == ["2026-04-12T00:00:00Z"]


def test_new_york_window_differs_from_berlin_between_the_two_dst_changes():
    # The US changes on 8 March 2026, Europe on 29 March: the schedule must follow its own zone.
    new_york = dict(
        SUNDAY_BERLIN,
        rrule="DTSTART;TZID=America/New_York:20260104T020000 RRULE:FREQ=WEEKLY;BYDAY=SU",
        timezone="America/New_York",
    )
    assert mw.next_windows(new_york, after="2026-03-10T00:00:00Z", count=1) == ["2026-03-15T06:00:00Z"]
    assert mw.next_windows(SUNDAY_BERLIN, after="2026-03-10T00:00:00Z", count=1) == ["2026-03-15T01:00:00Z"]


def test_inside_window_with_room_fits():
    decision = mw.check_window(SUNDAY_BERLIN, 3600, now="2026-04-05T00:30:00Z")
    assert decision["in_window"] is True
    assert decision["fits"] is True
    assert decision["window_start"] == "2026-04-05T00:00:00Z"
    assert decision["window_end"] == "2026-04-05T03:00:00Z"
    assert decision["window_end_local"] == "2026-04-05T05:00:00+02:00"
    assert decision["remaining_s"] == 2.5 * 3600
    assert decision["planned_end"] == "2026-04-05T01:30:00Z"
    assert decision["next_window_start"] == "2026-04-12T00:00:00Z"


def test_downtime_ending_exactly_at_window_end_fits_one_second_more_does_not():
    assert mw.check_window(SUNDAY_BERLIN, 9000, now="2026-04-05T00:30:00Z")["fits"] is True
    late = mw.check_window(SUNDAY_BERLIN, 9001, now="2026-04-05T00:30:00Z")
    assert late["fits"] is False
    assert late["in_window"] is True
    assert "closes 2026-04-05T05:00:00+02:00" in late["reason"]
    assert "next window opens 2026-04-12T02:00:00+02:00" in late["reason"]


def test_outside_window_refuses_and_names_the_next_opening_in_local_time():
    decision = mw.check_window(SUNDAY_BERLIN, 600, now="2026-04-07T10:00:00Z")
    assert decision["in_window"] is False
    assert decision["fits"] is False
    assert decision["window_end"] is None
    assert decision["next_window_start"] == "2026-04-12T00:00:00Z"
    assert decision["next_window_start_local"] == "2026-04-12T02:00:00+02:00"
    assert "outside window 'sunday-night'" in decision["reason"]
    assert "2026-04-12T02:00:00+02:00" in decision["reason"]


def test_just_before_and_at_opening():
    assert mw.check_window(SUNDAY_BERLIN, 60, now="2026-04-04T23:59:59Z")["in_window"] is False
    opening = mw.check_window(SUNDAY_BERLIN, 60, now="2026-04-05T00:00:00Z")
    assert opening["in_window"] is True and opening["fits"] is True
    assert mw.check_window(SUNDAY_BERLIN, 0, now="2026-04-05T03:00:00Z")["in_window"] is False


def test_window_on_the_spring_forward_night_lasts_its_duration_in_real_seconds():
    decision = mw.check_window(SUNDAY_BERLIN, 3600, now="2026-03-29T02:30:00Z")
    assert decision["window_start"] == "2026-03-29T01:00:00Z"
    assert decision["window_end"] == "2026-03-29T04:00:00Z"
    assert decision["fits"] is True


def test_now_accepts_offsets_and_rejects_naive_times():
    same = mw.check_window(SUNDAY_BERLIN, 60, now="2026-04-05T02:30:00+02:00")
    assert same["now"] == "2026-04-05T00:30:00Z" and same["fits"] is True
    with pytest.raises(mw.MaintenanceWindowError, match="no UTC offset"):
        mw.check_window(SUNDAY_BERLIN, 60, now="2026-04-05T02:30:00")
    with pytest.raises(mw.MaintenanceWindowError, match="not an ISO-8601"):
        mw.check_window(SUNDAY_BERLIN, 60, now="Sunday night")


def test_default_now_is_the_current_time():
    import datetime as dt

    decision = mw.check_window(SUNDAY_BERLIN, 60)
    now = dt.datetime.fromisoformat(decision["now"].replace("Z", "+00:00"))
    assert abs((dt.datetime.now(dt.timezone.utc) - now).total_seconds()) < 60


def test_window_shorter_than_the_downtime_says_no_window_can_fit():
    short = dict(SUNDAY_BERLIN, duration_s=600)
    decision = mw.check_window(short, 3600, now="2026-04-05T00:01:00Z")
    assert decision["fits"] is False
    assert decision["next_window_fits"] is False
    assert "no window of this rule can fit" in decision["reason"]


def test_daily_overlapping_rule_picks_the_window_open_longest():
    spec = {
        "rrule": "DTSTART;TZID=UTC:20260101T000000 RRULE:FREQ=HOURLY;INTERVAL=1",
        "timezone": "UTC",
        "duration_s": 2 * 3600,
    }
    decision = mw.check_window(spec, 5400, now="2026-02-01T10:15:00Z")
    assert decision["window_start"] == "2026-02-01T10:00:00Z"
    assert decision["window_end"] == "2026-02-01T12:00:00Z"
    assert decision["fits"] is True


def test_finished_rule_has_no_next_window():
    spec = dict(SUNDAY_BERLIN, rrule="DTSTART;TZID=Europe/Berlin:20260104T020000 RRULE:FREQ=WEEKLY;COUNT=2")
    decision = mw.check_window(spec, 60, now="2026-06-01T00:00:00Z")
    assert decision["fits"] is False
    assert decision["next_window_start"] is None
    assert "no further windows" in decision["reason"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("weekly", "must be a mapping"),
        ({"rrule": SUNDAY_BERLIN["rrule"], "timezone": "Europe/Berlin"}, "missing duration_s"),
        (dict(SUNDAY_BERLIN, timezone="Europe/Atlantis"), "unknown time zone 'Europe/Atlantis'"),
        (dict(SUNDAY_BERLIN, timezone="America/New_York"), "DTSTART is in 'Europe/Berlin' but timezone is 'America/New_York'"),
        (dict(SUNDAY_BERLIN, rrule="DTSTART:20260104T020000Z RRULE:FREQ=WEEKLY"), "DTSTART needs an explicit TZID"),
        (dict(SUNDAY_BERLIN, rrule="every sunday at two"), "neither"),
        (dict(SUNDAY_BERLIN, rrule="DTSTART;TZID=Europe/Berlin:20260104T020000 RRULE:FREQ=SOMETIMES"), "does not parse"),
        (
            dict(SUNDAY_BERLIN, rrule="DTSTART;TZID=Europe/Berlin:20260104T020000 RRULE:FREQ=WEEKLY;UNTIL=20260301T000000"),
            "UNTIL must be given in UTC",
        ),
        (dict(SUNDAY_BERLIN, duration_s=0), "duration_s must be positive"),
        (dict(SUNDAY_BERLIN, duration_s="three hours"), "duration_s must be a number"),
        (dict(SUNDAY_BERLIN, duration_s=True), "duration_s must be a number"),
        ({k: v for k, v in SUNDAY_BERLIN.items() if k != "duration_s"} | {"duraton_s": 5}, "missing duration_s"),
    ],
)
def test_bad_specs_fail_with_the_reason(spec, message):
    with pytest.raises(mw.MaintenanceWindowError, match=message):
        mw.check_window(spec, 60, now="2026-04-05T00:30:00Z")


def test_bare_rule_is_anchored_in_the_window_time_zone():
    bare = dict(SUNDAY_BERLIN, rrule="FREQ=WEEKLY;BYDAY=SU;BYHOUR=2")
    assert mw.next_windows(bare, after="2026-03-20T00:00:00Z", count=3) == [
        "2026-03-22T01:00:00Z",
        "2026-03-29T01:00:00Z",
        "2026-04-05T00:00:00Z",
    ]
    assert mw.awx_rrule(bare) == "DTSTART;TZID=Europe/Berlin:20240101T000000 RRULE:FREQ=WEEKLY;BYDAY=SU;BYHOUR=2"
    prefixed = dict(bare, rrule="RRULE:FREQ=WEEKLY;BYDAY=SU;BYHOUR=2")
    assert mw.awx_rrule(prefixed) == mw.awx_rrule(bare)


def test_awx_rrule_of_a_full_rule_is_the_rule_on_one_line():
    assert mw.awx_rrule(SUNDAY_BERLIN) == SUNDAY_BERLIN["rrule"]
    two_lines = dict(SUNDAY_BERLIN, rrule=SUNDAY_BERLIN["rrule"].replace(" RRULE", "\nRRULE"))
    assert mw.awx_rrule(two_lines) == SUNDAY_BERLIN["rrule"]


def test_bad_planned_downtime_fails():
    with pytest.raises(mw.MaintenanceWindowError, match="must not be negative"):
        mw.check_window(SUNDAY_BERLIN, -1, now="2026-04-05T00:30:00Z")
    with pytest.raises(mw.MaintenanceWindowError, match="number of seconds"):
        mw.check_window(SUNDAY_BERLIN, "soon", now="2026-04-05T00:30:00Z")


def test_filters_raise_ansible_filter_errors_with_the_message():
    from ansible.errors import AnsibleFilterError

    filters = mw.FilterModule().filters()
    assert set(filters) == {
        "maintenance_window_check",
        "maintenance_window_next",
        "maintenance_window_validate",
        "maintenance_window_awx_rrule",
    }
    assert filters["maintenance_window_validate"](SUNDAY_BERLIN) is SUNDAY_BERLIN
    with pytest.raises(AnsibleFilterError, match="unknown time zone"):
        filters["maintenance_window_check"](dict(SUNDAY_BERLIN, timezone="Mars/Olympus"), 60)
