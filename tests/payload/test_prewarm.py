"""The model read-ahead (moe_bench.prewarm): reads everything it is given, never below the
memory reserve, ends with the benchmark, writes its record."""

from __future__ import annotations

import json
import subprocess
import sys

from moe_bench import prewarm

from conftest import payload_env

MIB = 1024 * 1024


def _meminfo(tmp_path, available_mib):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       65536000 kB\nMemFree:         1000 kB\nMemAvailable:   %d kB\n" % (available_mib * 1024))
    return str(path)


def _model(tmp_path):
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.safetensors").write_bytes(b"a" * (3 * MIB + 5))
    (folder / "sub" / "b.safetensors").write_bytes(b"b" * MIB)
    return folder


def test_reads_every_file_of_a_folder_and_counts_the_bytes(tmp_path):
    folder = _model(tmp_path)
    record = prewarm.prewarm([str(folder)], reserve_mib=1024, meminfo=_meminfo(tmp_path, 64000), chunk_bytes=MIB)
    assert record["stopped"] == "done" and record["error"] is None
    assert record["bytes"] == record["bytes_total"] == 4 * MIB + 5
    assert record["files_read"] == record["files_total"] == 2 and record["seconds"] >= 0


def test_stops_before_taking_memavailable_below_the_reserve(tmp_path):
    folder = _model(tmp_path)
    record = prewarm.prewarm([str(folder)], reserve_mib=2000, meminfo=_meminfo(tmp_path, 2000), chunk_bytes=MIB)
    assert record["stopped"] == "memory reserve" and record["bytes"] == 0 and record["mem_available_mib"] == 2000


def test_stops_when_the_benchmark_ended_and_reads_on_while_it_runs(tmp_path):
    folder = _model(tmp_path)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"status": "running"}))
    running = prewarm.prewarm([str(folder)], 1024, str(results), meminfo=_meminfo(tmp_path, 64000), chunk_bytes=MIB)
    assert running["stopped"] == "done"
    for status in ("complete", "failed"):
        results.write_text(json.dumps({"status": status}))
        record = prewarm.prewarm([str(folder)], 1024, str(results), meminfo=_meminfo(tmp_path, 64000), chunk_bytes=MIB)
        assert record["stopped"] == "benchmark ended" and record["bytes"] == 0


def test_stops_at_its_time_limit(tmp_path):
    record = prewarm.prewarm([str(_model(tmp_path))], 1024, limit_s=0, meminfo=_meminfo(tmp_path, 64000))
    assert record["stopped"] == "time limit" and record["bytes"] == 0


def test_a_file_that_cannot_be_read_is_an_error_in_the_record_not_a_crash(tmp_path):
    record = prewarm.prewarm([str(tmp_path / "missing")], 1024, meminfo=_meminfo(tmp_path, 64000))
    assert record["stopped"] == "done" and record["files_total"] == 0  # nothing under a missing path
    folder = _model(tmp_path)
    (folder / "a.safetensors").chmod(0)
    if subprocess.run(["test", "-r", str(folder / "a.safetensors")]).returncode == 0:
        return  # root reads it anyway
    record = prewarm.prewarm([str(folder)], 1024, meminfo=_meminfo(tmp_path, 64000))
    assert record["stopped"] == "error" and "PermissionError" in record["error"]


def test_the_command_writes_its_record(tmp_path):
    folder = _model(tmp_path)
    record_path = tmp_path / "prewarm.json"
    completed = subprocess.run([sys.executable, "-m", "moe_bench.prewarm", str(folder), "--reserve-mib", "1",
                                "--record", str(record_path)], capture_output=True, text=True, env=payload_env(),
                               timeout=60)
    assert completed.returncode == 0, completed.stderr
    record = json.loads(record_path.read_text())
    assert record["bytes"] == 4 * MIB + 5 and record["stopped"] == "done" and record["paths"] == [str(folder)]
