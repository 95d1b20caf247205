"""bench_job: status files in every state the async wrapper leaves them, the payload's log and
results files, and a real async job polled by ansible-playbook with the progress callback."""

from __future__ import annotations

import json
import re
import sys

import pytest

from moe_bench_testlib import load_source, run_module_main, run_playbook, write_executable

bench_job = load_source("bench_job", "library/bench_job.py")

JID = "j123456789.4242"


@pytest.fixture
def job(tmp_path):
    (tmp_path / "async").mkdir()
    return {"async_dir": str(tmp_path / "async"), "jid": JID,
            "log": str(tmp_path / "bench.log"), "results": str(tmp_path / "results.json"),
            "status_path": tmp_path / "async" / JID, "log_path": tmp_path / "bench.log",
            "results_path": tmp_path / "results.json"}


def poll(job, **extra):
    args = {key: job[key] for key in ("async_dir", "jid", "log", "results")}
    args.update(extra)
    return run_module_main(bench_job, args)


def results_document(done, m_list=(1, 2, 4), status="running"):
    return {"schema": "moe_bench.results", "schema_version": 1, "status": status,
            "config": {"m_list": list(m_list)},
            "results": [{"m": m, "us": 10.0 * m} for m in list(m_list)[:done]]}


def test_missing_job_file_is_finished_and_failed(job):
    result = poll(job)
    assert result["job_missing"] is True and result["finished"] is True and result["started"] is False
    assert result["job_failed"] is True and result["exit_code"] is None
    assert result["progress"].startswith("job status file missing")
    assert not result.get("failed")


@pytest.mark.parametrize("content", ["", '{"started": 1, "fini', "[1, 2]"])
def test_empty_or_partial_status_file_means_running(job, content):
    job["status_path"].write_text(content)
    result = poll(job)
    assert result["finished"] is False and result["started"] is True and result["job_missing"] is False
    assert result["job_failed"] is False and result["exit_code"] is None


def test_started_record_with_progress(job):
    job["status_path"].write_text(json.dumps({"started": True, "finished": False, "ansible_job_id": JID}))
    job["log_path"].write_text(
        "[moe_bench] building weights ...\nsome warning from torch\n"
        "[moe_bench] M=1 (1/3) 46.1 us 46.1 us/token 100.0% of floor elapsed 3.2 s\n"
        "[moe_bench] M=2 (2/3) 91.2 us 45.6 us/token 99.9% of floor elapsed 4.0 s\n"
        "unrelated trailing line\n")
    job["results_path"].write_text(json.dumps(results_document(2)))
    result = poll(job)
    assert result["finished"] is False and result["started"] is True
    expected = "[moe_bench] M=2 (2/3) 91.2 us 45.6 us/token 99.9% of floor elapsed 4.0 s [2/3 M done]"
    assert result["progress"] == expected and result["moe_bench_progress"] == expected
    assert (result["completed_m"], result["total_m"], result["results_status"]) == (2, 3, "running")
    assert result["log_tail"] == ""


def test_running_without_log_yet(job):
    job["status_path"].write_text(json.dumps({"started": 1, "finished": 0, "ansible_job_id": JID}))
    result = poll(job)
    assert result["progress"] == "running, no progress line yet in %s" % job["log"]
    assert result["completed_m"] is None and result["total_m"] is None


def test_finished_successfully(job):
    # The async wrapper's final record is the command module's result: no "started" key.
    job["status_path"].write_text(json.dumps({"changed": True, "rc": 0, "cmd": ["python3", "-m", "moe_bench"],
                                              "stdout": "", "stderr": "", "ansible_job_id": JID}))
    job["log_path"].write_text("[moe_bench] M=4 (3/3) 178.7 us\n[moe_bench] done: 3 results in results.json\n")
    job["results_path"].write_text(json.dumps(results_document(3, status="complete")))
    result = poll(job)
    assert result["finished"] is True and result["exit_code"] == 0 and result["job_failed"] is False
    assert result["progress"] == "finished, exited 0 [3/3 M done]: [moe_bench] done: 3 results in results.json"
    assert result["results_status"] == "complete"
    assert result["log_tail"] == ""


def test_finished_with_error_returns_log_tail(job):
    job["status_path"].write_text(json.dumps({"failed": True, "msg": "non-zero return code", "rc": 5,
                                              "stdout": "", "stderr": "", "ansible_job_id": JID}))
    lines = ["[moe_bench] M=%d" % m for m in range(40)] + ["RuntimeError: CUDA error: out of memory"]
    job["log_path"].write_text("\n".join(lines) + "\n")
    job["results_path"].write_text(json.dumps(results_document(1, status="failed")))
    result = poll(job, tail_lines=5)
    assert result["finished"] is True and result["exit_code"] == 5 and result["job_failed"] is True
    assert result["log_tail"].splitlines() == lines[-5:]
    assert result["progress"] == "finished, exited 5 [1/3 M done]: [moe_bench] M=39"
    assert not result.get("failed")  # the caller decides


def test_killed_at_time_limit(job):
    job["status_path"].write_text(json.dumps({"msg": "Timeout exceeded", "failed": True, "child_pid": 77}))
    job["log_path"].write_text("[moe_bench] M=2048 (12/12) running\n")
    result = poll(job)
    assert result["finished"] is True and result["timed_out"] is True and result["job_failed"] is True
    assert result["exit_code"] is None and result["job_msg"] == "Timeout exceeded"
    assert result["progress"] == "finished, killed at its async time limit: [moe_bench] M=2048 (12/12) running"
    assert result["log_tail"] == "[moe_bench] M=2048 (12/12) running"


def test_failed_job_without_log_uses_captured_output(job):
    job["status_path"].write_text(json.dumps({"failed": True, "rc": 2, "stdout": "",
                                              "stderr": "usage: moe_bench\nerror: bad --m-list"}))
    result = poll(job, log=None)
    assert result["log_tail"] == "usage: moe_bench\nerror: bad --m-list"


def test_partial_or_odd_results_file_is_tolerated(job):
    job["status_path"].write_text(json.dumps({"started": 1, "finished": 0}))
    job["results_path"].write_text('{"schema": "moe_bench.results", "results": [{"m": 1}')
    assert poll(job)["completed_m"] is None
    job["results_path"].write_text(json.dumps({"results": [{"m": 1}], "config": "?"}))
    result = poll(job)
    assert (result["completed_m"], result["total_m"]) == (1, None)
    job["results_path"].write_text("[]")
    assert poll(job)["completed_m"] is None


def test_long_log_reads_only_the_end(job):
    job["status_path"].write_text(json.dumps({"started": 1, "finished": 0}))
    filler = ("x" * 1000 + "\n") * 600  # about 600 KB
    job["log_path"].write_text("[moe_bench] M=1 early\n" + filler + "[moe_bench] M=512 (10/12) late\r\n" + "tail\n")
    assert poll(job)["progress"] == "[moe_bench] M=512 (10/12) late"


def test_jid_must_not_be_a_path(job):
    result = poll(job, jid="../etc/passwd")
    assert result["failed"] is True and "jid must be a job id" in result["msg"]


def test_check_mode_reads(job):
    job["status_path"].write_text(json.dumps({"rc": 0}))
    result = poll(job, _ansible_check_mode=True)
    assert result["finished"] is True and result["exit_code"] == 0


def test_the_first_look_keeps_the_job_record_and_never_replaces_it(job, tmp_path):
    record_file = tmp_path / "job.json"
    job["status_path"].write_text(json.dumps({"started": True, "finished": False, "ansible_job_id": JID}))
    first = poll(job, record_file=str(record_file), record={"jid": JID, "limit_s": 60})
    assert first["record_written"] is True and first["finished"] is False
    assert json.loads(record_file.read_text()) == {"jid": JID, "limit_s": 60}
    assert record_file.stat().st_mode & 0o777 == 0o600
    # A later look (or a re-attached run) leaves the first record as it is.
    second = poll(job, record_file=str(record_file), record={"jid": "j-other"})
    assert second["record_written"] is False and json.loads(record_file.read_text())["jid"] == JID
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("job.json.tmp")) == []


def test_the_job_record_needs_its_content_and_is_not_written_in_check_mode(job, tmp_path):
    record_file = tmp_path / "job.json"
    job["status_path"].write_text(json.dumps({"rc": 0}))
    assert "record" in poll(job, record_file=str(record_file))["msg"]
    result = poll(job, record_file=str(record_file), record={"jid": JID}, _ansible_check_mode=True)
    assert result["record_written"] is False and not record_file.exists()


def test_a_record_that_cannot_be_written_fails_with_its_path(job, tmp_path):
    result = poll(job, record_file=str(tmp_path / "missing-folder" / "job.json"), record={"jid": JID})
    assert result["failed"] is True and "could not write the job record" in result["msg"]
    assert "missing-folder/job.json" in result["msg"]


FAKE_PAYLOAD = r'''#!{python}
"""Stands in for the benchmark payload: progress lines and an incrementally written results file."""
import json, os, sys, time
log_path, results_path, steps, exit_code, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
m_list = [2 ** i for i in range(steps)]
document = {"schema": "moe_bench.results", "status": "running", "config": {"m_list": m_list}, "results": []}
with open(log_path, "a") as log:
    log.write("[moe_bench] building weights ...\n"); log.flush()
    for position, m in enumerate(m_list, 1):
        time.sleep(pause)
        document["results"].append({"m": m})
        with open(results_path + ".tmp", "w") as out:
            json.dump(document, out)
        os.replace(results_path + ".tmp", results_path)
        log.write("[moe_bench] M=%d (%d/%d) elapsed %.1f s\n" % (m, position, len(m_list), position * pause)); log.flush()
    if exit_code:
        log.write("RuntimeError: CUDA error: an illegal memory access was encountered\n")
sys.exit(exit_code)
'''

PLAYBOOK = """
- name: Launch a benchmark job and poll it the way bench_run_async does
  hosts: localhost
  gather_facts: false
  vars:
    ansible_async_dir: "{{ work }}/async"
    plan: "{{ {'bench_budget_s': 60, 'async_margin_s': 10, 'poll_interval_s': 1, 'stop_timeout_s': 5,
               'load_budget_s': 5, 'health_poll_s': 1, 'vram_wait_s': 2, 'vram_interval_s': 1,
               'deadman_margin_s': 5, 'lock_ttl_margin_s': 5} | moe_bench_plan }}"
  tasks:
    - name: Launch a benchmark that fails
      ansible.builtin.command:
        argv: ["{{ payload }}", "{{ work }}/bad.log", "{{ work }}/bad.json", "2", "5", "0.1"]
      async: "{{ plan.async_limit_s }}"
      poll: 0
      register: bad_launch
      changed_when: true

    - name: Launch a benchmark that outlives its time limit
      ansible.builtin.command:
        argv: ["{{ payload }}", "{{ work }}/slow.log", "{{ work }}/slow.json", "3", "0", "20"]
      async: 2
      poll: 0
      register: slow_launch
      changed_when: true

    - name: Launch the benchmark
      ansible.builtin.command:
        argv: ["{{ payload }}", "{{ work }}/ok.log", "{{ work }}/ok.json", "4", "0", "2"]
      async: "{{ plan.async_limit_s }}"
      poll: 0
      register: ok_launch
      changed_when: true

    - name: Wait for the benchmark
      bench_job:
        jid: "{{ ok_launch.ansible_job_id }}"
        async_dir: "{{ ansible_async_dir }}"
        log: "{{ work }}/ok.log"
        results: "{{ work }}/ok.json"
      register: ok_job
      until: ok_job is finished
      retries: "{{ plan.poll_retries }}"
      delay: "{{ plan.poll_interval_s }}"

    - name: Wait for the failing benchmark
      bench_job:
        jid: "{{ bad_launch.ansible_job_id }}"
        async_dir: "{{ ansible_async_dir }}"
        log: "{{ work }}/bad.log"
        results: "{{ work }}/bad.json"
      register: bad_job
      until: bad_job is finished
      retries: 30
      delay: 1

    - name: Wait for the benchmark that is killed
      bench_job:
        jid: "{{ slow_launch.ansible_job_id }}"
        async_dir: "{{ ansible_async_dir }}"
        log: "{{ work }}/slow.log"
      register: slow_job
      until: slow_job is finished
      retries: 30
      delay: 1

    - name: Look for a job that does not exist
      bench_job:
        jid: "999999999999.1"
        async_dir: "{{ ansible_async_dir }}"
      register: missing_job

    - name: Save the results for the test
      ansible.builtin.copy:
        content: "{{ {'ok': ok_job, 'bad': bad_job, 'slow': slow_job, 'missing': missing_job, 'plan': plan} | to_json }}"
        dest: "{{ work }}/out.json"
        mode: "0644"
"""


def test_real_async_job_polled_with_progress_callback(tmp_path):
    payload = write_executable(tmp_path / "fake-payload", FAKE_PAYLOAD.replace("{python}", sys.executable))
    completed = run_playbook(tmp_path, PLAYBOOK, extra=["-v", "-e", json.dumps({"work": str(tmp_path), "payload": str(payload)})])
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-5000:]
    results = json.loads((tmp_path / "out.json").read_text())

    ok = results["ok"]
    assert ok["finished"] is True and ok["exit_code"] == 0 and ok["job_failed"] is False
    assert (ok["completed_m"], ok["total_m"]) == (4, 4)
    assert ok["attempts"] >= 2  # it really polled a running job
    assert ok["progress"] == "finished, exited 0 [4/4 M done]: [moe_bench] M=8 (4/4) elapsed 8.0 s"
    # The callback printed the payload's own progress line on retries, beside the default output.
    progress_lines = re.findall(r"^\[localhost\] Wait for the benchmark: (.*)$", output, re.MULTILINE)
    assert progress_lines, output[-3000:]
    assert any(re.match(r"\[moe_bench\] M=\d+ \(\d/4\) elapsed [\d.]+ s \[\d/4 M done\] \(attempt \d+/\d+\)$", line)
               for line in progress_lines), progress_lines
    assert "FAILED - RETRYING: [localhost]: Wait for the benchmark" in output  # default callback intact

    bad = results["bad"]
    assert bad["finished"] is True and bad["exit_code"] == 5 and bad["job_failed"] is True
    assert bad["log_tail"].splitlines()[-1] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert bad["completed_m"] == 2

    slow = results["slow"]
    assert slow["finished"] is True and slow["timed_out"] is True and slow["job_failed"] is True
    # On a loaded machine the kill may come before the first progress line: only the verdict is certain.
    assert slow["progress"].startswith("finished, killed at its async time limit")
    assert slow["exit_code"] is None and slow["job_msg"] == "Timeout exceeded"

    assert results["missing"]["job_missing"] is True and results["missing"]["finished"] is True
    assert results["plan"]["async_limit_s"] == 70 and results["plan"]["poll_retries"] == 77  # ceil((70 + 6) / 1) + 1


def test_long_poll_returns_as_soon_as_the_job_ends(job):
    """wait_s: the end of the job is noticed within a fraction of a second, not at the next poll."""
    import threading
    import time

    job["status_path"].write_text(json.dumps({"started": True, "finished": False, "ansible_job_id": JID}))
    job["log_path"].write_text("[moe_bench] M=1 (1/3) 46.1 us 46.1 us/token 100.0% of floor elapsed 3.2 s\n")

    def finish():
        time.sleep(0.6)
        job["status_path"].write_text(json.dumps({"rc": 0, "ansible_job_id": JID}))

    writer = threading.Thread(target=finish)
    started = time.monotonic()
    writer.start()
    result = poll(job, wait_s=20)
    elapsed = time.monotonic() - started
    writer.join()
    assert result["finished"] is True and result["exit_code"] == 0 and result["job_failed"] is False
    assert 0.5 <= elapsed < 3, elapsed
    assert 0.5 <= result["waited_s"] < 3


def test_long_poll_on_a_running_job_waits_its_interval_and_returns_the_progress(job):
    import time

    job["status_path"].write_text(json.dumps({"started": True, "finished": False, "ansible_job_id": JID}))
    job["log_path"].write_text("[moe_bench] M=1 (1/3) 46.1 us 46.1 us/token 100.0% of floor elapsed 3.2 s\n")
    started = time.monotonic()
    result = poll(job, wait_s=1.0, check_interval_s=0.1)
    elapsed = time.monotonic() - started
    assert result["finished"] is False and elapsed >= 1.0 and result["waited_s"] >= 1.0
    assert result["progress"].startswith("[moe_bench] M=1 (1/3)")


def test_long_poll_does_not_wait_on_a_missing_job(job):
    result = poll(job, wait_s=30)
    assert result["job_missing"] is True and result["finished"] is True and result["waited_s"] < 1


@pytest.mark.parametrize("option, value", [("wait_s", -1), ("check_interval_s", 0)])
def test_long_poll_refuses_bad_times(job, option, value):
    result = poll(job, **{option: value})
    assert result.get("failed") and option in result["msg"]
