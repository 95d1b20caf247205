"""scripts/test-summary: the closing line of `make test` fails on every way a phase can lie."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "test-summary"


def junit(path, cases):
    """cases: list of (name, outcome) with outcome pass | fail | skip."""
    body = []
    for name, outcome in cases:
        inner = {"pass": "", "fail": "<failure message='boom'/>", "skip": "<skipped message='no docker'/>"}[outcome]
        body.append("<testcase classname='tests.x' name='%s'>%s</testcase>" % (name, inner))
    counts = {o: sum(1 for _, v in cases if v == o) for o in ("fail", "skip")}
    path.write_text("<testsuites><testsuite name='pytest' tests='%d' failures='%d' errors='0' skipped='%d'>%s"
                    "</testsuite></testsuites>" % (len(cases), counts["fail"], counts["skip"], "".join(body)))


@pytest.fixture
def tree(tmp_path):
    """A tree with two role scenarios and the playbook scenario, and a complete, fresh .cache."""
    repo = tmp_path / "repo"
    for scenario in ("roles/alpha/molecule/default", "roles/beta/molecule/default", "molecule/playbook"):
        (repo / scenario).mkdir(parents=True)
        (repo / scenario / "molecule.yml").write_text("---\n")
    (repo / "molecule" / "shared").mkdir()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "test-run-started").write_text("")
    time.sleep(0.01)
    for phase in ("unit", "payload", "integration"):
        junit(cache / ("junit-%s.xml" % phase), [("test_a", "pass"), ("test_b", "pass")])
    (cache / "molecule-recap.txt").write_text("ok      alpha (3 s)\nok      beta (4 s)\nok      playbook (9 s)\n")
    (cache / "lint.txt").write_text("pass\n")
    return repo, cache


def summary(tree, ci=False):
    repo, cache = tree
    env = dict(os.environ)
    env.pop("CI", None)
    if ci:
        env["CI"] = "true"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cache", str(cache), "--repo", str(repo)],
                          capture_output=True, text=True, env=env)
    return proc.returncode, proc.stdout


def test_complete_fresh_reports_pass(tree):
    rc, out = summary(tree)
    assert rc == 0, out
    assert out.splitlines()[-1] == "10 passed, 0 failed, 0 skipped"


def test_a_phase_that_executed_no_test_fails(tree):
    junit(tree[1] / "junit-payload.xml", [])
    rc, out = summary(tree)
    assert rc == 1 and "the payload phase executed no test" in out, out


def test_a_phase_that_skipped_every_case_fails(tree):
    junit(tree[1] / "junit-integration.xml", [("test_a", "skip"), ("test_b", "skip")])
    rc, out = summary(tree)
    assert rc == 1 and "the integration phase skipped every one of its 2 cases" in out, out


def test_a_skip_is_named_outside_ci_and_fails_under_ci(tree):
    junit(tree[1] / "junit-unit.xml", [("test_a", "pass"), ("test_needs_docker", "skip")])
    rc, out = summary(tree)
    assert rc == 0, out
    assert "skipped unit: tests.x::test_needs_docker (no docker)" in out
    assert out.splitlines()[-1] == "9 passed, 0 failed, 1 skipped"
    rc, out = summary(tree, ci=True)
    assert rc == 1 and "1 case(s) skipped under CI=true" in out, out


def test_a_molecule_scenario_of_the_tree_missing_from_the_recap_fails(tree):
    repo, cache = tree
    (repo / "roles" / "gamma" / "molecule" / "default").mkdir(parents=True)
    (repo / "roles" / "gamma" / "molecule" / "default" / "molecule.yml").write_text("---\n")
    rc, out = summary(tree)
    assert rc == 1 and "lacks scenario(s) of the tree: gamma" in out, out


def beta_fails(tree, log=None):
    """Scenario beta failed (its log, if given, in .cache/molecule-beta.log): the summary's line
    above its closing count, which must say 1 failed."""
    cache = tree[1]
    (cache / "molecule-recap.txt").write_text("ok      alpha (3 s)\nFAILED  beta (4 s)\nok      playbook (9 s)\n")
    if log is not None:
        (cache / "molecule-beta.log").write_text(log)
    rc, out = summary(tree)
    assert rc == 1 and out.splitlines()[-1] == "9 passed, 1 failed, 0 skipped", out
    return out.splitlines()[-2]


def test_a_failed_scenario_counts_as_failed(tree):
    assert beta_fails(tree) == "test-summary: failed molecule: FAILED beta (4 s) (whole log molecule-beta.log)"


def test_a_failed_scenario_is_named_with_its_last_failed_task_not_an_ignored_one(tree):
    line = beta_fails(tree,
        "TASK [Probe a unit that is not there] ***\n"
        "fatal: [moe-bench-molecule-beta]: FAILED! => {\"msg\": \"expected\"}\n"
        "...ignoring\n"
        "FAILED - RETRYING: [moe-bench-molecule-beta]: Wait for the health endpoint (29 retries left).\n"
        "TASK [Check the outcome] ***\n"
        "fatal: [moe-bench-molecule-beta]: FAILED! => {\"assertion\": \"unit_active\",  \"msg\": \"the unit is down\"}\n"
        "TASK [Put the unit back whatever happened] ***\n"
        "fatal: [moe-bench-molecule-beta]: FAILED! => {\"msg\": \"already stopped\"}\n"
        "...ignoring\n"
        "PLAY RECAP ***\n"
        "ERROR    Ansible return code was 2, command was: ansible-playbook converge.yml\n"
        "INFO     [default > destroy] Executing\n")
    assert line == ("test-summary: failed molecule: FAILED beta (4 s): TASK [Check the outcome] "
                    "fatal: [moe-bench-molecule-beta]: "
                    "FAILED! => {\"assertion\": \"unit_active\", \"msg\": \"the unit is down\"} "
                    "(whole log molecule-beta.log)")


def test_a_scenario_is_read_in_the_action_molecule_marks_failed(tree):
    """Converge's rescued failures are not what broke an idempotence check after it."""
    line = beta_fails(tree,
        "INFO     [beta > converge] Executing\n"
        "TASK [Refuse a busy GPU (case)] ***\n"
        "fatal: [moe-bench-molecule-beta]: FAILED! => {\"msg\": \"GPU 0 is busy\"}\n"
        "TASK [Note the refusal] ***\n"
        "INFO     [beta > converge] Executed: Successful\n"
        "INFO     [beta > idempotence] Executing\n"
        "ERROR    Idempotence test failed because of the following tasks:\n"
        "INFO     [beta > idempotence] Executed: Failed\n"
        "INFO     [beta > destroy] Executing\n"
        "fatal: [localhost]: FAILED! => {\"msg\": \"network gone\"}\n"
        "...ignoring\n"
        "INFO     [beta > destroy] Executed: Successful\n")
    assert line == ("test-summary: failed molecule: FAILED beta (4 s): ERROR Idempotence test failed "
                    "because of the following tasks: (whole log molecule-beta.log)")


def test_a_scenario_that_failed_before_any_task_is_named_with_molecules_error(tree):
    line = beta_fails(tree, "INFO     [default > create] Executing\n"
                            "ERROR    Failed to pre-validate: the driver docker is not available\n")
    assert line == ("test-summary: failed molecule: FAILED beta (4 s): ERROR Failed to pre-validate: "
                    "the driver docker is not available (whole log molecule-beta.log)")


def test_each_failed_case_is_named_with_its_message_just_above_the_closing_line(tree):
    """A CI log that keeps only its tail must still say which case broke (stop 42's did not)."""
    cache = tree[1]
    junit(cache / "junit-payload.xml", [("test_a", "pass"), ("test_floor_compiles", "fail")])
    (cache / "lint.txt").write_text("fail\n")
    (cache / "lint.log").write_text(  # the shape of `ansible-lint --profile production --nocolor`'s output
        "WARNING  Skipped installing collection dependencies due to running in offline mode.\n"
        "WARNING  Listing 2 violation(s) that are fatal\n"
        "name[missing]: All tasks should be named.\n"
        "playbooks/zz_bad.yml:5 Task/Handler: shell echo hi\n\n"
        "no-changed-when: Commands should not change things if nothing needs doing.\n"
        "playbooks/zz_bad.yml:5 Task/Handler: shell echo hi\n\n"
        "Read documentation for instructions on how to ignore specific rule violations.\n\n"
        "# Rule Violation Summary\n\n"
        "  1 name profile:basic tags:idiom\n"
        "  1 no-changed-when profile:basic tags:command-shell,idempotency\n\n"
        "Failed: 2 failure(s), 0 warning(s) in 240 files processed of 1046 encountered.\n")
    rc, out = summary(tree)
    lines = out.splitlines()
    assert rc == 1 and lines[-1] == "8 passed, 2 failed, 0 skipped", out
    assert lines[-8:-1] == ["test-summary: failed payload: tests.x::test_floor_compiles (boom)",
                            "test-summary: failed lint: ansible-lint --profile production did not pass; it ended with:",
                            "test-summary: failed   | name[missing]: All tasks should be named.",
                            "test-summary: failed   | playbooks/zz_bad.yml:5 Task/Handler: shell echo hi",
                            "test-summary: failed   | no-changed-when: Commands should not change things if nothing needs doing.",
                            "test-summary: failed   | playbooks/zz_bad.yml:5 Task/Handler: shell echo hi",
                            "test-summary: failed   | Failed: 2 failure(s), 0 warning(s) in 240 files processed of "
                            "1046 encountered."], out


def test_a_long_lint_listing_is_cut_and_says_how_much_more_there_is(tree):
    cache = tree[1]
    (cache / "lint.txt").write_text("fail\n")
    (cache / "lint.log").write_text("WARNING  Listing 6 violation(s) that are fatal\n"
                                    + "".join("name[missing]: All tasks should be named.\nroles/r/tasks/main.yml:%d\n" % n
                                              for n in range(6))
                                    + "Failed: 6 failure(s), 0 warning(s) in 240 files processed.\n")
    rc, out = summary(tree)
    lines = out.splitlines()
    assert rc == 1 and lines[-3:-1] == ["test-summary: failed   | (4 more lines of violations in .cache/lint.log)",
                                        "test-summary: failed   | Failed: 6 failure(s), 0 warning(s) in 240 files "
                                        "processed."], out
    assert lines[-4] == "test-summary: failed   | roles/r/tasks/main.yml:3", out


def test_a_lint_that_listed_no_violation_is_quoted_by_its_last_lines(tree):
    cache = tree[1]
    (cache / "lint.txt").write_text("fail\n")
    (cache / "lint.log").write_text("".join("line %d\n" % n for n in range(1, 10)) +
                                    "CRITICAL Couldn't parse task at playbooks/moe_bench.yml:12\n")
    rc, out = summary(tree)
    lines = out.splitlines()
    assert rc == 1 and lines[-8:-1] == (
        ["test-summary: failed lint: ansible-lint --profile production did not pass; it ended with:"]
        + ["test-summary: failed   | line %d" % n for n in range(5, 10)]
        + ["test-summary: failed   | CRITICAL Couldn't parse task at playbooks/moe_bench.yml:12"]), out


def test_an_error_of_a_case_is_named_as_an_error(tree):
    cache = tree[1]
    (cache / "junit-unit.xml").write_text(
        "<testsuites><testsuite name='pytest' tests='1' failures='0' errors='1' skipped='0'>"
        "<testcase classname='tests.y' name='test_setup'><error message='fixture &quot;host&quot; failed'>"
        "trace</error></testcase></testsuite></testsuites>")
    rc, out = summary(tree)
    assert rc == 1 and out.splitlines()[-1] == "8 passed, 1 failed, 0 skipped", out
    assert "test-summary: failed unit: tests.y::test_setup (error: fixture \"host\" failed)" in out, out


@pytest.mark.parametrize("report", ["junit-unit.xml", "molecule-recap.txt", "lint.txt"])
def test_a_report_older_than_this_run_is_stale(tree, report):
    cache = tree[1]
    old = time.time() - 3600
    os.utime(cache / report, (old, old))
    rc, out = summary(tree)
    assert rc == 1 and ("%s is older than this make test run" % report) in out, out


@pytest.mark.parametrize("report, phase", [("lint.txt", "lint"), ("junit-payload.xml", "payload"),
                                           ("molecule-recap.txt", "molecule")])
def test_a_phase_that_did_not_run_fails(tree, report, phase):
    (tree[1] / report).unlink()
    rc, out = summary(tree)
    assert rc == 1 and ("the %s phase left no report" % phase) in out, out


def test_the_scenarios_of_this_repository_come_from_its_tree():
    sys.path.insert(0, str(SCRIPT.parent))
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.SourceFileLoader("test_summary_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader("test_summary_script", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    names = module.molecule_scenarios(REPO)
    on_disk = sorted(p.parts[-4] for p in REPO.glob("roles/*/molecule/default/molecule.yml"))
    assert sorted(n for n in names if n != "playbook") == on_disk and "playbook" in names
    # tests/run-molecule runs exactly these.
    listed = subprocess.run(["bash", "-c", "source <(sed -n '/^RUN_ORDER=/,/^\\[ -f molecule/p' tests/run-molecule); "
                             "printf '%s\\n' \"${ALL[@]}\""], cwd=REPO, capture_output=True, text=True).stdout.split()
    assert sorted(listed) == sorted(names), (listed, names)


def test_make_lint_keeps_a_plain_log_for_the_summary_to_quote():
    """lint_failures reads .cache/lint.log as plain text: `make lint` must ask ansible-lint for
    no colour (it colours and links its rule names even into a pipe)."""
    dry = subprocess.run(["make", "-n", "--no-print-directory", "lint"], cwd=REPO, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    recipe = [line for line in dry.stdout.splitlines() if "ansible-lint" in line and ".cache/lint.log" in line]
    assert len(recipe) == 1, dry.stdout
    assert "--nocolor" in recipe[0].split("|")[0], recipe[0]
