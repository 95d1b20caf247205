"""The simulated host's fake inference server, run directly on this machine.

Starts simhost/kit/usr/local/bin/fake-inference as a real process on a free loopback port
with a temporary GPU state, and checks what a client and nvidia-smi see: the load delay
(503, then 200), the OpenAI-style answers, the memory it holds, and each failure switch.
Inside the simulated host the same program runs under systemd (fake-inference.service).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
KIT = REPO / "simhost" / "kit"
SERVER = KIT / "usr" / "local" / "bin" / "fake-inference"
NVIDIA_SMI = KIT / "usr" / "bin" / "nvidia-smi"
KIT_PYTHONPATH = KIT / "usr" / "lib" / "python3" / "dist-packages"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def request(url, body=None, token=None):
    """(status, parsed JSON body) of one HTTP request."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


class Server:
    def __init__(self, tmp_path, **switches):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.state = tmp_path / "state.json"
        self.log_path = tmp_path / "server.log"
        self.env = {**os.environ, "PYTHONPATH": str(KIT_PYTHONPATH), "FAKE_GPU_STATE": str(self.state),
                    "FAKE_PORT": str(self.port), "FAKE_LOAD_SECONDS": "1", "FAKE_SHARDS": "4",
                    "FAKE_GPU_MIB": "130000", **{k: str(v) for k, v in switches.items()}}
        if not self.state.exists():
            subprocess.run([sys.executable, "-m", "fake_gpu", "init", "--count", "2"], env=self.env, check=True)
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen([sys.executable, str(SERVER)], env=self.env,
                                        stdout=self.log, stderr=subprocess.STDOUT)

    def output(self):
        return self.log_path.read_text()

    def used_mib(self):
        out = subprocess.run([sys.executable, str(NVIDIA_SMI), "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits"], env=self.env, capture_output=True,
                             text=True, check=True).stdout
        return [int(x) for x in out.split()]

    def apps(self):
        out = subprocess.run([sys.executable, str(NVIDIA_SMI), "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], env=self.env, capture_output=True,
                             text=True, check=True).stdout
        return [tuple(int(v) for v in line.split(", ")) for line in out.splitlines()]

    def wait_for(self, predicate, timeout=15, what="condition"):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if predicate():
                    return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; server output:\n{self.output()}")

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=15)
        self.log.close()
        return code


@pytest.fixture
def start(tmp_path):
    servers = []

    def starter(**switches):
        server = Server(tmp_path, **switches)
        servers.append(server)
        return server

    yield starter
    for server in servers:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def test_loads_then_serves_and_releases_memory_on_stop(start):
    server = start(FAKE_LOAD_SECONDS="5")
    server.wait_for(lambda: request(server.base + "/health")[0] == 503, what="503 while loading")
    assert server.used_mib() == [130009, 130009]
    assert server.apps() == [(server.process.pid, 130000), (server.process.pid, 130000)]
    # Like SGLang, the model list answers before the model is ready; completions do not.
    status, models = request(server.base + "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "kimi-k2.6-fake"
    assert request(server.base + "/v1/completions", {"prompt": "hi"})[0] == 503

    server.wait_for(lambda: request(server.base + "/health")[0] == 200, what="health 200")
    status, completion = request(server.base + "/v1/completions",
                                 {"model": "kimi-k2.6-fake", "prompt": "Say hi", "max_tokens": 5})
    assert status == 200
    assert completion["object"] == "text_completion"
    assert len(completion["choices"][0]["text"].split()) == 5
    assert completion["usage"]["completion_tokens"] == 5
    assert request(server.base + "/v1/completions", {"model": "other", "prompt": "x"})[0] == 404

    assert server.stop() == 0
    assert server.used_mib() == [0, 0]
    output = server.output()
    for shard in range(1, 5):
        assert f"loading weights shard {shard}/4" in output
    assert "shutdown complete, GPU memory released" in output


def test_fail_on_start_exits_at_once_without_memory(start):
    server = start(FAKE_FAIL_ON_START="1")
    assert server.process.wait(timeout=10) == 1
    assert "FAKE_FAIL_ON_START" in server.output()
    assert server.used_mib() == [0, 0]


def test_crash_loop_crashes_after_its_delay_and_frees_memory(start):
    server = start(FAKE_CRASH_LOOP="1", FAKE_CRASH_AFTER_SECONDS="1", FAKE_LOAD_SECONDS="10")
    server.wait_for(lambda: server.used_mib() == [130009, 130009], what="memory held")
    started = time.time()
    assert server.process.wait(timeout=10) == 1
    assert time.time() - started < 5
    assert "illegal memory access" in server.output()
    # Nothing unregistered it: the memory is free because the process is gone.
    assert json.loads(server.state.read_text())["processes"]
    assert server.used_mib() == [0, 0]


def test_never_ready_keeps_health_at_503(start):
    server = start(FAKE_NEVER_READY="1", FAKE_LOAD_SECONDS="0.2")
    server.wait_for(lambda: "warm-up never finishes" in server.output(), what="loading finished")
    for _ in range(3):
        assert request(server.base + "/health")[0] == 503
        time.sleep(0.2)
    assert server.stop() == 0


def test_required_token_guards_health_and_completions(start):
    server = start(FAKE_REQUIRE_TOKEN="s3cret", FAKE_LOAD_SECONDS="0")
    server.wait_for(lambda: request(server.base + "/health", token="s3cret")[0] == 200, what="ready")
    assert request(server.base + "/health")[0] == 401
    assert request(server.base + "/health", token="wrong")[0] == 401
    assert request(server.base + "/v1/completions", {"prompt": "x"})[0] == 401
    assert request(server.base + "/v1/completions", {"prompt": "x"}, token="s3cret")[0] == 200
    assert server.stop() == 0


def test_leaked_child_keeps_holding_memory_after_the_server_stops(start):
    server = start(FAKE_LEAK_CHILD="1", FAKE_LEAK_MIB="2048", FAKE_GPUS="1", FAKE_LOAD_SECONDS="0")
    server.wait_for(lambda: len(server.apps()) == 2, what="server and child registered")
    child_pid = next(pid for pid, _ in server.apps() if pid != server.process.pid)
    try:
        assert os.getsid(child_pid) == child_pid, "the child must run in its own session"
        assert server.stop() == 0
        assert server.apps() == [(child_pid, 2048)]
        assert server.used_mib() == [0, 2057]
    finally:
        os.kill(child_pid, signal.SIGKILL)
    server.wait_for(lambda: server.used_mib() == [0, 0], what="memory freed after the child died")


def test_slow_stop_takes_its_time(start):
    server = start(FAKE_STOP_SECONDS="1", FAKE_LOAD_SECONDS="0")
    server.wait_for(lambda: request(server.base + "/health")[0] == 200, what="ready")
    started = time.time()
    assert server.stop() == 0
    assert time.time() - started >= 1
