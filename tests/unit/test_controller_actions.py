"""The controller-side action plugins (plugins/action): real `ansible` runs on localhost.

controller_folder and payload_package replace tasks delegated to localhost that each started a
module process on the controller; they must do the same work, fail the same way, and be
documented like modules.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import stat
import tarfile

import yaml

from moe_bench_testlib import REPO, run_ansible_module


def test_controller_folder_creates_the_folder_with_its_mode_and_proves_it_writable(tmp_path):
    target = tmp_path / "results" / "ct200.example"
    completed, result = run_ansible_module(tmp_path, "controller_folder", {"path": str(target), "mode": "0750"})
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert result["created"] is True and result["changed"] is True and result["writable"] is True
    assert target.is_dir() and stat.S_IMODE(target.stat().st_mode) == 0o750
    # The probe file is gone again.
    assert list(target.iterdir()) == []
    again = run_ansible_module(tmp_path, "controller_folder", {"path": str(target)})[1]
    assert again["created"] is False and again["changed"] is False and again["writable"] is True


def test_controller_folder_fails_with_the_reason_when_it_cannot(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    completed, result = run_ansible_module(tmp_path, "controller_folder", {"path": str(blocker)})
    assert completed.returncode != 0 and result["failed"] is True
    assert "is not a folder" in result["msg"] and str(blocker) in result["msg"] and result["writable"] is False
    completed, result = run_ansible_module(tmp_path, "controller_folder", {"path": str(blocker / "below")})
    assert completed.returncode != 0 and result["failed"] is True
    assert "cannot create" in result["msg"]


def test_controller_folder_in_check_mode_makes_nothing(tmp_path):
    target = tmp_path / "new" / "folder"
    completed, result = run_ansible_module(tmp_path, "controller_folder", {"path": str(target)}, extra=("--check",))
    assert completed.returncode == 0, completed.stdout
    assert result["created"] is True and result["writable"] is True
    assert not (tmp_path / "new").exists()


def _payload(tmp_path):
    source = tmp_path / "src" / "moe_bench"
    (source / "kernels").mkdir(parents=True)
    (source / "__init__.py").write_text("")
    (source / "cli.py").write_text("print('cli')\n")
    (source / "kernels" / "a.py").write_text("A = 1\n")
    (source / "run.sh").write_text("#!/bin/sh\n")
    (source / "run.sh").chmod(0o755)
    (source / "__pycache__").mkdir()
    (source / "__pycache__" / "cli.cpython-311.pyc").write_bytes(b"\0junk")
    (source / "kernels" / "stale.pyc").write_bytes(b"\0junk")
    return source


def test_payload_package_is_reproducible_complete_and_leaves_the_bytecode_out(tmp_path):
    source = _payload(tmp_path)
    completed, first = run_ansible_module(tmp_path, "payload_package", {"src": str(source) + "/"})
    assert completed.returncode == 0, completed.stdout + completed.stderr
    archive = first["path"]
    # Written to the run's own temporary folder, which Ansible removes at the end of the run.
    assert not os.path.exists(archive)

    # Same files, new mtimes: the same archive (the host's stamp compares this checksum).
    for path in source.rglob("*.py"):
        os.utime(path, (1, 1))
    second = run_ansible_module(tmp_path, "payload_package", {"src": str(source)})[1]
    assert second["checksum"] == first["checksum"] and second["size"] == first["size"]
    expected = {name: hashlib.sha256((source / name).read_bytes()).hexdigest()
                for name in ("__init__.py", "cli.py", "kernels/a.py", "run.sh")}
    assert first["files"] == expected

    # A changed file changes the archive.
    (source / "kernels" / "a.py").write_text("A = 2\n")
    third = run_ansible_module(tmp_path, "payload_package", {"src": str(source)})[1]
    assert third["checksum"] != first["checksum"]


def test_payload_package_archive_unpacks_to_the_payload_folder(tmp_path):
    source = _payload(tmp_path)
    playbook = tmp_path / "pack.yml"
    keep = tmp_path / "kept.tar"
    playbook.write_text(yaml.safe_dump([{
        "hosts": "localhost", "gather_facts": False,
        "tasks": [
            {"payload_package": {"src": str(source)}, "register": "package"},
            {"ansible.builtin.copy": {"src": "{{ package.path }}", "dest": str(keep), "mode": "0600"}},
        ]}]))
    from moe_bench_testlib import VENV_BIN, ansible_env
    import subprocess

    completed = subprocess.run([str(VENV_BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(playbook)],
                               cwd=REPO, env=ansible_env(tmp_path), capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stdout
    with tarfile.open(keep) as archive:
        members = {member.name: member for member in archive.getmembers()}
        assert sorted(members) == ["moe_bench", "moe_bench/__init__.py", "moe_bench/cli.py", "moe_bench/kernels",
                                   "moe_bench/kernels/a.py", "moe_bench/run.sh"]
        assert all(member.mtime == 0 and member.uid == 0 and member.gid == 0 for member in members.values())
        assert members["moe_bench/run.sh"].mode == 0o755
        assert archive.extractfile("moe_bench/cli.py").read() == b"print('cli')\n"


def test_payload_package_refuses_a_missing_source(tmp_path):
    completed, result = run_ansible_module(tmp_path, "payload_package", {"src": str(tmp_path / "nope")})
    assert completed.returncode != 0
    assert "does not exist on the controller" in result["msg"]


def _documented_options(name):
    tree = ast.parse((REPO / "library" / ("%s.py" % name)).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "DOCUMENTATION":
            return yaml.safe_load(node.value.value)["options"]
    raise AssertionError("no DOCUMENTATION in library/%s.py" % name)


def _plugin_spec(name):
    tree = ast.parse((REPO / "plugins" / "action" / ("%s.py" % name)).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "ARGUMENT_SPEC":
            call = node.value
            return {keyword.arg: {inner.arg: ast.literal_eval(inner.value) for inner in keyword.value.keywords}
                    for keyword in call.keywords}
    raise AssertionError("no ARGUMENT_SPEC in plugins/action/%s.py" % name)


def test_each_action_plugin_is_documented_with_its_own_arguments():
    for name in ("controller_folder", "payload_package"):
        documented, spec = _documented_options(name), _plugin_spec(name)
        assert set(documented) == set(spec), name
        for option, settings in spec.items():
            assert documented[option].get("type", "str") == settings.get("type", "str"), (name, option)
            assert bool(documented[option].get("required")) == bool(settings.get("required")), (name, option)
            assert documented[option].get("default") == settings.get("default"), (name, option)
