"""host_lock, the host lock taken and released in one round trip, on a real folder.

The whole-cycle cases (two runs at the same moment, a stale lock taken over, re-attach after a
cut connection) run against the simulated host in tests/integration/test_safety_lock_restore.py
and test_safety_controller.py; these pin the module's own rules."""

from __future__ import annotations

import json
import os
import stat

import pytest

from moe_bench_testlib import load_source, run_module_main

host_lock = load_source("host_lock", "library/host_lock.py")

RUN = "20261201T120000Z-aaaaaa"
OTHER = "20261201T110000Z-bbbbbb"
RECORD = {"owner": "ops", "controller": "ctl.example", "pid": 4242, "run_id": "ignored"}


def take(state_dir, **extra):
    args = {"state_dir": str(state_dir), "run_id": RUN, "record": RECORD, "plan": {"m_list": [1, 2]},
            "host": "ct200.example"}
    args.update(extra)
    return run_module_main(host_lock, args)


def lock_of(state_dir):
    return json.loads((state_dir / "lock").read_text())


def test_free_lock_is_taken_with_the_run_folder_plan_and_current(tmp_path):
    state = tmp_path / "state"
    result = take(state)
    assert result["changed"] is True and result.get("failed") is not True
    assert result["active_run_id"] == RUN and result["reattach"] is False and result["job_exists"] is False
    held = lock_of(state)
    assert held["run_id"] == RUN and held["owner"] == "ops" and held["pid"] == 4242
    assert json.loads((state / "runs" / RUN / "plan.json").read_text()) == {"m_list": [1, 2]}
    assert os.readlink(state / "current") == "runs/%s" % RUN
    # Root-only: folders 0700, files 0600; the candidate is gone.
    for folder in (state, state / "runs", state / "async", state / "runs" / RUN):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert stat.S_IMODE((state / "lock").stat().st_mode) == 0o600
    assert sorted(path.name for path in state.iterdir()) == ["async", "current", "lock", "runs"]


def test_a_lock_taken_by_another_run_in_between_fails_and_touches_nothing(tmp_path):
    # The caller judged the lock free, but another run linked its own first.
    state = tmp_path / "state"
    state.mkdir()
    (state / "lock").write_text(json.dumps({"run_id": OTHER}))
    result = take(state)
    assert result["failed"] is True
    assert "Another run took the lock on ct200.example at the same moment (%s)" % OTHER in result["msg"]
    assert "touched nothing" in result["msg"]
    assert lock_of(state)["run_id"] == OTHER
    assert not (state / "runs" / RUN).exists() and not (state / "current").exists()
    assert not list(state.glob("lock.*")), "the candidate was left behind"


def test_stale_lock_of_a_finished_run_is_replaced_by_a_new_run(tmp_path):
    state = tmp_path / "state"
    (state / "runs" / OTHER).mkdir(parents=True)
    (state / "runs" / OTHER / "prior_state.json").write_text("{}")
    (state / "runs" / OTHER / "recover.json").write_text("{}")
    (state / "lock").write_text(json.dumps({"run_id": OTHER}))
    result = take(state, stale_run_id=OTHER)
    assert result["active_run_id"] == RUN and result["reattach"] is False
    assert lock_of(state)["run_id"] == RUN


def test_stale_lock_of_an_unfinished_run_is_re_attached_to(tmp_path):
    # That run stopped the unit (prior_state.json) and never recovered it (no recover.json).
    state = tmp_path / "state"
    run_dir = state / "runs" / OTHER
    run_dir.mkdir(parents=True)
    (run_dir / "prior_state.json").write_text("{}")
    (run_dir / "job.json").write_text('{"ansible_job_id": "j1"}')
    (run_dir / "plan.json").write_text('{"first": true}')
    (state / "lock").write_text(json.dumps({"run_id": OTHER}))
    result = take(state, stale_run_id=OTHER)
    assert result["active_run_id"] == OTHER and result["reattach"] is True and result["job_exists"] is True
    assert lock_of(state)["run_id"] == OTHER and lock_of(state)["owner"] == "ops"
    # The first plan is kept; the re-attaching run's plan goes beside it.
    assert json.loads((run_dir / "plan.json").read_text()) == {"first": True}
    assert json.loads((run_dir / "plan.reattach.json").read_text()) == {"m_list": [1, 2]}
    assert os.readlink(state / "current") == "runs/%s" % OTHER


@pytest.mark.parametrize("holder, release_any, released", [
    (RUN, False, True), (OTHER, False, False), (OTHER, True, True)])
def test_release_removes_only_this_runs_lock_unless_any_may_go(tmp_path, holder, release_any, released):
    state = tmp_path
    (state / "lock").write_text(json.dumps({"run_id": holder}))
    result = run_module_main(host_lock, {"state_dir": str(state), "run_id": RUN, "state": "absent",
                                         "release_any": release_any})
    assert result["released"] is released and result["changed"] is released
    assert result["lock"]["run_id"] == holder
    assert (state / "lock").exists() is not released


def test_release_without_a_lock_changes_nothing(tmp_path):
    result = run_module_main(host_lock, {"state_dir": str(tmp_path), "run_id": RUN, "state": "absent"})
    assert result["changed"] is False and result["released"] is False and result["lock"] == {}
    assert list(tmp_path.iterdir()) == []


def test_check_mode_takes_nothing(tmp_path):
    state = tmp_path / "state"
    result = take(state, _ansible_check_mode=True)
    assert result["active_run_id"] == RUN and result.get("failed") is not True
    assert not state.exists()
