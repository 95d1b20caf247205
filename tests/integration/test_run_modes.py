"""The ways operators and AWX launch the playbook besides a plain run: `--check` (a preview that
changes nothing anywhere), `--diff`, and tags (only the memory report; skipping the report and
the push; a tag selection that would reach the stop without its safeguards)."""

import json
import re

from conftest import STATE_DIR, fetched_run_dirs
from test_safety_lock_restore import OTHER_RUN, write_lock


def host_snapshot(host):
    """What a run would change on the host: the unit's process, the state folder, the timer."""
    return {"unit": {k: v for k, v in host.unit_show().items() if k in ("ActiveState", "MainPID",
                                                                         "ActiveEnterTimestampMonotonic")},
            # Every path and its modification time under the state and payload folders.
            "state": host.exec("find %s /opt/moe-bench -printf '%%p %%T@\\n' 2>/dev/null | sort; true" % STATE_DIR).stdout,
            "timer": host.timer_loaded()}


def test_check_mode_previews_every_host_and_changes_nothing(simhost, run_playbook, results_dir):
    since = simhost.epoch()
    before = host_snapshot(simhost)
    run = run_playbook(simhost, {"moe_bench_m_list": "1,2,4,8"}, extra_args=["--check", "--diff"])
    assert run.rc == 0, run.describe()
    text = " ".join(run.stdout.split())
    preview = re.search(r"would stop fake-inference\.service on %s for about (\d+) s \(stop <= (\d+) s, "
                        r"memory <= (\d+) s, benchmark <= (\d+) s, load <= (\d+) s\); GPUs 0; M 1,2,4,8; "
                        r"window: none set; lock: free" % re.escape(simhost.name), text)
    assert preview, run.describe()
    downtime, stop, memory, bench, load = map(int, preview.groups())
    # The figures are the plan's: FAST_VARS' budgets (stop 30 s is the unit's own TimeoutStopSec).
    assert (stop, memory, bench, load) == (30 + 15, 10, 300 + 60, 60), preview.group(0)
    assert downtime >= stop + memory + bench + load
    assert "Check mode: nothing was changed on %s" % simhost.name in text, run.describe()
    # --diff shows the lock a real run would write.
    assert re.search(r'"would_write": "%s/lock"' % STATE_DIR, run.stdout), run.describe()
    assert re.search(r'"run_id": "\d{8}T\d{6}Z-[0-9a-f]{6}"', run.stdout), run.describe()
    # Nothing changed anywhere: no stop, no files on the host, no timer, nothing on the controller.
    assert simhost.stop_count(since) == 0
    assert host_snapshot(simhost) == before
    assert simhost.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0
    assert list(results_dir.rglob("*")) == [], list(results_dir.rglob("*"))
    # No step of the downtime ran, and nothing waited out a timeout.
    for step in ("Record the service's state and stop it", "Wait until the GPUs are released", "Dead-man switch armed"):
        assert step not in run.stdout, step


def test_check_mode_tells_the_truth_about_a_held_lock(simhost, run_playbook):
    write_lock(simhost, controller="other-controller.example", pid=4242, expires_in_s=3600)
    run = run_playbook(simhost, {}, extra_args=["--check"])
    assert run.rc != 0, run.describe()
    assert "is locked by run %s" % OTHER_RUN in " ".join(run.stdout.split()), run.describe()
    assert simhost.read_json("%s/lock" % STATE_DIR)["run_id"] == OTHER_RUN


def task_results(stdout, name):
    """The result words (ok, changed, skipping, fatal, ...) of every task whose title has name."""
    found = set()
    for chunk in stdout.split("\nTASK [")[1:]:
        title, _, body = chunk.partition("\n")
        if name in title:
            found |= set(re.findall(r"^(ok|changed|skipping|fatal|failed|included): ", body, re.M))
    return found


def test_tag_vram_check_runs_only_the_read_only_memory_report(simhost, run_playbook, results_dir):
    since = simhost.epoch()
    before = host_snapshot(simhost)
    run = run_playbook(simhost, {}, extra_args=["--tags", "vram_check"])
    assert run.rc == 0, run.describe()
    assert re.search(r"\b0\s+NVIDIA H200\s+130009\b", run.stdout), run.describe()
    # The downtime's roles are imported statically: their tasks may be listed, never run.
    assert task_results(run.stdout, "Wait until the GPUs are released") <= {"skipping"}, run.describe()
    assert simhost.stop_count(since) == 0
    assert host_snapshot(simhost) == before
    assert simhost.run_ids() == []


def test_skip_tags_report_and_push_still_runs_the_whole_cycle(simhost, run_playbook, results_dir, tmp_path):
    push_dest = tmp_path / "pushed"
    run = run_playbook(simhost, {"moe_bench_results_push_dest": str(push_dest)},
                       extra_args=["--skip-tags", "bench_report,results_push"])
    assert run.rc == 0, run.describe()
    assert simhost.unit_show()["ActiveState"] == "active" and simhost.health_status() == 200
    assert not simhost.timer_loaded()
    assert simhost.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0
    (fetched,) = fetched_run_dirs(results_dir, simhost)
    assert json.loads((fetched / "results.json").read_text())["status"] == "complete"
    # The skipped roles did not run: no report files, nothing pushed.
    assert not (fetched / "summary.md").exists() and not (fetched / "manifest.json").exists()
    assert not push_dest.exists()


def test_a_tag_selection_reaching_the_stop_without_its_safeguards_stops_nothing(simhost, run_playbook):
    since = simhost.epoch()
    before = host_snapshot(simhost)
    run = run_playbook(simhost, {}, extra_args=["--tags", "service_stop,vram_check,bench_run_async"])
    assert run.rc == 0, run.describe()
    assert simhost.stop_count(since) == 0, simhost.journal(since_epoch=since)
    assert host_snapshot(simhost) == before
