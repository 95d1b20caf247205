"""A scheduled AWX launch of playbooks/moe_bench.yml, without an AWX server.

What AWX would receive is rendered from awx/moe_bench.yml by running the real
playbooks/awx_configure.yml against a stand-in awx.awx collection whose modules only record
their arguments (the API calls AWX would get). From those records the test builds what AWX
hands a job launched by a window's schedule: the inventory (the group of GPU hosts, one group
per window, each host's variables), the extra vars (the template's extra_vars, the survey's
defaults, the schedule's extra_data - every answer as the string AWX sends - and AWX's own
awx_* variables), the template's verbosity and the schedule's limit. It then runs the job
through ansible-runner's Python API, as AWX does, against two simulated hosts serving two
different units on different GPUs, plus a host of another window that must not be touched.
"""

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

from conftest import FAST_LOAD_SECONDS, REPO, STATE_DIR, UNIT, VENV_BIN, start_simhost, stop_simhost, _unique_name

ansible_runner = pytest.importorskip("ansible_runner")

AWX_DATA = yaml.safe_load((REPO / "awx" / "moe_bench.yml").read_text())
AWX_MODULES = ("organization", "execution_environment", "project", "inventory", "host", "group",
               "job_template", "schedule")
# A module of the stand-in collection: it returns its (templated) arguments, which is what the
# real module would send to AWX's API.
RECORDER = '''
from ansible.plugins.action import ActionBase


class ActionModule(ActionBase):
    def run(self, tmp=None, task_vars=None):
        return {"changed": False, "awx_object": dict(self._task.args)}
'''
# The second host's unit: a copy of fake-inference.service under another name, on another port
# and other GPUs, as a vLLM host would differ from an SGLang one.
OTHER_UNIT = "vllm-fake.service"
OTHER_PORT = 8000
OPEN_WINDOW = "it_open_now"
# Run-wide settings that keep the run short, as a window's schedule would give them
# (extra_data), every value a string as AWX passes survey answers.
FAST_SCHEDULE_DATA = {
    "moe_bench_m_list": "1,2",
    "moe_bench_preset": "tiny",
    "moe_bench_backend": "torch",
    "moe_bench_bench_budget_s": "300",
    "moe_bench_bench_poll_s": "2",
    "moe_bench_async_margin_s": "60",
    "moe_bench_load_budget_s": "60",
    "moe_bench_health_poll_s": "1",
    "moe_bench_stop_timeout_s": "30",
    "moe_bench_stop_margin_s": "15",
    "moe_bench_vram_timeout_s": "10",
    "moe_bench_vram_interval_s": "1",
    "moe_bench_deadman_margin_s": "60",
    "moe_bench_lock_ttl_margin_s": "60",
}
# What AWX adds to a job launched by a schedule.
AWX_JOB_VARS = {"awx_job_id": "4712", "awx_job_template_name": "moe-bench", "awx_job_launch_type": "scheduled",
                "awx_schedule_id": "13", "awx_schedule_name": f"moe-bench {OPEN_WINDOW}"}


def as_awx_sends(value):
    """A value as it arrives in a job's extra vars from a survey answer or a schedule: a string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def open_window():
    """A daily Europe/Berlin window that opened five minutes ago and stays open two hours."""
    zone = ZoneInfo("Europe/Berlin")
    opening = (dt.datetime.now(zone) - dt.timedelta(minutes=5)).replace(microsecond=0)
    return {"name": OPEN_WINDOW, "description": "open while the test runs",
            "rrule": f"DTSTART;TZID=Europe/Berlin:{opening.strftime('%Y%m%dT%H%M%S')} RRULE:FREQ=DAILY",
            "timezone": "Europe/Berlin", "duration_s": 7200, "enabled": True,
            "extra_data": FAST_SCHEDULE_DATA}


def make_second_unit(host):
    """Serve OTHER_UNIT instead of fake-inference.service: own name, env file, port and GPUs."""
    host.exec(
        "set -e; mkdir -p /etc/fake-inference-vllm; "
        "cp /usr/share/fake-inference/env.defaults /etc/fake-inference-vllm/env; "
        "printf 'FAKE_PORT=%d\\nFAKE_GPUS=1,2\\nFAKE_LOAD_SECONDS=%d\\n' >> /etc/fake-inference-vllm/env; "
        "sed -e 's#/etc/fake-inference/env#/etc/fake-inference-vllm/env#' "
        "    /etc/systemd/system/fake-inference.service > /etc/systemd/system/%s; "
        "systemctl disable --now %s; systemctl daemon-reload; systemctl enable --now %s"
        % (OTHER_PORT, FAST_LOAD_SECONDS, OTHER_UNIT, UNIT, OTHER_UNIT))


def health(host, port):
    out = host.exec("curl -s -o /dev/null -w '%%{http_code}' --max-time 3 http://127.0.0.1:%d/health" % port,
                    check=False).stdout.strip()
    return int(out) if out.isdigit() else 0


@pytest.fixture(autouse=True)
def _project_venv_on_path(monkeypatch):
    # ansible-runner starts the `ansible-playbook` it finds on PATH: the project's venv.
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.fixture(scope="module")
def awx_hosts(tmp_path_factory):
    """Two simulated hosts of one window: fake-inference.service on GPUs 0,1 of 2, and
    vllm-fake.service (port 8000) on GPU 2 of 3."""
    names = [_unique_name("awx-fra"), _unique_name("awx-nyc")]
    try:
        first = start_simhost(names[0], tmp_path_factory.mktemp(names[0]), gpus=2)
        second = start_simhost(names[1], tmp_path_factory.mktemp(names[1]), gpus=3)
        make_second_unit(second)
        yield first, second
    finally:
        for name in names:
            stop_simhost(name)


def site_data(hosts, results, pushed):
    """awx/moe_bench.yml as a site edits it (awx/README.md: a copy with its hosts and windows)."""
    first, second = hosts
    data = json.loads(json.dumps(AWX_DATA))
    connection = lambda host: {key: host.connection[key] for key in ("ansible_host", "ansible_port", "ansible_user",  # noqa: E731
                                                                    "ansible_ssh_private_key_file")}
    data["awx_moe_bench_windows"] = [open_window()] + [w for w in data["awx_moe_bench_windows"]
                                                       if w["name"] == "wednesday_night_new_york"]
    data["awx_moe_bench_hosts"] = [
        {"name": first.name, "window": OPEN_WINDOW,
         "variables": dict(connection(first), moe_bench_unit=UNIT, moe_bench_gpus=[0, 1],
                           moe_bench_health_url="http://127.0.0.1:30000/health",
                           moe_bench_python="/opt/bench-venv/bin/python", moe_bench_device="cpu")},
        {"name": second.name, "window": OPEN_WINDOW,
         "variables": dict(connection(second), moe_bench_unit=OTHER_UNIT, moe_bench_gpus=[2],
                           moe_bench_health_url=f"http://127.0.0.1:{OTHER_PORT}/health",
                           moe_bench_python="/opt/bench-venv/bin/python", moe_bench_device="cpu")},
        # another window's host (TEST-NET address): a launch limited to the open window never reaches it
        {"name": "h200-other-window", "window": "wednesday_night_new_york",
         "variables": {"ansible_host": "192.0.2.1", "moe_bench_unit": UNIT, "moe_bench_gpus": [0],
                       "moe_bench_health_url": "http://127.0.0.1:30000/health",
                       "moe_bench_python": "/opt/bench-venv/bin/python"}},
    ]
    # the job's results folder and the results host, on this machine
    data["awx_moe_bench_inventory"]["variables"]["moe_bench_results_dir"] = str(results)
    data["awx_moe_bench_job_template"]["extra_vars"]["moe_bench_results_push_dest"] = str(pushed)
    return data


def render_awx_objects(tmp_path, site):
    """Run playbooks/awx_configure.yml with a recording awx.awx: the AWX objects, as AWX gets them."""
    collection = tmp_path / "collections" / "ansible_collections" / "awx" / "awx"
    (collection / "plugins" / "action").mkdir(parents=True)
    (collection / "galaxy.yml").write_text("namespace: awx\nname: awx\nversion: 24.6.1\n")
    for module in AWX_MODULES:
        (collection / "plugins" / "action" / f"{module}.py").write_text(RECORDER)
    pdd = tmp_path / "configure"
    (pdd / "env").mkdir(parents=True)
    (pdd / "env" / "extravars").write_text(yaml.safe_dump(site))
    (pdd / "env" / "envvars").write_text(yaml.safe_dump({
        "ANSIBLE_COLLECTIONS_PATH": str(tmp_path / "collections"), "HOME": str(tmp_path / "home")}))
    (pdd / "project").symlink_to(REPO, target_is_directory=True)
    runner = ansible_runner.run(private_data_dir=str(pdd), playbook="playbooks/awx_configure.yml", quiet=True)
    assert runner.status == "successful", runner.stdout.read()[-4000:]
    objects = {module: [] for module in AWX_MODULES}
    for event in runner.events:
        data = event.get("event_data", {})
        if event.get("event") in ("runner_on_ok", "runner_item_on_ok") and "awx_object" in data.get("res", {}):
            objects[data["task_action"].split(".")[-1]].append(data["res"]["awx_object"])
    return objects


def awx_inventory(objects):
    """The inventory AWX builds for a job from its host and group objects (inventory script form)."""
    inventory = {"all": {"children": {}}}
    hostvars = {host["name"]: host["variables"] for host in objects["host"]}
    for group in objects["group"]:
        inventory["all"]["children"][group["name"]] = {"hosts": {name: {} for name in group["hosts"]},
                                                       "vars": group["variables"]}
    inventory["all"]["hosts"] = hostvars
    return inventory


def scheduled_launch(objects, window):
    """Extra vars, limit and verbosity of the job a window's schedule launches."""
    template = objects["job_template"][0]
    schedule = next(item for item in objects["schedule"] if item["name"].endswith(" " + window))
    extra_vars = dict(template["extra_vars"])
    # a scheduled launch answers every survey question with its default (AWX: strings)
    for question in template["survey_spec"]["spec"]:
        extra_vars[question["variable"]] = as_awx_sends(question["default"])
    extra_vars.update({name: as_awx_sends(value) for name, value in schedule["extra_data"].items()})
    extra_vars.update(AWX_JOB_VARS)
    return {"playbook": template["playbook"], "extra_vars": extra_vars, "limit": schedule["limit"],
            "verbosity": int(template["verbosity"]), "survey": template["survey_spec"]}


def launch(tmp_path, objects, window):
    job = scheduled_launch(objects, window)
    pdd = tmp_path / "job"
    for sub in ("env", "inventory"):
        (pdd / sub).mkdir(parents=True)
    (pdd / "env" / "extravars").write_text(json.dumps(job["extra_vars"]))
    (pdd / "inventory" / "hosts.yml").write_text(yaml.safe_dump(awx_inventory(objects)))
    short = pathlib.Path(tempfile.mkdtemp(prefix="awx-", dir="/tmp"))
    (pdd / "env" / "envvars").write_text(yaml.safe_dump({
        "HOME": str(short), "ANSIBLE_SSH_CONTROL_PATH_DIR": str(short / "cp"), "ANSIBLE_NOCOLOR": "1"}))
    (pdd / "project").symlink_to(REPO, target_is_directory=True)
    try:
        runner = ansible_runner.run(private_data_dir=str(pdd), playbook=job["playbook"], limit=job["limit"],
                                    verbosity=job["verbosity"] or None, quiet=True)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    return runner, job, list(runner.events)


def ok_events(events, task):
    return [event["event_data"] for event in events
            if event.get("event") == "runner_on_ok" and event["event_data"].get("task") == task]


def test_a_scheduled_awx_launch_runs_each_host_of_the_window_with_its_own_unit_and_gpus(
        awx_hosts, tmp_path):
    first, second = awx_hosts
    results, pushed = tmp_path / "results", tmp_path / "results-host"
    objects = render_awx_objects(tmp_path, site_data(awx_hosts, results, pushed))
    job = scheduled_launch(objects, OPEN_WINDOW)
    # What AWX passes: the window's group as the limit, every answer a string, no per-host fact.
    assert job["limit"] == f"window_{OPEN_WINDOW}"
    assert job["extra_vars"]["moe_bench_bench_budget_s"] == "300"
    assert job["extra_vars"]["moe_bench_window_override"] == "false"
    assert not {"moe_bench_unit", "moe_bench_gpus", "moe_bench_health_url"} & set(job["extra_vars"])
    since = {host.name: host.epoch() for host in awx_hosts}

    runner, job, events = launch(tmp_path, objects, OPEN_WINDOW)
    stdout = runner.stdout.read()
    assert runner.status == "successful" and runner.rc == 0, stdout[-6000:]

    # Both hosts of the window ran; the other window's host was never reached.
    assert set(runner.stats["ok"]) == {first.name, second.name}, runner.stats
    assert not runner.stats["failures"] and not runner.stats["dark"], runner.stats
    assert "h200-other-window" not in stdout

    expected = {first.name: (UNIT, [0, 1], 30000), second.name: (OTHER_UNIT, [2], OTHER_PORT)}
    plans = {event["host"]: event["res"]["ansible_facts"]["moe_bench_plan"]
             for event in ok_events(events, "Add the run's places and the payload's arguments to the plan")}
    assert set(plans) == set(expected)
    for host in awx_hosts:
        unit, gpus, port = expected[host.name]
        plan = plans[host.name]
        # each host kept its own unit and GPUs, typed as the command line gives them
        assert plan["unit"] == unit and plan["gpus"] == gpus, plan
        assert plan["inputs"]["moe_bench_bench_budget_s"] == 300
        assert plan["inputs"]["moe_bench_window_override"] is False
        # the schedule's "300" and "60" became the numbers the plan's arithmetic needs
        assert plan["m_list"] == [1, 2] and plan["async_limit_s"] == 300 + 60
        # the memory check looked at this host's GPUs only
        checked = [event for event in events if event.get("event") == "runner_on_ok"
                   and event["event_data"].get("host") == host.name
                   and event["event_data"].get("role") == "vram_check"
                   and "gpus" in event["event_data"].get("res", {})]
        assert checked, "no memory check on %s" % host.name
        # the real end state: its unit stopped once and is back, healthy; no lock; results here and pushed
        journal = host.journal(unit=unit, since_epoch=since[host.name])
        assert len([line for line in journal.splitlines() if line.startswith("Stopping ")]) == 1, journal
        assert host.unit_active(unit) == "active"
        assert health(host, port) == 200
        assert host.exec("test ! -e %s/lock" % STATE_DIR, check=False).returncode == 0, "lock left on %s" % host.name
        run_dirs = [path for path in (results / host.name).iterdir() if path.is_dir()]
        assert len(run_dirs) == 1 and (run_dirs[0] / "results.json").is_file()
        assert json.loads((run_dirs[0] / "results.json").read_text())["status"] == "complete"
        assert (pushed / host.name / run_dirs[0].name / "results.json").is_file()
    # the second host's other unit was left alone
    assert second.unit_active(UNIT) == "inactive"
    assert "Stopping " not in second.journal(unit=UNIT, since_epoch=since[second.name])


def test_a_wrong_survey_answer_is_refused_before_anything_is_stopped(awx_hosts, tmp_path):
    first, second = awx_hosts
    site = site_data(awx_hosts, tmp_path / "results", tmp_path / "results-host")
    site["awx_moe_bench_windows"][0]["extra_data"] = dict(FAST_SCHEDULE_DATA, moe_bench_bench_budget_s="30m")
    objects = render_awx_objects(tmp_path, site)
    since = {host.name: host.epoch() for host in awx_hosts}
    runs_before = {host.name: host.run_ids() for host in awx_hosts}
    runner, _job, _events = launch(tmp_path, objects, OPEN_WINDOW)
    stdout = " ".join(runner.stdout.read().split())
    assert runner.status == "failed", stdout[-4000:]
    assert "moe_bench_bench_budget_s" in stdout, stdout[-4000:]
    assert "Nothing was stopped." in stdout
    for host, unit in ((first, UNIT), (second, OTHER_UNIT)):
        assert host.unit_active(unit) == "active"
        assert "Stopping " not in host.journal(unit=unit, since_epoch=since[host.name])
        assert host.run_ids() == runs_before[host.name], "a run folder was made on %s" % host.name
        assert host.exec("test ! -e %s/lock" % STATE_DIR, check=False).returncode == 0


def test_the_rendered_inventory_puts_every_host_in_the_group_the_playbook_runs_on(tmp_path, awx_hosts):
    objects = render_awx_objects(tmp_path, site_data(awx_hosts, tmp_path / "r", tmp_path / "p"))
    groups = {group["name"]: group for group in objects["group"]}
    assert set(groups["moe_bench_hosts"]["hosts"]) == {host["name"] for host in objects["host"]}
    assert set(groups[f"window_{OPEN_WINDOW}"]["hosts"]) == {host.name for host in awx_hosts}
    assert groups[f"window_{OPEN_WINDOW}"]["variables"]["moe_bench_window"]["timezone"] == "Europe/Berlin"
