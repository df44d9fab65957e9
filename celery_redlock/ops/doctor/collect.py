"""Everything ``doctor`` asks, and nothing it concludes: the I/O that produces the facts.

Each lock node is asked once, concurrently, with the node timeout and no retries
(:func:`probe_nodes`), then sampled for its clock; the app's registered tasks give
their lock options (:func:`task_locking`); the nodes say who holds the app's beat
leader lock (:func:`beat_leader`). The results are the value types of :mod:`.facts`,
which the pure checks of :mod:`.checks` judge.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from ...engine.keys import lock_keys
from ...exceptions import ConfigurationError
from ...integration.parking import LEASE
from ...integration.settings import Settings, from_conf
from ...nodes import Call, NodeSet, Server, fan_out
from ..budgets import held_budgets
from ..parked import ParkedView, parked_runs
from .facts import (
    CONFIG_PARAMETERS,
    INFO_SECTIONS,
    Backlog,
    BeatLeaderFacts,
    LeaderLock,
    NodeFacts,
    TaskLocking,
    node_facts,
    time_skew,
)

__all__ = [
    "CLOCK_SAMPLES",
    "OVERDUE",
    "backlogs",
    "beat_leader",
    "collect",
    "declared_options",
    "overdue_runs",
    "probe_nodes",
    "task_locking",
]

#: Seconds past its due time after which a parked run counts as waiting for a worker:
#: twice a take's lease (a taken run whose copy did not start is due again after one).
OVERDUE = 2 * LEASE

#: TIME round trips per node; the one with the shortest round trip measures the skew.
CLOCK_SAMPLES = 3


def collect(
    app: Any, *, timeout: float
) -> tuple[Settings, list[NodeFacts], list[TaskLocking], list[str]]:
    """Read the app's settings and tasks and ask its lock nodes; raises ConfigurationError."""
    settings = from_conf(app.conf)
    urls = settings.node_urls()
    tasks, unmatched = task_locking(app, settings)
    return (
        settings,
        probe_nodes(urls, timeout=timeout, prefix=settings.key_prefix),
        tasks,
        unmatched,
    )


def task_locking(app: Any, settings: Settings) -> tuple[list[TaskLocking], list[str]]:
    """The lock options of every locked task of ``app``, and the unmatched patterns.

    A task is locked when it is a :class:`~celery_redlock.LockedTask`, or when a
    ``redlock_tasks`` pattern names it (first match in the dict's order, as the
    worker does). Its options are resolved by the worker's own function
    (:func:`celery_redlock.integration.task.task_options`), so an error here is exactly one that
    stops the worker. Tasks are not modified.
    """
    from ...integration.task import LockedTask, task_options  # noqa: PLC0415 (keeps import of this module light)

    patterns = settings.tasks or {}  # None when redlock_tasks is not set
    found: list[TaskLocking] = []
    matched: set[str] = set()
    conf = app.conf
    for name in sorted(app.tasks):
        task = app.tasks[name]
        pattern = next((p for p in patterns if name == p or fnmatch.fnmatchcase(name, p)), None)
        ours = isinstance(task, LockedTask)
        if pattern is None and not ours:
            continue
        entry_source = None if pattern is None else f"redlock_tasks[{pattern!r}]"
        source = f"task {name}" if entry_source is None else f"{entry_source} (task {name})"
        if pattern is not None:
            matched.add(pattern)
        try:
            options = task_options(
                task,
                None if pattern is None else patterns[pattern],
                source=entry_source,
                # As config_only.lockify: a project's class has no lock_* options of ours.
                read_attributes=ours and getattr(type(task), "_redlock_read_attributes", True),
            )
        except ConfigurationError as exc:
            found.append(TaskLocking(name, source, error=str(exc)))
            continue
        found.append(
            TaskLocking(
                name,
                source,
                ttl=options.timing.ttl,
                renew_interval=options.timing.renew_interval,
                on_busy=options.on_busy,
                on_lost=options.on_lost,
                wait_timeout=options.wait_timeout,
                time_limit=getattr(task, "time_limit", None) or conf.get("task_time_limit"),
                soft_time_limit=getattr(task, "soft_time_limit", None)
                or conf.get("task_soft_time_limit"),
                rate=None if options.rate is None else str(options.rate),
                unique=options.unique,
                unique_ttl=options.unique_ttl,
            )
        )
    unmatched = [p for p in patterns if p not in matched]
    return found, unmatched


def probe_nodes(
    urls: Sequence[str],
    *,
    timeout: float,
    clock: Callable[[], float] = time.time,
    prefix: str | None = None,
) -> list[NodeFacts]:
    """Ask every node for its configuration, INFO and clock (concurrently, no retries).

    A Redis Cluster node is asked on each of its masters: one :class:`NodeFacts` per
    master, whose ``lock_node`` names the cluster. ``clock`` is this host's wall
    clock (injectable for tests).
    """
    nodeset = NodeSet(urls, timeout=timeout)
    try:
        servers: list[Server] = []
        owners: list[str] = []
        unreachable: dict[str, str] = {}
        for node in nodeset.nodes:
            try:
                masters = node.masters()
            except (RedisError, OSError) as exc:  # a cluster whose slot map cannot be read
                unreachable[node.safe_url] = f"{type(exc).__name__}: {exc}"
                continue
            servers += masters
            owners += [node.safe_url] * len(masters)
        calls = [Call.command("CONFIG", "GET", p) for p in CONFIG_PARAMETERS]
        calls += [Call.command("INFO", s) for s in INFO_SECTIONS]
        replies = fan_out(servers, [calls] * len(servers), timeout=timeout)
        facts = []
        for node in nodeset.nodes:
            if node.safe_url in unreachable:
                facts.append(NodeFacts(node.safe_url, error=unreachable[node.safe_url]))
            for i, owner in enumerate(owners):
                if owner != node.safe_url:
                    continue
                reply = replies[i]
                assert reply is not None  # no `decided`: every node has a reply
                server_facts = node_facts(reply)
                if servers[i] is not node:
                    server_facts.lock_node = owner
                if server_facts.error is None:
                    _measure_clock(servers[i], server_facts, clock, timeout)
                    if prefix is not None:
                        _find_permanent_keys(servers[i], server_facts, prefix, timeout)
                facts.append(server_facts)
        return facts
    finally:
        nodeset.close()


#: Keys of the prefix ``doctor`` reads on each server at most (SCAN, then PTTL each).
PERMANENT_SCAN_LIMIT = 100_000
#: Keys without a TTL named in the report, at most.
PERMANENT_SHOWN = 5


def _find_permanent_keys(server: Server, facts: NodeFacts, prefix: str, timeout: float) -> None:
    """Count the keys of ``prefix`` with no TTL on ``server`` (bounded: SCAN, PTTL).

    Every key this version writes expires (README: bounded memory); one without a
    TTL was left by an earlier version (its fence counters) and stays for ever.
    """
    pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
    cursor = "0"
    while True:
        scan = Call.command("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
        reply = fan_out([server], [[scan]], timeout=timeout)[0]
        if reply is None or not reply.ok or isinstance(reply.values[0], Exception):
            facts.keys_complete = False
            return
        cursor, found = reply.values[0]
        if found:
            pttls = fan_out([server], [[Call.command("PTTL", k) for k in found]], timeout=timeout)[
                0
            ]
            if pttls is None or not pttls.ok:
                facts.keys_complete = False
                return
            for key, pttl in zip(found, pttls.values, strict=True):
                if pttl == -1:
                    facts.permanent_count += 1
                    if len(facts.permanent_keys) < PERMANENT_SHOWN:
                        facts.permanent_keys.append(str(key))
            facts.keys_scanned += len(found)
        if str(cursor) == "0":
            return
        if facts.keys_scanned >= PERMANENT_SCAN_LIMIT:
            facts.keys_complete = False
            return


def _measure_clock(
    server: Server, facts: NodeFacts, clock: Callable[[], float], timeout: float
) -> None:
    """Skew from the TIME sample with the shortest round trip (least uncertainty)."""
    best: tuple[float, float] | None = None
    for _ in range(CLOCK_SAMPLES):
        sent = clock()
        started = time.monotonic()
        reply = fan_out([server], [[Call.command("TIME")]], timeout=timeout)[0]
        rtt = time.monotonic() - started
        received = clock()
        skew = time_skew(reply, sent, received)
        if skew is None:
            continue
        if best is None or rtt < best[0]:
            best = (rtt, skew)
    if best is not None:
        facts.rtt = best[0]
        facts.clock_uncertainty = best[0] / 2
        facts.clock_skew = best[1]


def beat_leader(app: Any, settings: Settings, *, timeout: float) -> BeatLeaderFacts:
    """Who holds this app's beat leader lock (and the older default name's).

    The older name (``beat:<main>``) is looked up only when ``redlock_beat_name`` is
    unset and this version derives another name. A node that does not answer adds no
    holder: its ``node-unreachable`` finding already says so.
    """
    from ...integration.beat import broker_identity, leader_name  # noqa: PLC0415 (beat imports Celery's scheduler)

    try:
        broker = broker_identity(app)
        names = [leader_name(app, settings.beat_name)]
    except ConfigurationError as exc:
        return BeatLeaderFacts(error=str(exc))
    legacy = f"beat:{app.main or 'celery'}"
    if settings.beat_name is None and legacy != names[0]:
        names.append(legacy)
    keys = [lock_keys(name, settings.key_prefix).lock for name in names]
    nodeset = NodeSet(settings.node_urls(), timeout=timeout)
    try:
        replies = nodeset.call([Call.command("HGET", key, "task_name") for key in keys])
    finally:
        nodeset.close()
    holders: list[list[str]] = [[] for _ in keys]
    for reply in replies:
        if reply is None or reply.error is not None:
            continue
        for found, value in zip(holders, reply.values, strict=True):
            if isinstance(value, str) and value:
                found.append(value)
    locks = (
        LeaderLock(key, tuple(found), legacy=i > 0)
        for i, (key, found) in enumerate(zip(keys, holders, strict=True))
    )
    return BeatLeaderFacts(broker, tuple(locks))


def declared_options(app: Any, *, timeout: float) -> dict[str, dict[str, Any]] | None:
    """Each worker's locked tasks and their options (the ``redlock_options`` command).

    None when no worker answered (or the broker could not be reached): nothing to
    compare. A worker of an older version does not know the command and is left out.
    """
    try:
        replies = app.control.broadcast("redlock_options", reply=True, timeout=timeout)
    except Exception:  # the broker: doctor reports the lock nodes regardless
        return None
    found = {
        worker: tasks
        for reply in replies or ()
        for worker, tasks in reply.items()
        if isinstance(tasks, dict) and "error" not in tasks
    }
    return found or None


def overdue_runs(settings: Settings, *, timeout: float) -> list[ParkedView]:
    """The parked runs no worker took in time: due longer ago than :data:`OVERDUE`.

    A live worker's publisher takes a run within a tick of its due time, and a taken run
    is due again only when its copy did not start within the take's lease; so a run due
    longer ago than that lease and more has been waiting for a worker, not its turn.
    """
    nodeset = NodeSet(settings.node_urls(), timeout=timeout)
    try:
        runs, _ = parked_runs(nodeset, settings.key_prefix, timeout=timeout)
    finally:
        nodeset.close()
    return [run for run in runs if run.due_in < -OVERDUE]


def backlogs(settings: Settings, *, timeout: float) -> list[Backlog]:
    """The keys with a rate budget and runs waiting on the queue for it (SCAN, never KEYS).

    A node that does not answer adds nothing: its ``node-unreachable`` finding says so.
    """
    nodeset = NodeSet(settings.node_urls(), timeout=timeout)
    try:
        views, _ = held_budgets(nodeset, settings.key_prefix, timeout=timeout)
    finally:
        nodeset.close()
    return [
        Backlog(view.key, view.queued, budget.limit, budget.window)
        for view in views
        if (budget := view.budget) is not None and view.queued
    ]
