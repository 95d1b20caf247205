"""service_health against a real HTTP server on 127.0.0.1 and a fake systemctl/journalctl."""

from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moe_bench_testlib import FakeSystemd, load_source, run_module_main, run_playbook, unit_state

service_health = load_source("service_health", "library/service_health.py")

TOKEN = "s3cr3t-Token-4f9a1c"
UNIT = "fake-inference.service"


class InferenceServer(object):
    """An OpenAI-style server whose answers a test sets: health status, models, completions."""

    def __init__(self):
        self.health_status = 200
        self.health_after = None  # (n, status): answer `status` from the n-th health request on
        self.completion_status = 200
        self.required_token = None
        self.requests = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status, document):
                body = json.dumps(document).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _record(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode() if length else ""
                owner.requests.append({"method": self.command, "path": self.path,
                                       "headers": dict(self.headers), "body": body})

            def _authorized(self):
                if owner.required_token is None:
                    return True
                given = self.headers.get("Authorization", "")
                if given == "Bearer " + owner.required_token:
                    return True
                # Echoes what it got, as some servers do: the module must still not leak it.
                self._answer(401, {"error": "invalid credentials: %s" % given})
                return False

            def do_GET(self):
                self._record()
                if not self._authorized():
                    return
                if self.path == "/health":
                    status = owner.health_status
                    count = sum(1 for request in owner.requests if request["path"] == "/health")
                    if owner.health_after and count >= owner.health_after[0]:
                        status = owner.health_after[1]
                    self._answer(status, {"status": "ok" if status == 200 else "loading model"})
                elif self.path == "/v1/models":
                    self._answer(200, {"object": "list", "data": [{"id": "kimi-k2.6", "object": "model"}]})
                else:
                    self._answer(404, {"error": "not found"})

            def do_POST(self):
                self._record()
                if not self._authorized():
                    return
                if self.path == "/v1/completions" and owner.completion_status == 200:
                    self._answer(200, {"object": "text_completion", "choices": [{"index": 0, "text": "!"}]})
                else:
                    self._answer(owner.completion_status, {"error": "engine not ready"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = "http://127.0.0.1:%d" % self.port
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server():
    running = InferenceServer()
    yield running
    running.close()


@pytest.fixture
def systemd(tmp_path, monkeypatch):
    fake = FakeSystemd(tmp_path / "bin", units={UNIT: unit_state("active", "running", main_pid=4242)},
                       journal={UNIT: ["Nov 29 18:00:%02d host fake-inference[4242]: line %d" % (i, i) for i in range(40)]})
    monkeypatch.setenv("PATH", "%s:%s" % (fake.directory, os.environ["PATH"]))
    return fake


def check(**args):
    args.setdefault("unit", UNIT)
    return run_module_main(service_health, args)


def test_ready_when_active_and_healthy(server, systemd):
    result = check(url=server.url + "/health", token=TOKEN, headers={"X-Client": "moe-bench"})
    assert result["ready"] is True and result["dead"] is False, result
    assert result["health"]["status"] == 200 and result["health"]["ok"] is True
    assert result["unit_state"] == {"ActiveState": "active", "SubState": "running", "Result": "success",
                                    "NRestarts": 0, "MainPID": 4242, "LoadState": "loaded"}
    assert result["journal_tail"] == ""
    request = server.requests[-1]
    assert request["headers"]["Authorization"] == "Bearer " + TOKEN
    assert request["headers"]["X-Client"] == "moe-bench"
    assert ["systemctl", "show", "--property=ActiveState,SubState,Result,NRestarts,MainPID,LoadState", UNIT] \
        in systemd.calls()
    assert TOKEN not in json.dumps(result)


def test_loading_is_neither_ready_nor_dead(server, systemd):
    systemd.set({UNIT: unit_state("activating", "start", main_pid=4242)})
    server.health_status = 503
    result = check(url=server.url + "/health", baseline_restarts=0)
    assert result["ready"] is False and result["dead"] is False
    assert result["health"]["status"] == 503 and result["health"]["ok"] is False
    assert result["reason"] == ("not ready yet: unit %s is activating/start; HTTP 503 from %s/health (expected 200): "
                                '{"status": "loading model"}' % (UNIT, server.url))
    assert result["journal_tail"] == ""


def test_active_but_health_503_is_not_ready(server, systemd):
    server.health_status = 503
    result = check(url=server.url + "/health")
    assert result["ready"] is False and result["dead"] is False


@pytest.mark.parametrize("state, baseline, expect_running, reason", [
    (unit_state("failed", "failed", result="exit-code"), None, True,
     "unit fake-inference.service entered the failed state (Result=exit-code)"),
    (unit_state("activating", "auto-restart", result="exit-code", restarts=2), None, True,
     "unit fake-inference.service is crash-looping: systemd is restarting it (activating/auto-restart, "
     "NRestarts=2, Result=exit-code)"),
    (unit_state("activating", "start", restarts=3), 1, True,
     "unit fake-inference.service was restarted by systemd 2 time(s) since it was started (NRestarts 3 > 1)"),
    (unit_state("inactive", "dead"), None, True,
     "unit fake-inference.service is inactive (SubState=dead, Result=success) although it was started: "
     "its process exited"),
])
def test_dead_states_carry_reason_and_journal(server, systemd, state, baseline, expect_running, reason):
    systemd.set({UNIT: state}, journal={UNIT: ["line %d" % i for i in range(40)]})
    server.health_status = 503
    args = dict(url=server.url + "/health", expect_running=expect_running)
    if baseline is not None:
        args["baseline_restarts"] = baseline
    result = check(**args)
    assert result["dead"] is True and result["ready"] is False
    assert result["reason"] == reason
    assert result["journal_tail"].splitlines() == ["line %d" % i for i in range(10, 40)]
    assert ["journalctl", "-u", UNIT, "-n", "30", "--no-pager"] in systemd.calls()
    assert not result.get("failed")  # a dead unit is a result, not a module failure


def test_restarts_at_baseline_are_not_dead(server, systemd):
    systemd.set({UNIT: unit_state("active", "running", restarts=3)})
    result = check(url=server.url + "/health", baseline_restarts=3)
    assert result["dead"] is False and result["ready"] is True


def test_inactive_without_expect_running_is_not_dead(systemd):
    systemd.set({UNIT: unit_state("inactive", "dead")})
    result = check(expect_running=False)
    assert result["dead"] is False and result["ready"] is False
    assert result["reason"] == "not ready yet: unit %s is inactive/dead" % UNIT


def test_unknown_unit_is_dead_without_http(server, systemd):
    result = check(unit="no-such-unit", url=server.url + "/health")
    assert result["dead"] is True
    assert result["reason"] == "unit no-such-unit not found (LoadState=not-found): check the unit name"
    assert server.requests == []
    assert result["journal_tail"] == ""


def test_without_url_ready_means_active(systemd):
    result = check()
    assert result["ready"] is True and result["health"] is None


def test_token_never_returned_even_when_server_echoes_it(server, systemd):
    server.required_token = "the-right-token"
    result = check(url=server.url + "/health?t=" + TOKEN, token=TOKEN)
    assert result["health"]["status"] == 401 and result["ready"] is False
    assert "invalid credentials: Bearer ********" in result["health"]["error"]
    assert TOKEN not in json.dumps(result)


def test_secret_looking_headers_are_redacted(server, systemd):
    server.required_token = "x"
    result = check(url=server.url + "/health", headers={"Authorization": "Bearer hdr-secret-123"})
    assert result["health"]["status"] == 401
    assert "hdr-secret-123" not in json.dumps(result)


def test_connection_refused(systemd):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = check(url="http://127.0.0.1:%d/health" % port, timeout=2)
    assert result["health"]["status"] is None and result["ready"] is False
    assert result["health"]["error"].startswith("no answer from http://127.0.0.1:%d/health:" % port)
    assert "refused" in result["health"]["error"].lower()


def test_expected_status_list(server, systemd):
    server.health_status = 204
    assert check(url=server.url + "/health")["ready"] is False
    assert check(url=server.url + "/health", expected_status=[200, 204])["ready"] is True


def test_completion_with_model(server, systemd):
    result = check(url=server.url + "/health", token=TOKEN, completion={"model": "kimi-k2.6", "prompt": "ping"})
    assert result["ready"] is True, result
    post = [request for request in server.requests if request["method"] == "POST"][-1]
    assert post["path"] == "/v1/completions"
    assert json.loads(post["body"]) == {"model": "kimi-k2.6", "prompt": "ping", "max_tokens": 1}
    assert post["headers"]["Authorization"] == "Bearer " + TOKEN
    assert result["completion"]["model"] == "kimi-k2.6" and result["completion"]["ok"] is True


def test_completion_model_from_models_list(server, systemd):
    result = check(url=server.url + "/health", completion={})
    assert result["ready"] is True
    assert result["completion"]["model"] == "kimi-k2.6"
    assert [request["path"] for request in server.requests] == ["/health", "/v1/models", "/v1/completions"]


def test_completion_failure_is_not_ready(server, systemd):
    server.completion_status = 500
    result = check(url=server.url + "/health", completion={"model": "m"})
    assert result["ready"] is False and result["dead"] is False
    assert "completion: HTTP 500 from %s/v1/completions" % server.url in result["reason"]


def test_completion_not_sent_while_loading(server, systemd):
    server.health_status = 503
    result = check(url=server.url + "/health", completion={"model": "m"})
    assert result["completion"] is None
    assert all(request["method"] == "GET" for request in server.requests)


@pytest.mark.parametrize("args, message", [
    ({"url": "ftp://127.0.0.1/health"}, "url must be an http:// or https:// URL, got ftp://127.0.0.1/health"),
    ({"url": "127.0.0.1:8000/health"}, "url must be an http:// or https:// URL"),
    ({"url": "http://h/health", "completion": {"url": "file:///etc/passwd"}}, "completion.url must be an http://"),
    ({"timeout": 0}, "timeout must be more than 0 seconds"),
])
def test_bad_input_fails(systemd, args, message):
    result = check(**args)
    assert result["failed"] is True and message in result["msg"]
    assert systemd.calls() == []


def test_systemctl_error_fails_clearly(systemd):
    systemd.set({}, fail={"rc": 1, "stderr": "System has not been booted with systemd as init system (PID 1).\n"})
    result = check()
    assert result["failed"] is True
    assert result["msg"] == ("could not read the state of unit(s) %s: systemctl show exited 1: System has not been "
                             "booted with systemd as init system (PID 1)." % UNIT)


PLAYBOOK = """
- name: Exercise service_health the way service_recover does
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Wait until the service is ready or dead
      service_health:
        unit: fake-inference.service
        url: "{{ health_url }}"
        token: "{{ health_token }}"
        baseline_restarts: 0
      register: health
      until: health.ready or health.dead
      retries: 20
      delay: 1

    - name: Check a unit that died
      service_health:
        unit: broken.service
        url: "{{ health_url }}"
        token: "{{ health_token }}"
      register: broken
      until: broken.ready or broken.dead
      retries: 20
      delay: 1

    - name: Save the results for the test
      ansible.builtin.copy:
        content: "{{ {'health': health, 'broken': broken} | to_json }}"
        dest: "{{ results_file }}"
        mode: "0600"
"""


def test_real_playbook_until_loop_and_secret(tmp_path, server):
    # The unit is active while the model still loads (health 503 for two polls): the loop waits.
    systemd = FakeSystemd(tmp_path / "bin", units={
        UNIT: unit_state("active", "running", main_pid=99),
        "broken.service": unit_state("failed", "failed", result="exit-code", restarts=5),
    }, journal={"broken.service": ["broken.service: Main process exited, status=1/FAILURE"]})
    server.required_token = TOKEN
    server.health_status = 503
    server.health_after = (3, 200)
    results_file = tmp_path / "results.json"
    completed = run_playbook(tmp_path, PLAYBOOK, extra_path=systemd.directory, extra=[
        "-vvv", "-e", json.dumps({"health_url": server.url + "/health", "health_token": TOKEN,
                                  "results_file": str(results_file)})])
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    results = json.loads(results_file.read_text())
    health, broken = results["health"], results["broken"]
    assert health["ready"] is True and health["attempts"] == 3
    assert [request["path"] for request in server.requests].count("/health") == 4  # 3 polls + 1 for broken
    assert broken["dead"] is True and broken["attempts"] == 1
    assert broken["reason"] == "unit broken.service entered the failed state (Result=exit-code)"
    assert broken["journal_tail"] == "broken.service: Main process exited, status=1/FAILURE"
    # The token went to the server, and nowhere into Ansible's output, even at -vvv.
    assert all(request["headers"].get("Authorization") == "Bearer " + TOKEN for request in server.requests)
    assert TOKEN not in completed.stdout + completed.stderr
    assert TOKEN not in results_file.read_text()
