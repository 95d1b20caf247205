"""The bench_report role in a real ansible-playbook run on the controller (local connection).

Two hosts report in parallel forks into one results folder: gpu-a's run is 15% slower at one
M than its previous run, gpu-b's has no earlier run. The play must print both summaries,
publish both hosts' headline figures through set_stats (what AWX shows as the job's
artifacts), list gpu-a as regressed and, with bench_report_fail_on_regression, fail gpu-a only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from report_fixtures import REPO, load_fixture_document, slowed, write_run

from moe_bench_report.build import build_report

PLAYBOOK = """\
- name: Report the benchmark runs
  hosts: gpu
  gather_facts: false
  tasks:
    - name: Set the facts the earlier roles leave on each host
      ansible.builtin.set_fact:
        bench_fetch_dir: "{{ results_root }}/{{ inventory_hostname }}/{{ run_id }}"
        service_stop_stopped_at: "2026-11-30T10:00:05Z"
        bench_run_async_started_at: "2026-11-30T10:00:30Z"
        bench_run_async_finished_at: "2026-11-30T10:04:30Z"
        service_recover_ready_at: "2026-11-30T10:10:05Z"
        service_recover_time_to_ready_s: 330.5
        moe_bench_plan:
          run_id: "{{ run_id }}"

    - name: Write the report
      ansible.builtin.include_role:
        name: bench_report
      vars:
        bench_report_plots: false
        bench_report_fail_on_regression: true
        bench_report_run_dir: "{{ bench_fetch_dir }}"
        bench_report_project_dir: "{{ project_dir }}"
        bench_report_timeline:
          service_stop_stopped_at: "{{ service_stop_stopped_at }}"
          bench_run_async_started_at: "{{ bench_run_async_started_at }}"
          bench_run_async_finished_at: "{{ bench_run_async_finished_at }}"
          service_recover_ready_at: "{{ service_recover_ready_at }}"
          service_recover_time_to_ready_s: "{{ service_recover_time_to_ready_s }}"
          moe_bench_plan: "{{ moe_bench_plan }}"
"""

RUN_ID = "20261130T100000Z-c0ffee"


def test_role_reports_each_host_and_publishes_headline_figures(tmp_path):
    results_root = tmp_path / "results"
    document = load_fixture_document()
    earlier = slowed(document, 64, 1.0, started_at="2026-11-29T10:00:00Z")
    build_report(write_run(results_root, "gpu-a", "20261129T100000Z-000001", earlier), "gpu-a", {}, plots=False, environ={})
    write_run(results_root, "gpu-a", RUN_ID, slowed(document, 64, 1.15, started_at="2026-11-30T10:00:40Z"))
    write_run(results_root, "gpu-b", RUN_ID, slowed(document, 64, 1.0, started_at="2026-11-30T10:00:40Z"))

    (tmp_path / "play.yml").write_text(PLAYBOOK)
    (tmp_path / "inventory.ini").write_text(
        "[gpu]\ngpu-a\ngpu-b\n\n[gpu:vars]\n"
        f"ansible_connection=local\nansible_python_interpreter={sys.executable}\n"
    )
    environment = {
        key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_") and key != "JOB_ID"
    }
    environment.update(
        ANSIBLE_ROLES_PATH=str(REPO / "roles"),
        ANSIBLE_STDOUT_CALLBACK="ansible.posix.json",
        ANSIBLE_SHOW_CUSTOM_STATS="true",
        ANSIBLE_LOCAL_TEMP=str(tmp_path / "ansible-tmp"),
        PATH=f"{Path(sys.executable).parent}:{environment.get('PATH', '/usr/bin:/bin')}",
    )
    completed = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            "-i", "inventory.ini", "play.yml",
            # A relative results folder, as an inventory may give it: the role resolves it.
            "-e", f"results_root=results run_id={RUN_ID} project_dir={REPO}",
            "-e", "awx_job_id=555 awx_job_launch_type=scheduled awx_schedule_name=nightly",
        ],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = json.loads(completed.stdout)
    # gpu-a fails on its regression (by request), gpu-b succeeds.
    assert completed.returncode == 2, completed.stderr
    assert output["stats"]["gpu-a"]["failures"] == 1
    assert output["stats"]["gpu-b"]["failures"] == 0

    stats = output["global_custom_stats"]
    assert sorted(stats["moe_bench_report"]) == ["gpu-a", "gpu-b"]
    assert stats["moe_bench_regressed_hosts"] == ["gpu-a"]
    gpu_a, gpu_b = stats["moe_bench_report"]["gpu-a"], stats["moe_bench_report"]["gpu-b"]
    assert gpu_a["regression"] is True and gpu_a["regression_at_m"] == [64]
    assert gpu_a["baseline_run_id"] == "20261129T100000Z-000001"
    assert gpu_b["regression"] is False and gpu_b["baseline_run_id"] is None
    for headline in (gpu_a, gpu_b):
        assert headline["run_id"] == RUN_ID
        assert headline["downtime_s"] == 600.0
        assert headline["knee_m"] is not None
        assert set(headline["us_per_m"]) == {str(row["m"]) for row in document["results"]}

    tasks = {task["task"]["name"]: task["hosts"] for play in output["plays"] for task in play["tasks"]}
    shown = next(hosts for name, hosts in tasks.items() if "Show the report" in name)
    assert any(line.startswith("REGRESSION:") for line in shown["gpu-a"]["msg"])
    assert any(line.startswith("Downtime: 10 min 00 s") for line in shown["gpu-b"]["msg"])
    stopped = next(hosts for name, hosts in tasks.items() if "Stop on the regression" in name)
    assert "slower than run 20261129T100000Z-000001" in stopped["gpu-a"]["msg"]
    assert "M=64" in stopped["gpu-a"]["msg"]

    for host in ("gpu-a", "gpu-b"):
        run_dir = results_root / host / RUN_ID
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["launch"]["by"] == "awx" and manifest["launch"]["job_id"] == "555"
        assert manifest["launch"]["scheduled"] is True and manifest["launch"]["schedule"] == "nightly"
        assert manifest["timeline"]["time_to_ready_s"] == 330.5
        assert manifest["plan"] == {"run_id": RUN_ID}
        assert (run_dir / "summary.md").is_file()
    top_index = (results_root / "index.md").read_text()
    assert "[gpu-a](gpu-a/index.md)" in top_index and "[gpu-b](gpu-b/index.md)" in top_index
    history_a = json.loads((results_root / "gpu-a" / "history.json").read_text())
    assert [entry["run_id"] for entry in history_a["runs"]] == ["20261129T100000Z-000001", RUN_ID]
