"""The unit will not come back (fails on start, crash-loops under Restart=): the playbook fails
within about one poll interval, not after the whole load budget, with the journal's tail."""

import json
import re

import pytest

from conftest import STATE_DIR, fetched_run_dirs

LOAD_BUDGET_S = 300
POLL_S = 3


@pytest.mark.parametrize("switches, journal_line", [
    pytest.param({"FAKE_FAIL_ON_START": "1"}, r"FAKE_FAIL_ON_START|fail", id="fails-on-start"),
    # Crashes 3 s after each start, long before its 30 s load ends: Restart= cycles it.
    pytest.param({"FAKE_CRASH_LOOP": "1", "FAKE_CRASH_AFTER_SECONDS": "3", "FAKE_LOAD_SECONDS": "30"},
                 r"CUDA error: an illegal memory access", id="crash-loop"),
])
def test_unit_that_will_not_come_back_fails_fast_with_journal_tail(simhost, run_playbook, results_dir,
                                                                  switches, journal_line):
    # The switches take effect at the next start: the playbook's own restart.
    simhost.set_switches(restart=False, **switches)
    run = run_playbook(simhost, {"moe_bench_load_budget_s": LOAD_BUDGET_S, "moe_bench_health_poll_s": POLL_S})
    assert run.rc != 0, run.describe()
    assert "did NOT come back" in run.stdout, run.describe()
    assert "THE SERVICE IS DOWN" in run.stdout, run.describe()
    assert "Journal tail" in run.stdout, run.describe()
    assert re.search(journal_line, run.stdout), run.describe()
    # Failed fast: the recovery's own clock, and the whole run, far below the load budget.
    waited = float(re.search(r"did NOT come back: .*? after ([0-9.]+) s", run.stdout, re.S).group(1))
    assert waited < 60, "recovery gave up after %s s (load budget %s s, poll %s s)" % (waited, LOAD_BUDGET_S, POLL_S)
    assert run.wall_s < LOAD_BUDGET_S, run.wall_s
    # Final state: the unit is not serving, and the host says so.
    state = simhost.unit_show()
    assert state["ActiveState"] != "active" or int(state["NRestarts"]) > 0, state
    assert simhost.health_status() != 200
    (run_id,) = simhost.run_ids()
    recover = simhost.read_json("%s/runs/%s/recover.json" % (STATE_DIR, run_id))
    assert recover and str(recover["ready"]).lower() == "false", recover
    # The benchmark had finished before the failed restart: its results are on the controller.
    (fetched,) = fetched_run_dirs(results_dir, simhost)
    assert json.loads((fetched / "results.json").read_text())["status"] == "complete"
