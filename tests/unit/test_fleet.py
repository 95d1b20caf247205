"""The fleet rollout's logic without a host: serial, the pools' minimum, the rollout gate, the
per-payload budget of several GPUs, the per-GPU outlier rule and the fleet report on result files."""

from __future__ import annotations

import json

import pytest
from ansible.errors import AnsibleFilterError

from moe_bench_testlib import load_source
from report_fixtures import load_fixture_document, slowed, write_run

from moe_bench_report import gpus as gpus_module
from moe_bench_report.build import build_report, schema_module
from moe_bench_report.fleet import build_fleet

filters = load_source("moe_bench_filters", "plugins/filter/moe_bench.py")
fleet_filters = load_source("moe_bench_fleet_filters", "plugins/filter/moe_bench_fleet.py")

SETTINGS = {
    "bench_budget_s": 600, "async_margin_s": 120, "poll_interval_s": 10, "stop_timeout_s": 90,
    "load_budget_s": 900, "health_poll_s": 15, "vram_wait_s": 120, "vram_interval_s": 5,
    "deadman_margin_s": 600, "lock_ttl_margin_s": 300,
}


@pytest.mark.parametrize("given, typed", [
    (1, 1), ("3", 3), ("25%", "25%"), ("100 %", "100%"), ([1, "50%"], [1, "50%"]), ("1,2,50%", [1, 2, "50%"]),
])
def test_serial_accepts_what_ansible_takes(given, typed):
    assert filters.moe_bench_serial(given) == typed


@pytest.mark.parametrize("given", [0, "0", "0%", "150%", -1, "two", True, [], [1, 0], "1.5"])
def test_serial_refuses_zero_and_nonsense(given):
    with pytest.raises(AnsibleFilterError, match="moe_bench_serial"):
        filters.moe_bench_serial(given)
    assert "moe_bench_serial" in filters.moe_bench_check(given, "serial")


def test_gpus_one_after_the_other_take_one_budget_each_in_the_deadline():
    together = filters.moe_bench_plan(dict(SETTINGS, gpu_runs=1), 0)
    in_turn = filters.moe_bench_plan(dict(SETTINGS, gpu_runs=4), 0)
    assert together["async_limit_s"] == 600 + 120
    assert in_turn["async_limit_s"] == 4 * 600 + 120
    assert in_turn["bench_total_s"] == 2400
    grown = in_turn["async_limit_s"] - together["async_limit_s"]
    assert in_turn["planned_downtime_s"] - together["planned_downtime_s"] == grown
    assert in_turn["deadman_delay_s"] - together["deadman_delay_s"] == grown
    assert in_turn["poll_retries"] * 10 >= in_turn["async_limit_s"]


def test_pool_minimum_larger_than_the_pool_is_refused():
    hosts = [{"host": "a", "pool": "k26", "min_healthy": 2}, {"host": "b", "pool": "k26", "min_healthy": 2},
             {"host": "c", "pool": "", "min_healthy": 9}]
    problems = fleet_filters.moe_bench_pool_problems(hosts)
    assert len(problems) == 1 and "pool k26" in problems[0] and "2 host(s)" in problems[0] and "at most 1" in problems[0]
    assert fleet_filters.moe_bench_pool_problems([dict(h, min_healthy=1) for h in hosts[:2]]) == []
    mixed = fleet_filters.moe_bench_pool_problems([hosts[0], dict(hosts[1], min_healthy=1)])
    assert "different moe_bench_pool_min_healthy" in mixed[0]


@pytest.mark.parametrize("outcomes, total, percentage, go", [
    ([], 3, 0, True), (["ok", "skipped"], 3, 0, True), (["ok", "down"], 3, 0, False), (["failed"], 3, 0, False),
    (["failed"], 4, 25, True), (["failed", "down"], 4, 25, False), ([""], 3, 0, False), (["ok"], 1, 100, True),
    # test_fleet's rollout: 5 hosts, 25% -> one may fail; a regression-failed host, two skipped, then a DOWN one
    (["failed", "skipped", "skipped"], 5, 25, True), (["failed", "skipped", "skipped", "down"], 5, 25, False),
    (["not started", "unreachable", "refused"], 3, 0, True),
])
def test_rollout_gate(outcomes, total, percentage, go):
    gate = fleet_filters.moe_bench_rollout_gate(outcomes, total, percentage)
    assert gate["go"] is go
    assert (gate["why"] == "") is go
    if not go:
        assert "moe_bench_max_fail_percentage" in gate["why"]


def test_fleet_table_one_line_per_host():
    lines = fleet_filters.moe_bench_fleet_table([{"host": "ct200.example", "state": "ok", "why": ""},
                                                 {"host": "ct201.example", "state": "refused", "why": "GPU 5\n missing"}])
    assert len(lines) == 3 and lines[2].split()[:2] == ["ct201.example", "refused"] and lines[2].endswith("GPU 5 missing")


def test_outlier_rule_on_result_files(tmp_path):
    """Four GPUs of one host, one 15% slower at M=8 and one 5% slower everywhere: only the first is flagged."""
    base = load_fixture_document()
    documents = {0: base, 1: base, 2: slowed(base, 8, 1.15), 3: base}
    for m in [row["m"] for row in base["results"]]:
        documents[3] = slowed(documents[3], m, 1.05)
    paths = []
    for gpu, document in documents.items():
        path = tmp_path / ("results.json" if gpu == 0 else "gpu%d/results.json" % gpu)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(document))
        paths.append(("GPU %d" % gpu, path))
    section = gpus_module.gpu_section(gpus_module.load_documents(paths, schema_module().load_results), 0.10)
    assert [(item["label"], item["m"]) for item in section["outliers"]] == [("GPU 2", 8)]
    assert section["outliers"][0]["over"] == pytest.approx(1.15 / 1.025 - 1, rel=1e-6)
    assert section["outlier_labels"] == ["GPU 2"]
    assert "GPU 2" in gpus_module.markdown(section) and " !" in gpus_module.markdown(section)
    # A tighter threshold also flags the GPU that is 5% slower everywhere.
    tighter = gpus_module.gpu_section(gpus_module.load_documents(paths, schema_module().load_results), 0.02)
    assert "GPU 3" in tighter["outlier_labels"]


def test_a_missing_gpu_file_is_reported_not_fatal(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(load_fixture_document()))
    loaded = gpus_module.load_documents([("GPU 0", tmp_path / "results.json"), ("GPU 1", tmp_path / "gpu1/results.json")],
                                        schema_module().load_results)
    section = gpus_module.gpu_section(loaded)
    assert section["gpus"][1]["status"] == "no results file" and section["outliers"] == []


def _two_gpu_run(root, host, run_id, second):
    run_dir = write_run(root, host, run_id, load_fixture_document())
    (run_dir / "gpu1").mkdir()
    (run_dir / "gpu1" / "results.json").write_text(json.dumps(second))
    plan = {"run_id": run_id, "gpus": [0, 1],
            "payload_runs": [{"gpu": 0, "results": "results.json"}, {"gpu": 1, "results": "gpu1/results.json"}]}
    (run_dir / "timeline.json").write_text(json.dumps({"moe_bench_plan": plan}))
    return run_dir, plan


def test_host_report_has_the_per_gpu_table_and_plot(tmp_path):
    run_dir, plan = _two_gpu_run(tmp_path, "ct200.example", "20261201T120000Z-aaaaaa", load_fixture_document())
    summary = build_report(run_dir, "ct200.example", {"moe_bench_plan": plan}, plots=True)
    assert [gpu["label"] for gpu in summary["gpus"]["gpus"]] == ["GPU 0", "GPU 1"]
    assert summary["headline"]["gpus"] == 2 and summary["headline"]["gpu_outliers"] == []
    assert "## Every GPU of the host" in (run_dir / "summary.md").read_text()
    assert (run_dir / "per_gpu.png").stat().st_size > 10000


def test_fleet_report_flags_the_slow_gpu_across_hosts(tmp_path):
    base = load_fixture_document()
    first, _ = _two_gpu_run(tmp_path, "ct200.example", "20261201T120000Z-aaaaaa", base)
    second, _ = _two_gpu_run(tmp_path, "ct201.example", "20261201T121000Z-bbbbbb", slowed(base, 64, 1.3))
    for run_dir, host in ((first, "ct200.example"), (second, "ct201.example")):
        build_report(run_dir, host, json.loads((run_dir / "timeline.json").read_text()), plots=False)
    hosts = [{"host": "ct200.example", "outcome": "ok", "run_dir": str(first)},
             {"host": "ct201.example", "outcome": "ok", "run_dir": str(second)},
             {"host": "ct202.example", "outcome": "down", "why": "did NOT come back", "run_dir": None},
             {"host": "ct203.example", "outcome": "not started", "why": "the rollout stopped"}]
    fleet = build_fleet(tmp_path / "fleet" / "f1", hosts, schema_module().load_results, 0.10, plots=True, fleet_id="f1")
    assert [(item["label"], item["m"]) for item in fleet["outliers"]] == [("ct201.example GPU 1", 64)]
    assert fleet["counts"] == {"ok": 2, "down": 1, "not started": 1}
    assert [row["gpus"] for row in fleet["hosts"]] == [2, 2, 0, 0]
    text = (tmp_path / "fleet" / "f1" / "fleet.md").read_text()
    assert "ct203.example | not started" in text and "[summary](../../ct200.example/" in text
    assert (tmp_path / "fleet" / "f1" / "fleet_per_token.png").stat().st_size > 10000
    assert json.loads((tmp_path / "fleet" / "f1" / "fleet.json").read_text())["schema"] == "moe_bench_report.fleet"
