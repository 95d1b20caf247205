"""Rules for every test phase (unit, payload, integration).

Under CI=true a skipped test is a missing prerequisite (Docker's engine, the simulated host image,
a venv, ansible_runner, a package) and the suite must fail on it, never pass around it: every
skip, at collection or at run time, is reported as a failure there, with the skip's own reason.
Outside CI a skip stays a skip; scripts/test-summary counts and names it in the closing line.
A test that cannot run on this kind of machine at all (it needs a GPU) is not skipped but left
out by its marker (`-m "not gpu"`), which the phase's command states.
"""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
CI_SKIP_PREFIX = "skipped under CI=true, where a missing prerequisite fails the suite: "


def _as_ci_failure(report):
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = CI_SKIP_PREFIX + reason


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _as_ci_failure(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _as_ci_failure(outcome.get_result())
