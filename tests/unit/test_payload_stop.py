"""payload_stop: real processes that write under a run folder are stopped (SIGTERM, then SIGKILL
for one that ignores it), processes writing elsewhere are left alone, check mode only looks."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from moe_bench_testlib import load_source, run_module_main

payload_stop = load_source("payload_stop", "library/payload_stop.py")

# A stand-in payload: argv carries --out like the real one; it writes a line when SIGTERM reaches
# it (the real payload records the stop in its results) unless told to ignore the signal.
STAND_IN = r"""
import signal, sys, time
marker = sys.argv[sys.argv.index("--marker") + 1]
def on_term(signum, frame):
    open(marker, "w").write("terminated\n")
    sys.exit(1)
signal.signal(signal.SIGTERM, signal.SIG_IGN if "--ignore-term" in sys.argv else on_term)
open(marker + ".ready", "w").write("ready\n")
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def runs(tmp_path):
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    started = []

    def start(out, *extra, new_session=True):
        marker = str(tmp_path / ("marker-%d" % len(started)))
        proc = subprocess.Popen([sys.executable, "-c", STAND_IN, "--out", str(out), "--marker", marker] + list(extra),
                                start_new_session=new_session)
        started.append(proc)
        deadline = time.monotonic() + 30
        while not os.path.exists(marker + ".ready"):
            assert proc.poll() is None and time.monotonic() < deadline, "stand-in payload did not start"
            time.sleep(0.02)
        return proc, marker

    yield tmp_path, start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def stop(folder, check_mode=False, **extra):
    args = {"under": str(folder), "term_grace_s": 5, "kill_wait_s": 5}
    args.update(extra)
    if check_mode:
        args["_ansible_check_mode"] = True
    return run_module_main(payload_stop, args)


def gone(proc, seconds=5):
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_a_payload_under_the_folder_is_terminated_and_others_are_left_alone(runs):
    tmp_path, start = runs
    payload, marker = start(tmp_path / "runs" / "r1" / "results.json")
    other, _ = start(tmp_path / "elsewhere" / "results.json")
    result = stop(tmp_path / "runs")
    assert [item["pid"] for item in result["found"]] == [payload.pid], result
    assert "--out %s" % (tmp_path / "runs" / "r1" / "results.json") in result["found"][0]["args"]
    assert result["terminated"] == [payload.pid] and result["killed"] == [] and result["left"] == []
    assert result["changed"] is True
    assert gone(payload) and payload.returncode == 1
    # SIGTERM reached it (the real payload records its stop then), no SIGKILL was needed.
    assert open(marker).read() == "terminated\n"
    assert other.poll() is None, "a process writing outside the folder was stopped"


def test_a_payload_that_ignores_sigterm_is_killed(runs):
    tmp_path, start = runs
    payload, marker = start(tmp_path / "runs" / "r1" / "gpu1" / "results.json", "--ignore-term")
    started = time.monotonic()
    result = stop(tmp_path / "runs", term_grace_s=1)
    assert result["killed"] == [payload.pid] and result["terminated"] == [] and result["left"] == [], result
    assert time.monotonic() - started >= 1, "SIGKILL came before the grace period was over"
    assert gone(payload) and payload.returncode == -9
    assert not os.path.exists(marker)


def test_check_mode_and_nothing_found_signal_nothing(runs):
    tmp_path, start = runs
    payload, _ = start(tmp_path / "runs" / "r1" / "results.json")
    looked = stop(tmp_path / "runs", check_mode=True)
    assert [item["pid"] for item in looked["found"]] == [payload.pid] and looked["changed"] is False
    time.sleep(0.3)
    assert payload.poll() is None, "check mode stopped the payload"
    none = stop(tmp_path / "elsewhere" / "nothing")
    assert none["found"] == [] and none["changed"] is False and none["left"] == []


def test_a_zombie_counts_as_gone(runs):
    # A payload that exited but was not reaped by its parent holds nothing: it is not waited for.
    tmp_path, start = runs
    payload, _ = start(tmp_path / "runs" / "r1" / "results.json", new_session=False)
    os.kill(payload.pid, 9)
    deadline = time.monotonic() + 10
    while payload_stop.process_identity(payload.pid)[1] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    result = stop(tmp_path / "runs")
    assert result["found"] == [] and result["changed"] is False


@pytest.mark.parametrize("argv, path", [
    (["python", "-m", "moe_bench", "--out", "/x/r/results.json"], "/x/r/results.json"),
    (["python", "--out=/x/r/results.json"], "/x/r/results.json"),
    (["python", "--results", "/x/r/results.json"], None),
    (["python", "--out"], None),
])
def test_output_path(argv, path):
    assert payload_stop.output_path(argv) == path


@pytest.mark.parametrize("path, folder, expected", [
    ("/var/lib/mb/runs/a/results.json", "/var/lib/mb/runs", True),
    ("/var/lib/mb/runs/a/results.json", "/var/lib/mb/runs/", True),
    ("/var/lib/mb/runs-old/a/results.json", "/var/lib/mb/runs", False),
    ("/var/lib/mb/runs/../elsewhere/results.json", "/var/lib/mb/runs", False),
    ("/var/lib/mb/runs", "/var/lib/mb/runs", False),
])
def test_inside(path, folder, expected):
    assert payload_stop.inside(path, folder) is expected


def test_a_relative_or_root_folder_is_refused():
    for folder in ("/", "runs"):
        result = run_module_main(payload_stop, {"under": folder})
        assert result.get("failed") and "absolute folder other than /" in result["msg"], result
