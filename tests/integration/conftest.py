"""Shared fixtures of the integration tests: real simulated GPU hosts, real ansible-playbook runs.

Every test here drives `ansible-playbook` as a subprocess against a container started from
`moe-bench-simhost:latest` (a Debian host booting systemd, with a fake nvidia-smi and
`fake-inference.service`), over SSH as the demo inventory does. Only nvidia-smi and the
inference server are doubles: systemd, SSH, Ansible and the payload are real.

Fixtures:
  simhost_factory   start fresh hosts (unique names), removed at teardown even on failure
  simhost           one host per test module, reset to a clean state before each test
  run_playbook      run a playbook against a host, wait, capture rc/stdout/stderr/wall time
  start_playbook    the same in the background (to kill the controller or cut its connection)

Skips the whole directory when Docker's engine does not answer or the image is missing
(`make host-image` builds it).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
ANSIBLE_PLAYBOOK = VENV_BIN / "ansible-playbook"
IMAGE = os.environ.get("SIMHOST_IMAGE", "moe-bench-simhost:latest")
UNIT = "fake-inference.service"
STATE_DIR = "/var/lib/moe-bench"
DEADMAN_TIMER = "moe-bench-deadman-fake-inference.timer"
NAME_PREFIX = "mb-it"

# Settings that keep a whole playbook run to a few tens of seconds on the simulated host:
# the tiny payload shape on the CPU, a short M list, a 2 s model load and short polls.
# A test overrides what it exercises.
FAST_VARS = {
    "moe_bench_unit": UNIT,
    "moe_bench_health_url": "http://127.0.0.1:30000/health",
    "moe_bench_python": "/opt/bench-venv/bin/python",
    "moe_bench_device": "cpu",
    "moe_bench_preset": "tiny",
    "moe_bench_backend": "torch",
    "moe_bench_gpus": [0],
    "moe_bench_m_list": "1,2,4,8",
    "moe_bench_load_budget_s": 60,
    "moe_bench_health_poll_s": 1,
    # The settle period is exercised by its own test; elsewhere a short one keeps runs fast.
    "moe_bench_health_settle_s": 2,
    "moe_bench_stop_margin_s": 15,
    "moe_bench_vram_timeout_s": 10,
    "moe_bench_vram_interval_s": 1,
    "moe_bench_bench_budget_s": 300,
    "moe_bench_bench_poll_s": 2,
    "moe_bench_async_margin_s": 60,
    "moe_bench_stop_timeout_s": 30,
    "moe_bench_deadman_margin_s": 60,
    "moe_bench_lock_ttl_margin_s": 60,
    # The rehearsal beside the live service is exercised by test_downtime_modes; elsewhere it
    # would add a payload run to every playbook run.
    "moe_bench_rehearse": "false",
}
# A long M list: the payload runs long enough on the CPU to be interrupted mid-run (or to
# outlast a few seconds' budget). The CPU harness spends at most a fraction of a second per M,
# so the length comes from the number of M values: up to 2048 it ran to its end within a 3 s
# budget on a fast machine.
LONG_M_LIST = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192,16384"
FAST_LOAD_SECONDS = 2


# --------------------------------------------------------------------------------------------
# Plain helpers (usable by other test modules through the fixtures' objects)
# --------------------------------------------------------------------------------------------

def sh(argv, check=True, timeout=120, **kwargs):
    """Run argv, return CompletedProcess with text output; raise with the output on failure."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError("command %s failed with rc %d\nstdout:\n%s\nstderr:\n%s"
                             % (shlex.join(map(str, argv)), proc.returncode, proc.stdout, proc.stderr))
    return proc


def docker_available():
    try:
        return sh(["docker", "image", "inspect", IMAGE], check=False, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class PlaybookRun:
    """A finished (or killed) ansible-playbook run."""
    argv: list
    rc: int
    stdout: str
    stderr: str
    wall_s: float
    extra_vars: dict = field(default_factory=dict)

    @property
    def output(self):
        return self.stdout + "\n" + self.stderr

    def describe(self):
        return "ansible-playbook rc=%s after %.1f s\n--- stdout (tail) ---\n%s\n--- stderr (tail) ---\n%s" % (
            self.rc, self.wall_s, self.stdout[-6000:], self.stderr[-3000:])


class BackgroundPlaybook:
    """ansible-playbook running in its own process group, to be killed or waited for."""

    def __init__(self, argv, env, extra_vars, log_dir):
        self.argv = argv
        self.extra_vars = extra_vars
        self.stdout_path = log_dir / ("bg-%s.stdout" % uuid.uuid4().hex[:6])
        self.stderr_path = self.stdout_path.with_suffix(".stderr")
        self._stdout = open(self.stdout_path, "w")
        self._stderr = open(self.stderr_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self._stdout, stderr=self._stderr,
                                     start_new_session=True)

    @property
    def pid(self):
        return self.proc.pid

    def stdout_so_far(self):
        self._stdout.flush()
        return self.stdout_path.read_text(errors="replace")

    def wait_for_output(self, pattern, timeout):
        """Block until stdout matches pattern (regex); fail if the run ends or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, self.stdout_so_far()):
                return
            if self.proc.poll() is not None:
                raise AssertionError("ansible-playbook ended (rc %s) before printing %r:\n%s"
                                     % (self.proc.returncode, pattern, self.stdout_so_far()[-5000:]))
            time.sleep(0.3)
        raise AssertionError("ansible-playbook did not print %r within %s s:\n%s"
                             % (pattern, timeout, self.stdout_so_far()[-5000:]))

    def kill_controller(self):
        """SIGKILL ansible-playbook and its workers (its own process group): no rescue, no always."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def wait(self, timeout):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_controller()
        return self.result()

    def result(self):
        self._stdout.close()
        self._stderr.close()
        return PlaybookRun(self.argv, self.proc.returncode, self.stdout_path.read_text(errors="replace"),
                           self.stderr_path.read_text(errors="replace"), time.monotonic() - self.started,
                           self.extra_vars)

    def close(self):
        if self.proc.poll() is None:
            self.kill_controller()
        for handle in (self._stdout, self._stderr):
            if not handle.closed:
                handle.close()


class SimHost:
    """One running simulated GPU host and the probes the tests read its state with."""

    def __init__(self, name, workdir):
        self.name = name
        self.workdir = workdir
        self.connection = yaml.safe_load(
            (REPO / "simhost" / "build" / "instances" / name / "connection.yml").read_text())
        self.inventory = workdir / "inventory.yml"
        self.write_inventory()

    # --- inventory -------------------------------------------------------------------------
    def write_inventory(self):
        """An inventory like inventory/demo: group moe_bench_hosts, one host reached over SSH."""
        host_vars = dict(self.connection)
        inventory = {"moe_bench_hosts": {"hosts": {self.name: host_vars}}}
        self.inventory.write_text(yaml.safe_dump(inventory, sort_keys=False))

    # --- commands in the container ----------------------------------------------------------
    def exec(self, command, check=True, timeout=60):
        """Run a shell command inside the container (as root)."""
        return sh(["docker", "exec", self.name, "sh", "-c", command], check=check, timeout=timeout)

    def exec_detached(self, command):
        sh(["docker", "exec", "-d", self.name, "sh", "-c", command])

    # --- the unit --------------------------------------------------------------------------
    def unit_show(self, unit=UNIT):
        props = "ActiveState,SubState,Result,MainPID,NRestarts,ActiveEnterTimestamp," \
                "ActiveEnterTimestampMonotonic,InactiveEnterTimestampMonotonic,LoadState,ControlGroup"
        out = self.exec("systemctl show -p %s %s" % (props, shlex.quote(unit))).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def unit_active(self, unit=UNIT):
        return self.exec("systemctl is-active %s" % shlex.quote(unit), check=False).stdout.strip()

    def health_status(self, token=None):
        header = "-H %s" % shlex.quote("Authorization: Bearer " + token) if token else ""
        out = self.exec("curl -s -o /dev/null -w '%%{http_code}' --max-time 3 %s http://127.0.0.1:30000/health"
                        % header, check=False).stdout.strip()
        return int(out) if out.isdigit() else 0

    def wait_healthy(self, timeout=60, token=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.unit_active() == "active" and self.health_status(token) == 200:
                return
            time.sleep(0.5)
        raise AssertionError("%s on %s not healthy within %s s: %s" % (UNIT, self.name, timeout, self.unit_show()))

    def stop_count(self, since_epoch):
        """How many times systemd logged the unit stopping since a moment (journal 'Stopping')."""
        return len([line for line in self.journal(since_epoch=since_epoch).splitlines()
                    if line.startswith("Stopping ")])

    def journal(self, unit=UNIT, since_epoch=None):
        """The journal of one unit (all units with unit=None), since a moment if given. The
        moment keeps its fraction: whole seconds would take in what happened just before it."""
        where = "-u %s" % unit if unit else ""
        since = "--since @%.6f" % since_epoch if since_epoch else ""
        return self.exec("journalctl %s %s --no-pager -o cat" % (where, since), check=False).stdout

    def epoch(self):
        return float(self.exec("date +%s.%N").stdout.strip())

    # --- failure switches -------------------------------------------------------------------
    def set_switches(self, restart=True, **switches):
        assignments = " ".join(shlex.quote("%s=%s" % item) for item in switches.items())
        self.exec("fake-inference-ctl set %s%s" % (assignments, " --restart" if restart else ""))

    def reset_switches(self, restart=True):
        self.exec("fake-inference-ctl reset%s" % (" --restart" if restart else ""))

    def set_payload_env(self, **env):
        """Environment for every SSH session (pam_env reads /etc/environment): reaches the payload."""
        text = "".join("%s=%s\n" % item for item in env.items())
        self.exec("printf %s > /etc/environment" % shlex.quote(text))

    # --- GPUs -------------------------------------------------------------------------------
    def nvidia_smi(self, *args):
        return self.exec("nvidia-smi %s" % " ".join(shlex.quote(a) for a in args)).stdout

    def gpu_state(self):
        return json.loads(self.exec("fake-gpu show").stdout)

    def pid_alive(self, pid):
        return self.exec("kill -0 %d" % int(pid), check=False).returncode == 0

    def start_gpu_holder(self, gpus="0", mib=20000, unit="stray-holder"):
        """An unrelated process holding GPU memory, outside the inference unit; returns its pid."""
        self.exec("systemd-run --unit=%s --collect fake-gpu-hold %s %d --name stray" % (unit, gpus, mib))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            pid = int(self.exec("systemctl show -p MainPID --value %s" % unit).stdout.strip() or 0)
            if pid and "stray" in self.nvidia_smi("--query-compute-apps=pid,process_name",
                                                   "--format=csv,noheader"):
                return pid
            time.sleep(0.3)
        raise AssertionError("fake-gpu-hold did not register on %s" % self.name)

    # --- run state --------------------------------------------------------------------------
    def run_ids(self):
        out = self.exec("ls -1 %s/runs 2>/dev/null || true" % STATE_DIR).stdout
        return [line for line in out.split() if line]

    def run_files(self, run_id):
        out = self.exec("ls -1 %s/runs/%s 2>/dev/null || true" % (STATE_DIR, run_id)).stdout
        return sorted(line for line in out.split() if line)

    def read_file(self, path, check=True):
        proc = self.exec("cat %s" % shlex.quote(path), check=check)
        return proc.stdout if proc.returncode == 0 else None

    def read_json(self, path):
        text = self.read_file(path, check=False)
        return json.loads(text) if text else None

    def pids_of(self, pattern):
        """Pids whose command line matches pattern (pgrep -f inside the container)."""
        out = self.exec("pgrep -f %s || true" % shlex.quote(pattern)).stdout
        return [int(pid) for pid in out.split()]

    def payload_pids(self):
        """The payload's python processes (not the async wrapper's shell)."""
        out = self.exec("ps -eo pid=,args=").stdout
        return [int(line.split(None, 1)[0]) for line in out.splitlines()
                if "-m moe_bench" in line and "/opt/bench-venv/bin/python" in line.split(None, 1)[1].split()[0]]

    def unit_cgroup_pids(self, unit=UNIT):
        """Pids in the unit's cgroup (cgroup v2, or the name=systemd hierarchy of a v1 host)."""
        group = self.exec("systemctl show -p ControlGroup --value %s" % unit).stdout.strip()
        if not group:
            return []
        out = self.exec("cat /sys/fs/cgroup%s/cgroup.procs /sys/fs/cgroup/unified%s/cgroup.procs "
                        "/sys/fs/cgroup/systemd%s/cgroup.procs 2>/dev/null; true" % (group, group, group)).stdout
        return sorted({int(pid) for pid in out.split()})

    def gpu_holder_pids(self):
        out = self.nvidia_smi("--query-compute-apps=pid", "--format=csv,noheader,nounits")
        return sorted({int(line) for line in out.split() if line.strip().isdigit()})

    def timer_loaded(self, timer=DEADMAN_TIMER):
        return self.exec("systemctl show -p LoadState --value %s" % timer).stdout.strip() == "loaded"

    # --- cutting the connection ---------------------------------------------------------------
    def kill_ssh_sessions(self):
        """Kill every SSH session process inside the container (the listener stays): a dropped link."""
        out = self.exec("ps -eo pid=,args=").stdout
        pids = [line.split(None, 1)[0] for line in out.splitlines()
                if re.search(r"sshd: \S+@|sshd: root \[priv\]|sshd-session", line)]
        if pids:
            self.exec("kill -9 %s" % " ".join(pids), check=False)
        return pids

    # --- reset between tests -------------------------------------------------------------
    def reset(self):
        """Back to a clean host: default switches, unit active and healthy, no run state."""
        self.exec(
            "systemctl stop %s %s 2>/dev/null; systemctl reset-failed %s %s 2>/dev/null; "
            "systemctl stop stray-holder.service 2>/dev/null; "
            ": > /etc/environment; rm -rf %s; "
            "fake-gpu unreadable --gpus \"$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd,)\" "
            "--fields ''; true"
            % (DEADMAN_TIMER, DEADMAN_TIMER.replace(".timer", ".service"),
               DEADMAN_TIMER, DEADMAN_TIMER.replace(".timer", ".service"), STATE_DIR), check=False)
        # The reset's restart stops the whole cgroup again (the leak drop-in is gone by then),
        # so a leak child left by an earlier test is freed too.
        pids = self.payload_pids()
        if pids:
            self.exec("kill -9 %s" % " ".join(map(str, pids)), check=False)
        self.reset_switches(restart=False)
        self.set_switches(restart=True, FAKE_LOAD_SECONDS=FAST_LOAD_SECONDS)
        self.wait_healthy(timeout=60)


def start_simhost(name, workdir, gpus=None):
    env = dict(os.environ)
    if gpus:
        env["SIMHOST_GPUS"] = str(gpus)
    sh([str(REPO / "simhost" / "up"), name], timeout=300, env=env)
    host = SimHost(name, workdir)
    # Fast loads from the start; the image default is 5 s.
    host.set_switches(restart=True, FAKE_LOAD_SECONDS=FAST_LOAD_SECONDS)
    host.wait_healthy(timeout=60)
    return host


def stop_simhost(name):
    sh([str(REPO / "simhost" / "down"), name], check=False, timeout=120)


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def _require_simhost_image():
    if not ANSIBLE_PLAYBOOK.exists():
        pytest.skip("no .venv: run scripts/bootstrap (make venv)")
    if not docker_available():
        pytest.skip("Docker's engine or the image %s is missing: run `make host-image`" % IMAGE)


def _unique_name(label):
    return "%s-%s-%s" % (NAME_PREFIX, re.sub(r"[^a-z0-9]+", "-", label.lower())[:20].strip("-"),
                         uuid.uuid4().hex[:6])


@pytest.fixture
def simhost_factory(tmp_path_factory):
    """Start fresh hosts: `host = simhost_factory("label")`; all removed at teardown."""
    started = []

    def factory(label="host", gpus=None):
        name = _unique_name(label)
        started.append(name)
        return start_simhost(name, tmp_path_factory.mktemp(name), gpus=gpus)

    yield factory
    for name in started:
        stop_simhost(name)


@pytest.fixture(scope="module")
def _module_simhost(request, tmp_path_factory):
    name = _unique_name(Path(request.module.__file__).stem.replace("test_", ""))
    try:
        host = start_simhost(name, tmp_path_factory.mktemp(name))
    except BaseException:
        stop_simhost(name)
        raise
    yield host
    stop_simhost(name)


@pytest.fixture
def simhost(_module_simhost):
    """One host per test module, reset before each test (switches, run state, timers)."""
    _module_simhost.reset()
    return _module_simhost


@pytest.fixture
def results_dir(tmp_path):
    path = tmp_path / "results"
    path.mkdir()
    return path


def _playbook_argv(host, playbook, extra_vars, tmp_dir, verbose):
    vars_file = tmp_dir / ("extra-vars-%s.json" % uuid.uuid4().hex[:6])
    vars_file.write_text(json.dumps(extra_vars))
    argv = [str(ANSIBLE_PLAYBOOK), "-i", str(host.inventory), str(REPO / "playbooks" / playbook),
            "-e", "@%s" % vars_file]
    if verbose:
        argv.append("-" + "v" * verbose)
    return argv


def _playbook_env(tmp_dir):
    env = dict(os.environ)
    env["ANSIBLE_CONFIG"] = str(REPO / "ansible.cfg")
    env["PATH"] = "%s:%s" % (VENV_BIN, env.get("PATH", ""))
    env["ANSIBLE_NOCOLOR"] = "1"
    env["ANSIBLE_FORCE_COLOR"] = "0"
    # A private ControlPath per test: a killed controller must not leave a master that the next
    # run silently reuses (and cutting the connection must really cut it).
    cp_dir = tmp_dir / "cp"
    cp_dir.mkdir(exist_ok=True)
    env["ANSIBLE_SSH_CONTROL_PATH_DIR"] = str(cp_dir)
    env["ANSIBLE_LOCAL_TEMP"] = str(tmp_dir / "ansible-local")
    env.pop("ANSIBLE_INVENTORY", None)
    return env


def merged_vars(results_dir, overrides):
    extra_vars = dict(FAST_VARS)
    extra_vars["moe_bench_results_dir"] = str(results_dir)
    extra_vars.update(overrides or {})
    return extra_vars


@pytest.fixture
def run_playbook(tmp_path, results_dir):
    """run_playbook(host, extra_vars={}, playbook="moe_bench.yml", timeout=600, verbose=0) -> PlaybookRun."""

    def runner(host, extra_vars=None, playbook="moe_bench.yml", timeout=600, verbose=0, raw_vars=False,
               extra_args=()):
        all_vars = dict(extra_vars or {}) if raw_vars else merged_vars(results_dir, extra_vars)
        argv = _playbook_argv(host, playbook, all_vars, tmp_path, verbose) + list(extra_args)
        started = time.monotonic()
        try:
            proc = subprocess.run(argv, cwd=REPO, env=_playbook_env(tmp_path), capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            return PlaybookRun(argv, -1, (expired.stdout or b"").decode(errors="replace")
                               if isinstance(expired.stdout, bytes) else (expired.stdout or ""),
                               "timed out after %s s" % timeout, time.monotonic() - started, all_vars)
        return PlaybookRun(argv, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started, all_vars)

    return runner


@pytest.fixture
def start_playbook(tmp_path, results_dir):
    """start_playbook(host, extra_vars={}, playbook="moe_bench.yml") -> BackgroundPlaybook (killed at teardown)."""
    running = []

    def starter(host, extra_vars=None, playbook="moe_bench.yml", verbose=0):
        all_vars = merged_vars(results_dir, extra_vars)
        argv = _playbook_argv(host, playbook, all_vars, tmp_path, verbose)
        background = BackgroundPlaybook(argv, _playbook_env(tmp_path), all_vars, tmp_path)
        running.append(background)
        return background

    yield starter
    for background in running:
        background.close()


def fetched_run_dirs(results_dir, host):
    base = Path(results_dir) / host.name
    return sorted(path for path in base.iterdir() if path.is_dir()) if base.exists() else []


def unit_stays_down_while_payloads_run(host, pids=None, interval=0.2):
    """Sample until no payload (of pids, when given) runs; fail when the unit was up while one ran.

    Each sample reads the unit first and the payloads after it: a unit seen active before a payload
    seen still running is an overlap that really happened, not two reads racing the run's progress.
    Returns the number of samples taken while a payload ran."""
    samples = 0
    while True:
        state = host.unit_active()
        running = set(host.payload_pids())
        if pids is not None:
            running &= set(pids)
        if not running:
            return samples
        assert state not in ("active", "activating", "reloading"), \
            "the unit %s was %s while benchmark payload(s) %s still ran on %s: %s" % (
                UNIT, state, sorted(running), host.name, host.unit_show())
        samples += 1
        time.sleep(interval)


def wait_until(predicate, timeout, interval=0.5, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("%s not reached within %s s" % (what, timeout))
