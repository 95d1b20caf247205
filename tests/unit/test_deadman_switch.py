"""deadman_switch, the dead-man timer armed and disarmed in one module call, against a fake
systemctl and systemd-run on PATH.

The timer really firing (and the run then failing with its figures INVALID) is proven against
the simulated host's real systemd in tests/integration/test_safety_deadman.py and
test_safety_controller.py; these pin the decisions and the records."""

from __future__ import annotations

import json
import os
import time

import pytest

from moe_bench_testlib import FakeSystemd, load_source, run_module_main, unit_state

deadman_switch = load_source("deadman_switch", "library/deadman_switch.py")

UNIT = "fake-inference.service"
NAME = "moe-bench-deadman-fake-inference"
RUN = "20261201T120000Z-aaaaaa"


@pytest.fixture
def systemd(tmp_path, monkeypatch):
    fake = FakeSystemd(tmp_path / "bin", units={UNIT: unit_state("active", "running")})
    monkeypatch.setenv("PATH", "%s:%s" % (fake.directory, os.environ["PATH"]))
    return fake


def arm(state_dir, **extra):
    args = {"unit": UNIT, "run_id": RUN, "state_dir": str(state_dir), "delay_s": 600}
    args.update(extra)
    return run_module_main(deadman_switch, args)


def record(state_dir, name="deadman.json"):
    return json.loads((state_dir / "runs" / RUN / name).read_text())


def test_arms_a_timer_that_starts_the_unit_after_the_delay_and_records_it(systemd, tmp_path):
    result = arm(tmp_path)
    assert result["armed"] is True and result["changed"] is True and result["unit_state"] == "active"
    calls = systemd.calls()
    # The unit read once, an earlier timer cleared, then the new one.
    assert calls[0][:2] == ["systemctl", "show"]
    assert ["systemctl", "stop", NAME + ".timer", NAME + ".service"] in calls
    (run,) = [call for call in calls if call[0] == "systemd-run"]
    assert "--unit=%s" % NAME in run and "--on-active=600s" in run and "--remain-after-exit" in run
    assert run[-3:] == ["systemctl", "start", UNIT]
    saved = record(tmp_path)
    assert saved["armed"] is True and saved["delay_s"] == 600 and saved["reason"] == "armed"
    assert abs(saved["deadline_epoch"] - 600 - time.time()) < 60 and saved["deadline"] > saved["armed_at"]
    assert saved["timer"] == NAME + ".timer"


@pytest.mark.parametrize("active, restore, enabled, armed, reason", [
    ("inactive", "previous", True, False, "unit was inactive before the run: it stays stopped"),
    ("inactive", "always", True, True, "armed"),
    ("active", "never", True, False, "restore policy never"),
    ("active", "previous", False, False, "disabled"),
    ("activating", "previous", True, True, "armed"),
])
def test_armed_only_when_the_unit_will_be_started_afterwards(systemd, tmp_path, active, restore, enabled, armed, reason):
    systemd.set({UNIT: unit_state(active, "dead")})
    result = arm(tmp_path, restore=restore, enabled=enabled)
    assert result["armed"] is armed
    assert record(tmp_path)["reason"] == reason and record(tmp_path)["armed"] is armed
    assert any(call[0] == "systemd-run" for call in systemd.calls()) is armed


def test_a_timer_that_cannot_be_armed_fails_with_systemd_runs_message(systemd, tmp_path):
    systemd.set({UNIT: unit_state("active", "running")}, rc={"systemd-run": 1})
    result = arm(tmp_path)
    assert result["failed"] is True
    assert "could not arm the dead-man timer %s.timer: systemd-run exited 1" % NAME in result["msg"]


def test_disarm_stops_a_loaded_timer_and_says_it_had_not_fired(systemd, tmp_path):
    systemd.set({NAME + ".timer": unit_state("active", "waiting"), NAME + ".service": unit_state("inactive", "dead")})
    result = run_module_main(deadman_switch, {"unit": UNIT, "run_id": RUN, "state_dir": str(tmp_path), "state": "disarmed"})
    assert result["was_armed"] is True and result["fired"] is False and result["changed"] is True
    assert ["systemctl", "stop", NAME + ".timer"] in systemd.calls()
    saved = record(tmp_path, "deadman.disarmed.json")
    assert saved["was_armed"] is True and saved["fired"] is False


def test_disarm_of_a_timer_that_fired_says_so(systemd, tmp_path):
    # The timer ran out: its service started the unit and stays active (RemainAfterExit).
    systemd.set({NAME + ".timer": unit_state("inactive", "dead", load="not-found"),
                 NAME + ".service": unit_state("active", "exited")})
    result = run_module_main(deadman_switch, {"unit": UNIT, "run_id": RUN, "state_dir": str(tmp_path), "state": "disarmed"})
    assert result["fired"] is True and result["was_armed"] is False
    assert ["systemctl", "stop", NAME + ".service"] in systemd.calls()
    assert record(tmp_path, "deadman.disarmed.json")["fired"] is True


def test_disarm_without_a_timer_or_a_run_changes_nothing(systemd, tmp_path):
    result = run_module_main(deadman_switch, {"unit": UNIT, "state_dir": str(tmp_path), "state": "disarmed"})
    assert result["changed"] is False and result["was_armed"] is False and result["fired"] is False
    assert [call[1] for call in systemd.calls()] == ["show"]
    assert list(tmp_path.iterdir()) == [tmp_path / "bin"]


def test_check_mode_arms_nothing_and_writes_nothing(systemd, tmp_path):
    result = arm(tmp_path, _ansible_check_mode=True)
    assert result["armed"] is True
    assert not any(call[0] == "systemd-run" or call[1] == "stop" for call in systemd.calls())
    assert not (tmp_path / "runs").exists()
