"""A fleet in one command: four simulated hosts side by side, two real playbook runs.

Run 1, the fleet preflight refuses two bad hosts (a GPU index it lacks, a pre-stop hook file that
does not exist): nothing is stopped on any host, one table says which host and why.
Run 2, the rollout one host at a time:
  A (two GPUs, moe_bench_gpus [0, 1])  -> ok: one payload per GPU, per-GPU results and report; its
                                          pre-stop hook ran with the unit still up, its post-recover
                                          hook once it was back
  B (pool east, minimum 1 healthy)     -> skipped by the capacity guard: its pool peer D is unhealthy
  C (its unit fails to start again)    -> DOWN, reported; the rollout stops
  D (pool east, health 503)            -> not started: never touched
and the fleet report (fleet.md, fleet.json, plot) lists all four; a webhook on this machine's
loopback is told each host's final state, the health check's header value nowhere in it.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

from conftest import (ANSIBLE_PLAYBOOK, REPO, STATE_DIR, PlaybookRun, _playbook_env, merged_vars)


def _fleet_run(hosts, host_vars, tmp_path, results_dir, extra=None, timeout=900):
    inventory = {"moe_bench_hosts": {"hosts": {
        host.name: dict(host.connection, **host_vars.get(key, {})) for key, host in hosts.items()}}}
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


def _untouched(host, since):
    assert host.stop_count(since) == 0, "%s was stopped" % host.name
    assert host.unit_active() == "active"
    assert not host.timer_loaded(), "dead-man timer on %s" % host.name
    assert host.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock left on %s" % host.name
    assert host.run_ids() == [], "run folder on %s" % host.name


def test_fleet_preflight_refusal_then_rollout_with_guard_stop_and_report(simhost_factory, tmp_path, results_dir):
    # Started side by side (each start waits for systemd, SSH and the model's health).
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {key: pool.submit(simhost_factory, "fleet-" + key, gpus=2 if key == "a" else 1) for key in "abcd"}
        hosts = {key: future.result() for key, future in futures.items()}
    start_s = time.monotonic() - started
    host_vars = {"a": {"moe_bench_gpus": [0, 1]},
                 "b": {"moe_bench_gpus": [0], "moe_bench_pool": "east", "moe_bench_pool_min_healthy": 1},
                 "c": {"moe_bench_gpus": [0]},
                 "d": {"moe_bench_gpus": [0, 1], "moe_bench_pool": "east", "moe_bench_pool_min_healthy": 1}}

    # --- run 1: D asks for a GPU it lacks, B names a hook file that does not exist: refused in the
    # preflight, nothing stopped anywhere
    host_vars["b"]["moe_bench_pre_stop_tasks"] = "/nonexistent/drain.yml"
    since = min(host.epoch() for host in hosts.values())
    refused = _fleet_run(hosts, host_vars, tmp_path, results_dir)
    assert refused.rc != 0, refused.describe()
    assert "The fleet preflight refused the rollout" in refused.stdout, refused.describe()
    assert "GPU(s) 1 do not exist on %s" % hosts["d"].name in refused.stdout, refused.describe()
    assert "Nothing was stopped on any host" in refused.stdout
    table = [line for line in refused.stdout.splitlines() if any(h.name in line for h in hosts.values())
             and (" ok " in line or " refused " in line)]
    assert any(hosts["a"].name in line and " ok " in line for line in table), refused.describe()
    assert any(hosts["d"].name in line and " refused " in line for line in table), refused.describe()
    assert any(hosts["b"].name in line and " refused " in line for line in table), refused.describe()
    assert "moe_bench_pre_stop_tasks = /nonexistent/drain.yml: no such file on the controller" in refused.stdout
    for host in hosts.values():
        _untouched(host, since)
    assert "Record the service's state and stop it" not in refused.stdout

    # --- run 2: the rollout; A and C carry hooks that record the unit's state on the host
    host_vars["d"]["moe_bench_gpus"] = [0]
    del host_vars["b"]["moe_bench_pre_stop_tasks"]
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
    hosts["d"].set_switches(restart=True, FAKE_NEVER_READY="1")      # D serves no requests: B's pool is short
    hosts["c"].set_switches(restart=False, FAKE_FAIL_ON_START="1")   # C's unit will not start again
    since = min(host.epoch() for host in hosts.values())
    server, events = _webhook()
    try:
        run = _fleet_run(hosts, host_vars, tmp_path, results_dir, {
            "moe_bench_load_budget_s": 20,
            "moe_bench_notify": "http://127.0.0.1:%d/hook?token=url-secret" % server.server_address[1],
            "moe_bench_health_headers": {"X-Api-Key": SECRET_HEADER_VALUE}})
    finally:
        server.shutdown()
    assert run.rc != 0, run.describe()
    out = run.stdout

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

    # B: skipped by the capacity guard, never stopped
    assert "%s is skipped: capacity guard: pool east needs 1 healthy host(s)" % hosts["b"].name in out, run.describe()
    _untouched(hosts["b"], since)

    # C: stopped, did not come back: reported DOWN, the rollout stops after it
    c = hosts["c"]
    assert c.stop_count(since) == 1
    assert "did NOT come back" in out, run.describe()
    assert c.unit_active() != "active"
    # Its drain hook ran; its return hook did not (the service is not back)
    assert c.read_file("/root/hook-pre-stop.txt").split()[0] == "active"
    assert c.exec("test -e /root/hook-post-recover.txt", check=False).returncode != 0
    assert "The rollout stopped before this batch" in out

    # D: never touched
    _untouched(hosts["d"], since)

    # The fleet report: one row per host with its outcome, A's two GPUs in the plot's series
    (fleet_dir,) = (results_dir / "fleet").iterdir()
    fleet = json.loads((fleet_dir / "fleet.json").read_text())
    outcomes = {row["host"]: row["outcome"] for row in fleet["hosts"]}
    assert outcomes == {a.name: "ok", hosts["b"].name: "skipped", c.name: "down", hosts["d"].name: "not started"}
    # A's two GPUs and C's one (C measured before its unit failed to start: nothing measured is lost)
    assert fleet["configurations"][0]["series"] == sorted(["%s GPU 0" % a.name, "%s GPU 1" % a.name, "%s GPU 0" % c.name])
    assert (fleet_dir / "fleet_per_token.png").stat().st_size > 10000
    assert "| %s | not started |" % hosts["d"].name in (fleet_dir / "fleet.md").read_text()
    assert "fleet %s:" % fleet["fleet_id"] in out  # the recap, printed

    # The webhook: one event per host with its final state and the next step
    told = {event["host"]: event for event in events}
    assert {host: event["outcome"] for host, event in told.items()} == outcomes, events
    assert "service_recover.yml -l %s" % c.name in told[c.name]["next_step"]
    assert told[c.name]["unit"] == "fake-inference.service" and "did NOT come back" in told[c.name]["why"]
    assert SECRET_HEADER_VALUE not in json.dumps(events) and SECRET_HEADER_VALUE not in run.output
    assert "url-secret" not in run.output
    print("fleet test: hosts up %.1f s, refusal run %.1f s, rollout run %.1f s" % (start_s, refused.wall_s, run.wall_s))
