"""``celery redlock doctor``: whether the lock nodes and the app's settings are safe.

Pure checks over collected facts, plus a report, as RedBeat's ``checks.py``:

* :mod:`.collect` does all the I/O: it asks every lock node once, concurrently, with
  the node timeout and no retries, measures its clock, reads the registered tasks'
  lock options and who holds the beat leader lock.
* :mod:`.facts` holds what was collected, as plain values, and parses raw replies.
* The **pure checks** turn those facts and the app's settings into :class:`Finding`
  objects: :mod:`.checks_nodes` (each node), :mod:`.checks_settings` (settings and
  task options), :mod:`.checks` (the nodes together, the beat leader, and
  :func:`evaluate`, which runs them all). They open no sockets, so each is
  unit-tested with crafted replies.
* :mod:`.report` holds :class:`Finding`, :class:`Report`, the levels and
  :func:`exit_code`; :func:`diagnose` (here) is collect, evaluate, report.

Every finding has a level (``ok``, ``warn``, ``error``), a stable ``code`` and a
message that states the problem, what it leads to and how to fix it.

What is checked, and why (see ``docs/operations.md`` for the long form):

====================== ======= ===============================================
code                   level   when
====================== ======= ===============================================
node-unreachable       error   a lock node did not answer
evicting-policy        error   ``maxmemory-policy`` is ``allkeys-*`` or
                               ``volatile-*`` (every lock key has a TTL, so
                               volatile policies pick exactly the locks)
persistence-off        error   Redlock node without AOF or RDB (warn with one node)
persistence-rdb-only   error   Redlock node with RDB snapshots only (warn with one)
appendfsync-not-always warn    Redlock node with AOF but not ``appendfsync always``
too-few-nodes          error   ``redlock_nodes`` lists 2 nodes
even-node-count        error   ``redlock_nodes`` lists 4, 6... nodes
nodes-not-independent  error   two URLs reach the same server (same ``run_id``)
node-is-replica        error   a lock node is a read-only replica
replicas-without-wait  warn    a node has replicas, ``redlock_min_replicas`` is 0
min-replicas-unmet     error   fewer connected replicas than ``redlock_min_replicas``
recent-restart         warn    node up for less than the longest lease, and not
                               ``appendfsync always``
clock-skew             warn    node clock off by more than the drift allowance
slow-node              warn    round trip above half the node timeout
fail-open              warn    ``redlock_fail_open`` is on
drift-factor-zero      warn    ``redlock_drift_factor`` is 0
renew-slack            warn    renewal interval above half the lease
on-lost-ignore         warn    a task keeps running after losing its lock
wait-exceeds-limit     warn    ``on_busy="wait"`` can wait past the task's time limit
invalid-task-options   error   a task's lock options would stop the worker
unmatched-pattern      warn    a ``redlock_tasks`` pattern matches no task here
invalid-settings       error   the ``redlock_*`` settings do not validate
beat-leader-foreign    error   this app's beat leader lock is held by a beat of
                               another project (another broker): this
                               project's periodic tasks are not sent
beat-leader-unknown    warn    it is held by something else than a beat of this
                               version (an older beat, another program)
beat-leader-legacy     warn    the leader lock name of older versions
                               (``beat:<main>``) is held: an older beat of this
                               project, or of another project of that name
budget-backlog         warn    the runs waiting on the queue for a key's rate
                               budget take longer to start (queued / N x
                               window) than the shortest ``lock_unique_ttl`` of
                               a rated unique task
parked-overdue         warn    runs parked on the lock nodes are due longer
                               ago than twice a take's lease: no worker's
                               publisher takes them (no worker running)
settings-drift         error   workers that answered ``inspect`` declare
                               different lock options (key, args, mode, limit,
                               ttl, rate, unique, debounce, throttle) for one
                               task: they lock different keys for one call
====================== ======= ===============================================

Exit status of the command (:func:`exit_code`): 0 without error findings; 1 with
error findings; ``EX_UNAVAILABLE`` (69) when a node could not be asked at all (the
report is then incomplete, whatever else it says).
"""

from __future__ import annotations

from typing import Any

from ...exceptions import ConfigurationError
from .checks import (
    check_backlog,
    check_beat_leader,
    check_beat_leaders,
    check_drift,
    check_independent,
    check_node_count,
    check_overdue,
    evaluate,
    unique_claim_limit,
)
from .checks_nodes import (
    check_clock,
    check_config_access,
    check_eviction,
    check_latency,
    check_persistence,
    check_reachable,
    check_replication,
    check_uptime,
    durable,
)
from .checks_settings import check_settings, invalid_settings, leases
from .collect import (
    backlogs,
    beat_leader,
    collect,
    declared_options,
    overdue_runs,
    probe_nodes,
    task_locking,
)
from .facts import (
    Backlog,
    BeatLeaderFacts,
    LeaderLock,
    LeaseInUse,
    NodeFacts,
    TaskLocking,
    parse_info,
)
from .report import ERROR, LEVELS, OK, WARN, Finding, Report, exit_code

__all__ = [
    "ERROR",
    "LEVELS",
    "OK",
    "WARN",
    "Backlog",
    "BeatLeaderFacts",
    "Finding",
    "LeaderLock",
    "LeaseInUse",
    "NodeFacts",
    "Report",
    "TaskLocking",
    "backlogs",
    "beat_leader",
    "check_backlog",
    "check_beat_leader",
    "check_beat_leaders",
    "check_clock",
    "check_config_access",
    "check_drift",
    "check_eviction",
    "check_independent",
    "check_latency",
    "check_node_count",
    "check_overdue",
    "check_persistence",
    "check_reachable",
    "check_replication",
    "check_settings",
    "check_uptime",
    "collect",
    "declared_options",
    "diagnose",
    "durable",
    "evaluate",
    "exit_code",
    "invalid_settings",
    "leases",
    "overdue_runs",
    "parse_info",
    "probe_nodes",
    "task_locking",
    "unique_claim_limit",
]


def diagnose(app: Any, *, timeout: float = 1.0) -> Report:
    """Everything ``celery redlock doctor`` reports, for ``app``.

    Settings that do not validate are the one finding: no node is asked.
    """
    try:
        settings, facts, tasks, unmatched = collect(app, timeout=timeout)
    except ConfigurationError as exc:
        return Report([invalid_settings(str(exc))], [])
    beat = beat_leader(app, settings, timeout=timeout)
    queued = backlogs(settings, timeout=timeout)
    overdue = overdue_runs(settings, timeout=timeout)
    declared = declared_options(app, timeout=timeout)
    findings = evaluate(
        settings,
        facts,
        tasks,
        unmatched,
        beat=beat,
        backlogs=queued,
        overdue=overdue,
        declared=declared,
    )
    return Report(findings, facts)
