"""The moe_bench_progress callback's line format (its real run is in test_bench_job.py)."""

from __future__ import annotations

import json
import re

from moe_bench_testlib import load_source, run_playbook

callback = load_source("moe_bench_progress", "plugins/callback/moe_bench_progress.py")


def test_progress_line_with_attempts():
    line = callback.progress_line("gpu-1", "Wait for the benchmark", {
        "moe_bench_progress": "[moe_bench] M=256 (9/12) 2204.1 us\n", "attempts": 3, "retries": 73})
    assert line == "[gpu-1] Wait for the benchmark: [moe_bench] M=256 (9/12) 2204.1 us (attempt 2/73)"


def test_progress_line_without_attempts():
    assert callback.progress_line("h", "t", {"moe_bench_progress": "x"}) == "[h] t: x"


def test_no_line_without_progress():
    assert callback.progress_line("h", "t", {"attempts": 1, "retries": 3}) is None
    assert callback.progress_line("h", "t", {"moe_bench_progress": ""}) is None
    assert callback.progress_line("h", "t", {"censored": "the output has been hidden"}) is None
    assert callback.progress_line("h", "t", None) is None


def test_callback_declares_itself_as_opt_in_notification():
    module = callback.CallbackModule
    assert module.CALLBACK_NEEDS_ENABLED is True
    assert module.CALLBACK_TYPE == "notification"
    assert module.CALLBACK_NAME == "moe_bench_progress"


def test_machine_readable_stdout_callbacks():
    assert callback.stdout_is_machine_readable("ansible.builtin.json") is True
    assert callback.stdout_is_machine_readable("json") is True
    assert callback.stdout_is_machine_readable("ansible.posix.jsonl") is True
    assert callback.stdout_is_machine_readable("default") is False
    assert callback.stdout_is_machine_readable("community.general.yaml") is False
    assert callback.stdout_is_machine_readable(None) is False


RETRYING_PLAYBOOK = """
- name: Poll a job that never finishes
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Wait for the benchmark
      bench_job:
        jid: "j1.1"
        async_dir: "{{ work }}/async"
        log: "{{ work }}/bench.log"
      register: job
      until: job is finished
      retries: 2
      delay: 0
      ignore_errors: true
"""


def test_json_stdout_stays_parseable(tmp_path):
    (tmp_path / "async").mkdir()
    (tmp_path / "async" / "j1.1").write_text('{"started": 1, "finished": 0, "ansible_job_id": "j1.1"}')
    (tmp_path / "bench.log").write_text("[moe_bench] M=64 (7/12) 1638.0 us elapsed 42.0 s\n")
    env_override = {"ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.json"}
    completed = run_playbook(tmp_path, RETRYING_PLAYBOOK, extra=["-e", json.dumps({"work": str(tmp_path)})],
                             env_override=env_override)
    document = json.loads(completed.stdout)  # nothing but the JSON document on stdout
    result = document["plays"][0]["tasks"][0]["hosts"]["localhost"]
    assert result["finished"] is False and result["attempts"] == 2, completed.stderr
    assert re.findall(r"^\[localhost\] Wait for the benchmark: (.*)$", completed.stderr, re.MULTILINE) == [
        "[moe_bench] M=64 (7/12) 1638.0 us elapsed 42.0 s (attempt 1/3)",
        "[moe_bench] M=64 (7/12) 1638.0 us elapsed 42.0 s (attempt 2/3)",
    ]
