#!/usr/bin/python
# -*- coding: utf-8 -*-
"""Ansible module service_health: one readiness check of an inference unit (systemd state + HTTP)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: service_health
short_description: Check once whether an inference service is ready, still loading, or dead
description:
  - Reads the systemd state of O(unit) (C(systemctl show)) and, when O(url) is given, sends one HTTP
    GET to its health endpoint; optionally one small OpenAI-style completion request.
  - Makes exactly one check per call and never fails because the unit is down, so a task can loop
    with C(until) on RV(ready) or RV(dead) and stop within one poll interval when the unit
    dies during a long model load, instead of waiting for the whole budget.
  - The unit is RV(dead) when it is not found, in C(failed), cycling through
    C(activating/auto-restart), restarted more often than O(baseline_restarts), or inactive although
    O(expect_running) says it was started. A dead result carries the journal's tail.
  - The bearer O(token) is never returned; it is removed from every returned text.
version_added: "1.0.0"
author:
  - moe-bench-ops maintainers
options:
  unit:
    description: The systemd unit, for example C(sglang-k26-ddtree) or C(vllm-kimi-k25-int4.service).
    type: str
    required: true
  url:
    description:
      - Health endpoint, C(http://) or C(https://). When omitted, ready means the unit is active.
    type: str
  headers:
    description: Extra HTTP headers sent with the health and completion requests.
    type: dict
    default: {}
  token:
    description: "Bearer token sent as C(Authorization: Bearer <token>). Never logged nor returned."
    type: str
  expected_status:
    description: HTTP status codes that mean healthy.
    type: list
    elements: int
    default: [200]
  timeout:
    description: Seconds allowed for each HTTP request.
    type: float
    default: 5
  validate_certs:
    description: Verify TLS certificates of an C(https://) URL.
    type: bool
    default: true
  baseline_restarts:
    description:
      - The unit's C(NRestarts) before the start; a higher value means systemd restarted it (crash loop).
      - Not checked when omitted.
    type: int
  expect_running:
    description:
      - The unit was started and should be running, so C(inactive) means it exited, which is dead.
      - Set to V(false) to check a unit that may legitimately be stopped.
    type: bool
    default: true
  completion:
    description:
      - When given (and the health check passed), one C(POST) to an OpenAI-style completions endpoint
        with C(max_tokens) tokens; ready then also requires a C(200) answer with C(choices).
    type: dict
    suboptions:
      url:
        description: Completions URL. Default is C(/v1/completions) on the host of O(url).
        type: str
      model:
        description: Model name. Default is the first id listed by C(/v1/models) on the host of O(url).
        type: str
      prompt:
        description: Prompt text.
        type: str
        default: Hello
      max_tokens:
        description: Tokens to generate.
        type: int
        default: 1
  journal_lines:
    description: Lines of C(journalctl -u <unit>) returned when the unit is dead.
    type: int
    default: 30
  wait_s:
    description:
      - Long poll - keep checking about once a second for up to this many seconds and return as
        soon as the unit is ready or dead, so a task that loops with C(until) notices the change
        within a second instead of at its next poll. V(0) checks once.
    type: float
    default: 0
  settle_s:
    description:
      - Once ready, the unit must stay ready this many seconds (health answering, C(MainPID) and
        C(NRestarts) unchanged) before RV(ready) is returned; a unit that answers and then dies
        or is restarted within that time is RV(dead), the reason naming what changed.
      - Healthy for a moment is not back. V(0) returns at the first healthy answer.
    type: float
    default: 0
notes:
  - Requests go straight to the service, never through an HTTP proxy.
  - Supports check mode (it only reads).
"""

EXAMPLES = r"""
- name: Wait until the inference service is ready, stop early when it dies
  service_health:
    unit: sglang-k26-ddtree
    url: http://127.0.0.1:30000/health
    token: "{{ vault_inference_token }}"
    baseline_restarts: "{{ prior_state.NRestarts }}"
  register: health
  until: health.ready or health.dead
  retries: 61
  delay: 10

- name: Fail with the reason when the service died
  ansible.builtin.fail:
    msg: "{{ health.reason }}\n{{ health.journal_tail }}"
  when: health.dead

- name: Check with one small completion request
  service_health:
    unit: vllm-kimi-k25-int4
    url: http://127.0.0.1:8000/health
    completion:
      model: kimi-k2.5
      prompt: ping
"""

RETURN = r"""
ready:
  description: Unit active AND health status expected AND (when asked) the completion answered.
  returned: always
  type: bool
dead:
  description: The unit is not coming back without help (see the description).
  returned: always
  type: bool
reason:
  description: One sentence on the state (why it is dead, or what is still missing).
  returned: always
  type: str
  sample: "unit sglang-k26-ddtree entered the failed state (Result=exit-code)"
unit_state:
  description: Properties read from C(systemctl show). NRestarts and MainPID are integers (null when unknown).
  returned: always
  type: dict
  sample: {ActiveState: activating, SubState: start, Result: success, NRestarts: 0, MainPID: 4242, LoadState: loaded}
health:
  description: The health request; null when O(url) is omitted.
  returned: always
  type: dict
  contains:
    url: {description: The URL., type: str}
    status: {description: HTTP status, null when no answer., type: int}
    ok: {description: Whether the status is expected., type: bool}
    error: {description: What went wrong, null when ok., type: str}
    elapsed_s: {description: Seconds the request took., type: float}
completion:
  description: The completion request, same keys as RV(health) plus C(model); null when not asked or not reached.
  returned: always
  type: dict
journal_tail:
  description: The last O(journal_lines) lines of the unit's journal when dead, else an empty string.
  returned: always
  type: str
settled_s:
  description: Seconds the unit stayed ready during the settle period (null when O(settle_s) is 0 or it never became ready).
  returned: always
  type: float
checks:
  description: How many checks this call made (more than one with O(wait_s) or O(settle_s)).
  returned: always
  type: int
"""

import json
import time
from urllib.error import HTTPError, URLError
from urllib.parse import urlsplit, urlunsplit

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.common.text.converters import to_text
from ansible.module_utils.systemd_unit import read_units
from ansible.module_utils.urls import open_url

UNIT_PROPERTIES = ("ActiveState", "SubState", "Result", "NRestarts", "MainPID", "LoadState")
REDACTED = "********"
_SECRET_HEADER_WORDS = ("authorization", "token", "key", "secret", "cookie")
_BODY_EXCERPT = 200


class Redactor(object):
    """Removes secrets (the token, secret-looking header values) from any text returned."""

    def __init__(self, token, headers, every_header=False):
        secrets = [token] if token else []
        for name, value in (headers or {}).items():
            if (every_header or any(word in name.lower() for word in _SECRET_HEADER_WORDS)) and value:
                secrets.append(str(value))
        # Longest first, so a secret containing another is removed whole.
        self.secrets = sorted(set(secret for secret in secrets if secret), key=len, reverse=True)

    def __call__(self, text):
        if text is None:
            return None
        text = to_text(text, errors="surrogate_or_replace")
        for secret in self.secrets:
            text = text.replace(secret, REDACTED)
        return text


def judge_unit(unit, state, baseline_restarts, expect_running):
    """Return (dead, reason) from the unit's systemd state alone."""
    active, sub, result = state["ActiveState"], state["SubState"], state["Result"]
    restarts = state["NRestarts"]
    if state["LoadState"] == "not-found":
        return True, "unit %s not found (LoadState=not-found): check the unit name" % unit
    if active == "failed":
        return True, "unit %s entered the failed state (Result=%s)" % (unit, result)
    if active == "activating" and sub == "auto-restart":
        return True, "unit %s is crash-looping: systemd is restarting it (activating/auto-restart, NRestarts=%s, Result=%s)" % (
            unit, restarts, result)
    if baseline_restarts is not None and restarts is not None and restarts > baseline_restarts:
        return True, "unit %s was restarted by systemd %d time(s) since it was started (NRestarts %d > %d)" % (
            unit, restarts - baseline_restarts, restarts, baseline_restarts)
    if expect_running and active == "inactive":
        return True, "unit %s is inactive (SubState=%s, Result=%s) although it was started: its process exited" % (
            unit, sub, result)
    return False, None


def http_request(url, method, headers, timeout, validate_certs, expected_status, redact, body=None):
    """One request; returns (outcome dict, parsed JSON body or None). Never raises for HTTP trouble."""
    outcome = {"url": redact(url), "status": None, "ok": False, "error": None, "elapsed_s": None}
    started = time.monotonic()
    payload = None
    text = ""
    try:
        response = open_url(url, method=method, headers=headers, timeout=timeout, use_proxy=False,
                            validate_certs=validate_certs, data=body, follow_redirects="safe")
        outcome["status"] = response.getcode()
        text = to_text(response.read(), errors="surrogate_or_replace")
    except HTTPError as error:
        outcome["status"] = error.code
        try:
            text = to_text(error.read(), errors="surrogate_or_replace")
        except Exception:  # noqa: BLE001 - the body is only context for the message
            text = ""
    except (URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", None) or error
        outcome["error"] = redact("no answer from %s: %s" % (url, reason))
    except Exception as error:  # noqa: BLE001 - one check must never crash the poll loop
        outcome["error"] = redact("request to %s failed: %s" % (url, error))
    outcome["elapsed_s"] = round(time.monotonic() - started, 3)
    if outcome["status"] is not None:
        outcome["ok"] = outcome["status"] in expected_status
        if not outcome["ok"]:
            excerpt = " ".join(text.split())[:_BODY_EXCERPT]
            outcome["error"] = redact("HTTP %d from %s (expected %s)%s" % (
                outcome["status"], url, ", ".join(str(code) for code in expected_status),
                ": " + excerpt if excerpt else ""))
        try:
            payload = json.loads(text) if text else None
        except ValueError:
            payload = None
    return outcome, payload


def base_url(url):
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "", "", ""))


def check_completion(params, headers, redact):
    options = params["completion"]
    model = options.get("model")
    if not model:
        if not params["url"]:
            return {"url": None, "status": None, "ok": False, "model": None,
                    "error": "completion.model is needed when url is not given", "elapsed_s": None}
        models_outcome, models = http_request(base_url(params["url"]) + "/v1/models", "GET", headers, params["timeout"],
                                              params["validate_certs"], [200], redact)
        listed = (models or {}).get("data") if isinstance(models, dict) else None
        if not models_outcome["ok"] or not listed:
            models_outcome["error"] = models_outcome["error"] or "no model listed by /v1/models"
            models_outcome["model"] = None
            return models_outcome
        model = listed[0].get("id")
    url = options.get("url") or (base_url(params["url"]) + "/v1/completions")
    body = json.dumps({"model": model, "prompt": options["prompt"], "max_tokens": options["max_tokens"]})
    request_headers = dict(headers)
    request_headers["Content-Type"] = "application/json"
    outcome, answer = http_request(url, "POST", request_headers, params["timeout"], params["validate_certs"],
                                   [200], redact, body=body)
    outcome["model"] = model
    if outcome["ok"] and not (isinstance(answer, dict) and answer.get("choices")):
        outcome["ok"] = False
        outcome["error"] = "HTTP 200 from %s but no choices in the answer" % redact(url)
    return outcome


def read_unit(module, unit, redact):
    return read_units(module, [unit], UNIT_PROPERTIES, redact=redact)[unit]


def check_once(module, params, headers, redact, baseline_restarts):
    """One look at the unit and its health URL: a dict of ready, dead, reason, state, health, completion."""
    unit = params["unit"]
    state = read_unit(module, unit, redact)
    dead, reason = judge_unit(unit, state, baseline_restarts, params["expect_running"])
    health = None
    completion = None
    if params["url"] and state["LoadState"] != "not-found":
        health, _body = http_request(params["url"], "GET", headers, params["timeout"], params["validate_certs"],
                                     params["expected_status"], redact)
        if health["ok"] and params["completion"] is not None and not dead:
            completion = check_completion(params, headers, redact)

    active = state["ActiveState"] == "active"
    ready = (not dead and active and (health is None or health["ok"])
             and (params["completion"] is None or bool(completion and completion["ok"])))
    if ready:
        reason = "unit %s is active%s%s" % (
            unit, " and %s answered %s" % (redact(params["url"]), health["status"]) if health else "",
            " and a completion answered" if completion else "")
    elif not dead:
        waiting_for = []
        if not active:
            waiting_for.append("unit %s is %s/%s" % (unit, state["ActiveState"], state["SubState"]))
        if health is not None and not health["ok"]:
            waiting_for.append(health["error"])
        if completion is not None and not completion["ok"]:
            waiting_for.append("completion: %s" % completion["error"])
        reason = "not ready yet: " + "; ".join(waiting_for)
    return {"ready": ready, "dead": dead, "reason": reason, "state": state, "health": health,
            "completion": completion}


def settle(module, params, headers, redact, first):
    """Watch a ready unit for settle_s seconds; the first check that is not ready with the same
    MainPID and NRestarts makes it dead. Returns (check, settled seconds)."""
    unit = params["unit"]
    pid, restarts = first["state"]["MainPID"], first["state"]["NRestarts"]
    started = time.monotonic()
    check = first
    while time.monotonic() - started < params["settle_s"]:
        time.sleep(min(1.0, max(0.0, params["settle_s"] - (time.monotonic() - started))))
        check = check_once(module, params, headers, redact, restarts)
        now_pid, now_restarts = check["state"]["MainPID"], check["state"]["NRestarts"]
        if check["ready"] and now_pid == pid and now_restarts == restarts:
            continue
        elapsed = time.monotonic() - started
        what = check["reason"] if not check["ready"] else "its process changed"
        check["ready"] = False
        check["dead"] = True
        check["reason"] = (
            "unit %s answered healthy, then did not stay healthy for the settle period of %g s: after %.1f s %s "
            "(MainPID %s -> %s, NRestarts %s -> %s): it is crash-looping or was restarted"
            % (unit, params["settle_s"], elapsed, what, pid, now_pid, restarts, now_restarts))
        return check, round(elapsed, 1)
    return check, round(time.monotonic() - started, 1)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            unit=dict(type="str", required=True),
            url=dict(type="str"),
            # header values are credentials as often as not (X-Api-Key): masked everywhere,
            # the module's logged invocation included
            headers=dict(type="dict", default={}, no_log=True),
            token=dict(type="str", no_log=True),
            expected_status=dict(type="list", elements="int", default=[200]),
            timeout=dict(type="float", default=5),
            validate_certs=dict(type="bool", default=True),
            baseline_restarts=dict(type="int"),
            expect_running=dict(type="bool", default=True),
            completion=dict(type="dict", options=dict(
                url=dict(type="str"),
                model=dict(type="str"),
                prompt=dict(type="str", default="Hello"),
                max_tokens=dict(type="int", default=1),
            )),
            journal_lines=dict(type="int", default=30),
            wait_s=dict(type="float", default=0),
            settle_s=dict(type="float", default=0),
        ),
        supports_check_mode=True,
    )
    params = module.params
    unit = params["unit"]
    # Every header value is treated as a secret: an API key can sit under any header name.
    redact = Redactor(params["token"], params["headers"], every_header=True)

    for name, url in (("url", params["url"]), ("completion.url", (params["completion"] or {}).get("url"))):
        if url and urlsplit(url).scheme not in ("http", "https"):
            module.fail_json(msg="%s must be an http:// or https:// URL, got %s" % (name, redact(url)))
    if params["timeout"] <= 0:
        module.fail_json(msg="timeout must be more than 0 seconds, got %s" % params["timeout"])
    for name in ("wait_s", "settle_s"):
        if params[name] < 0:
            module.fail_json(msg="%s must be 0 or more seconds, got %s" % (name, params[name]))

    headers = dict((str(name), str(value)) for name, value in params["headers"].items())
    if params["token"]:
        headers["Authorization"] = "Bearer " + params["token"]

    started = time.monotonic()
    checks = 1
    check = check_once(module, params, headers, redact, params["baseline_restarts"])
    while not (check["ready"] or check["dead"]) and time.monotonic() - started + 1.0 <= params["wait_s"]:
        time.sleep(1.0)
        checks += 1
        check = check_once(module, params, headers, redact, params["baseline_restarts"])
    settled_s = None
    if check["ready"] and params["settle_s"] > 0:
        check, settled_s = settle(module, params, headers, redact, check)
        checks += 1

    state = check["state"]
    journal_tail = ""
    if check["dead"] and state["LoadState"] != "not-found":
        journalctl = module.get_bin_path("journalctl")
        if journalctl:
            rc, stdout, stderr = module.run_command(
                [journalctl, "-u", unit, "-n", str(params["journal_lines"]), "--no-pager"], environ_update={"LC_ALL": "C"})
            journal_tail = stdout.rstrip("\n") if rc == 0 else "(journalctl exited %d: %s)" % (rc, stderr.strip())
        else:
            journal_tail = "(journalctl not found on this host)"

    module.exit_json(
        changed=False,
        ready=check["ready"],
        dead=check["dead"],
        reason=redact(check["reason"]),
        unit_state=dict((key, redact(value) if isinstance(value, str) else value) for key, value in state.items()),
        health=check["health"],
        completion=check["completion"],
        journal_tail=redact(journal_tail),
        settled_s=settled_s,
        checks=checks,
    )


if __name__ == "__main__":
    main()
