"""The fleet role's task files and the notify role in real ansible-playbook runs on the controller
(local connection), wired the way playbooks/moe_bench.yml wires them (playbooks/vars/roles.yml):

- the capacity guard in batches of two: a peer of the same batch never counts as healthy, a peer
  whose health answers 503 does not either (each peer checked through service_health, delegated to
  it: a fake systemctl and a health server on 127.0.0.1 are the only doubles);
- the preflight verdict: one unreachable host refuses the rollout unless moe_bench_skip_unreachable;
- notify's command mode: the event on stdin and in MOE_BENCH_EVENT, the health token and header
  values redacted, the command line never printed; a failing or hanging command is a warning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from moe_bench_testlib import REPO, VENV_BIN, FakeSystemd, ansible_env, unit_state, write_executable

ROLES_YML = REPO / "playbooks" / "vars" / "roles.yml"


def _playbook(tmp_path, text, inventory, extra_path=None, extra=()):
    (tmp_path / "play.yml").write_text(text)
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(inventory, sort_keys=False))
    env = ansible_env(tmp_path, extra_path)
    env["ANSIBLE_ROLES_PATH"] = str(REPO / "roles")
    return subprocess.run([str(VENV_BIN / "ansible-playbook"), "-i", str(tmp_path / "inventory.yml"),
                           str(tmp_path / "play.yml"), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)


def _local(**host_vars):
    return dict(ansible_connection="local", ansible_python_interpreter=sys.executable, **host_vars)


@pytest.fixture
def health_server():
    """/<host> answers the status set for it (default 200)."""
    statuses = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            status = statuses.get(self.path.strip("/"), 200)
            body = b'{"status": "ok"}' if status == 200 else b'{"status": "loading"}'
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.statuses = statuses
    server.url = "http://127.0.0.1:%d" % server.server_address[1]
    yield server
    server.shutdown()
    server.server_close()


CAPACITY_PLAY = """\
- name: Check each host's pool batch by batch, as the rollout does
  hosts: fleet
  gather_facts: false
  serial: 2
  vars_files:
    - {roles_yml}
  tasks:
    - name: Leave the typed inputs as bench_plan does
      ansible.builtin.set_fact:
        moe_bench_plan:
          inputs:
            moe_bench_pool: "{{{{ moe_bench_pool | default('') }}}}"
            moe_bench_pool_min_healthy: "{{{{ moe_bench_pool_min_healthy | default(0) }}}}"
            moe_bench_health_url: "{{{{ moe_bench_health_url }}}}"

    - name: Run the capacity guard
      ansible.builtin.include_role:
        name: fleet
        tasks_from: capacity
      when: moe_bench_plan.inputs.moe_bench_pool | length > 0

    - name: Keep the verdict for the test
      ansible.builtin.copy:
        content: "{{{{ fleet_capacity | default({{}}) | to_json }}}}"
        dest: "{out}/{{{{ inventory_hostname }}}}.json"
        mode: "0644"
"""


def test_capacity_guard_counts_batch_peers_as_down(tmp_path, health_server):
    """Pool east of four hosts must keep 2 healthy, batches of two: [h1, h2], [h3, h4]; h3 answers 503.
    h1 sees h2 (its batch) as down and h3 unhealthy: only h4 -> skipped; so is h2. h3 and h4 see h1
    and h2 healthy (and each other in the batch) -> go. Counting a batch peer would let h1 and h2 go
    with h3 unhealthy: three of four down or sick at once."""
    names = ["h1", "h2", "h3", "h4"]
    systemd = FakeSystemd(tmp_path / "bin", units={"unit-%s.service" % name: unit_state("active", "running", main_pid=10 + i)
                                                  for i, name in enumerate(names)})
    health_server.statuses["h3"] = 503
    out = tmp_path / "out"
    out.mkdir()
    inventory = {"fleet": {"hosts": {name: _local(
        moe_bench_pool="east", moe_bench_pool_min_healthy=2, moe_bench_unit="unit-%s.service" % name,
        moe_bench_health_url="%s/%s" % (health_server.url, name)) for name in names}}}
    completed = _playbook(tmp_path, CAPACITY_PLAY.format(roles_yml=ROLES_YML, out=out), inventory,
                          extra_path=systemd.directory)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    verdicts = {name: json.loads((out / ("%s.json" % name)).read_text()) for name in names}
    assert {name: verdict["ok"] for name, verdict in verdicts.items()} == {"h1": False, "h2": False, "h3": True, "h4": True}
    assert verdicts["h1"]["healthy"] == ["h4"] and verdicts["h2"]["healthy"] == ["h4"]
    assert verdicts["h3"]["healthy"] == ["h1", "h2"] and verdicts["h4"]["healthy"] == ["h1", "h2"]
    assert verdicts["h1"]["why"] == ("pool east needs 2 healthy host(s) while h1 is stopped, and only 1 of its other "
                                     "host(s) are healthy (h4); about to stop in this batch: h2")
    assert verdicts["h2"]["why"].endswith("about to stop in this batch: h1")
    # The peers of a host's own batch are not even asked (the batch stops them anyway)
    asked = [call[-1] for call in systemd.calls() if call[0] == "systemctl"]
    assert {unit: asked.count(unit) for unit in set(asked)} == {"unit-%s.service" % name: 2 for name in names}


VERDICT_PLAY = """\
- name: Decide on a fleet with one host that never answered
  hosts: localhost
  gather_facts: false
  vars:
    hosts_seen:
      - {{host: ct200.example, state: ok, why: ""}}
      - {{host: ct201.example, state: unreachable, why: no answer}}
  tasks:
    - name: Refuse by default
      block:
        - name: Run the verdict (moe_bench_skip_unreachable false)
          ansible.builtin.include_role:
            name: fleet
            tasks_from: verdict
          vars:
            fleet_hosts: "{{{{ hosts_seen }}}}"
        - name: Note that the verdict let it through
          ansible.builtin.copy: {{content: "went on", dest: "{out}/default.txt", mode: "0644"}}
      rescue:
        - name: Keep the refusal
          ansible.builtin.copy: {{content: "{{{{ ansible_failed_result.msg }}}}", dest: "{out}/default.txt", mode: "0644"}}

    - name: Run the verdict (moe_bench_skip_unreachable true)
      ansible.builtin.include_role:
        name: fleet
        tasks_from: verdict
      vars:
        fleet_hosts: "{{{{ hosts_seen }}}}"
        fleet_skip_unreachable: "{{{{ 'true' | bool }}}}"

    - name: Note that the rollout goes on
      ansible.builtin.copy: {{content: "went on", dest: "{out}/skip.txt", mode: "0644"}}

    - name: A refused host is refused whatever moe_bench_skip_unreachable says
      block:
        - name: Run the verdict with a refusal and a pool problem
          ansible.builtin.include_role:
            name: fleet
            tasks_from: verdict
          vars:
            fleet_hosts: "{{{{ hosts_seen + [{{'host': 'ct202.example', 'state': 'refused', 'why': 'GPU(s) 5 do not exist'}}] }}}}"
            fleet_problems: ["pool west: moe_bench_pool_min_healthy is 1 but the pool has 1 host(s) in this run (ct200.example)"]
            fleet_skip_unreachable: true
      rescue:
        - name: Keep the refusal
          ansible.builtin.copy: {{content: "{{{{ ansible_failed_result.msg }}}}", dest: "{out}/refused.txt", mode: "0644"}}
"""


def test_verdict_refuses_an_unreachable_host_unless_told_to_skip_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    completed = _playbook(tmp_path, VERDICT_PLAY.format(out=out), {"all": {"hosts": {"localhost": _local()}}})
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    refusal = (out / "default.txt").read_text()
    assert refusal.startswith("The fleet preflight refused the rollout: ct201.example is unreachable.")
    assert "Nothing was stopped on any host (ct200.example, ct201.example)" in refusal
    assert "-e moe_bench_skip_unreachable=true goes on without the unreachable hosts" in refusal
    assert (out / "skip.txt").read_text() == "went on"
    assert "Going on without ct201.example (unreachable, moe_bench_skip_unreachable is true)" in completed.stdout
    refused = (out / "refused.txt").read_text()
    assert "ct202.example: GPU(s) 5 do not exist; pool west: moe_bench_pool_min_healthy is 1" in refused
    assert "unreachable" not in refused.split("Nothing was stopped")[0]


NOTIFY_PLAY = """\
- name: Tell a command each host's final state, as play 3 does
  hosts: fleet
  gather_facts: false
  vars_files:
    - {roles_yml}
  vars:
    __moe_bench_run_id: 20261201T120000Z-abcdef
    __moe_bench_results_run_dir: /srv/results/{{{{ inventory_hostname }}}}/20261201T120000Z-abcdef
    moe_bench_fleet_id: 20261201T115900Z-fleet0
  tasks:
    - name: Leave the state the rollout leaves
      ansible.builtin.set_fact:
        moe_bench_plan:
          inputs:
            moe_bench_unit: sglang-k26-ddtree.service
            moe_bench_pool: ""
            moe_bench_notify: "{{{{ notify_command }}}}"
            moe_bench_health_url: http://127.0.0.1:30000/health
        __moe_bench_outcome: down
        __moe_bench_why: >-
          sglang-k26-ddtree.service did NOT come back on {{{{ inventory_hostname }}}} (the health check sent
          X-Api-Key {header_secret} and the bearer {token_secret})

    - name: Tell moe_bench_notify this host's final state
      ansible.builtin.include_role:
        name: notify
"""

NOTIFIER = r'''#!{python}
import json, os, sys, time
out = sys.argv[1]
host = json.loads(os.environ["MOE_BENCH_EVENT"])["host"]
with open(os.path.join(out, host + ".json"), "w") as handle:
    json.dump({"stdin": sys.stdin.read(), "env": os.environ["MOE_BENCH_EVENT"], "argv": sys.argv[1:]}, handle)
if host == "ct201.example":
    sys.exit(3)
if host == "ct202.example":
    time.sleep(8)
'''


def test_notify_command_gets_the_event_with_secrets_redacted(tmp_path):
    header_secret, token_secret, channel_secret = "hdr-3f9a-secret", "tok-77c1-secret", "chan-5e2b-secret"
    out = tmp_path / "told"
    out.mkdir()
    notifier = tmp_path / "notifier"
    write_executable(notifier, NOTIFIER.replace("{python}", sys.executable))
    inventory = {"fleet": {"hosts": {name: _local() for name in ("ct200.example", "ct201.example", "ct202.example")},
                           "vars": {"moe_bench_health_token": token_secret,
                                    "moe_bench_health_headers": {"X-Api-Key": header_secret},
                                    "notify_timeout_s": 3}}}
    completed = _playbook(
        tmp_path, NOTIFY_PLAY.format(roles_yml=ROLES_YML, header_secret=header_secret, token_secret=token_secret),
        inventory, extra=["-e", json.dumps({"notify_command": "%s %s --channel %s" % (notifier, out, channel_secret)})])
    output = completed.stdout + completed.stderr
    # A failing or hanging command is a warning: no host fails because nobody could be told.
    assert completed.returncode == 0, output[-4000:]
    told = json.loads((out / "ct200.example.json").read_text())
    event = json.loads(told["stdin"])
    assert json.loads(told["env"]) == event
    assert told["argv"] == [str(out), "--channel", channel_secret]
    assert {key: event[key] for key in ("host", "unit", "outcome", "run_id", "fleet_id")} == {
        "host": "ct200.example", "unit": "sglang-k26-ddtree.service", "outcome": "down",
        "run_id": "20261201T120000Z-abcdef", "fleet_id": "20261201T115900Z-fleet0"}
    assert "service_recover.yml -l ct200.example" in event["next_step"]
    assert "X-Api-Key <redacted> and the bearer <redacted>" in event["why"]
    for path in out.iterdir():
        assert header_secret not in path.read_text() and token_secret not in path.read_text()
    for secret in (header_secret, token_secret, channel_secret):
        assert secret not in output
    assert "ct200.example (down): command notifier exited 0" in output
    assert "WARNING: the notification for ct201.example (down) failed (exit code 3)" in output
    assert "WARNING: the notification for ct202.example (down) failed (no answer within 3 s)" in output
