"""What one run of playbooks/moe_bench.yml costs in CPU, on the controller and on the host.

Starts (or reuses) one simulated host, runs the playbook against it with the integration
suite's settings (tests/integration/conftest.py FAST_VARS), and prints the wall time, the CPU
seconds of ansible-playbook and every process it started (os.times of the children), and the
CPU seconds the host's container used meanwhile (its cgroup's cpuacct.usage). The suite is
CPU-bound on 2 cores, so these two figures are what a playbook change costs each test.

  .venv/bin/python tools/playbook_cost.py [--runs 3] [--reuse] [--vars '{"moe_bench_m_list": "1,2"}']
  .venv/bin/python tools/playbook_cost.py --down          # remove the host

The playbook's output of the last run goes to --out (default /tmp/playbook-cost.txt), with
ansible.posix.profile_tasks' per-task times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

import conftest as it  # noqa: E402  (the suite's own host and playbook helpers)

NAME = "mb-cost"


def container_cpu_s(name: str) -> float:
    container = subprocess.check_output(["docker", "inspect", "-f", "{{.Id}}", name], text=True).strip()
    for pattern in ("/sys/fs/cgroup/cpuacct/docker/%s/cpuacct.usage",
                    "/sys/fs/cgroup/system.slice/docker-%s.scope/cpu.stat"):
        path = Path(pattern % container)
        if path.exists():
            text = path.read_text()
            if path.name == "cpu.stat":  # cgroup v2: usage_usec
                return int(dict(line.split() for line in text.splitlines())["usage_usec"]) / 1e6
            return int(text) / 1e9
    raise SystemExit("cannot find the cgroup CPU counter of container %s" % name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--reuse", action="store_true", help="reuse the host of an earlier call (reset it)")
    parser.add_argument("--vars", default="{}", help="JSON object of extra vars over the suite's settings")
    parser.add_argument("--out", default="/tmp/playbook-cost.txt")
    parser.add_argument("--down", action="store_true")
    arguments = parser.parse_args(argv)
    workdir = Path("/tmp/playbook-cost")
    if arguments.down:
        it.stop_simhost(NAME)
        return 0
    workdir.mkdir(exist_ok=True)
    if arguments.reuse:
        host = it.SimHost(NAME, workdir)
        host.write_inventory()
    else:
        it.stop_simhost(NAME)
        host = it.start_simhost(NAME, workdir)
    results = workdir / "results"
    results.mkdir(exist_ok=True)
    rows = []
    for _ in range(arguments.runs):
        host.reset()
        extra_vars = it.merged_vars(results, json.loads(arguments.vars))
        argv_ = it._playbook_argv(host, "moe_bench.yml", extra_vars, workdir, 0)
        env = it._playbook_env(workdir)
        env["ANSIBLE_CALLBACKS_ENABLED"] = "moe_bench_progress,ansible.posix.profile_tasks"
        host_before, before, started = container_cpu_s(NAME), os.times(), time.monotonic()
        completed = subprocess.run(argv_, cwd=REPO, env=env, capture_output=True, text=True)
        wall, after = time.monotonic() - started, os.times()
        host_cpu = container_cpu_s(NAME) - host_before
        controller = (after.children_user - before.children_user) + (after.children_system - before.children_system)
        Path(arguments.out).write_text(completed.stdout + completed.stderr)
        rows.append((completed.returncode, wall, controller, host_cpu))
        print("rc %d  wall %.1f s  controller CPU %.1f s  host CPU %.1f s  tasks %d"
              % (completed.returncode, wall, controller, host_cpu, completed.stdout.count("\nTASK [")), flush=True)
    if len(rows) > 1:
        print("median: wall %.1f s  controller CPU %.1f s  host CPU %.1f s"
              % tuple(statistics.median(row[i] for row in rows) for i in (1, 2, 3)))
    return 0 if all(row[0] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
