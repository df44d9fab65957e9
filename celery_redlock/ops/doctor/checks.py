"""The setup's checks, and :func:`evaluate`: every check over everything collected.

The setup's checks judge the nodes together (how many lock nodes, whether they are
distinct servers) and who holds the app's beat leader lock. :func:`evaluate` runs
them with the per-node checks (:mod:`.checks_nodes`) and the settings checks
(:mod:`.checks_settings`), and derives what those need from the settings: the
longest and shortest lease in use, the drift allowance, the node timeout. All of it
is pure: values in, :class:`~.report.Finding` objects out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...engine.timing import drift_allowance
from ...integration.settings import Settings
from ..parked import ParkedView
from .checks_nodes import (
    check_clock,
    check_config_access,
    check_eviction,
    check_latency,
    check_persistence,
    check_reachable,
    check_replication,
    check_uptime,
)
from .checks_settings import check_settings, leases
from .facts import Backlog, BeatLeaderFacts, LeaseInUse, NodeFacts, TaskLocking
from .report import ERROR, OK, WARN, Finding

__all__ = [
    "check_backlog",
    "check_beat_leader",
    "check_beat_leaders",
    "check_independent",
    "check_node_count",
    "evaluate",
    "unique_claim_limit",
]

# -- message templates: problem, consequence, fix ----------------------------------

TOO_FEW_MESSAGE = (
    "redlock_nodes lists 2 nodes: a lock needs both (a majority of 2), so either node "
    "being down or slow stops every lock, which is worse than one node. Fix: use 3 (or 5) "
    "independent masters, or a single node with redlock_url."
)
EVEN_MESSAGE = (
    "redlock_nodes lists {n} nodes, an even number: a lock needs {quorum}, so this survives "
    "no more failures than {odd} nodes would, adds a node that can slow or fail "
    "acquisitions, and a split into two halves leaves no side able to lock. Fix: use an "
    "odd number of independent masters ({odd} or {more})."
)
SAME_SERVER_MESSAGE = (
    "{nodes} reach the same Redis server (run_id {run_id}): Redlock counts it {count} "
    "times, so one server failure (or one restart without persistence) counts as several "
    "and a 'majority' may be one machine. Fix: list independent masters in redlock_nodes "
    "(different servers, not different databases or host names of one server)."
)


def check_node_count(count: int) -> Finding:
    """Redlock needs an odd number of nodes, at least 3; one node is a plain lock."""
    if count == 1:
        return Finding(
            OK, "node-count", "one lock node: no Redlock, and no locking while it is down"
        )
    if count == 2:
        return Finding(ERROR, "too-few-nodes", TOO_FEW_MESSAGE)
    quorum = count // 2 + 1
    if count % 2 == 0:
        return Finding(
            ERROR,
            "even-node-count",
            EVEN_MESSAGE.format(n=count, quorum=quorum, odd=count - 1, more=count + 1),
        )
    return Finding(
        OK,
        "node-count",
        f"{count} nodes, a lock needs {quorum}: survives {count - quorum} node failure(s)",
    )


def check_independent(run_ids: Mapping[str, str]) -> list[Finding]:
    """Every node URL reaches a different server (``run_id`` from INFO server)."""
    by_run: dict[str, list[str]] = {}
    for node, run_id in run_ids.items():
        if run_id:
            by_run.setdefault(run_id, []).append(node)
    findings = [
        Finding(
            ERROR,
            "nodes-not-independent",
            SAME_SERVER_MESSAGE.format(nodes=" and ".join(nodes), run_id=run_id, count=len(nodes)),
        )
        for run_id, nodes in sorted(by_run.items())
        if len(nodes) > 1
    ]
    if not findings and len(run_ids) > 1:
        findings.append(Finding(OK, "independence", "every node is a distinct server"))
    return findings


def evaluate(
    settings: Settings,
    facts: Sequence[NodeFacts],
    tasks: Sequence[TaskLocking] = (),
    unmatched: Sequence[str] = (),
    beat: BeatLeaderFacts | None = None,
    backlogs: Sequence[Backlog] = (),
    overdue: Sequence[ParkedView] = (),
    declared: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Finding]:
    """Run every check over the gathered facts.

    The setup's findings (node count, independence, settings) come first, then each
    node's, in the order of the configured nodes, then the beat leader's (``beat``,
    when it was looked up), then the keys whose queued runs drain too slowly
    (``backlogs``, against the tasks' claims), then the parked runs no worker took
    (``overdue``), then the tasks whose workers disagree on their lock options
    (``declared``: worker -> task -> options).
    """
    # The masters of one Redis Cluster are one lock node (one vote) between them.
    lock_nodes = len({n.lock_node or n.node for n in facts})
    redlock = lock_nodes > 1
    all_leases = leases(settings, tasks)
    longest = max(all_leases, key=lambda lease: lease.ttl)
    shortest = min(all_leases, key=lambda lease: lease.ttl)
    # Redlock's allowance for one lease (Timing.drift), for the shortest lease in use.
    budget = drift_allowance(shortest.ttl, settings.drift_factor)
    budget_source = (
        f"{shortest.source} {shortest.ttl:g}s x redlock_drift_factor {settings.drift_factor:g}"
    )
    node_timeout = settings.timing.node_timeout
    findings: list[Finding] = [check_node_count(lock_nodes)]
    if redlock:
        findings += check_independent(
            {n.node: n.info.get("run_id", "") for n in facts if n.error is None}
        )
    findings += check_settings(settings, tasks, unmatched)
    for node in facts:
        findings.append(check_reachable(node))
        if node.error is not None:
            continue
        config_access = check_config_access(node)
        if config_access is not None:
            findings.append(config_access)
        findings.append(check_eviction(node.node, node.config, node.info))
        findings.append(check_persistence(node.node, node.config, node.info, redlock=redlock))
        findings.append(
            check_replication(node.node, node.info, settings.min_replicas, majority_needed=redlock)
        )
        optional = (
            check_uptime(node.node, node.info, node.config, longest),
            check_clock(node.node, node.clock_skew, node.clock_uncertainty, budget, budget_source),
            check_latency(node.node, node.rtt, node_timeout),
            check_permanent_keys(node, settings.key_prefix),
        )
        findings += [f for f in optional if f is not None]
    if beat is not None:
        findings += check_beat_leaders(beat)
    claims = unique_claim_limit(tasks)
    for backlog in backlogs:
        finding = check_backlog(backlog, claims)
        if finding is not None:
            findings.append(finding)
    if overdue:
        findings.append(check_overdue(overdue))
    if declared:
        findings += check_drift(declared)
    return findings


DRIFT_MESSAGE = (
    "Workers disagree on the lock options of {task}: {parts}. They lock different keys, "
    "or the same key differently, for the same call: two bodies of one resource can run "
    "at once. Deploy one configuration (redlock_tasks, the task's lock_* options) to "
    "every worker."
)


def check_drift(declared: Mapping[str, Mapping[str, Any]]) -> list[Finding]:
    """Error for each task whose workers declared different lock options.

    ``declared``: worker -> task name -> the options it resolved
    (:func:`celery_redlock.integration.declared.declared`). A task one worker runs
    and another does not is no drift (queues route tasks to some workers only).
    """
    by_task: dict[str, dict[str, Mapping[str, Any]]] = {}
    for worker, tasks in declared.items():
        for task, options in tasks.items():
            by_task.setdefault(task, {})[worker] = options
    findings = []
    for task, workers in sorted(by_task.items()):
        fields = sorted({f for options in workers.values() for f in options})
        differ = [f for f in fields if len({repr(o.get(f)) for o in workers.values()}) > 1]
        if not differ:
            continue
        parts = "; ".join(
            f"{f}: " + ", ".join(f"{w} {o.get(f)!r}" for w, o in sorted(workers.items()))
            for f in differ
        )
        findings.append(
            Finding(ERROR, "settings-drift", DRIFT_MESSAGE.format(task=task, parts=parts))
        )
    return findings


OVERDUE_MESSAGE = (
    "{count} run(s) parked on the lock nodes are overdue by up to {late} (e.g. {example}): "
    "no worker's publisher took them. A worker of this app publishes parked runs from "
    "its main process: is one running, with redlock enabled, on these lock nodes?"
)


def check_overdue(overdue: Sequence[ParkedView]) -> Finding:
    """Warn of parked runs that no worker took (see :func:`.collect.overdue_runs`)."""
    oldest = min(overdue, key=lambda run: run.due_in)
    return Finding(
        WARN,
        "parked-overdue",
        OVERDUE_MESSAGE.format(
            count=len(overdue),
            late=f"{-oldest.due_in:.0f}s",
            example=f"{oldest.task_name or 'task'}[{oldest.task_id}]",
        ),
    )


BACKLOG_MESSAGE = "{key}: {queued} run(s) wait on the queue for a budget of {rate}. {parts}"
#: Each limit a backlog can outlast: what is measured against it, and what follows.
BACKLOG_PARTS = {
    "claim": "They take {value:g}s to start at the earliest (queued / N x window), longer "
    "than {limit}: the send-time claims of its lock_unique tasks expire before their "
    "copies start, so a duplicate of a queued copy can be sent meanwhile. Fix: allow "
    "more starts (lock_rate), send fewer runs of the key at once, or raise "
    "lock_unique_ttl above the drain time.",
}


def unique_claim_limit(tasks: Sequence[TaskLocking]) -> LeaseInUse | None:
    """How long the shortest send-time claim of a rated ``lock_unique`` task lasts.

    A copy of such a task waits on the queue for its budget while its claim keeps the
    other copies out; None when no task has both (their claims are not at stake).
    """
    claims = [
        LeaseInUse(f"lock_unique_ttl of task {t.name}", t.unique_ttl)
        for t in tasks
        if t.rate and t.unique and t.unique_ttl is not None
    ]
    return min(claims, key=lambda claim: claim.ttl) if claims else None


def check_backlog(backlog: Backlog, claims: LeaseInUse | None) -> Finding | None:
    """Warn when a key's queued runs outlast a send-time claim.

    ``claims`` (the shortest ``lock_unique_ttl`` of a rated unique task,
    :func:`unique_claim_limit`) against ``backlog.drain``, the time the budget takes
    to start every queued run. None when it fits. (The broker's visibility timeout is
    not at stake: a run is never put back for longer than half of it,
    :func:`celery_redlock.integration.budgets.longest_hold`.)
    """
    measured = {"claim": (claims, backlog.drain)}
    parts = [
        BACKLOG_PARTS[kind].format(value=round(value, 1), limit=f"{limit.source} ({limit.ttl:g}s)")
        for kind, (limit, value) in measured.items()
        if limit is not None and value > limit.ttl
    ]
    if not parts:
        return None
    rate = f"{backlog.limit} per {backlog.window:g}s"
    message = BACKLOG_MESSAGE.format(
        key=backlog.key, queued=backlog.queued, rate=rate, parts=" ".join(parts)
    )
    return Finding(WARN, "budget-backlog", message)


PERMANENT_MESSAGE = (
    "{count}{more} key(s) of the prefix {prefix!r} on {node} have no TTL (e.g. {examples}): "
    "left by an earlier version (fence counters), they stay until deleted and add up "
    "with every distinct key ever locked. Delete the ':fence' ones once no earlier "
    "version runs any more (README: Upgrading): the next fence of each comes from the "
    "node's clock, larger than any it replaces."
)


def check_permanent_keys(node: NodeFacts, prefix: str) -> Finding | None:
    """Warn about keys of the prefix that will never expire (bounded memory)."""
    if not node.permanent_count:
        return None
    return Finding(
        WARN,
        "permanent-keys",
        PERMANENT_MESSAGE.format(
            count=node.permanent_count,
            more="" if node.keys_complete else "+",
            prefix=prefix,
            node=node.node,
            examples=", ".join(node.permanent_keys),
        ),
    )


def check_beat_leader(
    key: str, holders: Sequence[str], broker: str, *, legacy: bool = False
) -> Finding | None:
    """Who holds this app's beat leader lock ``key``, against this app's broker.

    ``holders`` are the nodes' ``task_name`` of the lock; ``broker`` is this app's
    broker identity (:func:`celery_redlock.beat.broker_identity`). With ``legacy``,
    ``key`` is the name older versions derived (``beat:<main>``) while this app derives
    another: whoever holds it leads besides this app's beat. None when no node holds it.
    """
    from ...integration.beat import parse_beat_holder, same_broker  # noqa: PLC0415 (beat imports Celery's scheduler)

    if not holders:
        return None
    holder = max(set(holders), key=list(holders).count)
    leader = parse_beat_holder(holder)
    if legacy:
        return Finding(
            WARN,
            "beat-leader-legacy",
            f"{key}, the beat leader lock name of older celery_redlock versions, is held "
            f"by {holder!r}: a beat of an older version (of this project, or of another "
            "project with this app name). It and this project's beats lead side by side, "
            "each under its own name. Fix: upgrade every beat of the project together, "
            "or set the same redlock_beat_name in all of them.",
        )
    if leader is None:
        return Finding(
            WARN,
            "beat-leader-unknown",
            f"beat leader lock {key} is held by {holder!r}, not a beat of this version "
            "(an older beat, or another program): if it is not this project's, this "
            "project's periodic tasks are not sent while it holds the lock. Fix: give "
            "each project its own redlock_beat_name.",
        )
    where = f"app {leader['app']} on {leader['host']}:{leader['pid']}"
    if not same_broker(leader["broker"], broker):
        return Finding(
            ERROR,
            "beat-leader-foreign",
            f"beat leader lock {key} is held by a beat of another project ({where}, "
            f"broker {leader['broker']}; this app's broker is {broker}): this project's "
            "periodic tasks are not sent while it leads. Fix: give each project its own "
            "redlock_beat_name (or leave it unset: the default tells brokers apart).",
        )
    return Finding(OK, "beat-leader", f"beat leader lock {key} is held by {where}")


def check_beat_leaders(beat: BeatLeaderFacts) -> list[Finding]:
    """:func:`check_beat_leader` for each name of the leader lock that someone holds.

    A warning instead when the lock could not be looked up (``beat.error``).
    """
    if beat.error is not None:
        return [Finding(WARN, "beat-leader-unknown", f"beat leader lock not checked: {beat.error}")]
    findings = [
        check_beat_leader(lock.key, lock.holders, beat.broker, legacy=lock.legacy)
        for lock in beat.locks
    ]
    return [f for f in findings if f is not None]
