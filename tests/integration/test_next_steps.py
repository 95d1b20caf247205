"""The next steps the failure matrix tells operators to run, run against the simulated host:
playbooks/service_recover.yml (bring a host back: start, wait healthy, disarm, clear the lock)
and playbooks/vram_check.yml (read-only memory report, even with fields nvidia-smi cannot read)."""

import json
import re
import time

from conftest import DEADMAN_TIMER, STATE_DIR, UNIT

RECOVER_VARS = {"moe_bench_unit": UNIT, "moe_bench_health_url": "http://127.0.0.1:30000/health",
                "moe_bench_health_poll_s": 1, "moe_bench_load_budget_s": 60, "moe_bench_health_settle_s": 2}


def leave_host_as_a_failed_run_does(host):
    """Unit stopped, a dead-man timer armed for it far ahead, the lock of a run still in place."""
    host.exec("systemctl stop %s" % UNIT)
    host.exec("systemd-run --unit=%s --on-active=3600s --timer-property=AccuracySec=1s --remain-after-exit "
              "systemctl start %s" % (DEADMAN_TIMER.replace(".timer", ""), UNIT))
    lock = {"run_id": "20261201T000000Z-0a1b2c", "unit": UNIT, "controller": "gone.example", "pid": 1,
            "expires_epoch": int(time.time()) + 3600}
    host.exec("mkdir -p %s/runs && printf '%%s' '%s' > %s/lock" % (STATE_DIR, json.dumps(lock), STATE_DIR))
    assert host.unit_active() == "inactive" and host.timer_loaded()


def test_service_recover_brings_the_host_back_and_clears_timer_and_lock(simhost, run_playbook):
    leave_host_as_a_failed_run_does(simhost)
    run = run_playbook(simhost, RECOVER_VARS, playbook="service_recover.yml", raw_vars=True)
    assert run.rc == 0, run.describe()
    state = simhost.unit_show()
    assert state["ActiveState"] == "active", state
    assert simhost.health_status() == 200
    assert not simhost.timer_loaded(), "dead-man timer left armed"
    assert simhost.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock not cleared"
    text = " ".join(run.stdout.split())
    assert "is active and healthy" in text and "stayed healthy for the settle period" in text, run.describe()


def test_service_recover_on_a_unit_that_cannot_start_says_it_is_down(simhost, run_playbook):
    leave_host_as_a_failed_run_does(simhost)
    simhost.set_switches(restart=False, FAKE_FAIL_ON_START="1")
    run = run_playbook(simhost, RECOVER_VARS, playbook="service_recover.yml", raw_vars=True)
    text = " ".join(run.stdout.split())
    assert run.rc != 0, run.describe()
    assert "did NOT come back" in text and "THE SERVICE IS DOWN" in text, run.describe()
    assert "journalctl -u %s" % UNIT in text, run.describe()
    assert simhost.health_status() != 200
    # Nothing is cleared that would stop the host from trying again: the timer stays armed.
    assert simhost.timer_loaded()


def test_vram_check_reports_memory_and_holders_and_changes_nothing(simhost, run_playbook):
    before = simhost.unit_show()
    # GPU 1's memory fields read [N/A] (as on a MIG or vGPU host), and so does the unit's usage there.
    simhost.exec("fake-gpu unreadable --gpus 1 --fields memory.used,memory.free,used_memory")
    for extra_args in ([], ["--check"]):
        run = run_playbook(simhost, {}, playbook="vram_check.yml", raw_vars=True, extra_args=extra_args)
        assert run.rc == 0, run.describe()
        # The GPU table: GPU 0 held by the unit, GPU 1 unreadable, in the module's own layout.
        assert re.search(r"\b0\s+NVIDIA H200\s+130009\s+\d+\s+143771\b", run.stdout), run.describe()
        assert re.search(r"\b1\s+NVIDIA H200\s+\[N/A\]\s+\[N/A\]\s+143771\b", run.stdout), run.describe()
        # The holder table names the unit's main pid and its unit, with [N/A] usage on GPU 1.
        assert re.search(r"\b0\s+%s\s+\S+\s+130000\s+%s" % (before["MainPID"], re.escape(UNIT)), run.stdout), \
            run.describe()
        assert re.search(r"\b1\s+%s\s+\S+\s+N/A\s+%s" % (before["MainPID"], re.escape(UNIT)), run.stdout), \
            run.describe()
    after = simhost.unit_show()
    assert after["MainPID"] == before["MainPID"] and after["ActiveState"] == "active"
    assert simhost.run_ids() == [] and not simhost.timer_loaded()
