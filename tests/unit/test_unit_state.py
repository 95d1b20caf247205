"""unit_state, the one reader of systemd units' state, against a fake systemctl on PATH."""

from __future__ import annotations

import os
import threading
import time

import pytest

from moe_bench_testlib import FakeSystemd, load_source, run_module_main, unit_state

unit_state_module = load_source("unit_state", "library/unit_state.py")
systemd_unit = load_source("systemd_unit", "module_utils/systemd_unit.py")

UNIT = "fake-inference.service"
TIMER = "moe-bench-deadman-fake-inference.timer"


@pytest.fixture
def systemd(tmp_path, monkeypatch):
    fake = FakeSystemd(tmp_path / "bin", units={UNIT: unit_state("active", "running", restarts=3, main_pid=4242)})
    monkeypatch.setenv("PATH", "%s:%s" % (fake.directory, os.environ["PATH"]))
    return fake


def test_reads_and_types_every_unit_in_one_call(systemd):
    result = run_module_main(unit_state_module, {"name": [UNIT, TIMER]})
    assert result["changed"] is False and result["reached"] is True
    assert result["state"] == {"LoadState": "loaded", "ActiveState": "active", "SubState": "running",
                               "Result": "success", "MainPID": 4242, "NRestarts": 3}
    # A unit systemd does not know is still a block of its own, in the order asked.
    assert result["units"][TIMER]["LoadState"] == "not-found"
    assert result["units"][UNIT] == result["state"]
    assert len(systemd.calls()) == 1


def test_waits_for_the_state_and_returns_as_soon_as_it_is_reached(systemd):
    def stop_later():
        time.sleep(1.0)
        systemd.set({UNIT: unit_state("inactive", "dead")})
    threading.Thread(target=stop_later).start()
    started = time.monotonic()
    result = run_module_main(unit_state_module, {"name": [UNIT], "wait_for": ["inactive", "failed"],
                                                 "wait_s": 20, "interval": 0.2})
    elapsed = time.monotonic() - started
    assert result["reached"] is True and result["state"]["ActiveState"] == "inactive"
    assert 0.9 <= result["waited_s"] < 5 and elapsed < 5


def test_a_wait_that_runs_out_says_so_without_failing(systemd):
    result = run_module_main(unit_state_module, {"name": [UNIT], "wait_for": ["inactive"], "wait_s": 0.6,
                                                 "interval": 0.2})
    assert result.get("failed") is not True
    assert result["reached"] is False and result["state"]["ActiveState"] == "active"
    assert result["waited_s"] >= 0.6


def test_systemctl_error_fails_with_its_message(systemd):
    systemd.set({}, fail={"rc": 1, "stderr": "Failed to connect to bus"})
    result = run_module_main(unit_state_module, {"name": [UNIT]})
    assert result["failed"] is True
    assert "systemctl show exited 1: Failed to connect to bus" in result["msg"]


def test_parse_show_splits_blocks_and_types_integers():
    text = "LoadState=loaded\nMainPID=12\nNRestarts=\n\nLoadState=not-found\nMainPID=0\nNRestarts=[not set]\n"
    blocks = systemd_unit.parse_show(text, ["LoadState", "MainPID", "NRestarts", "Result"])
    assert blocks == [{"LoadState": "loaded", "MainPID": 12, "NRestarts": None, "Result": None},
                      {"LoadState": "not-found", "MainPID": 0, "NRestarts": None, "Result": None}]


def test_cgroup_pids_reads_every_hierarchy_and_skips_missing(tmp_path):
    files = {"/sys/fs/cgroup/system.slice/x.service/cgroup.procs": "12\n14\n",
             "/sys/fs/cgroup/systemd/system.slice/x.service/cgroup.procs": "14\n15\n"}
    assert systemd_unit.cgroup_pids("/system.slice/x.service", lambda path: files.get(path, "")) == [12, 14, 15]
    assert systemd_unit.cgroup_pids("", lambda path: "1") == []
