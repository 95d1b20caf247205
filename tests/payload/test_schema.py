"""The results file: round trip, CSV beside it, atomic writes, the versioned loader."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from moe_bench import schema

ENVIRONMENT = {"hostname": "gpu-7", "gpu_name": "NVIDIA H200", "driver": "580.159.04", "cuda": "13.0",
               "torch": "2.11.0", "triton": "3.6.0", "python": "3.12.3", "device": "cuda:0"}
CONFIG = {"preset": "kimi-k2.6", "experts": 384, "hidden": 7168, "inter": 2048, "topk": 8, "group_size": 32,
          "tp": 1, "backend": "triton", "dtype": "bfloat16", "m_list": [1, 2, 4], "seed": 0}


def row(m: int) -> dict:
    return {"m": m, "us": 100.0 * m, "us_p20": 99.0 * m, "us_p80": 101.0 * m, "us_per_token": 100.0,
            "bytes": 1000 * m, "flops": 2000 * m, "gbps": 10.0, "tflops": 0.02, "floor_us": 50.0 * m,
            "pct_of_floor": 50.0, "compile_s": 0.5, "distinct_experts": 8.0}


def test_round_trip_through_the_loader(tmp_path):
    path = tmp_path / "results.json"
    writer = schema.ResultsWriter(path, ENVIRONMENT, CONFIG)
    writer.set_ceilings({"bandwidth_gbps": 4300.0, "tflops": 790.0, "source": "measured"})
    writer.add_correctness({"m": 1, "rel_err": 0.003, "bound": 0.01, "ok": True, "config": {"block_m": 16},
                            "call_s": 2.25})
    writer.set_timing({"method": "cuda-graph", "routings": 8, "notes": []})
    for m in (1, 2, 4):
        writer.add_result(row(m))
    writer.complete()

    loaded = schema.load_results(path)
    assert loaded["schema"] == "moe_bench.results"
    assert loaded["schema_version"] == schema.SCHEMA_VERSION
    assert loaded["status"] == "complete"
    assert loaded["finished_at"].endswith("Z")
    assert loaded["environment"] == ENVIRONMENT
    assert loaded["config"] == dict(CONFIG, tp_ranks=None)  # given for one device: None
    assert loaded["ceilings"]["source"] == "measured"
    assert loaded["correctness"][0]["ok"] is True
    assert [r["m"] for r in loaded["results"]] == [1, 2, 4]
    assert loaded["results"][2] == row(4)
    assert loaded["compile_seconds"] == pytest.approx(2.25 + 1.5)  # check's first call + each M's
    assert loaded["completed_m"] == [1, 2, 4]
    assert loaded["total_m"] == 3
    assert loaded["timing"]["method"] == "cuda-graph"


def test_csv_beside_the_json_carries_the_rows(tmp_path):
    path = tmp_path / "run" / "results.json"
    writer = schema.ResultsWriter(path, ENVIRONMENT, CONFIG)
    writer.add_result(row(1))
    writer.add_result(row(2))
    with open(tmp_path / "run" / "results.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == list(schema.RESULT_FIELDS)
    assert [int(r["m"]) for r in rows] == [1, 2]
    assert float(rows[1]["us"]) == 200.0


def test_every_write_is_complete_on_disk_and_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "results.json"
    writer = schema.ResultsWriter(path, ENVIRONMENT, CONFIG)
    for m in (1, 2):
        writer.add_result(row(m))
        # A reader at any moment between writes sees a whole document with the finished M.
        assert schema.load_results(path)["completed_m"] == list(range(1, m + 1))
        assert schema.load_results(path)["status"] == "running"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv", "results.json"]


def test_a_run_killed_between_two_writes_has_csv_rows_for_every_m_the_json_completed(tmp_path, monkeypatch):
    """A kill (the async time limit's SIGKILL) can land between the CSV's write and the
    JSON's: the JSON, the document of record, is written last, so the CSV never holds fewer
    M than the JSON says completed (test_run's killed run saw that race once)."""
    path = tmp_path / "results.json"
    writer = schema.ResultsWriter(path, ENVIRONMENT, CONFIG)
    writer.add_result(row(1))
    writer.add_result(row(2))
    written = []

    def killed_after_first(target, text):
        if written:
            raise KeyboardInterrupt("killed")
        written.append(target)
        real(target, text)

    real = schema.atomic_write_text
    monkeypatch.setattr(schema, "atomic_write_text", killed_after_first)
    with pytest.raises(KeyboardInterrupt):
        writer.add_result(row(4))
    monkeypatch.undo()
    completed = schema.load_results(path)["completed_m"]
    with open(tmp_path / "results.csv", newline="") as fh:
        csv_ms = [int(r["m"]) for r in csv.DictReader(fh)]
    assert set(completed) <= set(csv_ms), (completed, csv_ms)
    assert completed == [1, 2] and csv_ms == [1, 2, 4]


def test_a_failed_run_records_the_error(tmp_path):
    path = tmp_path / "results.json"
    writer = schema.ResultsWriter(path, ENVIRONMENT, CONFIG)
    writer.add_result(row(1))
    writer.fail("runtime", "CUDA out of memory at M=1024", 5)
    loaded = schema.load_results(path)
    assert loaded["status"] == "failed"
    assert loaded["error"] == {"kind": "runtime", "message": "CUDA out of memory at M=1024", "exit_code": 5}
    assert loaded["completed_m"] == [1]


def test_writer_rejects_incomplete_rows_and_unknown_error_kinds(tmp_path):
    writer = schema.ResultsWriter(tmp_path / "r.json", ENVIRONMENT, CONFIG)
    with pytest.raises(ValueError, match="lacks"):
        writer.add_result({"m": 1, "us": 3.0})
    with pytest.raises(ValueError, match="unknown error kind"):
        writer.fail("gremlins", "?", 9)


def test_loader_rejects_what_is_not_a_results_document(tmp_path):
    not_json = tmp_path / "broken.json"
    not_json.write_text('{"schema": "moe_bench.results", "schema_ver')
    with pytest.raises(schema.ResultsFormatError, match="not valid JSON"):
        schema.load_results(not_json)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "something.else", "schema_version": 1}))
    with pytest.raises(schema.ResultsFormatError, match="not a moe_bench.results document"):
        schema.load_results(other)
    newer = tmp_path / "newer.json"
    document = schema.new_document(ENVIRONMENT, CONFIG)
    document["schema_version"] = schema.SCHEMA_VERSION + 1
    newer.write_text(json.dumps(document))
    with pytest.raises(schema.ResultsFormatError, match="newer than this loader"):
        schema.load_results(newer)
    bad_row = tmp_path / "bad_row.json"
    document = schema.new_document(ENVIRONMENT, CONFIG)
    document["results"] = [{"m": 1}]
    bad_row.write_text(json.dumps(document))
    with pytest.raises(schema.ResultsFormatError, match="m=1"):
        schema.load_results(bad_row)


def test_loader_upgrades_older_versions_through_the_chain(tmp_path, monkeypatch):
    """A version bump registers one upgrade step; files written by the old payload still load."""
    old = tmp_path / "v1.json"
    writer = schema.ResultsWriter(old, ENVIRONMENT, CONFIG)
    writer.add_result(row(2))

    def to_next_version(document):
        for r in document["results"]:
            r["ns_per_token"] = r["us_per_token"] * 1000
        return document

    current = schema.SCHEMA_VERSION
    monkeypatch.setattr(schema, "SCHEMA_VERSION", current + 1)
    monkeypatch.setitem(schema._UPGRADES, current, to_next_version)
    loaded = schema.load_results(old)
    assert loaded["schema_version"] == current + 1
    assert loaded["results"][0]["ns_per_token"] == 100_000.0


def test_loader_runs_without_torch(tmp_path):
    """The controller (report, set_stats) loads results with a Python that has no torch."""
    path = tmp_path / "results.json"
    schema.ResultsWriter(path, ENVIRONMENT, CONFIG).add_result(row(1))
    files_dir = os.path.dirname(os.path.dirname(schema.__file__))
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from moe_bench.schema import load_results\n"
        f"print(load_results({str(path)!r})['completed_m'])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=files_dir), timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[1]"


REAL_V1 = os.path.join(os.path.dirname(__file__), "..", "fixtures", "h200", "h200_kimi-k2.6_triton.json")


def test_a_version_1_file_of_a_real_run_loads_in_the_current_layout():
    with open(REAL_V1, encoding="utf-8") as handle:
        raw = json.load(handle)
    assert raw["schema_version"] == 1 and "tp" not in raw and "tp_ranks" not in raw["config"]
    loaded = schema.load_results(REAL_V1)
    assert loaded["schema_version"] == schema.SCHEMA_VERSION == 4
    assert loaded["tp"] is None and loaded["tp_results"] == [] and loaded["config"]["tp_ranks"] is None
    assert loaded["phases"] is None
    assert loaded["rehearsal"] is None and loaded["gpu_at_start"] is None  # version 4 fields, absent in older files
    assert all(c["worst_row_rel_err"] is None and c["worst_row"] is None for c in loaded["correctness"])
    assert [r["m"] for r in loaded["results"]] == [r["m"] for r in raw["results"]]
    assert loaded["results"][0] == raw["results"][0]


def tp_row(m: int) -> dict:
    return {"m": m, "ranks": 4, "layer_us": 30.0 * m, "layer_us_p20": 29.0 * m, "layer_us_p80": 31.0 * m,
            "moe_us": 20.0 * m, "moe_us_p20": 19.0 * m, "moe_us_p80": 21.0 * m, "allreduce_us": 10.0,
            "allreduce_us_p20": 9.0, "allreduce_us_p80": 11.0, "allreduce_bytes": 14336 * m,
            "algbw_gbps": 1.4336 * m, "busbw_gbps": 2.1504 * m, "moe_us_by_rank": [20.0 * m, 19.5 * m, 19.0 * m, 18.0 * m],
            "allreduce_us_by_rank": [10.0, 9.9, 9.8, 9.7], "samples": 100}


def test_a_tensor_parallel_run_round_trips_with_its_phase_csv(tmp_path):
    path = tmp_path / "results-tp.json"
    writer = schema.ResultsWriter(path, ENVIRONMENT, dict(CONFIG, tp=4, tp_ranks=4))
    assert not schema.phases_csv_path_for(path).exists()  # one-device runs write no phase CSV
    writer.set_tp({"ranks": 4, "collective": "nccl", "devices": ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]})
    for m in (1, 2):
        writer.add_result(row(m))
        writer.add_tp_result(tp_row(m))
    writer.complete()
    loaded = schema.load_results(path)
    assert loaded["config"]["tp_ranks"] == 4 and loaded["tp"]["collective"] == "nccl"
    assert loaded["tp_results"] == [tp_row(1), tp_row(2)]
    phases = schema.phases_csv_path_for(path)
    assert phases.name == "results-tp-phases.csv"
    with open(phases, newline="") as handle:
        table = list(csv.DictReader(handle))
    assert list(table[0]) == list(schema.TP_RESULT_FIELDS)
    assert table[1]["moe_us_by_rank"] == "40.0;39.0;38.0;36.0" and float(table[1]["busbw_gbps"]) == 4.3008
    with pytest.raises(ValueError, match="lacks"):
        writer.add_tp_result({"m": 4})
    document = json.loads(path.read_text())
    document["tp_results"][0].pop("busbw_gbps")
    path.write_text(json.dumps(document))
    with pytest.raises(schema.ResultsFormatError, match="tensor-parallel result row for m=1 lacks"):
        schema.load_results(path)
