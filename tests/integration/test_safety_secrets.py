"""The health check's bearer token never appears in output, host logs or fetched files."""

import shlex
import shutil
import subprocess
import tempfile
import uuid

from conftest import STATE_DIR


def test_health_token_is_used_but_never_shown_logged_or_written(simhost, run_playbook, results_dir):
    token = "tok-" + uuid.uuid4().hex
    simhost.set_switches(restart=True, FAKE_REQUIRE_TOKEN=token)
    simhost.wait_healthy(token=token)
    assert simhost.health_status() == 401
    since = simhost.epoch()
    run = run_playbook(simhost, {"moe_bench_health_token": token}, verbose=3)
    # The token worked: the service passed its authenticated health check.
    assert run.rc == 0, run.describe().replace(token, "<TOKEN>")
    assert simhost.unit_show()["ActiveState"] == "active"
    assert token not in run.stdout, "token printed on stdout"
    assert token not in run.stderr, "token printed on stderr"
    # The host: the whole journal since the run (module invocations are logged there), the state
    # folder, the payload folder and /var/log.
    journal = simhost.journal(unit=None, since_epoch=since)
    assert journal.strip(), "empty journal: the search would prove nothing"
    assert token not in journal, "token in the host's journal"
    found = simhost.exec("grep -rl -F %s %s /opt/moe-bench /var/log /root/.ansible 2>/dev/null || true"
                         % (token, STATE_DIR)).stdout.strip()
    assert found == "", "token written on the host: %s" % found
    # The controller: every fetched file and report.
    found_local = subprocess.run(["grep", "-rl", "-F", token, str(results_dir)], capture_output=True, text=True)
    assert found_local.stdout.strip() == "", "token in fetched files: %s" % found_local.stdout
    assert any(results_dir.rglob("results.json")), "nothing fetched: the search would prove nothing"


# --- Every secret, every output place (issue 14, item 6) -------------------------------------

import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402
import yaml  # noqa: E402

from conftest import REPO, VENV_BIN, merged_vars  # noqa: E402

ansible_runner = pytest.importorskip("ansible_runner")
RESULTS_HOST_DIR = "/srv/secret-test-results"


def vault_encrypt(text, password_file):
    """`ansible-vault encrypt_string` output for a value: what an operator puts in a vars file."""
    proc = subprocess.run([str(VENV_BIN / "ansible-vault"), "encrypt_string", "--vault-password-file",
                           str(password_file), text], capture_output=True, text=True, check=True)
    return proc.stdout


def plant_secrets(host, root):
    """A vaulted token and a vaulted header value (group_vars next to the inventory, as an operator
    keeps them), a plain header value, and the results host's private key. Returns
    (secrets by name, extra vars, environment)."""
    secrets = {name: "%s-%s" % (name, uuid.uuid4().hex) for name in ("token", "vaulted_key", "plain_header")}
    password_file = root / "vault-password"
    password_file.write_text("vault-pass-" + uuid.uuid4().hex + "\n")
    group_vars = host.inventory.parent / "group_vars"
    group_vars.mkdir(exist_ok=True)
    (group_vars / "moe_bench_hosts.yml").write_text(
        "---\nmoe_bench_health_token: " + vault_encrypt(secrets["token"], password_file).strip() + "\n"
        "vault_health_api_key: " + vault_encrypt(secrets["vaulted_key"], password_file).strip() + "\n")
    key_file = pathlib.Path(host.connection["ansible_ssh_private_key_file"])
    # the results host's key: every line of its body is a secret (the armour lines are not)
    key_lines = [line for line in key_file.read_text().splitlines() if line and not line.startswith("-----")]
    extra_vars = {
        "moe_bench_health_headers": {"X-Api-Key": "{{ vault_health_api_key }}", "X-Tenant-Secret": secrets["plain_header"]},
        # the results host: this same simulated host over SSH, with its own key file
        "moe_bench_results_push_dest": "root@127.0.0.1:%s" % RESULTS_HOST_DIR,
        "results_push_ssh_port": host.connection["ansible_port"],
        "results_push_ssh_private_key_file": str(key_file),
    }
    env = {"ANSIBLE_VAULT_PASSWORD_FILE": str(password_file)}
    host.set_switches(restart=True, FAKE_REQUIRE_TOKEN=secrets["token"])
    host.wait_healthy(token=secrets["token"])
    return secrets, key_lines, extra_vars, env


def find_secrets(text, secrets, key_lines):
    found = [name for name, value in secrets.items() if value in text]
    found += ["results host key"] if any(line in text for line in key_lines) else []
    return found


def assert_nowhere_on_the_hosts(host, since, secrets, key_lines):
    journal = host.journal(unit=None, since_epoch=since)
    assert "Invoked with" in journal, "no module invocation in the journal: the search would prove nothing"
    assert find_secrets(journal, secrets, key_lines) == [], "secret in the host's journal"
    for name, value in list(secrets.items()) + [("results host key", key_lines[1])]:
        found = host.exec("grep -rl -F -e %s %s /opt/moe-bench /var/log /root/.ansible %s 2>/dev/null || true"
                          % (shlex.quote(value), STATE_DIR, RESULTS_HOST_DIR)).stdout.strip()
        assert found == "", "%s written on the host: %s" % (name, found)
    assert host.exec("ls %s/*/*/results.json" % RESULTS_HOST_DIR, check=False).returncode == 0, \
        "nothing pushed: the push (and its key) was not exercised"


def assert_nowhere_in(folder, secrets, key_lines, what):
    files = [path for path in pathlib.Path(folder).rglob("*") if path.is_file()]
    assert files, "no %s: the search would prove nothing" % what
    leaks = {str(path): found for path in files
             for found in [find_secrets(path.read_text(errors="replace"), secrets, key_lines)] if found}
    assert leaks == {}, "secrets in %s: %s" % (what, leaks)


def test_no_secret_in_output_journal_state_results_or_report(simhost, run_playbook, results_dir, tmp_path,
                                                             monkeypatch):
    """ansible-playbook at the default verbosity, without the module invocation in results."""
    secrets, key_lines, extra_vars, env = plant_secrets(simhost, tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("ANSIBLE_INJECT_INVOCATION", raising=False)
    since = simhost.epoch()
    try:
        run = run_playbook(simhost, extra_vars)
    finally:
        (simhost.inventory.parent / "group_vars" / "moe_bench_hosts.yml").unlink()
    assert run.rc == 0, run.describe()
    assert find_secrets(run.output, secrets, key_lines) == [], "secret in the playbook output"
    assert simhost.health_status(token=secrets["token"]) == 200
    assert_nowhere_on_the_hosts(simhost, since, secrets, key_lines)
    assert any(results_dir.rglob("summary.md")), "no report: the search would prove nothing"
    assert_nowhere_in(results_dir, secrets, key_lines, "the results and the report")


def test_no_secret_in_ansible_runner_artifacts_at_high_verbosity_with_invocations(simhost, tmp_path, monkeypatch):
    """As AWX runs it: ansible-runner, -vvvv, ANSIBLE_INJECT_INVOCATION=true (every module's
    arguments in its result), vault password from the job's environment; every artifact searched."""
    secrets, key_lines, extra_vars, env = plant_secrets(simhost, tmp_path)
    pdd = tmp_path / "pdd"
    (pdd / "env").mkdir(parents=True)
    (pdd / "inventory").mkdir()
    results = tmp_path / "results"
    (pdd / "env" / "extravars").write_text(json.dumps(merged_vars(results, extra_vars)))
    short = pathlib.Path(tempfile.mkdtemp(prefix="awx-", dir="/tmp"))
    (pdd / "env" / "envvars").write_text(yaml.safe_dump(dict(
        env, ANSIBLE_INJECT_INVOCATION="true", HOME=str(short), ANSIBLE_SSH_CONTROL_PATH_DIR=str(short / "cp"),
        ANSIBLE_NOCOLOR="1")))
    (pdd / "inventory" / "hosts.yml").write_text(simhost.inventory.read_text())
    shutil.copytree(simhost.inventory.parent / "group_vars", pdd / "inventory" / "group_vars")
    (simhost.inventory.parent / "group_vars" / "moe_bench_hosts.yml").unlink()
    (pdd / "project").symlink_to(REPO, target_is_directory=True)
    monkeypatch.setenv("PATH", "%s%s%s" % (VENV_BIN, os.pathsep, os.environ.get("PATH", "")))
    since = simhost.epoch()
    try:
        runner = ansible_runner.run(private_data_dir=str(pdd), playbook="playbooks/moe_bench.yml",
                                    verbosity=4, quiet=True)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    stdout = runner.stdout.read()
    assert runner.status == "successful", find_secrets(stdout, secrets, key_lines) or stdout[-5000:]
    # the invocations really are in the results, so their secrets were masked, not missing
    assert '"invocation"' in stdout or "invocation:" in stdout, "no module invocation in the output"
    assert "X-Tenant-Secret" in stdout, "the header was not passed: the search would prove nothing"
    assert find_secrets(stdout, secrets, key_lines) == [], "secret in the job's output"
    assert_nowhere_in(pdd / "artifacts", secrets, key_lines, "the ansible-runner artifacts")
    assert_nowhere_on_the_hosts(simhost, since, secrets, key_lines)
    assert_nowhere_in(results, secrets, key_lines, "the results and the report")
