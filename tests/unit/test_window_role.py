"""roles/maintenance_window through real ansible-playbook runs on localhost (no host touched)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = pathlib.Path(sys.executable).parent / "ansible-playbook"

SUNDAY_BERLIN = {
    "name": "sunday_night_berlin",
    "rrule": "DTSTART;TZID=Europe/Berlin:20260104T020000 RRULE:FREQ=WEEKLY;BYDAY=SU",
    "timezone": "Europe/Berlin",
    "duration_s": 10800,
}

PLAYBOOK = """
- name: Decide on the maintenance window
  hosts: localhost
  connection: local
  gather_facts: false
  roles:
    - role: maintenance_window
  post_tasks:
    - name: Save the decision
      ansible.builtin.copy:
        content: "{{ maintenance_window_decision | to_json }}"
        dest: "{{ decision_file }}"
        mode: "0644"
"""


def run_role(tmp_path, **extra_vars):
    playbook = tmp_path / "window.yml"
    playbook.write_text(PLAYBOOK)
    decision_file = tmp_path / "decision.json"
    extra_vars.setdefault("maintenance_window_planned_downtime_s", 3600)
    extra_vars["decision_file"] = str(decision_file)
    extra_vars["ansible_python_interpreter"] = sys.executable
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        ANSIBLE_ROLES_PATH=str(REPO / "roles"),
        ANSIBLE_FILTER_PLUGINS=str(REPO / "plugins" / "filter"),
        ANSIBLE_NOCOLOR="1",
        HOME=str(tmp_path),
    )
    result = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", "localhost,", str(playbook), "-e", json.dumps(extra_vars)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    decision = json.loads(decision_file.read_text()) if decision_file.exists() else None
    return result, decision


def test_inside_the_window_runs_and_records_a_manual_launch(tmp_path):
    result, decision = run_role(
        tmp_path, maintenance_window_spec=SUNDAY_BERLIN, maintenance_window_now="2026-04-05T02:10:00+02:00"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert decision["allowed"] is True
    assert decision["mode"] == "in_window"
    assert decision["override"] is False
    assert decision["source"] == "manual" and decision["scheduled"] is False
    assert decision["window_end"] == "2026-04-05T03:00:00Z"
    assert decision["planned_end"] == "2026-04-05T01:10:00Z"
    assert decision["window"]["name"] == "sunday_night_berlin"
    assert decision["planned_downtime_s"] == 3600


def test_outside_the_window_refuses_and_says_when_the_next_one_opens(tmp_path):
    result, decision = run_role(
        tmp_path, maintenance_window_spec=SUNDAY_BERLIN, maintenance_window_now="2026-04-07T12:00:00Z"
    )
    assert result.returncode == 2
    assert decision is None  # the play stopped before anything after the guard
    output = " ".join(result.stdout.split())
    assert "Not starting the benchmark on localhost" in output
    assert "Nothing was stopped" in output
    assert "the next window opens 2026-04-12T02:00:00+02:00" in output
    assert "moe_bench_window_override=true" in output


def test_downtime_longer_than_what_is_left_of_the_window_refuses(tmp_path):
    result, _ = run_role(
        tmp_path,
        maintenance_window_spec=SUNDAY_BERLIN,
        maintenance_window_now="2026-04-05T04:30:00+02:00",
        maintenance_window_planned_downtime_s=3600,
    )
    assert result.returncode == 2
    output = " ".join(result.stdout.split())
    assert "closes 2026-04-05T05:00:00+02:00, 1800 s from now" in output


def test_override_runs_and_is_recorded(tmp_path):
    result, decision = run_role(
        tmp_path,
        maintenance_window_spec=SUNDAY_BERLIN,
        maintenance_window_now="2026-04-07T12:00:00Z",
        maintenance_window_override="true",  # as an AWX survey sends it
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert decision["allowed"] is True
    assert decision["mode"] == "override" and decision["override"] is True
    assert decision["fits"] is False and decision["in_window"] is False
    assert decision["next_window_start"] == "2026-04-12T00:00:00Z"
    assert "outside the maintenance window because the override is set" in result.stdout


def test_survey_false_string_does_not_override(tmp_path):
    result, _ = run_role(
        tmp_path,
        maintenance_window_spec=SUNDAY_BERLIN,
        maintenance_window_now="2026-04-07T12:00:00Z",
        maintenance_window_override="false",
    )
    assert result.returncode == 2


def test_scheduled_awx_launch_is_recorded_with_its_ids(tmp_path):
    # The extra vars AWX adds to a job launched by a schedule.
    result, decision = run_role(
        tmp_path,
        maintenance_window_spec=SUNDAY_BERLIN,
        maintenance_window_now="2026-04-05T02:00:30+02:00",
        awx_job_id=4711,
        awx_job_template_name="moe-bench",
        awx_job_launch_type="scheduled",
        awx_schedule_id=12,
        awx_schedule_name="moe-bench sunday_night_berlin",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert decision["source"] == "awx_schedule" and decision["scheduled"] is True
    assert decision["awx"]["awx_job_id"] == 4711
    assert decision["awx"]["awx_schedule_id"] == 12
    assert decision["awx"]["awx_schedule_name"] == "moe-bench sunday_night_berlin"
    assert decision["mode"] == "in_window"


def test_tower_prefixed_variables_are_understood(tmp_path):
    result, decision = run_role(
        tmp_path,
        maintenance_window_spec=SUNDAY_BERLIN,
        maintenance_window_now="2026-04-05T02:00:30+02:00",
        tower_job_id=99,
        tower_schedule_id=3,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert decision["source"] == "awx_schedule"
    assert decision["awx"]["awx_job_id"] == 99


def test_awx_launch_by_hand_is_not_a_scheduled_one(tmp_path):
    result, decision = run_role(
        tmp_path,
        maintenance_window_spec=SUNDAY_BERLIN,
        maintenance_window_now="2026-04-05T02:10:00+02:00",
        awx_job_id=4712,
        awx_job_launch_type="manual",
        awx_user_name="oncall",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert decision["source"] == "awx" and decision["scheduled"] is False
    assert decision["awx"]["awx_user_name"] == "oncall"


def test_no_window_configured_runs_unless_one_is_required(tmp_path):
    result, decision = run_role(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert decision["mode"] == "no_window" and decision["allowed"] is True
    assert decision["window"] is None
    result, _ = run_role(tmp_path, maintenance_window_required=True)
    assert result.returncode == 2
    assert "one is required" in result.stdout


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (dict(SUNDAY_BERLIN, timezone="Europe/Atlantis"), "unknown time zone 'Europe/Atlantis'"),
        ({"rrule": "FREQ=WEEKLY", "timezone": "UTC"}, "duration_s"),
    ],
)
def test_bad_window_fails_before_anything_with_the_reason(tmp_path, spec, message):
    result, decision = run_role(tmp_path, maintenance_window_spec=spec, maintenance_window_now="2026-04-05T00:10:00Z")
    assert result.returncode != 0
    assert decision is None
    assert message in result.stdout + result.stderr
