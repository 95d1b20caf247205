"""gpu_memory: in-process runs of main() against a fake nvidia-smi replaying real captures,
and real `ansible localhost -m gpu_memory` runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from moe_bench_testlib import (
    FakeNvidiaSmi,
    fixture_frame,
    fixture_text,
    load_source,
    run_ansible_module,
    run_module_main,
    run_playbook,
)

gpu_memory = load_source("gpu_memory", "library/gpu_memory.py")

BUSY_X2 = fixture_frame("x2_query-gpu_busy.csv", "x2_query-compute-apps_busy.csv")
IDLE_X2 = fixture_frame("x2_query-gpu_idle.csv", "x2_query-compute-apps_idle.csv")
BUSY_H200 = fixture_frame("query-gpu_busy.csv", "query-compute-apps_busy.csv")


@pytest.fixture
def fake_proc(tmp_path, monkeypatch):
    """A /proc with cgroup files: pid 558 in a system service (cgroup v2), 559 gone."""
    root = tmp_path / "proc"
    (root / "558").mkdir(parents=True)
    (root / "558" / "cgroup").write_text("0::/system.slice/fake-inference.service\n")
    monkeypatch.setattr(gpu_memory, "PROC_ROOT", str(root))
    return root


def run(tmp_path, frames, **args):
    fake = FakeNvidiaSmi(tmp_path / "fake", frames)
    args.setdefault("nvidia_smi", str(fake.path))
    return run_module_main(gpu_memory, args), fake


@pytest.mark.parametrize("text, unit", [
    ("0::/system.slice/fake-inference.service\n", "fake-inference.service"),
    ("0::/system.slice/sglang-k26-ddtree.service/payload\n", "sglang-k26-ddtree.service"),
    ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/srv.service\n", "srv.service"),
    ("0::/user.slice/user-1000.slice/session-3.scope\n", "session-3.scope"),
    ("0::/\n", None),
    ("", None),
    # cgroup v1: the name=systemd hierarchy carries the unit
    ("12:pids:/system.slice/vllm-kimi-k25-int4.service\n4:memory:/system.slice/vllm-kimi-k25-int4.service\n"
     "1:name=systemd:/system.slice/vllm-kimi-k25-int4.service\n", "vllm-kimi-k25-int4.service"),
    ("9:name=systemd:/\n4:memory:/process_api/3cd05\n0::/\n", None),
    # hybrid: unified line empty, v1 systemd line has the unit
    ("1:name=systemd:/system.slice/a.service\n0::/\n", "a.service"),
])
def test_unit_from_cgroup(text, unit):
    assert gpu_memory.unit_from_cgroup(text) == unit


def test_unit_of_missing_pid_is_none(fake_proc):
    assert gpu_memory.unit_of_pid(559) is None
    assert gpu_memory.unit_of_pid(None) is None
    assert gpu_memory.unit_of_pid(558) == "fake-inference.service"


def test_report_once_without_arguments(tmp_path, fake_proc):
    result, fake = run(tmp_path, [BUSY_X2])
    assert not result.get("failed"), result
    assert result["ready"] is True and result["blocking"] == []
    assert result["checks"] == 1
    assert [(g["index"], g["used_mib"], g["free_mib"]) for g in result["gpus"]] == [(0, 41487, 101670), (1, 46607, 96550)]
    assert [(p["pid"], p["gpu_index"], p["used_mib"], p["unit"]) for p in result["processes"]] == [
        (558, 0, 41478, "fake-inference.service"), (559, 1, 46598, None)]
    assert fake.calls() == [
        ["--query-gpu=index,uuid,name,memory.total,memory.used,memory.free", "--format=csv,noheader,nounits"],
        ["--query-compute-apps=gpu_uuid,pid,process_name,used_memory", "--format=csv,noheader,nounits"],
    ]


def test_chosen_gpus_only(tmp_path, fake_proc):
    result, _ = run(tmp_path, [BUSY_X2], gpus=[1], max_used_mib=50000)
    assert [g["index"] for g in result["gpus"]] == [1]
    assert [p["pid"] for p in result["processes"]] == [559]
    assert result["ready"] is True


def test_missing_gpu_index_fails_at_once(tmp_path):
    result, fake = run(tmp_path, [BUSY_X2], gpus=[0, 3], max_used_mib=0, timeout=60, interval=1)
    assert result["failed"] is True
    assert "GPU index 3 requested, but this host has GPU(s) [0, 1]" in result["msg"]
    assert len(fake.calls()) == 2  # one read, no waiting


def test_thresholds_without_timeout_report_not_ready(tmp_path, fake_proc):
    result, fake = run(tmp_path, [BUSY_X2], max_used_mib=1024, min_free_mib=100000, max_processes=0)
    assert not result.get("failed")
    assert result["ready"] is False
    assert result["blocking"] == [
        "GPU 0: 41487 MiB used, more than the 1024 MiB allowed",
        "GPU 1: 46607 MiB used, more than the 1024 MiB allowed",
        "GPU 1: 96550 MiB free, less than the 100000 MiB needed",
        "2 process(es) hold GPU memory, at most 0 allowed",
    ]
    assert len(fake.calls()) == 2


def test_waits_until_memory_is_released(tmp_path, fake_proc):
    result, fake = run(tmp_path, [BUSY_X2, BUSY_X2, IDLE_X2], max_used_mib=1024, min_free_mib=143000,
                       max_processes=0, timeout=20, interval=0.05)
    assert not result.get("failed"), result
    assert result["ready"] is True and result["checks"] == 3
    assert result["processes"] == []
    assert [g["used_mib"] for g in result["gpus"]] == [0, 0]


def test_timeout_fails_with_holder_table(tmp_path, fake_proc):
    started = time.monotonic()
    result, fake = run(tmp_path, [BUSY_X2], gpus=[0, 1], max_used_mib=1024, timeout=1.5, interval=0.05)
    assert time.monotonic() - started < 10
    assert result["failed"] is True
    assert result["ready"] is False
    message = result["msg"]
    assert message.startswith("GPU memory was not released within 1.5 s")
    assert "GPU 0: 41487 MiB used, more than the 1024 MiB allowed" in message
    table = message.split("Processes holding memory:\n", 1)[1].splitlines()
    assert table[0].split() == ["GPU", "PID", "PROCESS", "MiB", "UNIT"]
    assert table[1].split() == ["0", "558", "python3", "41478", "fake-inference.service"]
    assert table[2].split() == ["1", "559", "python3", "46598", "-"]


def test_unreadable_memory_blocks(tmp_path):
    frame = {"gpu": "0, GPU-a, NVIDIA H200, [N/A], [N/A], [N/A]\n", "apps": ""}
    result, _ = run(tmp_path, [frame], max_used_mib=10, min_free_mib=10)
    assert result["ready"] is False
    assert result["blocking"] == ["GPU 0: memory.used is not readable ([N/A])",
                                  "GPU 0: memory.free is not readable ([N/A])"]


def test_nvidia_smi_error_is_reported_with_stderr(tmp_path):
    fake = FakeNvidiaSmi(tmp_path / "fake", [BUSY_H200], fail={
        "rc": 9, "stderr": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"})
    result = run_module_main(gpu_memory, {"nvidia_smi": str(fake.path)})
    assert result["failed"] is True
    assert "nvidia-smi failed (exit code 9)" in result["msg"]
    assert "couldn't communicate with the NVIDIA driver" in result["msg"]


def test_nvidia_smi_missing(tmp_path, monkeypatch):
    result = run_module_main(gpu_memory, {"nvidia_smi": str(tmp_path / "absent" / "nvidia-smi")})
    assert result["failed"] is True and "nvidia-smi not found or not executable" in result["msg"]
    monkeypatch.setenv("PATH", str(tmp_path))
    result = run_module_main(gpu_memory, {"nvidia_smi": "nvidia-smi-not-installed"})
    assert result["failed"] is True and "nvidia-smi-not-installed not found on PATH" in result["msg"]


def test_unparseable_output_fails_clearly(tmp_path):
    result, _ = run(tmp_path, [{"gpu": "garbage\n", "apps": ""}])
    assert result["failed"] is True
    assert result["msg"].startswith("could not parse nvidia-smi output: expected 6 comma-separated values")


def test_no_gpu_listed_fails(tmp_path):
    result, _ = run(tmp_path, [{"gpu": "", "apps": ""}])
    assert result["failed"] is True
    assert result["msg"] == "nvidia-smi lists no GPU on this host (empty --query-gpu output)"


@pytest.mark.parametrize("args, message", [
    ({"max_used_mib": -1}, "max_used_mib must be 0 or more"),
    ({"timeout": -5}, "timeout must be 0 or more seconds"),
    ({"interval": 0}, "interval must be more than 0 seconds"),
])
def test_bad_arguments(tmp_path, args, message):
    result, fake = run(tmp_path, [BUSY_H200], **args)
    assert result["failed"] is True and message in result["msg"]
    assert fake.calls() == []


def test_check_mode_reads_normally(tmp_path):
    result, fake = run(tmp_path, [BUSY_H200], _ansible_check_mode=True, max_used_mib=1024)
    assert result["ready"] is False and result["gpus"][0]["used_mib"] == 61967
    assert len(fake.calls()) == 2


def test_holders_table_format():
    processes = [{"gpu_index": 0, "pid": 452, "name": "python3", "used_mib": 61958, "unit": "sglang-k26-ddtree.service"}]
    assert gpu_memory.holders_table(processes).splitlines() == [
        "GPU  PID  PROCESS    MiB  UNIT",
        "  0  452  python3  61958  sglang-k26-ddtree.service",
    ]
    assert gpu_memory.holders_table([]) == "no process holds memory on the chosen GPUs"


E2E_PLAYBOOK = """
- name: Exercise gpu_memory the way the roles call it
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Report GPU memory in check mode
      gpu_memory:
        nvidia_smi: "{{ fake_released }}"
        gpus: [0]
      check_mode: true
      register: report

    - name: Wait until GPU memory is released
      gpu_memory:
        nvidia_smi: "{{ fake_released }}"
        max_used_mib: 1024
        timeout: 30
        interval: 0.2
      register: waited

    - name: Wait for GPU memory that is never released
      gpu_memory:
        nvidia_smi: "{{ fake_stuck }}"
        max_used_mib: 1024
        timeout: 0.5
        interval: 0.2
      register: stuck
      ignore_errors: true

    - name: Save the results for the test
      ansible.builtin.copy:
        content: "{{ {'report': report, 'waited': waited, 'stuck': stuck} | to_json }}"
        dest: "{{ results_file }}"
        mode: "0644"
"""


def test_real_ansible_playbook_run(tmp_path):
    """Through ansible-playbook (AnsiballZ ships module_utils) with a live holder process."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        uuid = "GPU-33b36c28-f7d1-d867-b2a9-c29c88a09e61"
        busy = {"gpu": fixture_text("query-gpu_busy.csv"), "apps": "%s, %d, python3, 61958\n" % (uuid, holder.pid)}
        released = FakeNvidiaSmi(tmp_path / "released", [busy, busy, fixture_frame("query-gpu_idle.csv")])
        stuck = FakeNvidiaSmi(tmp_path / "stuck", [BUSY_H200])
        with open("/proc/%d/cgroup" % holder.pid) as cgroup:
            expected_unit = gpu_memory.unit_from_cgroup(cgroup.read())
        results_file = tmp_path / "results.json"
        completed = run_playbook(tmp_path, E2E_PLAYBOOK, extra=[
            "-e", json.dumps({"fake_released": str(released.path), "fake_stuck": str(stuck.path),
                              "results_file": str(results_file)})])
        assert completed.returncode == 0, completed.stdout + completed.stderr
        results = json.loads(results_file.read_text())
    finally:
        holder.kill()
        holder.wait()

    report = results["report"]
    assert report["ready"] is True and report["checks"] == 1
    assert report["processes"] == [{"pid": holder.pid, "gpu_index": 0, "gpu_uuid": uuid, "name": "python3",
                                    "used_mib": 61958, "unit": expected_unit}]

    waited = results["waited"]
    assert waited["ready"] is True and waited["checks"] == 2
    assert waited["gpus"][0]["used_mib"] == 0 and waited["processes"] == []

    stuck_result = results["stuck"]
    assert stuck_result["failed"] is True
    assert "GPU 0: 61967 MiB used, more than the 1024 MiB allowed" in stuck_result["msg"]
    assert "  0  452  python3  61958  -" in stuck_result["msg"]
    assert "GPU memory was not released" in completed.stdout


def test_ad_hoc_run_fails_at_once_on_missing_gpu(tmp_path):
    """`ansible <host> -m gpu_memory`, as an operator runs it by hand."""
    fake = FakeNvidiaSmi(tmp_path / "fake", [BUSY_X2])
    completed, result = run_ansible_module(tmp_path, "gpu_memory", {
        "nvidia_smi": str(fake.path), "gpus": [0, 7], "max_used_mib": 0, "timeout": 300})
    assert completed.returncode != 0
    assert result["failed"] is True
    assert result["msg"] == "GPU index 7 requested, but this host has GPU(s) [0, 1] (nvidia-smi --query-gpu=index)"
    assert len(fake.calls()) == 2
