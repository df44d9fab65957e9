"""What ``doctor`` collected, as plain values, and the parsing of the nodes' raw replies.

:mod:`.collect` asks the nodes and the app and builds these; :mod:`.checks` reads
them and nothing else, so each check is a pure function of values a test can craft.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ResponseError

from ...nodes import Reply

__all__ = [
    "CONFIG_PARAMETERS",
    "INFO_SECTIONS",
    "Backlog",
    "BeatLeaderFacts",
    "LeaderLock",
    "LeaseInUse",
    "NodeFacts",
    "TaskLocking",
    "node_facts",
    "parse_info",
    "time_skew",
]

#: CONFIG GET parameters the checks read, one call each (Redis 6.2 takes one per call).
CONFIG_PARAMETERS = ("maxmemory-policy", "maxmemory", "appendonly", "appendfsync", "save")
#: INFO sections the checks read.
INFO_SECTIONS = ("server", "replication", "persistence", "memory")

#: INFO fields shown in the JSON report (the ones the checks use, and the server's identity).
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
    #: Keys of the prefix without a TTL (left by an earlier version), among
    #: ``keys_scanned`` keys read; ``keys_complete``: the scan saw them all.
    permanent_keys: list[str] = field(default_factory=list)
    permanent_count: int = 0
    keys_scanned: int = 0
    keys_complete: bool = True

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
            "permanent_keys": self.permanent_count,
            "keys_scanned": self.keys_scanned,
            "keys_complete": self.keys_complete,
        }


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
    rate: str | None = None  #: ``lock_rate``, as written (``"5/s"``)
    unique: str | None = None
    unique_ttl: float | None = None


@dataclass(frozen=True)
class Backlog:
    """Runs waiting on the queue for a key with a rate budget, and that budget.

    ``queued`` runs at ``limit`` starts per ``window`` seconds take ``drain`` seconds
    to start, at the earliest.
    """

    key: str
    queued: int
    limit: int
    window: float

    @property
    def drain(self) -> float:
        """Seconds until the budget has started every queued run."""
        return self.queued / self.limit * self.window


@dataclass(frozen=True)
class LeaderLock:
    """One name the app's beat leader lock may go by, and who holds it.

    ``holders`` are the lock's ``task_name`` on each node that has it (empty: nobody
    holds it). ``legacy`` marks the name older versions derived (``beat:<main>``),
    looked up only when it differs from the one this app derives.
    """

    key: str
    holders: tuple[str, ...] = ()
    legacy: bool = False


@dataclass(frozen=True)
class BeatLeaderFacts:
    """Who holds this app's beat leader lock, against this app's broker identity.

    ``error`` says why the lock was not looked up (the broker URL cannot be read);
    ``broker`` and ``locks`` are then empty.
    """

    broker: str = ""
    locks: tuple[LeaderLock, ...] = ()
    error: str | None = None


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


def node_facts(reply: Reply) -> NodeFacts:
    """The facts in one node's reply to the CONFIG GET calls then the INFO calls.

    A refused CONFIG (an error reply) sets ``config_error``; a refused INFO section
    is skipped; a node that did not answer has only ``error``.
    """
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


def time_skew(reply: Reply | None, sent: float, received: float) -> float | None:
    """The node's clock minus this host's, from a reply to ``TIME``.

    ``sent`` and ``received`` are this host's clock around the round trip; the node
    read its clock at their midpoint, give or take half the round trip. None when
    the node did not answer or refused.
    """
    if reply is None or reply.error is not None or isinstance(reply.values[0], ResponseError):
        return None
    seconds, micros = reply.values[0]
    return int(seconds) + int(micros) / 1e6 - (sent + received) / 2


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)
