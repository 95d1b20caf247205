"""playbooks/moe_bench.yml through ansible-runner's Python API, the way AWX runs a job: a
private data dir with env/extravars, env/settings, env/envvars, inventory/ and project/,
against a simulated GPU host. HOME points at an empty temporary folder, as in an execution
environment, to show that the async job's state does not depend on it.
MOE_BENCH_RUNNER_PROJECT points project/ at another checkout (default: this working tree)."""

from __future__ import annotations

import datetime as dt
import json
import os
import pathlib
import shutil
import tempfile
from zoneinfo import ZoneInfo

import pytest
import yaml

from conftest import FAST_VARS, REPO, STATE_DIR, UNIT, VENV_BIN

ansible_runner = pytest.importorskip("ansible_runner")

BERLIN = ZoneInfo("Europe/Berlin")


def window_opening(minutes_from_now, duration_s=7200):
    """A daily Europe/Berlin window whose opening is `minutes_from_now` away (negative: open)."""
    opening = (dt.datetime.now(BERLIN) + dt.timedelta(minutes=minutes_from_now)).replace(microsecond=0)
    return {
        "name": "runner_test_window",
        "rrule": f"DTSTART;TZID=Europe/Berlin:{opening.strftime('%Y%m%dT%H%M%S')} RRULE:FREQ=DAILY",
        "timezone": "Europe/Berlin",
        "duration_s": duration_s,
    }


# The extra variables AWX adds to a job launched by a schedule.
AWX_SCHEDULED_LAUNCH = {
    "awx_job_id": 4711,
    "awx_job_template_name": "moe-bench",
    "awx_job_launch_type": "scheduled",
    "awx_schedule_id": 12,
    "awx_schedule_name": "moe-bench runner_test_window",
    "tower_job_id": 4711,
    "tower_schedule_id": 12,
}


def private_data_dir(tmp_path, simhost, extravars):
    """Lay out a private data dir as AWX does for a job."""
    pdd = tmp_path / "pdd"
    (pdd / "env").mkdir(parents=True)
    (pdd / "inventory").mkdir()
    (pdd / "env" / "extravars").write_text(yaml.safe_dump(extravars))
    (pdd / "env" / "settings").write_text(yaml.safe_dump({"job_timeout": 900, "idle_timeout": 600}))
    # Short paths: ssh's control socket lives under them (a Unix socket path is limited to
    # about 100 bytes). AWX likewise points the control path at a short folder of the job.
    short = pathlib.Path(tempfile.mkdtemp(prefix="awx-", dir="/tmp"))
    home = short / "home"
    home.mkdir()
    (pdd / "env" / "envvars").write_text(
        yaml.safe_dump(
            {
                "HOME": str(home),
                "ANSIBLE_SSH_CONTROL_PATH_DIR": str(short / "cp"),
                "ANSIBLE_FORCE_COLOR": "False",
                "ANSIBLE_NOCOLOR": "1",
            }
        )
    )
    (pdd / "inventory" / "hosts.yml").write_text(simhost.inventory.read_text())
    # AWX copies the project checkout here; a link to the working tree is the same files.
    project = pathlib.Path(os.environ.get("MOE_BENCH_RUNNER_PROJECT", REPO))
    (pdd / "project").symlink_to(project, target_is_directory=True)
    return pdd, home


@pytest.fixture(autouse=True)
def _remove_short_dirs():
    before = set(pathlib.Path("/tmp").glob("awx-*"))
    yield
    for path in set(pathlib.Path("/tmp").glob("awx-*")) - before:
        shutil.rmtree(path, ignore_errors=True)


def run_job(pdd, monkeypatch):
    # ansible-runner starts the `ansible-playbook` it finds on PATH: the project's venv.
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return ansible_runner.run(
        private_data_dir=str(pdd),
        playbook="playbooks/moe_bench.yml",
        quiet=True,
    )


def events_of(runner):
    return list(runner.events)


def stats_artifact_data(events):
    stats = [event for event in events if event.get("event") == "playbook_on_stats"]
    assert stats, "no playbook_on_stats event"
    return stats[-1]["event_data"].get("artifact_data", {})


def ok_results(events, task_name=None):
    for event in events:
        if event.get("event") != "runner_on_ok":
            continue
        data = event["event_data"]
        if task_name is None or data.get("task") == task_name:
            yield data


def window_decision(events):
    for data in ok_results(events, "Record the window decision for the run manifest"):
        return data["res"]["ansible_facts"]["maintenance_window_decision"]
    pytest.fail("the job did not run roles/maintenance_window (no window decision recorded)")


def test_scheduled_job_in_its_window_runs_like_awx_and_reports(tmp_path, simhost, monkeypatch):
    results = tmp_path / "results"
    pushed = tmp_path / "results-host-share"
    extravars = dict(
        FAST_VARS,
        moe_bench_results_dir=str(results),
        moe_bench_window=window_opening(-5),
        moe_bench_results_push_dest=str(pushed),
        **AWX_SCHEDULED_LAUNCH,
    )
    pdd, home = private_data_dir(tmp_path, simhost, extravars)
    runner = run_job(pdd, monkeypatch)
    events = events_of(runner)
    stdout = runner.stdout.read()

    assert runner.status == "successful", stdout[-6000:]
    assert runner.rc == 0

    # The artifacts AWX reads back from a job.
    artifacts = pathlib.Path(runner.config.artifact_dir)
    assert artifacts.parent == pdd / "artifacts"
    assert (artifacts / "rc").read_text().strip() == "0"
    assert (artifacts / "status").read_text().strip() == "successful"
    assert "PLAY RECAP" in (artifacts / "stdout").read_text()
    assert any((artifacts / "job_events").iterdir())
    assert runner.stats["failures"] == {} and runner.stats["ok"].get(simhost.name, 0) > 0

    # The service is back.
    assert simhost.unit_active() == "active"

    # The window guard ran before the stop and recorded a scheduled AWX launch.
    decision = window_decision(events)
    assert decision["mode"] == "in_window" and decision["allowed"] is True
    assert decision["source"] == "awx_schedule" and decision["scheduled"] is True
    assert decision["awx"]["awx_job_id"] == 4711 and decision["awx"]["awx_schedule_id"] == 12
    task_starts = [event["event_data"] for event in events if event.get("event") == "playbook_on_task_start"]
    guard = next(i for i, data in enumerate(task_starts) if data.get("task") == "Record the window decision for the run manifest")
    stop_role = [i for i, data in enumerate(task_starts) if data.get("role") == "service_stop"]
    assert stop_role and guard < min(stop_role), "the window guard must run before anything is stopped"

    # The async job's state lives in the pinned folder on the host, not under anyone's HOME.
    launches = [data for data in ok_results(events) if {"ansible_job_id", "results_file"} <= set(data.get("res", {}))]
    assert launches, "no async launch event"
    for launch in launches:
        assert launch["res"]["results_file"].startswith(f"{STATE_DIR}/async/"), launch["res"]["results_file"]
        job_id = launch["res"]["ansible_job_id"]
        assert simhost.exec(f"test ! -e /root/.ansible_async/{job_id}", check=False).returncode == 0
    assert not (home / ".ansible_async").exists()

    # The set_stats summary AWX shows with the job.
    artifact_data = stats_artifact_data(events)
    assert simhost.name in artifact_data["moe_bench_report"], artifact_data
    assert artifact_data.get("moe_bench_regressed_hosts", []) == []

    # The results outlive the job's container: pushed to the results destination.
    run_dirs = [path for path in (results / simhost.name).iterdir() if path.is_dir()]
    assert len(run_dirs) == 1
    run_id = run_dirs[0].name
    pushed_run = pushed / simhost.name / run_id
    for name in ("results.json", "manifest.json", "summary.md"):
        assert (pushed_run / name).read_bytes() == (run_dirs[0] / name).read_bytes()
    manifest = json.loads((pushed_run / "manifest.json").read_text())
    assert "maintenance_window" in manifest, "the manifest should record maintenance_window_decision"
    assert manifest["maintenance_window"]["mode"] == "in_window"
    assert manifest["maintenance_window"]["source"] == "awx_schedule"


def test_scheduled_job_outside_its_window_refuses_before_the_stop(tmp_path, simhost, monkeypatch):
    since = simhost.epoch()
    extravars = dict(
        FAST_VARS,
        moe_bench_results_dir=str(tmp_path / "results"),
        # opens in 3 hours: a schedule that fired late, or a clock that is off
        moe_bench_window=window_opening(180, duration_s=3600),
        **AWX_SCHEDULED_LAUNCH,
    )
    pdd, _home = private_data_dir(tmp_path, simhost, extravars)
    runner = run_job(pdd, monkeypatch)
    events = events_of(runner)
    stdout = runner.stdout.read()

    assert runner.status == "failed"
    assert runner.rc == 2
    assert "Not starting the benchmark" in " ".join(stdout.split())
    assert "Nothing was stopped" in " ".join(stdout.split())
    assert simhost.unit_active() == "active"
    assert simhost.stop_count(since) == 0
    decision = window_decision(events)
    assert decision["mode"] == "refused" and decision["source"] == "awx_schedule"
    assert decision["next_window_start"] is not None
    refused = stats_artifact_data(events)["maintenance_window_refused"]
    assert "next window opens" in refused[simhost.name]
