"""playbooks/moe_bench.yml inside the execution environment, run the way AWX runs a job.

The image is moe-bench-ee:latest, built from execution-environment.yml by
scripts/build-ee-image (`make ee-image`, a prerequisite of `make test`). As AWX does:
ansible-runner (Python API) with process isolation starts the job in a container of that image,
as the unprivileged uid 1000 (the control process runs as that uid too, as AWX's does), with a
private data dir mounted at /runner, the project copied into it, and the machine credential's
SSH key handed over as env/ssh_key (ansible-runner feeds it to an ssh-agent in the container,
never to a file of the job). The simulated host is reached over the container network, the
results are pushed over SSH to a results host, and the job's artifacts are what AWX reads back.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil

import pytest
import yaml

ansible_runner = pytest.importorskip("ansible_runner")

from conftest import FAST_VARS, REPO, STATE_DIR, UNIT, VENV_BIN, sh  # noqa: E402

EE_IMAGE = os.environ.get("MOE_BENCH_EE_IMAGE", "moe-bench-ee:latest")
JOB_UID = 1000
AWX_DATA = yaml.safe_load((REPO / "awx" / "moe_bench.yml").read_text())
RESULTS_HOST_DIR = "/srv/moe-bench-results"
JOB_IDENT = "ee-job"
# Where the machine credential's key lands in the job (AWX writes a credential to a private
# file of the job; ansible-runner's own env/ssh_key route feeds an ssh-agent through a fifo that
# only the control process's uid can read, so it cannot serve a container user of another uid
# under docker, which has no --userns=keep-id as AWX's podman has).
KEY_IN_JOB = "/runner/env/credentials/gpu-hosts-ssh"


@pytest.fixture(scope="module", autouse=True)
def _require_ee_image():
    if sh(["docker", "image", "inspect", EE_IMAGE], check=False).returncode != 0:
        pytest.skip(f"{EE_IMAGE} is missing: run `make ee-image` (scripts/build-ee-image)")


def container_ip(host):
    return sh(["docker", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
               host.name]).stdout.strip()


def copy_project(dest):
    """The project as AWX copies a checkout into the job: the tracked (and new) files."""
    files = sh(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO).stdout.split("\0")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file() and not source.is_symlink():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def private_data_dir(root, host, ip, extravars):
    pdd = root / "pdd"
    for sub in ("env", "inventory", "project"):
        (pdd / sub).mkdir(parents=True)
    copy_project(pdd / "project")
    (pdd / "env" / "extravars").write_text(json.dumps(extravars))
    (pdd / "env" / "settings").write_text(yaml.safe_dump({"job_timeout": 900, "idle_timeout": 600}))
    (pdd / "env" / "envvars").write_text(yaml.safe_dump({"ANSIBLE_SSH_CONTROL_PATH_DIR": "/tmp/cp",
                                                         "ANSIBLE_NOCOLOR": "1"}))
    # the machine credential's key, a private file of the job
    key = pdd / "env" / "credentials" / "gpu-hosts-ssh"
    key.parent.mkdir()
    key.write_text(pathlib.Path(host.connection["ansible_ssh_private_key_file"]).read_text())
    os.chmod(key, 0o600)
    group = AWX_DATA["awx_moe_bench_inventory"]
    inventory = {"all": {"children": {group["group"]: {
        "vars": group["variables"],
        "hosts": {host.name: {"ansible_host": ip, "ansible_port": 22, "ansible_user": "root",
                              "ansible_ssh_private_key_file": KEY_IN_JOB,
                              "moe_bench_unit": UNIT, "moe_bench_gpus": [0],
                              "moe_bench_health_url": FAST_VARS["moe_bench_health_url"],
                              "moe_bench_python": FAST_VARS["moe_bench_python"], "moe_bench_device": "cpu"}}}}}}
    (pdd / "inventory" / "hosts.yml").write_text(yaml.safe_dump(inventory))
    # the job's own folder for its artifacts, as the job's user's (ansible-runner makes it 0700)
    for sub in ("job_events", "fact_cache"):
        (pdd / "artifacts" / JOB_IDENT / sub).mkdir(parents=True)
    sh(["chown", "-R", f"{JOB_UID}:{JOB_UID}", str(pdd)])
    return pdd


def run_job(pdd, monkeypatch):
    """ansible-runner with process isolation, as AWX starts a job: the container runs as uid 1000."""
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return ansible_runner.run(private_data_dir=str(pdd), ident=JOB_IDENT, playbook="playbooks/moe_bench.yml",
                              process_isolation=True, process_isolation_executable="docker",
                              container_image=EE_IMAGE, container_options=[f"--user={JOB_UID}"], quiet=True)


def test_moe_bench_runs_in_the_execution_environment_as_uid_1000(simhost, tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("ee-job")
    ip = container_ip(simhost)
    survey = {question["variable"]: str(question["default"]) for question in AWX_DATA["awx_moe_bench_survey"]["spec"]}
    run_wide = {name: str(value) for name, value in FAST_VARS.items()
                if name not in ("moe_bench_unit", "moe_bench_gpus", "moe_bench_health_url", "moe_bench_python",
                                "moe_bench_device")}
    # the template's extra vars, the survey's answers (run-wide settings that keep the job short
    # answered over the defaults), all strings as AWX sends them
    extravars = dict(AWX_DATA["awx_moe_bench_job_template"]["extra_vars"])
    extravars.update(survey)
    extravars.update(run_wide)
    extravars.update(moe_bench_results_push_dest=f"root@{ip}:{RESULTS_HOST_DIR}",
                     awx_job_id="4713", awx_job_launch_type="manual")
    pdd = private_data_dir(root, simhost, ip, extravars)
    runner = run_job(pdd, monkeypatch)
    artifacts = pathlib.Path(runner.config.artifact_dir)
    stdout = (artifacts / "stdout").read_text(errors="replace")
    needs_sudo = "sudo: not found" in stdout
    assert runner.status == "successful" and runner.rc == 0, (
        ("A task on the controller asked for sudo, which no execution environment has (issue 14 item 1: "
         "become applies to the GPU host's tasks only).\n" if needs_sudo else "") + stdout[-6000:])
    # it ran in the image, as uid 1000
    command = json.loads((artifacts / "command").read_text())["command"]
    assert command[0] == "docker" and EE_IMAGE in command and f"--user={JOB_UID}" in command

    # The artifacts AWX reads back.
    assert (artifacts / "rc").read_text().strip() == "0"
    assert (artifacts / "status").read_text().strip() == "successful"
    assert "PLAY RECAP" in stdout
    events = [json.loads(path.read_text()) for path in sorted((artifacts / "job_events").glob("*.json"))]
    assert events and runner.stats["ok"].get(simhost.name, 0) > 0 and not runner.stats["failures"], runner.stats
    # the key stayed in its credential file: no copy of it among the artifacts
    key = (pathlib.Path(simhost.connection["ansible_ssh_private_key_file"]).read_text().strip().splitlines()[1])
    assert not [path for path in artifacts.rglob("*") if path.is_file() and key in path.read_text(errors="replace")]

    # set_stats: the summary AWX shows with the job.
    stats = [event for event in events if event.get("event") == "playbook_on_stats"][-1]
    assert simhost.name in stats["event_data"]["artifact_data"]["moe_bench_report"]

    # The controller side ran as uid 1000 in the container: its results folder is uid 1000's.
    results = pdd / "project" / "results" / simhost.name
    run_dirs = [path for path in results.iterdir() if path.is_dir()]
    assert len(run_dirs) == 1
    run_dir = run_dirs[0]
    assert run_dir.stat().st_uid == JOB_UID and (run_dir / "results.json").stat().st_uid == JOB_UID
    assert json.loads((run_dir / "results.json").read_text())["status"] == "complete"

    # The push reached the results host over SSH, with the credential's key.
    for name in ("results.json", "manifest.json", "summary.md"):
        pushed = simhost.exec(f"sha256sum {RESULTS_HOST_DIR}/{simhost.name}/{run_dir.name}/{name}").stdout.split()[0]
        assert pushed == hashlib.sha256((run_dir / name).read_bytes()).hexdigest(), name

    # The host is back: unit active, health 200, no lock.
    assert simhost.unit_active() == "active"
    assert simhost.health_status() == 200
    assert simhost.exec(f"test ! -e {STATE_DIR}/lock", check=False).returncode == 0
