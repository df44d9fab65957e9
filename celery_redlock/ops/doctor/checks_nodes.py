"""Checks of each lock node: pure functions of what it replied.

Each check takes what a node answered (``CONFIG GET``, ``INFO``, ``TIME``, as
:class:`~.facts.NodeFacts` or its parts) and returns a :class:`~.report.Finding`
whose message states the problem, what it leads to and the fix. None opens a socket,
so each is unit-tested with crafted replies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .facts import LeaseInUse, NodeFacts
from .report import ERROR, OK, WARN, Finding

__all__ = [
    "check_clock",
    "check_config_access",
    "check_eviction",
    "check_latency",
    "check_persistence",
    "check_reachable",
    "check_replication",
    "check_uptime",
    "durable",
]

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
CONFIG_UNREADABLE_MESSAGE = (
    "CONFIG GET was refused ({error}); eviction and persistence were checked from INFO "
    "where possible. Managed services disable CONFIG: check maxmemory-policy noeviction "
    "and appendfsync always in the provider's settings."
)


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


def check_config_access(facts: NodeFacts) -> Finding | None:
    """A warning when the node refused CONFIG (the other checks then read INFO)."""
    if facts.config_error is None:
        return None
    return Finding(
        WARN,
        "config-unreadable",
        CONFIG_UNREADABLE_MESSAGE.format(error=facts.config_error),
        facts.node,
    )


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


def _int(value: Any, default: int | None = None) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:g}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
