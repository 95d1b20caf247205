"""A fleet in one command: five simulated hosts side by side and one inventory host that never
answers (E: a closed port on this machine), two real playbook runs.

Run 1, the fleet preflight refuses: a GPU index D lacks, a pre-stop hook file B names that does not
exist, moe_bench_serial 0 on F, a pool minimum larger than its pool (C alone in pool west), and E
unreachable (moe_bench_skip_unreachable false): nothing is stopped on any host, one table says
which host and why.
Run 2, the rollout in batches of moe_bench_serial [1, 2, 1], moe_bench_max_fail_percentage 25 (of
5 hosts: one may fail), E unreachable and skipped (moe_bench_skip_unreachable true):
  [A] (two GPUs at once)           -> failed on its regression flag (bench_report_fail_on_regression,
                                      an earlier 100x faster run planted): one payload per GPU,
                                      per-GPU results and report, its hooks ran; listed in the fleet
                                      report as failed. Under the percentage: the rollout goes on
  [B, D] (pool east with F, min 1) -> both skipped: each counts the other, in its batch, as down,
                                      and F answers 503
  [C] (two GPUs one after the other, its unit fails to start again)
                                   -> DOWN, reported; its two payloads ran in turn, its plan and
                                      dead-man deadline count two budgets. Over the percentage
  [F] (pool east, health 503)      -> not started: never touched
and the fleet report (fleet.md, fleet.json, plot) lists all six; a webhook on this machine's
loopback is told each host's final state, the health check's header value nowhere in it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from types import SimpleNamespace
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

from conftest import (ANSIBLE_PLAYBOOK, REPO, STATE_DIR, VENV_BIN, PlaybookRun, _playbook_env, merged_vars)

# Batches follow the inventory's order: A, then B and D together, then C, then F (E never answers).
ORDER = "abdcfe"


def _fleet_run(hosts, host_vars, tmp_path, results_dir, extra=None, timeout=900):
    inventory = {"moe_bench_hosts": {"hosts": {
        hosts[key].name: dict(hosts[key].connection, **host_vars.get(key, {})) for key in ORDER}}}
    inventory_path = tmp_path / "fleet-inventory.yml"
    inventory_path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    extra_vars = merged_vars(results_dir, extra)
    extra_vars.pop("moe_bench_gpus")  # per host, in the inventory
    vars_path = tmp_path / "fleet-extra-vars.json"
    vars_path.write_text(json.dumps(extra_vars))
    argv = [str(ANSIBLE_PLAYBOOK), "-i", str(inventory_path), str(REPO / "playbooks" / "moe_bench.yml"),
            "-e", "@%s" % vars_path]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, env=_playbook_env(tmp_path), capture_output=True, text=True, timeout=timeout)
    return PlaybookRun(argv, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started, extra_vars)


SECRET_HEADER_VALUE = "hdr-secret-7f3a9c"


def _webhook():
    """A webhook on 127.0.0.1 that keeps every JSON body posted to it."""
    received = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, received


def _closed_port():
    """A port of this machine that nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _plant_faster_run(results_dir, host):
    """An earlier complete run of the host's configuration, 100x faster at every M: the rollout's
    run of the host is flagged as a regression against it."""
    document = json.loads((REPO / "tests" / "fixtures" / "cpu" / "cpu_tiny_torch.json").read_text())
    document["started_at"], document["finished_at"] = "2026-01-01T00:00:00Z", "2026-01-01T00:00:30Z"
    for row in document["results"]:
        for key in ("us", "us_p20", "us_p80"):
            if isinstance(row.get(key), (int, float)):
                row[key] = row[key] / 100.0
    run_dir = results_dir / host / "20260101T000000Z-base00"
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text(json.dumps(document))
    subprocess.run([str(VENV_BIN / "python"), "-m", "moe_bench_report", "build", "--run-dir", str(run_dir),
                    "--host", host, "--no-plots"], check=True, capture_output=True, timeout=120,
                   env=dict(os.environ, PYTHONPATH="%s:%s/files" % (REPO, REPO), MPLBACKEND="Agg"))


def _untouched(host, since):
    assert host.stop_count(since) == 0, "%s was stopped" % host.name
    assert host.unit_active() == "active"
    assert not host.timer_loaded(), "dead-man timer on %s" % host.name
    assert host.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock left on %s" % host.name
    assert host.run_ids() == [], "run folder on %s" % host.name


def test_fleet_preflight_refusal_then_rollout_with_guard_stop_and_report(simhost_factory, tmp_path, results_dir):
    # Started side by side (each start waits for systemd, SSH and the model's health).
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=5) as pool:
        futures = {key: pool.submit(simhost_factory, "fleet-" + key, gpus=2 if key in "ac" else 1) for key in "abcdf"}
        hosts = {key: future.result() for key, future in futures.items()}
    start_s = time.monotonic() - started
    live = dict(hosts)
    # E: in the inventory, never answering (a closed port of this machine, nothing behind it)
    hosts["e"] = SimpleNamespace(name=hosts["a"].name.replace("fleet-a", "fleet-e"),
                                 connection=dict(hosts["a"].connection, ansible_port=_closed_port()))
    east = {"moe_bench_pool": "east", "moe_bench_pool_min_healthy": 1}
    host_vars = {"a": {"moe_bench_gpus": [0, 1]},
                 "b": dict(east, moe_bench_gpus=[0]),
                 "c": {"moe_bench_gpus": [0, 1], "moe_bench_gpu_parallel": False},
                 "d": dict(east, moe_bench_gpus=[0, 1]),
                 "e": {"moe_bench_gpus": [0]},
                 "f": dict(east, moe_bench_gpus=[0])}

    # --- run 1: D asks for a GPU it lacks, B names a hook file that does not exist, F gives serial 0,
    # C is alone in pool west that must keep 1 healthy, E does not answer: refused in the preflight,
    # nothing stopped anywhere
    host_vars["b"]["moe_bench_pre_stop_tasks"] = "/nonexistent/drain.yml"
    host_vars["f"]["moe_bench_serial"] = "0"
    host_vars["c"].update(moe_bench_pool="west", moe_bench_pool_min_healthy=1)
    since = min(host.epoch() for host in live.values())
    refused = _fleet_run(hosts, host_vars, tmp_path, results_dir)
    assert refused.rc != 0, refused.describe()
    assert "The fleet preflight refused the rollout" in refused.stdout, refused.describe()
    assert "GPU(s) 1 do not exist on %s" % hosts["d"].name in refused.stdout, refused.describe()
    assert "Nothing was stopped on any host" in refused.stdout
    table = [line for line in refused.stdout.splitlines() if any(h.name in line for h in hosts.values())
             and (" ok " in line or " refused " in line or " unreachable " in line)]
    for key, state in (("a", "ok"), ("b", "refused"), ("c", "ok"), ("d", "refused"), ("f", "refused"),
                       ("e", "unreachable")):
        assert any(hosts[key].name in line and " %s " % state in line for line in table), (key, table, refused.describe())
    assert "moe_bench_pre_stop_tasks = /nonexistent/drain.yml: no such file on the controller" in refused.stdout
    assert "moe_bench_serial must be at least 1" in refused.stdout and "(host %s)" % hosts["f"].name in refused.stdout
    assert ("pool west: moe_bench_pool_min_healthy is 1 but the pool has 1 host(s) in this run (%s)"
            % hosts["c"].name) in refused.stdout, refused.describe()
    assert "%s is unreachable" % hosts["e"].name in refused.stdout
    assert "-e moe_bench_skip_unreachable=true goes on without the unreachable hosts" in refused.stdout
    for host in live.values():
        _untouched(host, since)
    assert "Record the service's state and stop it" not in refused.stdout

    # --- run 2: the rollout; A and C carry hooks that record the unit's state on the host
    host_vars["d"]["moe_bench_gpus"] = [0]
    del host_vars["b"]["moe_bench_pre_stop_tasks"], host_vars["f"]["moe_bench_serial"]
    del host_vars["c"]["moe_bench_pool"], host_vars["c"]["moe_bench_pool_min_healthy"]
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for hook, marker in (("pre.yml", "hook-pre-stop"), ("post.yml", "hook-post-recover")):
        (hooks / hook).write_text(
            "- name: Record the unit's state and the run (test hook)\n"
            "  ansible.builtin.shell: >-\n"
            "    { systemctl is-active fake-inference.service; echo {{ moe_bench_plan.run_id }}; }\n"
            "    > /root/%s.txt\n"
            "  changed_when: true\n" % marker)
    for key in "ac":
        host_vars[key].update(moe_bench_pre_stop_tasks=str(hooks / "pre.yml"),
                              moe_bench_post_recover_tasks=str(hooks / "post.yml"))
    # A's run is a regression against an earlier, much faster one, and fails on it
    _plant_faster_run(results_dir, hosts["a"].name)
    host_vars["a"]["bench_report_fail_on_regression"] = True
    hosts["f"].set_switches(restart=True, FAKE_NEVER_READY="1")      # F serves no requests
    hosts["c"].set_switches(restart=False, FAKE_FAIL_ON_START="1")   # C's unit will not start again
    since = min(host.epoch() for host in live.values())
    server, events = _webhook()
    try:
        run = _fleet_run(hosts, host_vars, tmp_path, results_dir, {
            "moe_bench_serial": "1,2,1",
            "moe_bench_max_fail_percentage": "25",
            "moe_bench_skip_unreachable": "true",
            "moe_bench_load_budget_s": 20,
            "moe_bench_notify": "http://127.0.0.1:%d/hook?token=url-secret" % server.server_address[1],
            "moe_bench_health_headers": {"X-Api-Key": SECRET_HEADER_VALUE}})
    finally:
        server.shutdown()
    assert run.rc != 0, run.describe()
    out = run.stdout
    assert "Going on without %s (unreachable, moe_bench_skip_unreachable is true)" % hosts["e"].name in out, run.describe()

    # A: both GPUs measured in one downtime, each its own results file, the service back
    a = hosts["a"]
    assert a.stop_count(since) == 1 and a.unit_active() == "active" and a.health_status() == 200
    assert not a.timer_loaded()
    (a_run,) = a.run_ids()
    fetched = results_dir / a.name / a_run
    for name in ("results.json", "gpu1/results.json", "bench.log", "gpu1/bench.log", "per_gpu.png"):
        assert (fetched / name).is_file(), (name, sorted(str(p) for p in fetched.rglob("*")))
    for name in ("results.json", "gpu1/results.json"):
        document = json.loads((fetched / name).read_text())
        assert document["status"] == "complete" and document["correctness"], name
    summary = json.loads((fetched / "summary.json").read_text())
    assert [gpu["label"] for gpu in summary["gpus"]["gpus"]] == ["GPU 0", "GPU 1"]
    assert "## Every GPU of the host" in (fetched / "summary.md").read_text()
    job = json.loads(a.read_file("%s/runs/%s/job.json" % (STATE_DIR, a_run)))
    assert job["gpus"] in ([0, 1], "[0, 1]")
    # The hooks: the drain ran before the stop (the unit still active), the return once it was back
    assert a.read_file("/root/hook-pre-stop.txt").split() == ["active", a_run]
    assert a.read_file("/root/hook-post-recover.txt").split() == ["active", a_run]
    # Its regression failed it after the report, and the rollout went on (1 failure of 5 allowed)
    assert "is slower than run 20260101T000000Z-base00" in out, run.describe()

    # B and D, one batch of pool east: each counts the other as about to stop, F answers 503
    for key, peer in (("b", "d"), ("d", "b")):
        assert ("%s is skipped: capacity guard: pool east needs 1 healthy host(s) while %s is stopped, and only 0 "
                "of its other host(s) are healthy; about to stop in this batch: %s"
                % (hosts[key].name, hosts[key].name, hosts[peer].name)) in out, run.describe()
        _untouched(hosts[key], since)

    # C: its two GPUs one after the other, then it did not come back: reported DOWN, the rollout stops after it
    c = hosts["c"]
    assert c.stop_count(since) == 1
    assert "did NOT come back" in out, run.describe()
    assert c.unit_active() != "active"
    (c_run,) = c.run_ids()
    c_fetched = results_dir / c.name / c_run
    first, second = (json.loads((c_fetched / name).read_text()) for name in ("results.json", "gpu1/results.json"))
    assert first["status"] == second["status"] == "complete"
    # One after the other: the second GPU's payload started once the first had finished. The
    # stamps have one-second resolution, and the tiny CPU run can start and end within one second.
    assert first["started_at"] <= first["finished_at"] <= second["started_at"], (
        first["started_at"], first["finished_at"], second["started_at"])
    plans = {host.name: json.loads(host.read_file("%s/runs/%s/plan.json" % (STATE_DIR, host.run_ids()[0])))
             for host in (a, c)}
    budget = run.extra_vars["moe_bench_bench_budget_s"]
    assert (plans[a.name]["gpu_runs"], plans[c.name]["gpu_runs"]) == (1, 2)
    assert plans[c.name]["async_limit_s"] - plans[a.name]["async_limit_s"] == budget
    assert plans[c.name]["deadman_delay_s"] - plans[a.name]["deadman_delay_s"] == budget
    assert json.loads(c.read_file("%s/runs/%s/job.json" % (STATE_DIR, c_run)))["limit_s"] in (
        plans[c.name]["async_limit_s"], str(plans[c.name]["async_limit_s"]))
    # C's dead-man switch stays armed (the service is not back), at the deadline of its plan
    deadman = json.loads(c.read_file("%s/runs/%s/deadman.json" % (STATE_DIR, c_run)))
    assert int(deadman["delay_s"]) == plans[c.name]["deadman_delay_s"] and c.timer_loaded()
    # Its drain hook ran; its return hook did not (the service is not back)
    assert c.read_file("/root/hook-pre-stop.txt").split()[0] == "active"
    assert c.exec("test -e /root/hook-post-recover.txt", check=False).returncode != 0
    assert ("The rollout stopped before this batch: 2 host(s) failed so far, more than moe_bench_max_fail_percentage "
            "25% of 5 host(s) allows (1)") in out, run.describe()

    # F: never touched
    _untouched(hosts["f"], since)

    # The fleet report: one row per host with its outcome, A's two GPUs and C's two in the plot's series
    (fleet_dir,) = (results_dir / "fleet").iterdir()
    fleet = json.loads((fleet_dir / "fleet.json").read_text())
    outcomes = {row["host"]: row["outcome"] for row in fleet["hosts"]}
    assert outcomes == {a.name: "failed", hosts["b"].name: "skipped", hosts["d"].name: "skipped", c.name: "down",
                        hosts["f"].name: "not started", hosts["e"].name: "unreachable"}, outcomes
    why = {row["host"]: row.get("why") or "" for row in fleet["hosts"]}
    assert "slower than run 20260101T000000Z-base00" in why[a.name], why
    # A's two GPUs and C's two (C measured before its unit failed to start: nothing measured is lost)
    assert fleet["configurations"][0]["series"] == sorted(
        "%s GPU %d" % (host.name, gpu) for host in (a, c) for gpu in (0, 1))
    assert (fleet_dir / "fleet_per_token.png").stat().st_size > 10000
    assert "| %s | not started |" % hosts["f"].name in (fleet_dir / "fleet.md").read_text()
    assert "fleet %s:" % fleet["fleet_id"] in out  # the recap, printed
    # Each failed host fails with its own message, A's regression included
    assert "fatal: [%s]" % a.name in out and "fatal: [%s]" % c.name in out, run.describe()

    # The webhook: one event per host that took part with its final state and the next step
    told = {event["host"]: event for event in events}
    assert {host: event["outcome"] for host, event in told.items()} == {
        host: outcome for host, outcome in outcomes.items() if outcome != "unreachable"}, events
    assert "service_recover.yml -l %s" % c.name in told[c.name]["next_step"]
    assert told[c.name]["unit"] == "fake-inference.service" and "did NOT come back" in told[c.name]["why"]
    assert "slower than run" in told[a.name]["why"]
    assert SECRET_HEADER_VALUE not in json.dumps(events) and SECRET_HEADER_VALUE not in run.output
    assert "url-secret" not in run.output
    print("fleet test: hosts up %.1f s, refusal run %.1f s, rollout run %.1f s" % (start_s, refused.wall_s, run.wall_s))
