"""roles/results_push against real destinations: a controller folder and a second simulated
host reached over SSH (a results host), through real ansible-playbook runs."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import uuid

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = pathlib.Path(sys.executable).parent / "ansible-playbook"
# a unique name, with the prefix the other integration tests use for their hosts
RESULTS_HOST = f"mb-it-results-{uuid.uuid4().hex[:6]}"

PLAYBOOK = """
- name: Push a results folder
  hosts: localhost
  connection: local
  gather_facts: false
  roles:
    - role: results_push
  post_tasks:
    - name: Save what the push recorded
      ansible.builtin.copy:
        content: "{{ results_push_result | default({}) | to_json }}"
        dest: "{{ push_result_file }}"
        mode: "0644"
"""


def make_results(root, run_id, payload=b'{"status": "complete"}'):
    """A controller results folder of one host as the playbook leaves it."""
    run = root / run_id
    (run).mkdir(parents=True, exist_ok=True)
    (run / "results.json").write_bytes(payload)
    (run / "bench.log").write_text(f"[moe_bench] run {run_id}\n")
    (run / "manifest.json").write_text(json.dumps({"run_id": run_id}))
    (root / "history.json").write_text(json.dumps({"runs": sorted(p.name for p in root.iterdir() if p.is_dir())}))
    return run


def sha256_tree(root):
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def push(tmp_path, **extra_vars):
    playbook = tmp_path / "push.yml"
    playbook.write_text(PLAYBOOK)
    result_file = tmp_path / "push-result.json"
    result_file.unlink(missing_ok=True)
    extra_vars["push_result_file"] = str(result_file)
    inventory = tmp_path / "inventory.ini"
    # in the inventory, not in extra vars, so that the results host keeps its own python
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        ANSIBLE_ROLES_PATH=str(REPO / "roles"),
        ANSIBLE_NOCOLOR="1",
        HOME=str(tmp_path / "home"),
    )
    run = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), str(playbook), "-e", json.dumps(extra_vars)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    recorded = json.loads(result_file.read_text()) if result_file.exists() else None
    return run, recorded


def test_push_to_a_controller_folder_copies_every_file_and_keeps_earlier_runs(tmp_path):
    source = tmp_path / "results" / "simhost"
    make_results(source, "20260405T001000Z-aaaaaa")
    dest = tmp_path / "share"
    run, recorded = push(tmp_path, results_push_src=str(source), results_push_dest=str(dest), results_push_subdir="simhost")
    assert run.returncode == 0, run.stdout + run.stderr
    assert sha256_tree(dest / "simhost") == sha256_tree(source)
    assert recorded["verified"] is True and recorded["files"] == 4
    assert recorded["path"] == f"{dest}/simhost"

    # The next job's container starts empty: it has only its own run, and the push must not
    # remove the runs already at the destination.
    shutil.rmtree(source)
    make_results(source, "20260412T001000Z-bbbbbb")
    run, recorded = push(tmp_path, results_push_src=str(source), results_push_dest=str(dest), results_push_subdir="simhost")
    assert run.returncode == 0, run.stdout + run.stderr
    assert (dest / "simhost" / "20260405T001000Z-aaaaaa" / "results.json").is_file()
    assert (dest / "simhost" / "20260412T001000Z-bbbbbb" / "results.json").is_file()
    assert json.loads((dest / "simhost" / "history.json").read_text())["runs"] == ["20260412T001000Z-bbbbbb"]


def test_no_destination_pushes_nothing_and_says_so(tmp_path):
    source = tmp_path / "results" / "simhost"
    make_results(source, "20260405T001000Z-aaaaaa")
    run, recorded = push(tmp_path, results_push_src=str(source), results_push_dest="")
    assert run.returncode == 0, run.stdout + run.stderr
    assert recorded == {}
    assert "results_push_dest is empty" in run.stdout


def test_missing_source_fails_with_the_folder_named(tmp_path):
    run, recorded = push(
        tmp_path, results_push_src=str(tmp_path / "nothing-here"), results_push_dest=str(tmp_path / "share")
    )
    assert run.returncode == 2
    assert "could not be pushed" in " ".join(run.stdout.split())
    assert recorded is None


@pytest.fixture(scope="module")
def results_host():
    """A second simulated host used as the results host, reached over SSH as root."""
    up = subprocess.run(
        [str(REPO / "simhost" / "up"), RESULTS_HOST, "--no-wait-ready"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if up.returncode != 0:
        subprocess.run([str(REPO / "simhost" / "down"), RESULTS_HOST], capture_output=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    connection = json.loads((REPO / "simhost" / "build" / "instances" / RESULTS_HOST / "connection.json").read_text())
    yield connection
    subprocess.run([str(REPO / "simhost" / "down"), RESULTS_HOST], capture_output=True, text=True, timeout=300)


def remote_sha256(path):
    listing = subprocess.run(
        ["docker", "exec", RESULTS_HOST, "sh", "-c", f"cd {path} && find . -type f -exec sha256sum {{}} +"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    sums = {}
    for line in listing.splitlines():
        digest, name = line.split(maxsplit=1)
        sums[name.removeprefix("./")] = digest
    return sums


def test_push_to_a_results_host_over_ssh(tmp_path, results_host):
    source = tmp_path / "results" / "simhost"
    make_results(source, "20260405T001000Z-cccccc", payload=os.urandom(200_000))
    dest = f"{results_host['user']}@{results_host['host']}:/srv/moe-bench-results"
    run, recorded = push(
        tmp_path,
        results_push_src=str(source),
        results_push_dest=dest,
        results_push_subdir="simhost",
        results_push_ssh_port=int(results_host["port"]),
        results_push_ssh_private_key_file=results_host["private_key_file"],
        results_push_ssh_common_args="-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null",
        results_push_python_interpreter="/usr/bin/python3",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert recorded["verified"] is True
    assert recorded["host"] == results_host["host"]
    assert remote_sha256("/srv/moe-bench-results/simhost") == sha256_tree(source)


def test_a_file_changed_on_the_results_host_is_put_right_on_the_next_push(tmp_path, results_host):
    source = tmp_path / "results" / "simhost"
    make_results(source, "20260405T001000Z-dddddd")
    common = dict(
        results_push_src=str(source),
        results_push_dest=f"{results_host['user']}@{results_host['host']}:/srv/moe-bench-results",
        results_push_subdir="simhost",
        results_push_ssh_port=int(results_host["port"]),
        results_push_ssh_private_key_file=results_host["private_key_file"],
        results_push_ssh_common_args="-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null",
        results_push_python_interpreter="/usr/bin/python3",
    )
    run, _ = push(tmp_path, **common)
    assert run.returncode == 0, run.stdout + run.stderr
    subprocess.run(
        ["docker", "exec", RESULTS_HOST, "sh", "-c",
         "echo corrupted > /srv/moe-bench-results/simhost/20260405T001000Z-dddddd/results.json"],
        check=True,
    )
    run, recorded = push(tmp_path, **common)
    assert run.returncode == 0, run.stdout + run.stderr
    assert recorded["changed"] is True
    assert remote_sha256("/srv/moe-bench-results/simhost")["20260405T001000Z-dddddd/results.json"] == (
        sha256_tree(source)["20260405T001000Z-dddddd/results.json"]
    )


def test_unreachable_results_host_fails_clearly_or_only_warns(tmp_path, results_host):
    source = tmp_path / "results" / "simhost"
    make_results(source, "20260405T001000Z-eeeeee")
    unreachable = dict(
        results_push_src=str(source),
        # the results host's key, but a port where nothing listens
        results_push_dest="root@127.0.0.1:/srv/moe-bench-results",
        results_push_ssh_port=9,
        results_push_ssh_private_key_file=results_host["private_key_file"],
        results_push_ssh_common_args="-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o ConnectTimeout=5",
    )
    run, _ = push(tmp_path, **unreachable)
    assert run.returncode != 0
    output = " ".join(run.stdout.split())
    assert "The results could not be pushed" in output
    assert f"The results are still in {source}" in output

    run, recorded = push(tmp_path, results_push_required=False, **unreachable)
    assert run.returncode == 0, run.stdout + run.stderr
    assert recorded["verified"] is False
    assert "WARNING: the results were not pushed" in run.stdout
