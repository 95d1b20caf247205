"""The simulated host's nvidia-smi answers in the real tool's format.

Runs simhost/kit/usr/bin/nvidia-smi directly on this machine with a temporary state file
that describes the GPUs of the real captures (tests/fixtures/nvidia-smi/, H200, driver
580.159.04) and real live processes standing in for the holders, and compares the output
with the captures line by line: headers, column order, units and widths.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
KIT = REPO / "simhost" / "kit"
NVIDIA_SMI = KIT / "usr" / "bin" / "nvidia-smi"
FAKE_GPU_HOLD = KIT / "usr" / "local" / "bin" / "fake-gpu-hold"
KIT_PYTHONPATH = KIT / "usr" / "lib" / "python3" / "dist-packages"
FIXTURES = REPO / "tests" / "fixtures" / "nvidia-smi"

ONE_GPU_UUID = "GPU-33b36c28-f7d1-d867-b2a9-c29c88a09e61"
TWO_GPU_UUIDS = ["GPU-ba2fb2e1-e13f-855e-a2da-7a7eab16b60f", "GPU-fedd8f2c-0670-9980-b400-024569efb1fb"]
ALL_GPU_FIELDS = ("index,uuid,name,memory.total,memory.used,memory.free,utilization.gpu,"
                  "temperature.gpu,power.draw,clocks.current.sm,clocks.current.memory")
MEMORY_FIELDS = "index,uuid,name,memory.total,memory.used,memory.free"
APP_FIELDS = "gpu_uuid,pid,process_name,used_memory"


def fixture_lines(name):
    return (FIXTURES / name).read_text().splitlines()


@pytest.fixture
def gpu_host(tmp_path):
    """A fake driver state in tmp_path and helpers to run the kit's tools against it."""

    class Host:
        state_path = tmp_path / "state.json"
        env = {**os.environ, "FAKE_GPU_STATE": str(tmp_path / "state.json"),
               "PYTHONPATH": str(KIT_PYTHONPATH)}
        sleepers: list[subprocess.Popen] = []

        def init(self, count, uuids=None):
            self.run_fake_gpu("init", "--count", str(count))
            if uuids:
                state = json.loads(self.state_path.read_text())
                for gpu, uuid in zip(state["gpus"], uuids):
                    gpu["uuid"] = uuid
                self.state_path.write_text(json.dumps(state))

        def run_fake_gpu(self, *args):
            subprocess.run([sys.executable, "-m", "fake_gpu", *args], env=self.env, check=True)

        def holder(self, gpu, mib, name="python3"):
            """A live process registered as holding memory; returns its pid."""
            sleeper = subprocess.Popen(["sleep", "600"])
            self.sleepers.append(sleeper)
            self.run_fake_gpu("register", "--pid", str(sleeper.pid), "--gpus", str(gpu),
                              "--mib", str(mib), "--name", name)
            return sleeper.pid

        def smi(self, *args, expect_rc=0):
            result = subprocess.run([sys.executable, str(NVIDIA_SMI), *args], env=self.env,
                                    capture_output=True, text=True, timeout=30)
            assert result.returncode == expect_rc, (args, result.returncode, result.stdout, result.stderr)
            return result.stdout

    host = Host()
    yield host
    for sleeper in host.sleepers:
        sleeper.kill()
        sleeper.wait()


def without_timestamp(lines):
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} {7}", lines[0]), lines[0]
    return lines[1:]


def with_pid(lines, real_pid, fixture_pid):
    """Fixture lines with the captured pid replaced by a live pid, widths kept."""
    out = []
    for line in lines:
        if line.startswith("|") and f" {fixture_pid} " in line:
            line = line.replace(f"{fixture_pid:>14}", f"{real_pid:>14}")
        line = line.replace(f", {fixture_pid},", f", {real_pid},")
        out.append(line)
    return out


def test_idle_table_matches_the_real_one(gpu_host):
    gpu_host.init(1, [ONE_GPU_UUID])
    output = gpu_host.smi().splitlines()
    assert without_timestamp(output) == without_timestamp(fixture_lines("nvidia-smi_idle.txt"))


def test_busy_table_matches_the_real_one(gpu_host):
    gpu_host.init(1, [ONE_GPU_UUID])
    pid = gpu_host.holder(0, 61958)
    output = gpu_host.smi().splitlines()
    expected = with_pid(without_timestamp(fixture_lines("nvidia-smi_busy.txt")), pid, 452)
    assert without_timestamp(output) == expected


def test_two_gpu_busy_table_matches_the_real_one(gpu_host):
    gpu_host.init(2, TWO_GPU_UUIDS)
    pid0 = gpu_host.holder(0, 41478)
    pid1 = gpu_host.holder(1, 46598)
    expected = with_pid(with_pid(without_timestamp(fixture_lines("x2_nvidia-smi_busy.txt")), pid0, 558), pid1, 559)
    assert without_timestamp(gpu_host.smi().splitlines()) == expected


def test_query_gpu_with_header_and_units_matches_the_real_one(gpu_host):
    gpu_host.init(1, [ONE_GPU_UUID])
    output = gpu_host.smi(f"--query-gpu={ALL_GPU_FIELDS}", "--format=csv")
    assert output.splitlines() == fixture_lines("query-gpu_idle.csv")


def test_query_gpu_noheader_nounits_matches_the_real_one(gpu_host):
    gpu_host.init(1, [ONE_GPU_UUID])
    gpu_host.holder(0, 61958)
    output = gpu_host.smi(f"--query-gpu={MEMORY_FIELDS}", "--format=csv,noheader,nounits")
    assert output.splitlines() == fixture_lines("query-gpu_busy.csv")


def test_two_gpu_queries_match_the_real_ones(gpu_host):
    gpu_host.init(2, TWO_GPU_UUIDS)
    assert gpu_host.smi(f"--query-gpu={MEMORY_FIELDS}", "--format=csv").splitlines() == \
        fixture_lines("x2_query-gpu_idle.csv")
    assert gpu_host.smi(f"--query-compute-apps={APP_FIELDS}", "--format=csv").splitlines() == \
        fixture_lines("x2_query-compute-apps_idle.csv")
    pid0 = gpu_host.holder(0, 41478)
    pid1 = gpu_host.holder(1, 46598)
    assert gpu_host.smi(f"--query-gpu={MEMORY_FIELDS}", "--format=csv,noheader,nounits").splitlines() == \
        fixture_lines("x2_query-gpu_busy.csv")
    apps = gpu_host.smi(f"--query-compute-apps={APP_FIELDS}", "--format=csv").splitlines()
    assert apps == with_pid(with_pid(fixture_lines("x2_query-compute-apps_busy.csv"), pid0, 558), pid1, 559)


def test_compute_apps_matches_the_real_one(gpu_host):
    gpu_host.init(1, [ONE_GPU_UUID])
    pid = gpu_host.holder(0, 61958)
    output = gpu_host.smi(f"--query-compute-apps={APP_FIELDS}", "--format=csv")
    assert output.splitlines() == with_pid(fixture_lines("query-compute-apps_busy.csv"), pid, 452)
    noheader = gpu_host.smi(f"--query-compute-apps={APP_FIELDS}", "--format=csv,noheader,nounits")
    assert noheader.splitlines() == [f"{ONE_GPU_UUID}, {pid}, python3, 61958"]


def test_memory_of_a_dead_process_is_released(gpu_host):
    gpu_host.init(1, [ONE_GPU_UUID])
    pid = gpu_host.holder(0, 61958)
    assert "61967" in gpu_host.smi(f"--query-gpu={MEMORY_FIELDS}", "--format=csv,noheader,nounits")
    sleeper = gpu_host.sleepers.pop()
    sleeper.kill()
    sleeper.wait()
    assert gpu_host.smi(f"--query-gpu={MEMORY_FIELDS}", "--format=csv,noheader,nounits").splitlines() == \
        [f"0, {ONE_GPU_UUID}, NVIDIA H200, 143771, 0, 143156"]
    assert gpu_host.smi(f"--query-compute-apps={APP_FIELDS}", "--format=csv").splitlines() == \
        fixture_lines("x2_query-compute-apps_idle.csv")
    assert str(pid) not in gpu_host.smi()


def test_a_reused_pid_does_not_hold_the_old_memory(gpu_host):
    gpu_host.init(1)
    pid = gpu_host.holder(0, 1000)
    state = json.loads(gpu_host.state_path.read_text())
    # Same pid, other start time: a different process that got the dead holder's pid.
    state["processes"][0]["start_ticks"] += 1
    gpu_host.state_path.write_text(json.dumps(state))
    assert gpu_host.smi("--query-gpu=memory.used", "--format=csv,noheader,nounits").strip() == "0"
    assert str(pid) not in gpu_host.smi(f"--query-compute-apps={APP_FIELDS}", "--format=csv")


def test_default_host_has_eight_idle_h200(gpu_host):
    gpu_host.run_fake_gpu("init")
    lines = gpu_host.smi(f"--query-gpu={MEMORY_FIELDS}", "--format=csv,noheader,nounits").splitlines()
    assert len(lines) == 8
    for index, line in enumerate(lines):
        fields = line.split(", ")
        assert fields[0] == str(index)
        assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", fields[1])
        assert fields[2:] == ["NVIDIA H200", "143771", "0", "143156"]
    assert len({line.split(", ")[1] for line in lines}) == 8


def test_list_and_id_filter(gpu_host):
    gpu_host.init(2, TWO_GPU_UUIDS)
    assert gpu_host.smi("-L").splitlines() == [
        f"GPU 0: NVIDIA H200 (UUID: {TWO_GPU_UUIDS[0]})",
        f"GPU 1: NVIDIA H200 (UUID: {TWO_GPU_UUIDS[1]})",
    ]
    pid = gpu_host.holder(1, 5000)
    by_index = gpu_host.smi("-i", "1", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits")
    assert by_index.splitlines() == ["1, 5009"]
    by_uuid = gpu_host.smi(f"--id={TWO_GPU_UUIDS[0]}", "--query-gpu=index,memory.used", "--format=csv,noheader")
    assert by_uuid.splitlines() == ["0, 0 MiB"]
    assert gpu_host.smi("-i", "0", f"--query-compute-apps={APP_FIELDS}", "--format=csv,noheader").strip() == ""
    assert str(pid) in gpu_host.smi("-i", "1", f"--query-compute-apps={APP_FIELDS}", "--format=csv,noheader")
    table = gpu_host.smi("-i", "1").splitlines()
    assert sum(1 for line in table if "NVIDIA H200" in line) == 1
    assert "No devices were found" in gpu_host.smi("-i", "7", "-L", expect_rc=6)


@pytest.mark.parametrize("args, message", [
    (["--bogus"], 'Option "--bogus" is not recognized'),
    (["--query-gpu=index,bogus.field", "--format=csv"], 'Field "bogus.field" is not a valid field to query.'),
    (["--query-gpu=index"], '"--format" must be specified'),
    (["--query-gpu=index", "--format=xml"], "is not a valid format"),
    (["--query-compute-apps=pid,used_power", "--format=csv"], 'Field "used_power" is not a valid field'),
])
def test_bad_input_is_refused_like_the_real_tool(gpu_host, args, message):
    gpu_host.init(1)
    assert message in gpu_host.smi(*args, expect_rc=2)


def test_missing_driver_state_reads_like_a_missing_driver(gpu_host):
    output = gpu_host.smi("--query-gpu=index", "--format=csv", expect_rc=9)
    assert output.startswith("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


def test_fake_gpu_hold_holds_until_stopped(gpu_host):
    gpu_host.init(2)
    hold = subprocess.Popen([sys.executable, str(FAKE_GPU_HOLD), "0,1", "3000", "--name", "stray-worker"],
                            env=gpu_host.env, stdout=subprocess.PIPE, text=True)
    try:
        assert f"pid {hold.pid} holds 3000 MiB on GPU 0,1" in hold.stdout.readline()
        apps = gpu_host.smi("--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits")
        assert apps.splitlines() == [f"{hold.pid}, stray-worker, 3000"] * 2
        hold.send_signal(signal.SIGTERM)
        assert hold.wait(timeout=10) == 0
    finally:
        hold.kill()
        hold.wait()
    # Unregistered on SIGTERM: the entry is gone from the state file itself.
    assert json.loads(gpu_host.state_path.read_text())["processes"] == []
    deadline = time.time() + 5
    while gpu_host.smi("--query-gpu=memory.used", "--format=csv,noheader,nounits").split() != ["0", "0"]:
        assert time.time() < deadline
        time.sleep(0.1)


def test_unreadable_fields_print_n_a_like_the_real_driver(gpu_host):
    gpu_host.init(2)
    gpu_host.holder(0, 1000)
    gpu_host.run_fake_gpu("unreadable", "--gpus", "0", "--fields", "memory.used,memory.free,used_memory")
    lines = gpu_host.smi("--query-gpu=index,memory.total,memory.used,memory.free",
                         "--format=csv,noheader,nounits").splitlines()
    assert lines[0] == "0, 143771, [N/A], [N/A]"
    assert re.match(r"^1, 143771, 0, \d+$", lines[1]), lines
    apps = gpu_host.smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits").splitlines()
    assert apps and apps[0].endswith(", [N/A]"), apps
    # And back: an empty field list makes every field readable again.
    gpu_host.run_fake_gpu("unreadable", "--gpus", "0", "--fields", "")
    assert "[N/A]" not in gpu_host.smi("--query-gpu=index,memory.used", "--format=csv,noheader,nounits")
