"""Shared helpers for the unit tests of the custom modules and plugins.

Modules are run two ways: in-process (their main() under patch_module_args, fast,
for the many input cases) and through a real `ansible` / `ansible-playbook` run on
localhost (the way the roles call them). The only doubles are the fake command-line
tools written here (nvidia-smi, systemctl, journalctl), which replay captured output.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import pathlib
import stat
import subprocess
import sys

import ansible.module_utils
from ansible.module_utils.testing import patch_module_args

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "nvidia-smi"
VENV_BIN = pathlib.Path(sys.executable).parent

# Let `from ansible.module_utils.nvidia_smi import ...` resolve to the project's
# module_utils, as Ansible's module builder does when it ships the module.
_PROJECT_MODULE_UTILS = str(REPO / "module_utils")
if _PROJECT_MODULE_UTILS not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(_PROJECT_MODULE_UTILS)


def fixture_text(name):
    return (FIXTURES / name).read_text()


def load_source(name, relative_path):
    """Import a project file (a module in library/, a plugin) by its path."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative_path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def run_module_main(module, args):
    """Run an Ansible module's main() in-process; return its result dict.

    The result carries "failed": True when the module called fail_json.
    """
    stdout = io.StringIO()
    with patch_module_args(args), contextlib.redirect_stdout(stdout):
        try:
            module.main()
        except SystemExit:
            pass
        else:
            raise AssertionError("module main() returned without exit_json/fail_json")
    documents = [line for line in stdout.getvalue().splitlines() if line.startswith("{")]
    return json.loads(documents[-1])


def write_executable(path, text):
    path = pathlib.Path(path)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


FAKE_NVIDIA_SMI = r'''#!{python}
"""Fake nvidia-smi: replays captured query output, one frame per --query-gpu call."""
import json, os, sys
config = json.load(open({config!r}))
with open(config["calls"], "a") as calls:
    calls.write(json.dumps(sys.argv[1:]) + "\n")
if config.get("fail"):
    sys.stderr.write(config["fail"]["stderr"])
    sys.exit(config["fail"]["rc"])
query = next(arg for arg in sys.argv[1:] if arg.startswith("--query-"))
count = int(open(config["counter"]).read()) if os.path.exists(config["counter"]) else 0
if query.startswith("--query-gpu="):
    count += 1
    with open(config["counter"], "w") as counter:
        counter.write(str(count))
frame = config["frames"][min(max(count - 1, 0), len(config["frames"]) - 1)]
sys.stdout.write(frame["gpu" if query.startswith("--query-gpu=") else "apps"])
'''


class FakeNvidiaSmi(object):
    """A fake nvidia-smi executable in a temporary directory.

    frames: list of {"gpu": text, "apps": text}; each --query-gpu call moves to the
    next frame (the last one repeats), so a test can make memory get released.
    """

    def __init__(self, directory, frames, fail=None):
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_path = self.directory / "fake-nvidia-smi.json"
        self.calls_path = self.directory / "calls.jsonl"
        self.counter_path = self.directory / "counter"
        self.config_path.write_text(json.dumps({
            "frames": frames, "fail": fail,
            "calls": str(self.calls_path), "counter": str(self.counter_path),
        }))
        self.path = write_executable(
            self.directory / "nvidia-smi",
            FAKE_NVIDIA_SMI.replace("{python}", sys.executable).replace("{config!r}", repr(str(self.config_path))),
        )

    def calls(self):
        if not self.calls_path.exists():
            return []
        return [json.loads(line) for line in self.calls_path.read_text().splitlines()]


def fixture_frame(gpu_fixture, apps_fixture=None):
    return {"gpu": fixture_text(gpu_fixture), "apps": fixture_text(apps_fixture) if apps_fixture else ""}


def ansible_env(tmp_path, extra_path=None):
    """Environment for running ansible/ansible-playbook against localhost from the repo."""
    env = dict(os.environ)
    env.update({
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_LOCAL_TEMP": str(pathlib.Path(tmp_path) / "ansible-local"),
        "ANSIBLE_REMOTE_TEMP": str(pathlib.Path(tmp_path) / "ansible-remote"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
    })
    path = str(VENV_BIN) + os.pathsep + env.get("PATH", "")
    if extra_path:
        path = str(extra_path) + os.pathsep + path
    env["PATH"] = path
    return env


def run_ansible_module(tmp_path, module_name, module_args, extra_path=None, extra=()):
    """`ansible localhost -m <module> -a <json>`; returns (CompletedProcess, result dict or None)."""
    command = [
        str(VENV_BIN / "ansible"), "localhost", "-i", "localhost,", "-c", "local", "-m", module_name,
        "-a", json.dumps(module_args), *extra,
    ]
    env = ansible_env(tmp_path, extra_path)
    env["ANSIBLE_LOAD_CALLBACK_PLUGINS"] = "1"
    env["ANSIBLE_STDOUT_CALLBACK"] = "ansible.builtin.json"
    completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    result = None
    try:
        document = json.loads(completed.stdout)
        result = document["plays"][0]["tasks"][0]["hosts"]["localhost"]
    except (ValueError, KeyError, IndexError):
        pass
    return completed, result


def run_playbook(tmp_path, playbook_text, extra_path=None, extra=(), env_override=None):
    playbook = pathlib.Path(tmp_path) / "playbook.yml"
    playbook.write_text(playbook_text)
    command = [str(VENV_BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(playbook), *extra]
    env = ansible_env(tmp_path, extra_path)
    env.update(env_override or {})
    return subprocess.run(command, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)


FAKE_SYSTEMCTL = r'''#!{python}
"""Fake systemctl/journalctl/systemd-run: answers `show` and `journalctl -u` from a JSON file."""
import json, os, sys
config = json.load(open({config!r}))
with open(config["calls"], "a") as calls:
    calls.write(json.dumps([os.path.basename(sys.argv[0])] + sys.argv[1:]) + "\n")
if config.get("fail"):
    sys.stderr.write(config["fail"]["stderr"])
    sys.exit(config["fail"]["rc"])
args = sys.argv[1:]
if os.path.basename(sys.argv[0]) == "journalctl":
    unit = args[args.index("-u") + 1]
    lines = config["journal"].get(unit, [])
    count = int(args[args.index("-n") + 1])
    sys.stdout.write("".join(line + "\n" for line in lines[-count:]))
    sys.exit(0)
if os.path.basename(sys.argv[0]) == "systemd-run" or args[0] != "show":
    # stop, reset-failed, systemd-run ...: recorded above, answered with the configured rc.
    sys.exit(config.get("rc", {}).get(os.path.basename(sys.argv[0]) if args[0].startswith("--") else args[0], 0))
properties = next(arg for arg in args if arg.startswith("--property=")).split("=", 1)[1].split(",")
blocks = []
for unit in [arg for arg in args[1:] if not arg.startswith("--")]:
    state = config["units"].get(unit) or config["units"].get(unit + ".service")
    if state is None:
        state = {"LoadState": "not-found", "ActiveState": "inactive", "SubState": "dead", "Result": "success",
                 "NRestarts": "0", "MainPID": "0"}
    blocks.append("".join("%s=%s\n" % (name, state.get(name, "")) for name in properties))
sys.stdout.write("\n".join(blocks))
'''


class FakeSystemd(object):
    """Fake `systemctl` (show answered, other verbs recorded), `journalctl -u` and `systemd-run` in a directory to put first on PATH."""

    def __init__(self, directory, units=None, journal=None, fail=None):
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_path = self.directory / "fake-systemd.json"
        self.calls_path = self.directory / "calls.jsonl"
        self.set(units or {}, journal or {}, fail)
        script = FAKE_SYSTEMCTL.replace("{python}", sys.executable).replace("{config!r}", repr(str(self.config_path)))
        write_executable(self.directory / "systemctl", script)
        write_executable(self.directory / "journalctl", script)
        write_executable(self.directory / "systemd-run", script)

    def set(self, units, journal=None, fail=None, rc=None):
        """rc: exit codes of other commands, e.g. {"systemd-run": 1, "stop": 5} (default 0)."""
        self.config_path.write_text(json.dumps({
            "units": units, "journal": journal or {}, "fail": fail, "rc": rc or {}, "calls": str(self.calls_path)}))

    def calls(self):
        if not self.calls_path.exists():
            return []
        return [json.loads(line) for line in self.calls_path.read_text().splitlines()]


def unit_state(active, sub, result="success", restarts=0, main_pid=0, load="loaded"):
    return {"ActiveState": active, "SubState": sub, "Result": result, "NRestarts": str(restarts),
            "MainPID": str(main_pid), "LoadState": load}
