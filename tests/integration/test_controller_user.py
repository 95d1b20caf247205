"""The controller as an unprivileged local user (no root, no sudo), as most operators and AWX's
execution environment run ansible-playbook: the whole cycle and a failure case, the GPU host
reached as root or as a sudo user. Every file the controller writes belongs to that user.

The user comes from scripts/controller-user (`make test` runs it; CI is root, so it exists)."""

import json
import os
import pwd
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import FAST_VARS, REPO, STATE_DIR, VENV_BIN, PlaybookRun

CONTROLLER_USER = os.environ.get("MOE_BENCH_CONTROLLER_USER", "moebench-ctl")


@pytest.fixture
def controller(simhost):
    """A private folder owned by the controller user: its SSH key, inventory, results, temp."""
    try:
        account = pwd.getpwnam(CONTROLLER_USER)
    except KeyError:
        pytest.skip("no local user %s: run scripts/controller-user as root (make test does)" % CONTROLLER_USER)
    if os.geteuid() != 0:
        pytest.skip("running the controller as %s needs root to switch to it" % CONTROLLER_USER)
    home = Path("/tmp") / ("mb-ctl-%s" % uuid.uuid4().hex[:8])
    home.mkdir(mode=0o700)
    key = home / "id_ed25519"
    shutil.copy(simhost.connection["ansible_ssh_private_key_file"], key)
    for path in (home / "results", home / "tmp", home / "cp"):
        path.mkdir()
    os.chmod(key, 0o600)

    class Controller:
        user = account
        dir = home
        results = home / "results"

        def inventory(self, remote_user="root", become_method=None):
            host_vars = dict(simhost.connection, ansible_ssh_private_key_file=str(key), ansible_user=remote_user)
            if become_method:
                host_vars["ansible_become_method"] = become_method
            inventory = home / ("inventory-%s.yml" % remote_user)
            inventory.write_text(yaml.safe_dump({"moe_bench_hosts": {"hosts": {simhost.name: host_vars}}}))
            return inventory

        def run(self, extra_vars=None, inventory=None, timeout=600):
            all_vars = dict(FAST_VARS, moe_bench_results_dir=str(home / "results"), **(extra_vars or {}))
            vars_file = home / ("vars-%s.json" % uuid.uuid4().hex[:6])
            vars_file.write_text(json.dumps(all_vars))
            subprocess.run(["chown", "-R", "%d:%d" % (account.pw_uid, account.pw_gid), str(home)], check=True)
            env = {"HOME": str(home), "USER": CONTROLLER_USER, "LOGNAME": CONTROLLER_USER,
                   "PATH": "%s:/usr/bin:/bin" % VENV_BIN, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
                   "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
                   "ANSIBLE_SSH_CONTROL_PATH_DIR": str(home / "cp"), "ANSIBLE_HOME": str(home / ".ansible"),
                   "LANG": "C.UTF-8"}
            argv = ["runuser", "-u", CONTROLLER_USER, "--", "env", "-i"] + ["%s=%s" % kv for kv in env.items()] + [
                str(VENV_BIN / "ansible-playbook"), "-i", str(inventory or self.inventory()),
                str(REPO / "playbooks" / "moe_bench.yml"), "-e", "@%s" % vars_file]
            started = time.monotonic()
            proc = subprocess.run(argv, cwd=str(home), capture_output=True, text=True, timeout=timeout)
            return PlaybookRun(argv, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started, all_vars)

        def files_not_owned(self):
            """Every path under the results that the controller user does not own."""
            return [str(path) for path in self.results.rglob("*") if path.stat().st_uid != account.pw_uid]

    yield Controller()
    shutil.rmtree(home, ignore_errors=True)


def assert_cycle_done(host, controller, run):
    assert host.unit_show()["ActiveState"] == "active" and host.health_status() == 200
    assert not host.timer_loaded(), "dead-man timer left armed"
    assert host.exec("test -e %s/lock" % STATE_DIR, check=False).returncode != 0, "lock not released"
    # Nothing on the controller asked for a password or root.
    assert "sudo" not in run.stderr.lower() and "password is required" not in run.stdout, run.describe()
    assert controller.files_not_owned() == [], controller.files_not_owned()


def test_whole_cycle_as_an_unprivileged_controller_user(simhost, controller):
    before = simhost.unit_show()
    run = controller.run()
    assert run.rc == 0, run.describe()
    assert simhost.unit_show()["MainPID"] != before["MainPID"], "the unit was never restarted"
    assert_cycle_done(simhost, controller, run)
    (run_dir,) = [path for path in (controller.results / simhost.name).iterdir() if path.is_dir()]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "complete" and [row["m"] for row in results["results"]] == [1, 2, 4, 8]
    for name in ("manifest.json", "summary.md", "bench.log"):
        assert (run_dir / name).exists(), sorted(p.name for p in run_dir.iterdir())


def test_failed_benchmark_as_an_unprivileged_controller_user_restores_the_service(simhost, controller):
    simhost.set_payload_env(MOE_BENCH_INTERNAL_FAIL_AT_M=4)
    run = controller.run()
    assert run.rc != 0, run.describe()
    assert "The benchmark failed on %s" % simhost.name in " ".join(run.stdout.split()), run.describe()
    assert_cycle_done(simhost, controller, run)
    (run_dir,) = [path for path in (controller.results / simhost.name).iterdir() if path.is_dir()]
    assert [row["m"] for row in json.loads((run_dir / "results.json").read_text())["results"]] == [1, 2]


def test_gpu_host_reached_as_a_sudo_user(simhost, controller):
    # A non-root remote user with passwordless sudo, as on most fleets.
    simhost.exec("id ops >/dev/null 2>&1 || useradd --create-home ops; "
                 "echo 'ops ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/ops && chmod 0440 /etc/sudoers.d/ops; "
                 "install -d -m 0700 -o ops -g ops /home/ops/.ssh && "
                 "cp /root/.ssh/authorized_keys /home/ops/.ssh/authorized_keys && "
                 "chown ops:ops /home/ops/.ssh/authorized_keys && chmod 0600 /home/ops/.ssh/authorized_keys")
    run = controller.run(inventory=controller.inventory(remote_user="ops"))
    assert run.rc == 0, run.describe()
    assert_cycle_done(simhost, controller, run)
    # The host's state was written through sudo, as root.
    assert simhost.exec("stat -c %%U %s" % STATE_DIR).stdout.strip() == "root"
