"""The dead-man deadline covers the longest legitimate run, and a run during which the timer
fired anyway fails with its figures marked invalid.

The deadline must hold against the unit's real stop: a unit whose own TimeoutStopSec (30 s) is
longer than the configured stop timeout, and whose stop really takes 20 s, with every later
budget used up to its limit (the benchmark killed at its time limit)."""

import json
import re

from conftest import DEADMAN_TIMER, LONG_M_LIST, STATE_DIR, fetched_run_dirs, unit_stays_down_while_payloads_run, wait_until

DEADMAN_SERVICE = DEADMAN_TIMER.replace(".timer", ".service")


def deadman_fired(host, since_epoch):
    """The dead-man service ran (its start is in the journal) since a moment."""
    return "moe-bench dead-man switch" in host.exec(
        "journalctl --since @%.6f --no-pager -o cat -u %s" % (since_epoch, DEADMAN_SERVICE), check=False).stdout


def test_slow_stop_and_every_budget_at_its_limit_never_fire_the_timer(simhost, start_playbook, results_dir):
    # The stop takes 20 s (the unit's TimeoutStopSec is 30 s) although the operator planned 2 s;
    # the benchmark runs until its 25 s time limit kills it. The old plan's deadline (2 + 2 + 25
    # + 10 = 39 s after the arming) fell in the middle of this benchmark.
    simhost.set_switches(restart=True, FAKE_STOP_SECONDS="20", FAKE_LOAD_SECONDS="2")
    simhost.wait_healthy(timeout=60)
    budgets = {"moe_bench_m_list": LONG_M_LIST, "moe_bench_stop_timeout_s": 2, "moe_bench_stop_margin_s": 5,
               "moe_bench_vram_timeout_s": 2, "moe_bench_bench_budget_s": 25, "moe_bench_async_margin_s": 0,
               "moe_bench_bench_poll_s": 1, "moe_bench_load_budget_s": 10, "moe_bench_health_poll_s": 1,
               "moe_bench_deadman_margin_s": 0,
               # A layer wide enough that its largest M alone outlasts the 25 s budget (the payload
               # fits its repetitions into the time it has, so a longer M list is not enough).
               "moe_bench_extra_args": ["--hidden", "8192", "--inter", "1024"]}
    since = simhost.epoch()
    run = start_playbook(simhost, budgets)
    # While the benchmark runs the unit must stay down: sample it for the whole benchmark.
    # (The payload also runs briefly before the stop, for its preflight: wait for the job itself.)
    def job_started():
        if run.proc.poll() is not None:
            raise AssertionError("the run ended before its benchmark job started:\n%s" % run.stdout_so_far()[-6000:])
        return any(simhost.exec("test -s %s/runs/%s/job.json" % (STATE_DIR, rid), check=False).returncode == 0
                   for rid in simhost.run_ids()) and simhost.payload_pids()

    wait_until(job_started, timeout=300, interval=0.5, what="benchmark job started")
    samples = unit_stays_down_while_payloads_run(simhost, interval=0.5)
    assert samples >= 10, "the benchmark ran for %d samples only: it did not use its budget" % samples
    result = run.wait(timeout=300)
    text = " ".join(result.stdout.split())
    # The plan took the unit's own stop timeout over the configured one, and said so.
    assert "TimeoutStopSec of the unit (30 s) is longer than moe_bench_stop_timeout_s (2 s)" in text, \
        result.describe()
    # The benchmark used its whole budget (killed at the limit): that failure, and no other.
    assert result.rc != 0, result.describe()
    assert "killed at the async time limit of 25 s" in text, result.describe()
    assert "The dead-man timer fired on" not in text, result.describe()
    # The stop really was slow, and the timer never fired.
    assert "draining for 20 s" in simhost.journal(since_epoch=since)
    assert not deadman_fired(simhost, since), simhost.journal(unit=DEADMAN_SERVICE)
    (run_id,) = simhost.run_ids()
    deadman = simhost.read_json("%s/runs/%s/deadman.json" % (STATE_DIR, run_id))
    # The deadline covers the stop at the unit's 30 s plus the margin, the memory wait, the
    # benchmark's limit and the load budget.
    assert int(deadman["delay_s"]) >= 30 + 5 + 2 + 25 + 10, deadman
    # End state: back and healthy, timer disarmed, lock released.
    assert simhost.unit_show()["ActiveState"] == "active" and simhost.health_status() == 200
    assert not simhost.timer_loaded()
    assert simhost.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock not released"


def test_run_during_which_the_timer_fired_fails_and_its_figures_are_invalid(simhost, start_playbook, results_dir):
    run = start_playbook(simhost, {"moe_bench_m_list": LONG_M_LIST})
    wait_until(lambda: simhost.payload_pids() and simhost.timer_loaded(), timeout=300, interval=0.5,
               what="benchmark running with the dead-man timer armed")
    since = simhost.epoch()
    # The timer fires (its service runs) while the benchmark runs: the host starts the unit.
    simhost.exec("systemctl start %s" % DEADMAN_SERVICE)
    wait_until(lambda: simhost.unit_active() == "active", timeout=30, what="the unit started by the timer")
    assert simhost.payload_pids(), "the benchmark had ended before the timer fired: nothing under test"
    result = run.wait(timeout=600)
    text = " ".join(result.stdout.split())
    assert deadman_fired(simhost, since)
    assert result.rc != 0, result.describe()
    assert re.search(r"The dead-man timer fired on %s during run \S+" % re.escape(simhost.name), text), \
        result.describe()
    assert "marked INVALID" in text, result.describe()
    # The service is back, the lock released, the timer gone.
    assert simhost.unit_show()["ActiveState"] == "active" and simhost.health_status() == 200
    assert not simhost.timer_loaded()
    assert simhost.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock not released"
    # The figures are kept but marked invalid in the manifest, the summary and the history.
    (fetched,) = fetched_run_dirs(results_dir, simhost)
    results = json.loads((fetched / "results.json").read_text())
    assert results["results"], "the measured figures were lost"
    manifest = json.loads((fetched / "manifest.json").read_text())
    assert manifest["validity"]["valid"] is False, manifest["validity"]
    assert "dead-man timer fired" in manifest["validity"]["reasons"][0]
    assert "INVALID" in (fetched / "summary.md").read_text()
    history = json.loads((results_dir / simhost.name / "history.json").read_text())
    assert [entry["status"] for entry in history["runs"]] == ["invalid"], history
