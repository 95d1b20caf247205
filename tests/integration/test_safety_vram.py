"""GPU memory not released after the stop: the check waits, then fails with the holder table; with
the opt-in kill only the stopped unit's leftovers die, never an unrelated process."""

import json
import re

from conftest import STATE_DIR, fetched_run_dirs, wait_until


def assert_restored_without_a_benchmark(host, results_dir):
    """The unit is back and healthy, no timer, no lock; the benchmark never started (no results)."""
    assert host.unit_show()["ActiveState"] == "active"
    assert host.health_status() == 200
    assert not host.timer_loaded(), "dead-man timer left armed"
    assert host.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock not released"
    (run_id,) = host.run_ids()
    assert "job.json" not in host.run_files(run_id), "the benchmark ran although the memory was not free"
    assert not any((run_dir / "results.json").exists() for run_dir in fetched_run_dirs(results_dir, host))


def _holder_row(output: str, pid: int) -> bool:
    """The failure message's holder table has a row for `pid` (GPU, PID, process, MiB, unit)."""
    return re.search(r"(?:^|\\n|\n)\s*\d+\s+%d\s+\S+\s+\d+\s" % pid, output) is not None

def leak_child_pids(host):
    """The fake server's leaking child: in the unit's cgroup, not its main pid."""
    main_pid = int(host.unit_show()["MainPID"])
    return [pid for pid in host.unit_cgroup_pids() if pid != main_pid]


def test_leftover_holding_memory_fails_with_holder_table(simhost, run_playbook, results_dir):
    simhost.set_switches(restart=True, FAKE_LEAK_CHILD="1")
    simhost.wait_healthy()
    leaked = wait_until(lambda: leak_child_pids(simhost), timeout=20, what="leak child started")
    run = run_playbook(simhost, {"moe_bench_vram_timeout_s": 6, "moe_bench_vram_interval_s": 1})
    assert run.rc != 0, run.describe()
    assert "GPU memory was not released" in run.stdout, run.describe()
    assert "Processes holding memory:" in run.stdout, run.describe()
    assert any(_holder_row(run.stdout, pid) for pid in leaked), (leaked, run.describe())
    assert "moe_bench_kill_unit_leftovers=true" in run.stdout, run.describe()
    # Nothing was killed without the opt-in, and the service is back.
    assert all(simhost.pid_alive(pid) for pid in leaked)
    assert_restored_without_a_benchmark(simhost, results_dir)


def test_opt_in_kill_takes_only_the_units_leftovers_never_an_unrelated_holder(simhost, run_playbook,
                                                                             results_dir):
    simhost.set_switches(restart=True, FAKE_LEAK_CHILD="1")
    simhost.wait_healthy()
    leaked = wait_until(lambda: leak_child_pids(simhost), timeout=20, what="leak child started")
    # An unrelated process on the same GPU, outside the unit: small enough not to block the
    # check on its own (500 + 9 MiB <= 1024 MiB), but listed as a holder.
    stray = simhost.start_gpu_holder(gpus="0", mib=500)
    assert stray not in leaked
    run = run_playbook(simhost, {"moe_bench_kill_unit_leftovers": True, "moe_bench_vram_timeout_s": 4,
                                 "moe_bench_vram_interval_s": 1, "moe_bench_vram_max_used_mib": 1024})
    assert run.rc == 0, run.describe()
    assert all(not simhost.pid_alive(pid) for pid in leaked), "the unit's leftover survived the opt-in kill"
    assert simhost.pid_alive(stray), "an unrelated GPU memory holder was killed"
    assert stray in simhost.gpu_holder_pids()
    assert "left alone" in run.stdout, run.describe()
    assert simhost.unit_show()["ActiveState"] == "active"
    assert simhost.health_status() == 200
    assert not simhost.timer_loaded()
    assert simhost.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock not released"
    (fetched,) = fetched_run_dirs(results_dir, simhost)
    assert json.loads((fetched / "results.json").read_text())["status"] == "complete"


def test_unrelated_holder_blocking_the_gpu_is_reported_never_killed(simhost, run_playbook, results_dir):
    stray = simhost.start_gpu_holder(gpus="0", mib=20000)
    run = run_playbook(simhost, {"moe_bench_kill_unit_leftovers": True, "moe_bench_vram_timeout_s": 4,
                                 "moe_bench_vram_interval_s": 1})
    assert run.rc != 0, run.describe()
    assert "GPU memory was not released" in run.stdout, run.describe()
    assert _holder_row(run.stdout, stray), run.describe()
    assert simhost.pid_alive(stray), "an unrelated GPU memory holder was killed"
    assert_restored_without_a_benchmark(simhost, results_dir)
