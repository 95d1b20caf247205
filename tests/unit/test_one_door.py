"""One door per role: every role reads its own inputs only, wired in one place, and systemd units
are read by one piece of code. Static checks over the tree (they fail on the first stray use)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
ROLES = sorted(path.name for path in (REPO / "roles").iterdir() if (path / "tasks").is_dir())


def role_files(role, *kinds):
    for kind in kinds:
        folder = REPO / "roles" / role / kind
        if folder.is_dir():
            yield from sorted(folder.rglob("*.yml"))


def spec_options(role):
    spec = yaml.safe_load((REPO / "roles" / role / "meta" / "argument_specs.yml").read_text())
    options = {}
    for entry in spec["argument_specs"].values():
        options.update(entry.get("options") or {})
    return options


def test_no_role_reads_another_roles_facts_or_a_path_outside_its_folder():
    offenders = []
    for role in ROLES:
        for path in role_files(role, "tasks", "defaults", "vars", "meta"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if line.lstrip().startswith("#"):
                    continue
                if re.search(r"role_path\s*(~\s*['\"]/\.\.|\|\s*dirname)|role_path\s*}}/\.\.", line):
                    offenders.append("%s:%d reaches outside its role: %s" % (path.relative_to(REPO), number, line.strip()))
                # hostvars[...] of the host itself is only allowed for the role's own facts.
                for name in re.findall(r"hostvars\[[^\]]+\]\[['\"]([A-Za-z0-9_]+)['\"]\]", line):
                    if not name.lstrip("_").startswith(role + "_"):
                        offenders.append("%s:%d reads %s through hostvars" % (path.relative_to(REPO), number, name))
    assert not offenders, "\n".join(offenders)


def test_every_role_input_is_wired_in_one_place_and_exists_in_the_roles_spec():
    wiring = yaml.safe_load((REPO / "playbooks" / "vars" / "roles.yml").read_text())
    unknown = []
    for name in wiring:
        if name.startswith("__"):
            continue
        role = next((role for role in ROLES if name.startswith(role + "_")), None)
        if role is None or name not in spec_options(role):
            unknown.append(name)
    assert not unknown, "playbooks/vars/roles.yml sets inputs no role's argument spec knows: %s" % unknown
    for playbook in ("moe_bench.yml", "service_recover.yml"):
        plays = yaml.safe_load((REPO / "playbooks" / playbook).read_text())
        for play in plays:
            # Loaded once per host by the play's first task (include_vars), not as vars_files.
            first = (play.get("tasks") or [{}])[0]
            assert (first.get("ansible.builtin.include_vars") or {}).get("file") == "vars/roles.yml", (
                "%s: the play %r does not load vars/roles.yml first" % (playbook, play.get("name")))
            assert "always" in first.get("tags", []), "%s: loading vars/roles.yml must be tagged always" % playbook
            assert not play.get("vars_files"), "%s: vars/roles.yml is loaded with include_vars, not vars_files" % playbook
            leaked = sorted(name for name in (play.get("vars") or {}) if not name.startswith("__"))
            assert not leaked, "%s sets role inputs outside vars/roles.yml: %s" % (playbook, leaked)


def _tasks(items):
    for task in items or []:
        yield task
        for key in ("block", "rescue", "always"):
            yield from _tasks(task.get(key))


def test_the_playbooks_pass_no_role_inputs_of_their_own_and_share_one_recovery():
    for playbook in ("moe_bench.yml", "service_recover.yml"):
        plays = yaml.safe_load((REPO / "playbooks" / playbook).read_text())
        tasks = [task for play in plays for task in _tasks(play.get("tasks"))]
        wired = ["%s: %s" % (task.get("name"), sorted(task["vars"])) for task in tasks
                 if ("ansible.builtin.include_role" in task or "ansible.builtin.import_role" in task) and task.get("vars")]
        assert not wired, "%s wires role inputs per task (put them in playbooks/vars/roles.yml): %s" % (playbook, wired)
        recoveries = [task for task in tasks
                      if (task.get("ansible.builtin.include_tasks") or {}).get("file") == "tasks/recover.yml"]
        assert len(recoveries) == 1, "%s must run playbooks/tasks/recover.yml once" % playbook
        direct = [task.get("name") for task in tasks
                  if (task.get("ansible.builtin.include_role") or {}).get("name") == "service_recover"]
        assert not direct, "%s starts the unit outside playbooks/tasks/recover.yml: %s" % (playbook, direct)


def test_systemd_units_are_read_by_the_unit_state_module_only():
    offenders = []
    for role in ROLES:
        for path in role_files(role, "tasks"):
            text = path.read_text()
            if re.search(r"systemctl\s*,\s*show|-\s*show\s*$|systemctl show", text, re.M):
                offenders.append(str(path.relative_to(REPO)))
    for path in sorted((REPO / "library").glob("*.py")):
        if path.name != "unit_state.py" and re.search(r'["\']show["\']', path.read_text()):
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, "systemctl show read outside unit_state / module_utils/systemd_unit.py: %s" % offenders
