"""moe_bench_plan / moe_bench_m_list / moe_bench_run_id: the timeout arithmetic and input checks."""

from __future__ import annotations

import re
from datetime import datetime, timezone

import pytest
from ansible.errors import AnsibleFilterError

from moe_bench_testlib import load_source

filters = load_source("moe_bench_filters", "plugins/filter/moe_bench.py")

# 2026-11-29T18:00:00Z
NOW = datetime(2026, 11, 29, 18, 0, 0, tzinfo=timezone.utc).timestamp()

SETTINGS = {
    "bench_budget_s": 600, "async_margin_s": 120, "poll_interval_s": 10, "stop_timeout_s": 90,
    "load_budget_s": 900, "health_poll_s": 15, "vram_wait_s": 120, "vram_interval_s": 5,
    "deadman_margin_s": 600, "lock_ttl_margin_s": 300,
}


def plan(**changes):
    settings = dict(SETTINGS)
    settings.update(changes)
    return filters.moe_bench_plan(settings, NOW)


def test_plan_arithmetic():
    result = plan()
    assert result["async_limit_s"] == 720
    assert result["poll_retries"] == 73          # ceil(720 / 10) + 1
    assert result["health_retries"] == 61        # ceil(900 / 15) + 1
    assert result["vram_retries"] == 25          # ceil(120 / 5) + 1
    assert result["planned_downtime_s"] == 90 + 120 + 720 + 900
    assert result["deadman_delay_s"] == 1830 + 600
    assert result["lock_ttl_s"] == 2430 + 300
    assert result["started_at"] == "2026-11-29T18:00:00Z"
    assert result["started_epoch"] == NOW
    assert re.match(r"^20261129T180000Z-[0-9a-f]{6}$", result["run_id"])
    for key, value in SETTINGS.items():
        assert result[key] == value


def test_plan_rounds_up_and_accepts_strings():
    # Extra vars given on the command line arrive as strings.
    result = plan(bench_budget_s="100.5", poll_interval_s="7", async_margin_s="0", health_poll_s=2.5,
                  load_budget_s=10)
    assert result["async_limit_s"] == 101
    assert result["poll_retries"] == 16          # ceil(101 / 7) + 1
    assert result["health_retries"] == 5         # ceil(10 / 2.5) + 1
    assert result["bench_budget_s"] == 100.5 and result["poll_interval_s"] == 7
    assert isinstance(result["poll_interval_s"], int)


def test_plan_retries_cover_the_budget():
    for budget, interval in [(60, 7), (61, 10), (1, 1), (3600, 30)]:
        result = plan(bench_budget_s=budget, async_margin_s=0, poll_interval_s=interval)
        # The loop's (retries - 1) pauses must last at least the async limit.
        assert (result["poll_retries"] - 1) * interval >= result["async_limit_s"]


def test_run_ids_differ_between_plans():
    assert plan()["run_id"] != plan()["run_id"]


@pytest.mark.parametrize("changes, message", [
    ({"bench_budget_s": 0}, "bench_budget_s must be more than 0 seconds, got 0"),
    ({"poll_interval_s": -5}, "poll_interval_s must be more than 0 seconds, got -5"),
    ({"async_margin_s": -1}, "async_margin_s must be 0 or more seconds, got -1"),
    ({"load_budget_s": "ten"}, "load_budget_s must be a number of seconds, got 'ten'"),
    ({"vram_wait_s": True}, "vram_wait_s must be a number of seconds, got True"),
    ({"stop_timeout_s": "nan"}, "stop_timeout_s must be a finite number of seconds"),
    ({"health_poll_s": None}, "missing budget(s): health_poll_s"),
    ({"poll_interval_s": 601}, "poll_interval_s (601 s) is longer than bench_budget_s (600 s): the first poll "
                               "would come after the deadline"),
    ({"health_poll_s": 1000}, "health_poll_s (1000 s) is longer than load_budget_s (900 s)"),
    ({"vram_interval_s": 200}, "vram_interval_s (200 s) is longer than vram_wait_s (120 s)"),
])
def test_plan_rejects_bad_values(changes, message):
    with pytest.raises(AnsibleFilterError) as raised:
        plan(**changes)
    assert message in str(raised.value)


def test_plan_reports_all_missing_keys():
    with pytest.raises(AnsibleFilterError, match="missing budget\\(s\\): bench_budget_s, .*lock_ttl_margin_s"):
        filters.moe_bench_plan({}, NOW)
    with pytest.raises(AnsibleFilterError, match="expects a dict of budgets, got list"):
        filters.moe_bench_plan([1, 2], NOW)


def test_plan_without_now_uses_current_time():
    before = datetime.now(timezone.utc).timestamp()
    result = filters.moe_bench_plan(dict(SETTINGS))
    assert before - 1 <= result["started_epoch"] <= datetime.now(timezone.utc).timestamp() + 1


def test_run_id():
    assert filters.moe_bench_run_id(NOW, "00ab9f") == "20261129T180000Z-00ab9f"
    assert re.match(r"^20261129T180000Z-[0-9a-f]{6}$", filters.moe_bench_run_id(NOW))
    assert filters.RUN_ID_PATTERN.match(filters.moe_bench_run_id())
    with pytest.raises(AnsibleFilterError, match="6 lowercase hex"):
        filters.moe_bench_run_id(NOW, "XYZ")


@pytest.mark.parametrize("value, expected", [
    ("1,2,4", [1, 2, 4]),
    (" 1, 2 ,4 ", [1, 2, 4]),
    ([1, 2, 4, 2048], [1, 2, 4, 2048]),
    (["1", "16"], [1, 16]),
    (256, [256]),
    ("65536", [65536]),
])
def test_m_list_accepts(value, expected):
    assert filters.moe_bench_m_list(value) == expected


@pytest.mark.parametrize("value, message", [
    ("", "the M list is empty"),
    ([], "the M list is empty"),
    ("1,,4", "'' in '1,,4' is not a whole number"),
    ("1,2.5", "'2.5' in '1,2.5' is not a whole number"),
    ("1,x", "'x' in '1,x' is not a whole number"),
    ("0,1", "M=0 is outside 1..65536"),
    ("-4", "M=-4 is outside 1..65536"),
    ("1,65537", "M=65537 is outside 1..65536"),
    ("1,2,2", "M=2 appears twice"),
    ("4,2", "the M list must be increasing, but 2 comes after 4"),
    ([1, True], "True is not a whole number"),
    ({"m": 1}, "expects a list or a comma-separated string"),
])
def test_m_list_rejects(value, message):
    with pytest.raises(AnsibleFilterError) as raised:
        filters.moe_bench_m_list(value)
    assert message in str(raised.value)


def test_filters_are_registered():
    registered = filters.FilterModule().filters()
    assert registered["moe_bench_plan"] is filters.moe_bench_plan
    assert registered["moe_bench_m_list"] is filters.moe_bench_m_list
    assert registered["moe_bench_run_id"] is filters.moe_bench_run_id


def test_retries_helper_matches_the_plan():
    plan = filters.moe_bench_plan({"bench_budget_s": 600, "async_margin_s": 60, "poll_interval_s": 7, "stop_timeout_s": 30,
                           "load_budget_s": 900, "health_poll_s": 10, "vram_wait_s": 60, "vram_interval_s": 5,
                           "deadman_margin_s": 300, "lock_ttl_margin_s": 300})
    assert filters.moe_bench_retries(900, 10) == plan["health_retries"] == 91
    assert filters.moe_bench_retries("95", 10) == 11
