"""Offline checks of the AWX definitions (awx/moe_bench.yml, playbooks/awx_configure.yml)
and the execution environment. No AWX runs here, so everything AWX would reject or
misread is checked against the same sources the playbooks use."""

from __future__ import annotations

import datetime as dt
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
from zoneinfo import ZoneInfo

import pytest
import yaml
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

REPO = pathlib.Path(__file__).resolve().parents[2]
VENV_BIN = pathlib.Path(sys.executable).parent
AWX_VARS = yaml.safe_load((REPO / "awx" / "moe_bench.yml").read_text())
PLAN_SPEC = yaml.safe_load((REPO / "roles" / "bench_plan" / "meta" / "argument_specs.yml").read_text())
PLAN_OPTIONS = PLAN_SPEC["argument_specs"]["main"]["options"]
SURVEY = AWX_VARS["awx_moe_bench_survey"]["spec"]
WINDOWS = AWX_VARS["awx_moe_bench_windows"]
AWX_CONFIGURE = REPO / "playbooks" / "awx_configure.yml"
AWX_MODULES_USED = sorted(
    {
        key
        for task in yaml.safe_load(AWX_CONFIGURE.read_text())[0]["tasks"]
        for key in task
        if key.startswith("awx.awx.")
    }
)


def _load_filter(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "plugins" / "filter" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mw = _load_filter("maintenance_window")

# What AWX puts into extra vars for an answer of each survey question type.
_SURVEY_TYPES = {"text", "textarea", "password", "integer", "float", "multiplechoice", "multiselect"}


def _answers(question):
    """Every value AWX can send for this question that the test can enumerate."""
    kind = question["type"]
    answers = []
    if "default" in question and question["default"] not in ("", None):
        answers.append(question["default"])
    if kind == "multiplechoice":
        answers.extend(question["choices"])
    elif kind == "multiselect":
        answers.extend([[choice] for choice in question["choices"]])
        answers.append(list(question["choices"]))
    elif kind == "integer":
        answers.extend([question["min"], question["max"]])
    return answers


@pytest.mark.parametrize("question", SURVEY, ids=[q["variable"] for q in SURVEY])
def test_survey_question_is_well_formed_for_awx(question):
    assert question["type"] in _SURVEY_TYPES
    for key in ("question_name", "variable", "required"):
        assert key in question, f"{question['variable']}: AWX needs {key}"
    if question["type"] in ("multiplechoice", "multiselect"):
        assert question["choices"], "a choice question needs choices"
        if question["type"] == "multiplechoice" and "default" in question:
            assert question["default"] in question["choices"]
    if question["type"] == "integer":
        assert isinstance(question["default"], int) and question["min"] <= question["default"] <= question["max"]
    if question["type"] in ("text", "textarea"):
        assert question["min"] <= len(str(question["default"])) <= question["max"]


def test_survey_variables_are_unique():
    names = [question["variable"] for question in SURVEY]
    assert len(names) == len(set(names))


# What differs from host to host. A survey answer is an extra var, which overrides every
# host's own value: these must be host (or group) variables of the AWX inventory.
PER_HOST_INPUTS = {"moe_bench_unit", "moe_bench_gpus", "moe_bench_health_url", "moe_bench_python",
                   "moe_bench_device", "moe_bench_nvidia_smi", "moe_bench_health_completion"}


def test_survey_asks_only_run_wide_choices():
    asked = {question["variable"] for question in SURVEY}
    assert not asked & PER_HOST_INPUTS, f"per-host facts in the survey: {sorted(asked & PER_HOST_INPUTS)}"
    assert {
        "moe_bench_m_list",
        "moe_bench_bench_budget_s",
        "moe_bench_load_budget_s",
        "moe_bench_window_override",
        "moe_bench_backend",
        "moe_bench_restore",
    } <= asked
    for window in WINDOWS:
        given = set(window.get("extra_data") or {})
        assert not given & PER_HOST_INPUTS, f"window {window['name']} sets per-host facts {sorted(given & PER_HOST_INPUTS)}"
    assert not set(AWX_VARS["awx_moe_bench_job_template"]["extra_vars"]) & PER_HOST_INPUTS


def test_every_host_carries_its_own_unit_gpus_health_url_and_python():
    for host in AWX_VARS["awx_moe_bench_hosts"]:
        variables = host["variables"]
        for name in ("moe_bench_unit", "moe_bench_gpus", "moe_bench_health_url", "moe_bench_python"):
            assert variables.get(name) not in (None, "", []), f"host {host['name']} has no {name}"


def test_the_inventory_group_is_the_one_the_playbook_runs_on():
    play = yaml.safe_load((REPO / "playbooks" / "moe_bench.yml").read_text())[0]
    default_target = re.fullmatch(r"\{\{\s*moe_bench_target\s*\|\s*default\('(\w+)'\)\s*\}\}", play["hosts"])
    assert default_target, f"the play should target moe_bench_target with a default group, not {play['hosts']!r}"
    assert default_target.group(1) == AWX_VARS["awx_moe_bench_inventory"]["group"]
    assert PLAN_OPTIONS["moe_bench_target"]["default"] == default_target.group(1)
    # awx_configure.yml makes exactly these groups and limits each schedule to its window's group
    tasks = yaml.safe_load(AWX_CONFIGURE.read_text())[0]["tasks"]
    schedule = next(task["awx.awx.schedule"] for task in tasks if "awx.awx.schedule" in task)
    assert schedule["limit"] == "window_{{ item.name }}"
    groups = [task["awx.awx.group"]["name"] for task in tasks if "awx.awx.group" in task]
    assert groups == ["{{ awx_moe_bench_inventory.group }}", "window_{{ item.name }}"]


@pytest.mark.parametrize("question", SURVEY, ids=[q["variable"] for q in SURVEY])
def test_every_survey_answer_passes_the_role_argument_spec(question):
    variable = question["variable"]
    assert variable in PLAN_OPTIONS, f"{variable} is not an input of roles/bench_plan (argument_specs.yml)"
    option = dict(PLAN_OPTIONS[variable])
    option.pop("description", None)
    option.pop("no_log", None)
    if option.get("choices") and question["type"] in ("multiplechoice", "multiselect"):
        assert set(map(str, question["choices"])) <= set(map(str, option["choices"]))
    validator = ArgumentSpecValidator({variable: option})
    answers = _answers(question)
    assert answers, f"{variable}: nothing to validate"
    for answer in answers:
        result = validator.validate({variable: answer})
        assert not result.error_messages, f"{variable}={answer!r}: {result.error_messages}"


def _plan_inputs(given):
    """What bench_plan makes of the given inputs: its own filter, with its own argument spec."""
    hosts_vars = AWX_VARS["awx_moe_bench_hosts"][0]["variables"]
    base = {name: hosts_vars[name] for name in ("moe_bench_unit", "moe_bench_health_url", "moe_bench_gpus")}
    base.update(AWX_VARS["awx_moe_bench_inventory"]["variables"])
    return _load_filter("moe_bench").moe_bench_inputs(PLAN_SPEC, dict(base, **given))


def _as_awx_sends(value):
    """A survey answer or schedule value as a string, the way it arrives in a job's extra vars."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def test_survey_answers_convert_to_what_the_roles_expect():
    # bench_plan's own conversion (not a validator that converts on the side): "0,1" -> [0, 1],
    # "true" -> True, "1800" -> 1800, exactly what the command line's typed values give.
    typed = {"moe_bench_gpus": [0, 1], "moe_bench_window_override": True, "moe_bench_bench_budget_s": 1800}
    as_strings = _plan_inputs({name: _as_awx_sends(value) for name, value in typed.items()})
    as_typed = _plan_inputs(typed)
    assert as_strings["errors"] == [] and as_typed["errors"] == []
    assert as_strings["inputs"] == as_typed["inputs"]
    for name, value in typed.items():
        assert as_strings["inputs"][name] == value, name
    # every default and choice of the survey, sent as a string, types like its value would
    for question in SURVEY:
        for answer in _answers(question):
            checked = _plan_inputs({question["variable"]: _as_awx_sends(answer)})
            assert checked["errors"] == [], (question["variable"], answer, checked["errors"])


def test_a_wrong_survey_answer_is_refused_naming_its_variable():
    for variable, answer in (("moe_bench_bench_budget_s", "30m"), ("moe_bench_window_override", "maybe"),
                             ("moe_bench_backend", "cutlass"), ("moe_bench_gpus", "0,x")):
        checked = _plan_inputs({variable: answer})
        assert any(variable in message for message in checked["errors"]), (variable, checked["errors"])


def test_schedule_extra_data_only_sets_survey_or_role_inputs():
    for window in WINDOWS:
        for variable, value in (window.get("extra_data") or {}).items():
            assert variable in PLAN_OPTIONS, f"window {window['name']}: {variable} is not a moe_bench input"
            assert variable != "moe_bench_window_override", "a schedule must never override the window"
            option = {k: v for k, v in PLAN_OPTIONS[variable].items() if k not in ("description", "no_log")}
            result = ArgumentSpecValidator({variable: option}).validate({variable: value})
            assert not result.error_messages, result.error_messages


def test_job_template_forbids_simultaneous_runs_and_prompts_for_the_schedules_limit():
    template = AWX_VARS["awx_moe_bench_job_template"]
    assert template["allow_simultaneous"] is False
    assert template["ask_limit_on_launch"] is True
    assert (REPO / template["playbook"]).is_file()


def test_hosts_and_windows_are_consistent():
    names = [window["name"] for window in WINDOWS]
    assert len(names) == len(set(names))
    for window in WINDOWS:
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", window["name"]), "window names become group names"
    hosts = AWX_VARS["awx_moe_bench_hosts"]
    assert hosts
    for host in hosts:
        assert host["window"] in names, f"host {host['name']} names an unknown window {host['window']}"


@pytest.mark.parametrize("window", WINDOWS, ids=[w["name"] for w in WINDOWS])
def test_window_rrule_has_explicit_time_zone_and_parses(window):
    awx_string = mw.awx_rrule(window)
    assert awx_string.startswith(f"DTSTART;TZID={window['timezone']}:")
    assert "\n" not in awx_string


@pytest.mark.parametrize("window", WINDOWS, ids=[w["name"] for w in WINDOWS])
def test_window_opens_at_the_same_wall_clock_time_all_year(window):
    # A year of openings crosses both daylight-saving changes of any zone that has them.
    zone = ZoneInfo(window["timezone"])
    start_local = re.search(r":(\d{8}T\d{6}) ", mw.awx_rrule(window)).group(1)
    wall_clock = dt.datetime.strptime(start_local, "%Y%m%dT%H%M%S").time()
    openings = mw.next_windows(window, after="2026-01-01T00:00:00Z", count=53)
    offsets = set()
    for opening in openings:
        local = dt.datetime.fromisoformat(opening.replace("Z", "+00:00")).astimezone(zone)
        intended = dt.datetime.combine(local.date(), wall_clock, tzinfo=zone)
        exists = intended.astimezone(dt.timezone.utc).astimezone(zone).replace(tzinfo=None) == intended.replace(tzinfo=None)
        if exists:
            assert local.time() == wall_clock, f"{opening} is {local} in {zone}, not {wall_clock}"
        else:
            # the wall-clock time falls in the spring-forward gap: it opens when the clocks jump
            assert local == intended.astimezone(dt.timezone.utc).astimezone(zone)
        offsets.add(local.utcoffset())
    assert len(offsets) == 2, "the openings should span both offsets of a zone with daylight saving"


def test_berlin_window_next_openings_across_the_spring_change():
    berlin = next(window for window in WINDOWS if window["timezone"] == "Europe/Berlin")
    assert mw.next_windows(berlin, after="2026-03-15T12:00:00Z", count=3) == [
        "2026-03-22T01:00:00Z",  # 02:00 CET
        "2026-03-29T01:00:00Z",  # the night of the change: 02:00 CET does not exist, opens at 03:00 CEST
        "2026-04-05T00:00:00Z",  # 02:00 CEST
    ]


def test_new_york_window_next_openings_across_the_us_spring_change():
    new_york = next(window for window in WINDOWS if window["timezone"] == "America/New_York")
    assert mw.next_windows(new_york, after="2026-03-01T00:00:00Z", count=2) == [
        "2026-03-04T06:30:00Z",  # 01:30 EST
        "2026-03-11T05:30:00Z",  # 01:30 EDT
    ]


def _survey_default(variable):
    return next(question["default"] for question in SURVEY if question["variable"] == variable)


@pytest.mark.parametrize("window", WINDOWS, ids=[w["name"] for w in WINDOWS])
def test_a_scheduled_launch_at_the_opening_fits_its_window(window):
    answers = {question["variable"]: question.get("default") for question in SURVEY}
    answers.update(window.get("extra_data") or {})
    # the downtime is at least the benchmark budget plus the model load budget
    lower_bound = answers["moe_bench_bench_budget_s"] + answers["moe_bench_load_budget_s"]
    opening = mw.next_windows(window, after="2026-06-01T00:00:00Z", count=1)[0]
    launched = (dt.datetime.fromisoformat(opening.replace("Z", "+00:00")) + dt.timedelta(seconds=30)).isoformat()
    assert mw.check_window(window, lower_bound, now=launched)["fits"], (
        f"window {window['name']} ({window['duration_s']} s) cannot hold the default budgets"
    )
    plan_filters = _load_filter("moe_bench").FilterModule().filters()
    # The budgets exactly as bench_plan hands them to the filter: its own mapping of
    # moe_bench_* inputs to filter keys, read from its tasks, and the argument spec's defaults.
    plan_tasks = (REPO / "roles" / "bench_plan" / "tasks" / "main.yml").read_text()
    mapping = dict(re.findall(r"^\s+(\w+_s):\s*\"\{\{\s*(?:__bench_plan_in\.)?(moe_bench_\w+)\s*\}\}\"", plan_tasks, re.M))
    assert mapping, "bench_plan no longer maps moe_bench_* budgets to moe_bench_plan keys"
    budgets = {}
    for key, variable in mapping.items():
        if variable in answers:
            budgets[key] = answers[variable]
        else:
            assert "default" in PLAN_OPTIONS.get(variable, {}), f"{variable} has no default in bench_plan's spec"
            budgets[key] = PLAN_OPTIONS[variable]["default"]
    plan = plan_filters["moe_bench_plan"](budgets)
    downtime = plan.get("planned_downtime_s", plan.get("downtime_s"))
    assert downtime is not None, f"moe_bench_plan gives no planned downtime: {sorted(plan)}"
    decision = mw.check_window(window, downtime, now=launched)
    assert decision["fits"], decision["reason"]


def test_awx_configure_loops_over_the_data_instead_of_copying_tasks():
    tasks = yaml.safe_load(AWX_CONFIGURE.read_text())[0]["tasks"]
    by_module = {}
    for task in tasks:
        for key in task:
            if key.startswith("awx.awx."):
                by_module.setdefault(key, []).append(task)
    assert len(by_module["awx.awx.schedule"]) == 1
    assert by_module["awx.awx.schedule"][0]["loop"] == "{{ awx_moe_bench_windows }}"
    assert "maintenance_window_awx_rrule" in by_module["awx.awx.schedule"][0]["awx.awx.schedule"]["rrule"]
    assert len(by_module["awx.awx.host"]) == 1
    assert by_module["awx.awx.host"][0]["loop"] == "{{ awx_moe_bench_hosts }}"
    template = by_module["awx.awx.job_template"][0]["awx.awx.job_template"]
    assert template["survey_spec"] == "{{ awx_moe_bench_survey }}"
    assert template["allow_simultaneous"] == "{{ awx_moe_bench_job_template.allow_simultaneous }}"


def _lint_config(tmp_path, mock_awx):
    config = {"profile": "production", "offline": True}
    if mock_awx:
        # ansible-lint's own mechanism for collections that are not installed
        config["mock_modules"] = AWX_MODULES_USED
    path = tmp_path / "ansible-lint.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _installed_awx_collection():
    """Path of an installed awx.awx collection (scripts/bootstrap puts one in .venv/collections)."""
    roots = os.environ.get("ANSIBLE_COLLECTIONS_PATH", "").split(os.pathsep) + [
        str(REPO / ".venv" / "collections"),
        str(pathlib.Path.home() / ".ansible" / "collections"),
        "/usr/share/ansible/collections",
    ]
    for root in filter(None, roots):
        candidate = pathlib.Path(root) / "ansible_collections" / "awx" / "awx"
        if (candidate / "plugins" / "modules" / "schedule.py").is_file():
            return candidate
    return None


def test_awx_configure_passes_ansible_lint_and_syntax_check(tmp_path):
    # ansible-lint runs ansible-playbook --syntax-check itself; without awx.awx installed
    # its mock_modules stand in for the collection's module names.
    config = _lint_config(tmp_path, mock_awx=_installed_awx_collection() is None)
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), HOME=str(tmp_path))
    env["ANSIBLE_COLLECTIONS_PATH"] = os.pathsep.join(filter(None, [
        os.environ.get("ANSIBLE_COLLECTIONS_PATH", ""), str(REPO / ".venv" / "collections")]))
    result = subprocess.run(
        [str(VENV_BIN / "ansible-lint"), "-c", str(config), "--nocolor", str(AWX_CONFIGURE.relative_to(REPO))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Passed" in result.stdout + result.stderr


def test_awx_configure_task_arguments_exist_in_the_awx_collection():
    collection = _installed_awx_collection()
    if collection is None:
        pytest.skip("awx.awx is not installed (ANSIBLE_COLLECTIONS_PATH): module options not checked")
    tasks = yaml.safe_load(AWX_CONFIGURE.read_text())[0]["tasks"]
    for task in tasks:
        for key, arguments in task.items():
            if not key.startswith("awx.awx."):
                continue
            source = (collection / "plugins" / "modules" / f"{key.split('.')[-1]}.py").read_text()
            documentation = yaml.safe_load(re.search(r'DOCUMENTATION = r?[\'"]{3}(.*?)[\'"]{3}', source, re.S).group(1))
            known = set()
            for name, option in documentation["options"].items():
                known.add(name)
                known.update(option.get("aliases", []))
            unknown = set(arguments) - known
            assert not unknown, f"{task['name']}: {key} has no option(s) {sorted(unknown)}"


def test_execution_environment_builds_a_context_with_what_the_playbooks_use(tmp_path):
    ee = yaml.safe_load((REPO / "execution-environment.yml").read_text())
    assert ee["version"] == 3
    assert ee["images"]["base_image"]["name"]
    assert "ansible-core" in ee["dependencies"]["ansible_core"]["package_pip"]
    python_packages = " ".join(ee["dependencies"]["python"])
    for package in ("matplotlib", "python-dateutil", "tzdata"):
        assert package in python_packages
    collections = {entry["name"] for entry in ee["dependencies"]["galaxy"]["collections"]}
    used = set()
    # what the job runs: roles and playbooks, not the Molecule scenarios beside the roles
    role_files = [path for path in (REPO / "roles").rglob("*.yml") if "molecule" not in path.parts]
    for path in role_files + list((REPO / "playbooks").glob("*.yml")):
        for match in re.finditer(r"^\s*-?\s*([a-z_]+)\.([a-z_]+)\.[a-z_]+:", path.read_text(), re.M):
            if match.group(1) != "ansible" or match.group(2) != "builtin":
                used.add(f"{match.group(1)}.{match.group(2)}")
    assert used == collections, (
        f"the execution environment should carry exactly the collections the playbooks use: "
        f"missing {sorted(used - collections)}, unused {sorted(collections - used)}"
    )
    text = (REPO / "execution-environment.yml").read_text().lower()
    assert not re.search(r"(password|token|secret)\s*:", text), "no secrets in the execution environment"

    builder = shutil.which("ansible-builder", path=str(VENV_BIN)) or shutil.which("ansible-builder")
    if builder is None:
        pytest.skip("ansible-builder is not installed (requirements/controller.txt)")
    result = subprocess.run(
        [
            builder,
            "create",
            "--output-filename",
            "Containerfile",
            "-f",
            str(REPO / "execution-environment.yml"),
            "-c",
            str(tmp_path / "context"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    containerfile = (tmp_path / "context" / "Containerfile").read_text()
    assert "quay.io/centos/centos:stream10" in containerfile
    requirements = (tmp_path / "context" / "_build" / "requirements.yml").read_text()
    assert "awx.awx" in requirements
