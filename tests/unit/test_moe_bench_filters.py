"""moe_bench_plan / moe_bench_m_list / moe_bench_run_id: the timeout arithmetic and input checks."""

from __future__ import annotations

import re
from datetime import datetime, timezone

import pytest
from ansible.errors import AnsibleFilterError

from moe_bench_testlib import REPO, load_source

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
    assert result["poll_retries"] == 74          # ceil((720 + 6) / 10) + 1: the limit and the wrapper's lag
    assert result["health_retries"] == 61        # ceil(900 / 15) + 1
    assert result["vram_retries"] == 25          # ceil(120 / 5) + 1
    # stop 90 + memory 120 + async limit 720 + the wrapper's lag past it 6 + one bench poll 10
    # + the stop of a payload that outlived its job (SIGTERM grace 10, SIGKILL wait 10)
    # + load 900 + one health poll 15
    assert result["planned_downtime_s"] == 90 + 120 + 720 + 6 + 10 + 10 + 10 + 900 + 15
    assert result["payload_term_grace_s"] == 10 and result["payload_kill_wait_s"] == 10
    assert result["deadman_delay_s"] == 1881 + 600
    assert result["lock_ttl_s"] == 2481 + 300
    assert result["stop_s"] == 90 and result["stop_wait_s"] == 90
    assert result["stop_corrected_from_unit"] is False
    assert result["started_at"] == "2026-11-29T18:00:00Z"
    assert result["started_epoch"] == NOW
    assert re.match(r"^20261129T180000Z-[0-9a-f]{6}$", result["run_id"])
    for key, value in SETTINGS.items():
        assert result[key] == value


def test_deadline_covers_the_longest_legitimate_run():
    # A unit whose own TimeoutStopSec (5 min) is longer than the configured stop timeout (90 s),
    # a 30 s stop margin, leftovers killed (two memory waits), a 30 s settle period.
    result = plan(unit_stop_timeout_s="5min", stop_margin_s=30, vram_waits=2, settle_s=30)
    assert result["stop_corrected_from_unit"] is True
    assert result["stop_s"] == 300 and result["stop_wait_s"] == 330
    assert result["vram_total_s"] == 2 * 120
    longest_run = (300 + 30) + 2 * 120 + (600 + 120) + 6 + 10 + (10 + 10) + 900 + 15 + 30
    assert result["deadman_delay_s"] == longest_run + 600
    # Every part at its limit still ends before the timer (the margin 0 is the tightest case).
    tight = plan(unit_stop_timeout_s="5min", stop_margin_s=30, vram_waits=2, settle_s=30, deadman_margin_s=0)
    assert tight["deadman_delay_s"] >= longest_run


@pytest.mark.parametrize("timespan, seconds", [
    ("1min 30s", 90), ("90s", 90), ("500ms", 0.5), ("2h", 7200), ("1h 1min 1s", 3661), ("45", 45),
    ("infinity", None), ("", None), (None, None), (30, 30),
])
def test_timespan_as_systemctl_show_prints_it(timespan, seconds):
    assert filters.moe_bench_timespan_s(timespan) == seconds


def test_unit_stop_timeout_shorter_than_configured_changes_nothing():
    result = plan(unit_stop_timeout_s="30s")
    assert result["stop_s"] == 90 and result["stop_corrected_from_unit"] is False
    assert plan(unit_stop_timeout_s="infinity")["stop_s"] == 90


@pytest.mark.parametrize("path", ["/", "/etc", "/usr", "/var", "/opt", "/home", "/root", "/tmp", "/etc/moe",
                                  "/usr/local", "/var/lib", "/var/log", "/home/alice", "relative/dir", "opt/x",
                                  "/opt/../etc", "", "//etc/"])
def test_folder_refuses_system_and_relative_paths(path):
    message = filters.moe_bench_check(path, "folder")
    assert message, path
    with pytest.raises(AnsibleFilterError):
        filters.moe_bench_folder(path)


@pytest.mark.parametrize("path, normal", [("/opt/moe-bench", "/opt/moe-bench"), ("/var/lib/moe-bench/", "/var/lib/moe-bench"),
                                          ("/srv/bench", "/srv/bench"), ("/root/moe-bench", "/root/moe-bench"),
                                          ("/data//bench/./x", "/data/bench/x")])
def test_folder_accepts_dedicated_folders(path, normal):
    assert filters.moe_bench_check(path, "folder") == ""
    assert filters.moe_bench_folder(path) == normal


def test_check_returns_the_refusal_or_nothing():
    assert filters.moe_bench_check(dict(SETTINGS), "plan") == ""
    assert filters.moe_bench_check(dict(SETTINGS, bench_budget_s=0), "plan") == \
        "moe_bench_bench_budget_s must be more than 0 seconds, got 0"
    assert filters.moe_bench_check("1,2", "m_list") == ""
    assert "not a whole number" in filters.moe_bench_check("1,two", "m_list")


def test_plan_rounds_up_and_accepts_strings():
    # Extra vars given on the command line arrive as strings.
    result = plan(bench_budget_s="100.5", poll_interval_s="7", async_margin_s="0", health_poll_s=2.5,
                  load_budget_s=10)
    assert result["async_limit_s"] == 101
    assert result["poll_retries"] == 17          # ceil((101 + 6) / 7) + 1
    assert result["health_retries"] == 5         # ceil(10 / 2.5) + 1
    assert result["bench_budget_s"] == 100.5 and result["poll_interval_s"] == 7
    assert isinstance(result["poll_interval_s"], int)


def test_plan_retries_cover_the_budget():
    for budget, interval in [(60, 7), (61, 10), (1, 1), (3600, 30)]:
        result = plan(bench_budget_s=budget, async_margin_s=0, poll_interval_s=interval)
        # The loop's (retries - 1) pauses must last at least the async limit and the wrapper's
        # lag past it (it looks every 5 s, and writes the record 1 s after the kill).
        assert (result["poll_retries"] - 1) * interval >= result["async_limit_s"] + 6


def test_run_ids_differ_between_plans():
    assert plan()["run_id"] != plan()["run_id"]


# Every refusal names the variable as the operator writes it (moe_bench_bench_poll_s, not
# poll_interval_s): the message is matched whole-word, so the plan's own key would not pass.
@pytest.mark.parametrize("changes, message", [
    ({"bench_budget_s": 0}, "moe_bench_bench_budget_s must be more than 0 seconds, got 0"),
    ({"poll_interval_s": -5}, "moe_bench_bench_poll_s must be more than 0 seconds, got -5"),
    ({"async_margin_s": -1}, "moe_bench_async_margin_s must be 0 or more seconds, got -1"),
    ({"load_budget_s": "ten"}, "moe_bench_load_budget_s must be a number of seconds, got 'ten'"),
    ({"vram_wait_s": True}, "moe_bench_vram_timeout_s must be a number of seconds, got True"),
    ({"stop_timeout_s": "nan"}, "moe_bench_stop_timeout_s must be a finite number of seconds"),
    ({"health_poll_s": None}, "missing budget(s): moe_bench_health_poll_s"),
    ({"poll_interval_s": 601}, "moe_bench_bench_poll_s (601 s) is longer than moe_bench_bench_budget_s (600 s): "
                               "the first poll would come after the deadline"),
    ({"health_poll_s": 1000}, "moe_bench_health_poll_s (1000 s) is longer than moe_bench_load_budget_s (900 s)"),
    ({"vram_interval_s": 200}, "moe_bench_vram_interval_s (200 s) is longer than moe_bench_vram_timeout_s (120 s)"),
    ({"settle_s": -1}, "moe_bench_health_settle_s must be 0 or more seconds, got -1"),
    ({"unit_stop_timeout_s": "soon"}, "the unit's TimeoutStopSec cannot be read"),
])
def test_plan_rejects_bad_values(changes, message):
    with pytest.raises(AnsibleFilterError) as raised:
        plan(**changes)
    assert re.search(r"(^|[^\w])" + re.escape(message), str(raised.value)), str(raised.value)


def test_plan_reports_all_missing_keys():
    with pytest.raises(AnsibleFilterError, match="missing budget\\(s\\): moe_bench_bench_budget_s, .*moe_bench_lock_ttl_margin_s"):
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


# --- moe_bench_inputs: AWX's strings become the command line's typed values -------------------

import pathlib  # noqa: E402

import yaml  # noqa: E402

PLAN_SPECS = yaml.safe_load(
    (pathlib.Path(__file__).resolve().parents[2] / "roles" / "bench_plan" / "meta" / "argument_specs.yml").read_text())
# what an inventory gives every host (the required inputs)
HOST_VARS = {"moe_bench_unit": "vllm-k26.service", "moe_bench_health_url": "http://127.0.0.1:8000/health",
             "moe_bench_results_dir": "/runner/project/results"}


def test_inputs_turn_awx_strings_into_the_values_the_cli_gives():
    # As a survey or a schedule's extra_data sends them ...
    as_awx_sends = {"moe_bench_gpus": "0,1", "moe_bench_window_override": "true", "moe_bench_bench_budget_s": "1800",
                    "moe_bench_lock_takeover": "false", "moe_bench_vram_margin_mib": "2048",
                    "moe_bench_m_list": "1,2,4", "moe_bench_backend": "torch"}
    # ... and as an inventory or `-e @file.json` gives them.
    as_cli_gives = {"moe_bench_gpus": [0, 1], "moe_bench_window_override": True, "moe_bench_bench_budget_s": 1800,
                    "moe_bench_lock_takeover": False, "moe_bench_vram_margin_mib": 2048,
                    "moe_bench_m_list": "1,2,4", "moe_bench_backend": "torch"}
    from_awx = filters.moe_bench_inputs(PLAN_SPECS, dict(HOST_VARS, **as_awx_sends))
    from_cli = filters.moe_bench_inputs(PLAN_SPECS, dict(HOST_VARS, **as_cli_gives))
    assert from_awx["errors"] == [] and from_cli["errors"] == []
    assert from_awx["inputs"] == from_cli["inputs"]
    for name, value in as_cli_gives.items():
        assert from_awx["inputs"][name] == value and type(from_awx["inputs"][name]) is type(value), name
    # defaults of the spec fill what was not given, as the role's defaults do
    assert from_awx["inputs"]["moe_bench_restore"] == "previous"


def test_inputs_leave_out_secrets():
    checked = filters.moe_bench_inputs(PLAN_SPECS, dict(HOST_VARS, moe_bench_health_token="tok-123",
                                                        moe_bench_health_headers={"X-Api-Key": "key-456"}))
    assert checked["errors"] == []
    assert "moe_bench_health_token" not in checked["inputs"]
    assert "moe_bench_health_headers" not in checked["inputs"]
    assert "tok-123" not in repr(checked) and "key-456" not in repr(checked)


@pytest.mark.parametrize("name, answer", [
    ("moe_bench_gpus", "0,x"),
    ("moe_bench_bench_budget_s", "30m"),
    ("moe_bench_window_override", "maybe"),
    ("moe_bench_restore", "sometimes"),
])
def test_inputs_report_a_wrong_answer_by_its_variable(name, answer):
    checked = filters.moe_bench_inputs(PLAN_SPECS, dict(HOST_VARS, **{name: answer}))
    assert checked["errors"], checked
    assert any(name in message for message in checked["errors"]), checked["errors"]


def test_inputs_filter_is_registered():
    assert filters.FilterModule().filters()["moe_bench_inputs"] is filters.moe_bench_inputs


# ---- moe_bench_stop and moe_bench_rehearse ------------------------------------------------

moe_bench_rehearse_mode = filters.moe_bench_rehearse_mode
moe_bench_stop_decision = filters.moe_bench_stop_decision
moe_bench_stop_mode = filters.moe_bench_stop_mode


def test_the_rehearsal_switch_and_the_stop_mode_take_awx_strings_and_yaml_bools():
    assert [moe_bench_rehearse_mode(v) for v in (True, False, "true", "False", " required ", "yes", "0")] == \
        ["true", "false", "true", "false", "required", "true", "false"]
    assert moe_bench_stop_mode(" AUTO ") == "auto"
    for bad, name in ((("maybe",), "moe_bench_rehearse"), (("sometimes",), "moe_bench_stop")):
        with pytest.raises(AnsibleFilterError, match=name):
            (moe_bench_rehearse_mode if name == "moe_bench_rehearse" else moe_bench_stop_mode)(*bad)


def test_never_plans_no_downtime_and_no_dead_man_switch_and_needs_the_rehearsal():
    never = plan(stop_mode="never", rehearse="true")
    assert never["planned_downtime_s"] == 0 and never["stop_mode"] == "never"
    always = plan()
    assert always["stop_mode"] == "always" and always["rehearse"] == "true" and always["planned_downtime_s"] > 0
    assert always["planned_downtime_s"] > 0 and always["rehearse_timeout_s"] == SETTINGS["bench_budget_s"]
    assert plan(stop_mode="auto")["deadman_delay_s"] == always["deadman_delay_s"]  # armed when auto stops
    with pytest.raises(AnsibleFilterError, match="moe_bench_rehearse cannot be false"):
        plan(stop_mode="never", rehearse=False)


GPUS = [{"index": 0, "free_mib": 13156, "used_mib": 130615}, {"index": 1, "free_mib": 9000, "used_mib": 134000}]


def test_auto_runs_beside_the_unit_only_when_every_chosen_gpu_has_the_room():
    fits = moe_bench_stop_decision("auto", GPUS, [0], 13156)
    assert (fits["stop"], fits["beside"]) == (False, True)
    assert "fits beside the serving unit (GPU 0 13156 MiB free; it needs 13156 MiB" in fits["why"]
    # Just short: one MiB more than GPU 0 has free falls back to stopping, and says so.
    short = moe_bench_stop_decision("auto", GPUS, [0], 13157)
    assert (short["stop"], short["beside"]) == (True, False)
    assert "does not fit beside the serving unit" in short["why"] and "falling back to stopping it" in short["why"]
    # Every chosen GPU counts: GPU 1 is short.
    assert moe_bench_stop_decision("auto", GPUS, [0, 1], 10000)["stop"] is True
    # A GPU the read did not see is never assumed free.
    unread = moe_bench_stop_decision("auto", GPUS[:1], [0, 1], 100)
    assert unread["stop"] is True and "GPU 1 unread" in unread["why"]


def test_always_stops_never_does_not_and_a_reattached_run_already_stopped():
    assert moe_bench_stop_decision("always", GPUS, [0], 1)["stop"] is True
    never = moe_bench_stop_decision("never", GPUS, [0], 10 ** 9)
    assert (never["stop"], never["beside"]) == (False, False) and "only the rehearsal ran" in never["why"]
    assert moe_bench_stop_decision("auto", GPUS, [0], 1, reattach=True)["stop"] is True


def test_the_payload_stop_the_deadline_covers_is_the_one_the_recovery_runs_by_default():
    # The plan's deadline counts the stop of a payload that outlived its job; service_recover's own
    # defaults (the recovery playbook's plan has no deadline) must not run a longer one.
    import yaml

    defaults = yaml.safe_load((REPO / "roles/service_recover/defaults/main.yml").read_text())
    result = plan()
    assert defaults["service_recover_payload_term_grace_s"] == result["payload_term_grace_s"]
    assert defaults["service_recover_payload_kill_wait_s"] == result["payload_kill_wait_s"]
