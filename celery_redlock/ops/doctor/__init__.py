"""``celery redlock doctor``: whether the lock nodes and the app's settings are safe.

Two layers, as RedBeat's ``checks.py``:

* **Pure checks** turn what the nodes answered (``CONFIG GET``, ``INFO``, ``TIME``)
  and the app's settings into :class:`Finding` objects. They open no sockets, so each
  is unit-tested with crafted replies.
* **The collector** (:func:`collect`) asks every lock node once, concurrently, with
  the node timeout and no retries, and reads the registered tasks' lock options.
  :func:`evaluate` runs every check over what it gathered.

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
====================== ======= ===============================================

Exit status of the command (:func:`exit_code`): 0 without error findings; 1 with
error findings; ``EX_UNAVAILABLE`` (69) when a node could not be asked at all (the
report is then incomplete, whatever else it says).
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery.platforms import EX_UNAVAILABLE
from redis.exceptions import RedisError, ResponseError

from ...engine.keys import lock_keys
from ...engine.timing import drift_allowance
from ...exceptions import ConfigurationError
from ...nodes import Call, NodeSet, Server, fan_out
from ...settings import Settings, from_conf

__all__ = [
    "ERROR",
    "LEVELS",
    "OK",
    "WARN",
    "Finding",
    "LeaseInUse",
    "NodeFacts",
    "Report",
    "TaskLocking",
    "beat_leader_findings",
    "check_beat_leader",
    "check_clock",
    "check_eviction",
    "check_independent",
    "check_latency",
    "check_node_count",
    "check_persistence",
    "check_reachable",
    "check_replication",
    "check_settings",
    "check_uptime",
    "close_nodeset",
    "collect",
    "diagnose",
    "durable",
    "evaluate",
    "exit_code",
    "leases",
    "parse_info",
    "probe_nodes",
    "task_locking",
]

OK, WARN, ERROR = "ok", "warn", "error"
LEVELS = (OK, WARN, ERROR)

#: CONFIG GET parameters the checks read, one call each (Redis 6.2 takes one per call).
CONFIG_PARAMETERS = ("maxmemory-policy", "maxmemory", "appendonly", "appendfsync", "save")
#: INFO sections the checks read.
INFO_SECTIONS = ("server", "replication", "persistence", "memory")
#: TIME round trips per node; the one with the shortest round trip measures the skew.
CLOCK_SAMPLES = 3

# -- message templates: problem, consequence, fix ----------------------------------

EVICTING_MESSAGE = (
    "maxmemory-policy is {policy!r} ({limit}): {victims} When a lock key is evicted, "
    "the lock disappears while its holder still runs and another worker takes it{fences}. "
    "Fix: CONFIG SET maxmemory-policy noeviction (and set it in redis.conf), or give the "
    "locks a Redis server of their own."
)
PERSISTENCE_OFF_MESSAGE = (
    "persistence is off (appendonly no, no RDB save points): a restart of this node "
    "forgets every lock it granted and its fence counters. {consequence} Fix: appendonly "
    "yes and appendfsync always, or keep a restarted node out for one max lease (delayed "
    "restart)."
)
RDB_ONLY_MESSAGE = (
    "only RDB snapshots (save {save!r}), no AOF: a restart brings back the last snapshot, "
    "so locks granted since then are forgotten and fence counters go back. {consequence} "
    "Fix: appendonly yes and appendfsync always."
)
FSYNC_MESSAGE = (
    "appendonly yes but appendfsync {fsync}: a crash of the machine (power, kernel) loses "
    "the writes of the last {window}, so this node may forget a lock it just granted and "
    "let a second holder in. Fix: appendfsync always (each acquisition is then on disk "
    "before it is granted), or delay restarts after a machine crash by one max lease."
)
REDLOCK_RESTART = (
    "With Redlock, a node that forgot a lock lets another client reach a majority while "
    "the holder still runs."
)
SINGLE_RESTART = (
    "With one node, a quick restart lets another worker take a lock whose holder learns "
    "of the loss only at its next renewal."
)
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
REPLICA_MESSAGE = (
    "this node is a read-only replica (of {master}): every acquisition on it fails with "
    "READONLY, so it never votes. Fix: list masters in redlock_nodes."
)
REPLICAS_WITHOUT_WAIT_MESSAGE = (
    "{replicas} replica(s) connected, and redlock_min_replicas is 0: replication is "
    "asynchronous, so after a failover the promoted replica may lack a lock granted just "
    "before and grant it again while its holder runs. Fix: redlock_min_replicas = "
    "{replicas} (every acquisition waits for the replicas with WAIT), or no automatic "
    "failover for lock nodes (Redlock wants independent masters)."
)
MIN_REPLICAS_MESSAGE = (
    "redlock_min_replicas is {wanted} but this node has {replicas} connected replica(s): "
    "WAIT can never be satisfied, so this node refuses every acquisition{majority}. Fix: "
    "attach the replicas, or lower redlock_min_replicas to {replicas}."
)
RESTART_MESSAGE = (
    "up for {uptime}, less than the longest lease ({ttl}s, {source}), and writes are not "
    "fsynced one by one: if this was a restart that lost data, locks granted before it "
    "may be granted again while their holders still run. Fix: keep a restarted node out "
    "for one max lease before it takes traffic (delayed restart), or appendonly yes with "
    "appendfsync always."
)
CLOCK_MESSAGE = (
    "clock differs from this host's by {skew:+.3f}s (measured to ±{uncertainty:.3f}s), more "
    "than the drift allowance of {budget:.3f}s ({source}): a clock this far off is not "
    "synchronised, and when it is stepped forward later Redis expires keys early, so "
    "locks end before their holders' deadlines. Fix: run NTP (chrony) on the Redis hosts "
    "and on this one; check which of the two clocks is wrong."
)
SLOW_MESSAGE = (
    "round trip {rtt:.0f} ms, more than half the node timeout ({budget:.0f} ms): "
    "acquisitions and renewals on this node will often time out, and a lease whose "
    "renewals time out is declared lost. Fix: put the lock nodes near the workers, or "
    "raise redlock_node_timeout (it must stay below the renewal interval)."
)
FAIL_OPEN_MESSAGE = (
    "redlock_fail_open is True: when Redis cannot be reached, locked tasks run without "
    "their lock, so an outage is exactly when two runs can overlap. Fix: leave it False "
    "unless running twice is harmless for every locked task."
)
DRIFT_ZERO_MESSAGE = (
    "redlock_drift_factor is 0: leases assume the clocks of this host and of Redis run at "
    "exactly the same rate, so a holder may trust its lease a little after Redis expired "
    "it. Fix: keep the default 0.01."
)
RENEW_SLACK_MESSAGE = (
    "{where}renews every {interval}s for a {ttl}s lease: a renewal delayed by more than "
    "{slack:.3f}s (a GC pause, a starved thread, a slow node) loses the lock. Fix: renew "
    "every ttl/3 (the default: leave the renew interval unset)."
)
ON_LOST_IGNORE_MESSAGE = (
    "task {task} has on_lost='ignore': after losing its lock it keeps running while "
    "another run may hold the lock. Fix: on_lost='abort' (the default), or pass "
    "self.lock.fence to the storage so that it rejects the late writer."
)
WAIT_LIMIT_MESSAGE = (
    "task {task} waits up to {wait}s for a busy lock (on_busy='wait'), but its "
    "{limit_name} is {limit}s: it can be {what} while still waiting. Fix: "
    "lock_wait_timeout below the time limit, or on_busy='retry'."
)
INVALID_TASK_MESSAGE = (
    "{source}: {error}. A worker that loads it refuses to start. Fix the option named."
)
UNMATCHED_MESSAGE = (
    "redlock_tasks pattern {pattern!r} matches no task registered here: a typo leaves the "
    "tasks it meant unlocked. (Tasks in modules this command did not import are not "
    "seen: list them in the app's imports or include.)"
)


# -- data --------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One result of a check.

    Arguments:
        level: ``ok``, ``warn`` or ``error``.
        code: stable identifier of the check (``evicting-policy``...).
        message: the problem, its consequence and the fix (or what is fine).
        node: the node it is about (sanitized URL), or ``None`` for the setup.
    """

    level: str
    code: str
    message: str
    node: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form with stable keys: level, code, node, message."""
        return {"level": self.level, "code": self.code, "node": self.node, "message": self.message}


@dataclass
class NodeFacts:
    """What one node answered.

    ``config`` maps CONFIG GET parameters to values; it is empty, with
    ``config_error`` set, when the server refused CONFIG (managed services rename or
    disable it). ``info`` holds the fields of the INFO sections read. The clock skew is
    the node's clock minus this host's, measured at the midpoint of the round trip;
    ``clock_uncertainty`` is half that round trip.
    """

    node: str
    error: str | None = None
    config: dict[str, str] = field(default_factory=dict)
    config_error: str | None = None
    info: dict[str, str] = field(default_factory=dict)
    clock_skew: float | None = None
    clock_uncertainty: float | None = None
    rtt: float | None = None
    #: The Redis Cluster lock node this master belongs to (None: it is a lock node).
    lock_node: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary of the facts the checks used."""
        info = {k: self.info[k] for k in _SHOWN_INFO if k in self.info}
        return {
            "node": self.node,
            "error": self.error,
            "config": dict(self.config),
            "config_error": self.config_error,
            "info": info,
            "clock_skew": _round(self.clock_skew),
            "clock_uncertainty": _round(self.clock_uncertainty),
            "rtt": _round(self.rtt),
            "lock_node": self.lock_node,
        }


_SHOWN_INFO = (
    "redis_version",
    "valkey_version",
    "run_id",
    "uptime_in_seconds",
    "role",
    "connected_slaves",
    "aof_enabled",
    "maxmemory",
    "maxmemory_policy",
)


@dataclass(frozen=True)
class LeaseInUse:
    """A lease length in use, and where it comes from (for messages)."""

    source: str
    ttl: float


@dataclass(frozen=True)
class TaskLocking:
    """The lock options of one task, as a worker would resolve them.

    ``error`` is the :class:`ConfigurationError` message when they do not validate
    (the worker would refuse to start); the other fields are then best effort.
    """

    name: str
    source: str
    ttl: float | None = None
    renew_interval: float | None = None
    on_busy: str | None = None
    on_lost: str | None = None
    wait_timeout: float | None = None
    time_limit: float | None = None
    soft_time_limit: float | None = None
    error: str | None = None


# -- parsing -----------------------------------------------------------------------


def parse_info(text: str) -> dict[str, str]:
    """Fields of an INFO reply: ``{"uptime_in_seconds": "12", ...}`` (values as text)."""
    fields: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or ":" not in line:
            continue
        name, value = line.split(":", 1)
        fields[name] = value
    return fields


def _int(value: Any, default: int | None = None) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:g}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# -- node checks (pure) ------------------------------------------------------------


def check_reachable(facts: NodeFacts) -> Finding:
    """``error`` when the node could not be asked at all."""
    if facts.error is not None:
        return Finding(
            ERROR,
            "node-unreachable",
            f"could not be asked: {facts.error.rstrip('.')}. Locks need a majority of nodes; "
            "its state is not checked. Fix: start it, or check the URL, network and credentials.",
            facts.node,
        )
    return Finding(OK, "reachable", "answered", facts.node)


def check_eviction(node: str, config: Mapping[str, Any], info: Mapping[str, Any]) -> Finding:
    """Whether Redis may evict lock keys (``maxmemory-policy``).

    Any ``allkeys-*`` policy may evict lock hashes and fence counters. Every
    ``volatile-*`` policy evicts keys that have a TTL, and every lock key has one
    (``volatile-ttl`` even picks the keys closest to expiry first). Both are errors
    whatever ``maxmemory`` is: with no limit set nothing is evicted today, but the
    policy turns on the moment a limit is set (CONFIG SET, or a managed service's
    default), without a restart and without anyone looking at the locks.
    """
    policy = config.get("maxmemory-policy") or info.get("maxmemory_policy")
    maxmemory = _int(config.get("maxmemory", info.get("maxmemory")))
    if not policy:
        return Finding(
            WARN,
            "evicting-policy",
            "maxmemory-policy could not be read (CONFIG refused, INFO without it): "
            "check that it is noeviction, or lock keys may be evicted.",
            node,
        )
    policy = str(policy).lower()
    if policy == "noeviction":
        return Finding(OK, "eviction", "maxmemory-policy is noeviction", node)
    limit = (
        "maxmemory is not set yet, so nothing is evicted today; a limit set later turns eviction on"
        if not maxmemory
        else f"maxmemory {maxmemory} bytes"
    )
    if policy.startswith("allkeys-"):
        victims = "when memory is full Redis deletes any key, lock hashes included."
        fences = ", and an evicted fence counter starts again from 1 (fences go back)"
    elif policy.startswith("volatile-"):
        victims = (
            "when memory is full Redis deletes keys that have a TTL, and every lock key "
            "has one (volatile-ttl even evicts the keys closest to expiry first)."
        )
        fences = ""
    else:
        return Finding(
            WARN,
            "evicting-policy",
            f"maxmemory-policy is {policy!r}, unknown to this check: make sure it never "
            "evicts keys with a TTL, or use noeviction.",
            node,
        )
    return Finding(
        ERROR,
        "evicting-policy",
        EVICTING_MESSAGE.format(policy=policy, limit=limit, victims=victims, fences=fences),
        node,
    )


def durable(config: Mapping[str, Any]) -> bool:
    """Whether every write is on disk before Redis answers (AOF with fsync always)."""
    return (
        str(config.get("appendonly", "")).lower() == "yes"
        and str(config.get("appendfsync", "")).lower() == "always"
    )


def check_persistence(
    node: str, config: Mapping[str, Any], info: Mapping[str, Any], *, redlock: bool
) -> Finding:
    """What a restart of the node forgets.

    With Redlock (2+ nodes), a node that forgets a lock lets a second client reach a
    majority, so no persistence is an error and AOF without ``appendfsync always`` a
    warning. With one node the same restart opens a window until the holder's next
    renewal, and the deployment already accepts a single point of failure: no
    persistence is a warning and the fsync policy is not reported.
    """
    appendonly = config.get("appendonly")
    if appendonly is None and "aof_enabled" in info:
        appendonly = "yes" if str(info["aof_enabled"]) == "1" else "no"
    if appendonly is None:
        return Finding(
            WARN,
            "persistence-unknown",
            "persistence settings could not be read (CONFIG refused): check appendonly "
            "yes and appendfsync always.",
            node,
        )
    consequence = REDLOCK_RESTART if redlock else SINGLE_RESTART
    if str(appendonly).lower() == "yes":
        fsync = str(config.get("appendfsync", "")).lower()
        if fsync == "always" or not redlock:
            what = f"appendonly yes, appendfsync {fsync or 'unknown'}"
            return Finding(OK, "persistence", what, node)
        if not fsync:
            return Finding(
                WARN,
                "appendfsync-not-always",
                "appendfsync could not be read (CONFIG refused): use appendfsync always.",
                node,
            )
        window = "second" if fsync == "everysec" else "30 seconds or so (the OS decides)"
        return Finding(
            WARN, "appendfsync-not-always", FSYNC_MESSAGE.format(fsync=fsync, window=window), node
        )
    level = ERROR if redlock else WARN
    save = config.get("save")
    if save:
        return Finding(
            level,
            "persistence-rdb-only",
            RDB_ONLY_MESSAGE.format(save=save, consequence=consequence),
            node,
        )
    return Finding(
        level, "persistence-off", PERSISTENCE_OFF_MESSAGE.format(consequence=consequence), node
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


def check_replication(
    node: str, info: Mapping[str, Any], min_replicas: int, *, majority_needed: bool = True
) -> Finding:
    """The node is a master, and its replicas match ``redlock_min_replicas``."""
    role = str(info.get("role", "master"))
    if role in ("slave", "replica"):
        master = f"{info.get('master_host', '?')}:{info.get('master_port', '?')}"
        return Finding(ERROR, "node-is-replica", REPLICA_MESSAGE.format(master=master), node)
    replicas = _int(info.get("connected_slaves"), 0) or 0
    if min_replicas > replicas:
        majority = "; with a majority of such nodes no lock can be taken" if majority_needed else ""
        return Finding(
            ERROR,
            "min-replicas-unmet",
            MIN_REPLICAS_MESSAGE.format(wanted=min_replicas, replicas=replicas, majority=majority),
            node,
        )
    if replicas and not min_replicas:
        return Finding(
            WARN,
            "replicas-without-wait",
            REPLICAS_WITHOUT_WAIT_MESSAGE.format(replicas=replicas),
            node,
        )
    what = f"master with {replicas} replica(s), redlock_min_replicas {min_replicas}"
    return Finding(OK, "replication", what, node)


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


def check_uptime(
    node: str, info: Mapping[str, Any], config: Mapping[str, Any], longest: LeaseInUse
) -> Finding | None:
    """A node up for less than the longest lease may have forgotten locks (delayed restart).

    A node that fsyncs every write forgot nothing in a restart, so its uptime does not
    matter; otherwise Redis's own answer is to keep a restarted node out for one max
    lease, which this check cannot see, so it warns.
    """
    uptime = _int(info.get("uptime_in_seconds"))
    if uptime is None:
        return None
    if uptime >= longest.ttl:
        return Finding(OK, "uptime", f"up {_duration(uptime)}", node)
    if durable(config):
        return Finding(
            OK,
            "uptime",
            f"up {_duration(uptime)}, less than the longest lease ({longest.ttl:g}s), but "
            "every write is fsynced: a restart forgot nothing",
            node,
        )
    return Finding(
        WARN,
        "recent-restart",
        RESTART_MESSAGE.format(
            uptime=_duration(uptime), ttl=f"{longest.ttl:g}", source=longest.source
        ),
        node,
    )


def check_clock(
    node: str, skew: float | None, uncertainty: float | None, budget: float, source: str
) -> Finding | None:
    """The node's clock agrees with this host's within the drift allowance.

    Only the part of the skew that the round trip cannot explain counts.
    """
    if skew is None:
        return None
    uncertainty = uncertainty or 0.0
    if abs(skew) - uncertainty > budget:
        return Finding(
            WARN,
            "clock-skew",
            CLOCK_MESSAGE.format(skew=skew, uncertainty=uncertainty, budget=budget, source=source),
            node,
        )
    return Finding(
        OK,
        "clock",
        f"clock within {abs(skew):.3f}s of this host's (±{uncertainty:.3f}s)",
        node,
    )


def check_latency(node: str, rtt: float | None, node_timeout: float) -> Finding | None:
    """The round trip leaves room in the node timeout."""
    if rtt is None:
        return None
    if rtt > node_timeout / 2:
        return Finding(
            WARN,
            "slow-node",
            SLOW_MESSAGE.format(rtt=rtt * 1000, budget=node_timeout * 1000),
            node,
        )
    return Finding(OK, "latency", f"round trip {rtt * 1000:.1f} ms", node)


# -- settings checks (pure) --------------------------------------------------------


def leases(settings: Settings, tasks: Iterable[TaskLocking]) -> list[LeaseInUse]:
    """Every lease length in use: the default, beat's, each task's, each pattern's."""
    found = [
        LeaseInUse("redlock_ttl", settings.ttl),
        LeaseInUse("redlock_beat_ttl", settings.beat_ttl),
    ]
    for pattern, options in (settings.tasks or {}).items():
        ttl = options.get("ttl")
        if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl > 0:
            found.append(LeaseInUse(f"redlock_tasks[{pattern!r}]", float(ttl)))
    found += [LeaseInUse(f"task {t.name}", t.ttl) for t in tasks if t.ttl and t.error is None]
    return found


def _renew_slack(where: str, ttl: float, interval: float | None) -> Finding | None:
    interval = ttl / 3 if interval is None else interval
    if interval <= ttl / 2:
        return None
    return Finding(
        WARN,
        "renew-slack",
        RENEW_SLACK_MESSAGE.format(
            where=where, interval=f"{interval:g}", ttl=f"{ttl:g}", slack=ttl - interval
        ),
    )


def check_settings(
    settings: Settings, tasks: Sequence[TaskLocking], unmatched: Sequence[str] = ()
) -> list[Finding]:
    """Settings that validate but are risky, and task options that do not validate.

    What is reported (settings that cannot work at all are already refused by
    :func:`celery_redlock.settings.from_conf` and never get here):

    * ``redlock_fail_open``: tasks run unlocked during an outage.
    * ``redlock_drift_factor = 0``: no allowance for clock rate differences.
    * a renewal interval above half the lease (global or per task): little room
      for one late renewal.
    * ``on_lost="ignore"`` on a task: it runs on without the lock.
    * ``on_busy="wait"`` with a wait timeout at or above the task's soft or hard time
      limit: the wait itself can be killed.
    * task options a worker would refuse, and ``redlock_tasks`` patterns matching
      nothing.
    """
    findings: list[Finding] = []
    if settings.fail_open:
        findings.append(Finding(WARN, "fail-open", FAIL_OPEN_MESSAGE))
    if settings.drift_factor == 0:
        findings.append(Finding(WARN, "drift-factor-zero", DRIFT_ZERO_MESSAGE))
    slack = _renew_slack("redlock_renew_interval: ", settings.ttl, settings.renew_interval)
    if slack is not None:
        findings.append(slack)
    for task in tasks:
        if task.error is not None:
            findings.append(
                Finding(
                    ERROR,
                    "invalid-task-options",
                    INVALID_TASK_MESSAGE.format(source=task.source, error=task.error),
                )
            )
            continue
        default = settings.timing
        inherited = (task.ttl, task.renew_interval) == (default.ttl, default.renew_interval)
        if task.ttl is not None and not inherited:  # the global check covers inherited ones
            slack = _renew_slack(f"task {task.name} ", task.ttl, task.renew_interval)
            if slack is not None:
                findings.append(slack)
        if task.on_lost == "ignore":
            findings.append(
                Finding(WARN, "on-lost-ignore", ON_LOST_IGNORE_MESSAGE.format(task=task.name))
            )
        if task.on_busy == "wait" and task.wait_timeout is not None:
            for limit_name, limit, what in (
                ("soft_time_limit", task.soft_time_limit, "interrupted (SoftTimeLimitExceeded)"),
                ("time_limit", task.time_limit, "killed"),
            ):
                if limit and task.wait_timeout >= limit:
                    findings.append(
                        Finding(
                            WARN,
                            "wait-exceeds-limit",
                            WAIT_LIMIT_MESSAGE.format(
                                task=task.name,
                                wait=f"{task.wait_timeout:g}",
                                limit_name=limit_name,
                                limit=f"{limit:g}",
                                what=what,
                            ),
                        )
                    )
                    break
    findings += [
        Finding(WARN, "unmatched-pattern", UNMATCHED_MESSAGE.format(pattern=p)) for p in unmatched
    ]
    if not findings:
        locked = len(tasks)
        findings.append(
            Finding(OK, "settings", f"settings and the lock options of {locked} task(s) are sound")
        )
    return findings


# -- everything (pure) -------------------------------------------------------------


def evaluate(
    settings: Settings,
    facts: Sequence[NodeFacts],
    tasks: Sequence[TaskLocking] = (),
    unmatched: Sequence[str] = (),
) -> list[Finding]:
    """Run every check over the gathered facts.

    The setup's findings (node count, independence, settings) come first, then each
    node's, in the order of the configured nodes.
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
        if node.config_error is not None:
            findings.append(
                Finding(
                    WARN,
                    "config-unreadable",
                    f"CONFIG GET was refused ({node.config_error}); eviction and persistence "
                    "were checked from INFO where possible. Managed services disable CONFIG: "
                    "check maxmemory-policy noeviction and appendfsync always in the "
                    "provider's settings.",
                    node.node,
                )
            )
        findings.append(check_eviction(node.node, node.config, node.info))
        findings.append(check_persistence(node.node, node.config, node.info, redlock=redlock))
        findings.append(
            check_replication(node.node, node.info, settings.min_replicas, majority_needed=redlock)
        )
        optional = (
            check_uptime(node.node, node.info, node.config, longest),
            check_clock(node.node, node.clock_skew, node.clock_uncertainty, budget, budget_source),
            check_latency(node.node, node.rtt, node_timeout),
        )
        findings += [f for f in optional if f is not None]
    return findings


def check_beat_leader(
    key: str, holders: Sequence[str], broker: str, *, legacy: bool = False
) -> Finding | None:
    """Who holds this app's beat leader lock ``key``, against this app's broker.

    ``holders`` are the nodes' ``task_name`` of the lock; ``broker`` is this app's
    broker identity (:func:`celery_redlock.beat.broker_identity`). With ``legacy``,
    ``key`` is the name older versions derived (``beat:<main>``) while this app derives
    another: whoever holds it leads besides this app's beat. None when no node holds it.
    """
    from ...beat import parse_beat_holder  # noqa: PLC0415 (beat imports Celery's scheduler)

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
    if leader["broker"] != broker:
        return Finding(
            ERROR,
            "beat-leader-foreign",
            f"beat leader lock {key} is held by a beat of another project ({where}, "
            f"broker {leader['broker']}; this app's broker is {broker}): this project's "
            "periodic tasks are not sent while it leads. Fix: give each project its own "
            "redlock_beat_name (or leave it unset: the default tells brokers apart).",
        )
    return Finding(OK, "beat-leader", f"beat leader lock {key} is held by {where}")


def exit_code(findings: Iterable[Finding]) -> int:
    """0 without errors; ``EX_UNAVAILABLE`` if a node was unreachable; else 1."""
    findings = list(findings)
    if any(f.code == "node-unreachable" and f.level == ERROR for f in findings):
        return EX_UNAVAILABLE
    if any(f.level == ERROR for f in findings):
        return 1
    return 0


# -- collecting (I/O) --------------------------------------------------------------


def task_locking(app: Any, settings: Settings) -> tuple[list[TaskLocking], list[str]]:
    """The lock options of every locked task of ``app``, and the unmatched patterns.

    A task is locked when it is a :class:`~celery_redlock.LockedTask`, or when a
    ``redlock_tasks`` pattern names it (first match in the dict's order, as the
    worker does). Its options are resolved by the worker's own function
    (:func:`celery_redlock.task.task_options`), so an error here is exactly one that
    stops the worker. Tasks are not modified.
    """
    from ...task import LockedTask, task_options  # noqa: PLC0415 (keeps import of this module light)

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
            )
        )
    unmatched = [p for p in patterns if p not in matched]
    return found, unmatched


def probe_nodes(
    urls: Sequence[str],
    *,
    timeout: float,
    clock: Callable[[], float] = time.time,
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
                assert replies[i] is not None  # no `decided`: every node has a reply
                server_facts = _facts(replies[i])
                if servers[i] is not node:
                    server_facts.lock_node = owner
                if server_facts.error is None:
                    _measure_clock(servers[i], server_facts, clock, timeout)
                facts.append(server_facts)
        return facts
    finally:
        close_nodeset(nodeset)


def _facts(reply: Any) -> NodeFacts:
    facts = NodeFacts(reply.node.safe_url)
    if reply.error is not None:
        facts.error = f"{type(reply.error).__name__}: {reply.error}"
        return facts
    n_config = len(CONFIG_PARAMETERS)
    for value in reply.values[:n_config]:
        if isinstance(value, ResponseError):
            facts.config_error = str(value)
            continue
        flat = list(value or [])
        facts.config.update(zip(flat[::2], flat[1::2], strict=False))
    for value in reply.values[n_config:]:
        if isinstance(value, ResponseError):
            continue
        facts.info.update(parse_info(value if isinstance(value, str) else str(value)))
    return facts


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
        if reply is None or reply.error is not None or isinstance(reply.values[0], ResponseError):
            continue
        seconds, micros = reply.values[0]
        skew = int(seconds) + int(micros) / 1e6 - (sent + received) / 2
        if best is None or rtt < best[0]:
            best = (rtt, skew)
    if best is not None:
        facts.rtt = best[0]
        facts.clock_uncertainty = best[0] / 2
        facts.clock_skew = best[1]


def beat_leader_findings(app: Any, settings: Settings, *, timeout: float) -> list[Finding]:
    """Read who holds this app's beat leader lock (and the older default name's)."""
    from ...beat import broker_identity, leader_name  # noqa: PLC0415

    try:
        broker = broker_identity(app)
        names = [leader_name(app, settings.beat_name)]
    except ConfigurationError as exc:
        return [Finding(WARN, "beat-leader-unknown", f"beat leader lock not checked: {exc}")]
    legacy = f"beat:{app.main or 'celery'}"
    if settings.beat_name is None and legacy != names[0]:
        names.append(legacy)
    keys = [lock_keys(name, settings.key_prefix).lock for name in names]
    nodeset = NodeSet(settings.node_urls(), timeout=timeout)
    try:
        replies = nodeset.call([Call.command("HGET", key, "task_name") for key in keys])
    finally:
        close_nodeset(nodeset)
    holders: list[list[str]] = [[] for _ in keys]
    for reply in replies:
        if reply is None or reply.error is not None:
            continue  # node-unreachable already says so
        for found, value in zip(holders, reply.values, strict=True):
            if isinstance(value, str) and value:
                found.append(value)
    findings = [
        check_beat_leader(key, found, broker, legacy=i > 0)
        for i, (key, found) in enumerate(zip(keys, holders, strict=True))
    ]
    return [f for f in findings if f is not None]


def close_nodeset(nodeset: NodeSet) -> None:
    """Close the connections of a NodeSet this process will not use again."""
    for node in nodeset.nodes:
        # A short-lived command owns this NodeSet alone, so closing its pooled
        # connections cannot pull a socket from under anyone.
        node.close()


@dataclass
class Report:
    """What :func:`diagnose` found: the findings, the node facts and the exit code."""

    findings: list[Finding]
    facts: list[NodeFacts]

    @property
    def exit_code(self) -> int:
        """The command's exit status (see :func:`exit_code`)."""
        return exit_code(self.findings)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form: ok, exit_code, counts, findings, nodes."""
        counts = {level: sum(f.level == level for f in self.findings) for level in LEVELS}
        return {
            "ok": self.exit_code == 0,
            "exit_code": self.exit_code,
            "counts": counts,
            "findings": [f.as_dict() for f in self.findings],
            "nodes": [n.as_dict() for n in self.facts],
        }


def collect(
    app: Any, *, timeout: float
) -> tuple[Settings, list[NodeFacts], list[TaskLocking], list[str]]:
    """Read the app's settings and tasks and ask its lock nodes; raises ConfigurationError."""
    settings = from_conf(app.conf)
    urls = settings.node_urls()
    tasks, unmatched = task_locking(app, settings)
    return settings, probe_nodes(urls, timeout=timeout), tasks, unmatched


def diagnose(app: Any, *, timeout: float = 1.0) -> Report:
    """Everything ``celery redlock doctor`` reports, for ``app``."""
    try:
        settings, facts, tasks, unmatched = collect(app, timeout=timeout)
    except ConfigurationError as exc:
        return Report(
            [
                Finding(
                    ERROR,
                    "invalid-settings",
                    f"{exc}. Workers with this configuration refuse to start; nothing else "
                    "was checked.",
                )
            ],
            [],
        )
    findings = evaluate(settings, facts, tasks, unmatched)
    findings += beat_leader_findings(app, settings, timeout=timeout)
    return Report(findings, facts)
