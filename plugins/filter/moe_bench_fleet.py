# -*- coding: utf-8 -*-
"""Filters of the fleet rollout: moe_bench_pool_problems (the pools' minimum against their size),
moe_bench_rollout_gate (does the rollout go on after the hosts done so far) and
moe_bench_fleet_table (the one table a fleet run prints: host -> state and why)."""

from __future__ import annotations

# Each filter's documentation is the YAML file of its name beside this one (ansible-doc -t filter NAME).

from ansible.errors import AnsibleFilterError

# The outcome of a host in the rollout. ok and skipped leave the host serving; failed means the
# benchmark failed and the service is back; down means the service did not come back.
OUTCOMES = ("ok", "failed", "down", "skipped", "not started", "refused", "unreachable")
FAILING = ("failed", "down")


def _whole(value, name):
    if isinstance(value, bool):
        raise ValueError(name)
    text = str(value).strip()
    if not text.lstrip("-").isdigit():
        raise ValueError(name)
    return int(text)


def moe_bench_pool_problems(hosts):
    """Refusals for the serving pools of the targeted hosts: a list of sentences, empty when fine.

    `hosts` is a list of {host, pool, min_healthy} (pool empty or missing: the host is in no pool).
    A pool's minimum must be a whole number from 0 to the pool's size minus one (a minimum equal to
    the size could never let one of its hosts stop), and the same on every host of the pool."""
    if not isinstance(hosts, (list, tuple)):
        raise AnsibleFilterError("moe_bench_pool_problems: expects a list of {host, pool, min_healthy}")
    pools = {}
    for entry in hosts:
        pool = entry.get("pool") or ""
        if pool:
            pools.setdefault(str(pool), []).append(entry)
    problems = []
    for pool, members in sorted(pools.items()):
        minima = {}
        for member in members:
            raw = member.get("min_healthy")
            try:
                minimum = 0 if raw in (None, "") else _whole(raw, "min_healthy")
            except ValueError:
                problems.append("moe_bench_pool_min_healthy of %s (pool %s) must be a whole number, got %r"
                                % (member.get("host"), pool, raw))
                continue
            minima.setdefault(minimum, []).append(str(member.get("host")))
        if len(minima) > 1:
            problems.append("pool %s has different moe_bench_pool_min_healthy on its hosts (%s): set it once for the pool"
                            % (pool, "; ".join("%s on %s" % (value, ", ".join(names))
                                               for value, names in sorted(minima.items()))))
            continue
        for minimum in minima:
            if minimum < 0 or minimum >= len(members):
                problems.append(
                    "pool %s: moe_bench_pool_min_healthy is %d but the pool has %d host(s) in this run (%s): "
                    "at most %d can stay healthy while one is stopped"
                    % (pool, minimum, len(members), ", ".join(sorted(str(m.get("host")) for m in members)),
                       len(members) - 1))
    return problems


def moe_bench_rollout_gate(outcomes, total, max_fail_percentage=0):
    """Whether the rollout goes on: {go, failing, allowed, why}.

    `outcomes` are the outcomes of the hosts done so far (OUTCOMES; an empty or unknown one counts
    as failing: a host that left the play unexpectedly), `total` the number of hosts in the rollout.
    The rollout stops once the failing hosts are more than max_fail_percentage percent of the total:
    with 0, after the first."""
    try:
        total = _whole(total, "total")
        percentage = float(str(max_fail_percentage).strip())
    except ValueError:
        raise AnsibleFilterError("moe_bench_rollout_gate: total must be a whole number and max_fail_percentage "
                                 "a number, got %r and %r" % (total, max_fail_percentage)) from None
    if not 0 <= percentage <= 100:
        raise AnsibleFilterError("moe_bench_max_fail_percentage must be from 0 to 100, got %r" % (max_fail_percentage,))
    failing = [outcome for outcome in outcomes
               if outcome in FAILING or outcome not in OUTCOMES]
    allowed = int(percentage / 100.0 * total)
    go = len(failing) <= allowed
    why = "" if go else (
        "%d host(s) failed so far, more than moe_bench_max_fail_percentage %s%% of %d host(s) allows (%d)"
        % (len(failing), ("%g" % percentage), total, allowed))
    return {"go": go, "failing": len(failing), "allowed": allowed, "why": why}


def moe_bench_fleet_table(rows, title="host"):
    """Lines of a plain table, one host a line: `rows` is a list of {host, state, why}."""
    if not isinstance(rows, (list, tuple)):
        raise AnsibleFilterError("moe_bench_fleet_table: expects a list of {host, state, why}")
    width = max([len(title)] + [len(str(row.get("host", ""))) for row in rows])
    state_width = max([5] + [len(str(row.get("state", ""))) for row in rows])
    lines = ["%-*s  %-*s  %s" % (width, title, state_width, "state", "why / what")]
    for row in rows:
        lines.append("%-*s  %-*s  %s" % (width, row.get("host", ""), state_width, row.get("state", ""),
                                         " ".join(str(row.get("why", "") or "").split())))
    return lines


class FilterModule(object):
    def filters(self):
        return {
            "moe_bench_pool_problems": moe_bench_pool_problems,
            "moe_bench_rollout_gate": moe_bench_rollout_gate,
            "moe_bench_fleet_table": moe_bench_fleet_table,
        }
