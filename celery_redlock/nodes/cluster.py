"""A whole Redis Cluster as one lock node: slot routing, MOVED and ASK.

A cluster is named by one URL listing some of its nodes (seeds)::

    redis+cluster://[[username]:password@]host[:port][,host[:port]...][/0][?option=...]
    rediss+cluster://...      (TLS; the options are redis-py's ``ssl_*`` URL options)

It is **one** lock node, one Redlock vote: a lock's keys share a hash tag
(``redlock:{NAME}...``), so they live in one slot on one master, and that master
alone decides. The cluster's masters are not independent failure domains for
Redlock: a master fails over to a replica that was copied asynchronously, exactly
as with Sentinel, so a failover can lose a lock (renewal then reports the loss).
For Redlock, list several independent clusters (or masters).

How requests travel (:func:`celery_redlock.nodes.fan_out` does the I/O):

* The node learns the slot map with ``CLUSTER SLOTS`` from any master it knows or
  any seed, lazily (constructing a node does no I/O), each try bounded by the
  node timeout and the caller's budget.
* :meth:`ClusterNode.route` turns a request into one :class:`~celery_redlock.nodes.calls.Leg`
  per master: the calls for that master, pipelined on one connection of its own
  per-master :class:`~celery_redlock.nodes.Node` (so the per-connection ordering
  guarantees of plain nodes hold per master, e.g. an undo queued behind the
  acquisition it undoes). Keyless commands (``WAIT``, ``INFO``...) go with the
  keyed call before them, or to the first keyed call's master.
* A call whose keys are in several slots is split per slot when its script says
  its keys are independent (:attr:`Script.per_key_args`): Redis Cluster refuses a
  script whose declared keys span slots, even on one master, so the parts are one
  call per slot, pipelined per master (one round trip per master). The reply is
  merged back into one entry per key, in key order. Any other multi-slot call
  raises :class:`CrossSlotError` naming the keys, before anything is sent.
* ``MOVED`` (the slot has a new owner) updates that slot, marks the map for a
  refresh, and sends the call again to the new owner; ``ASK`` (the slot is being
  migrated and the key is already on the target) sends ``ASKING`` and the call to
  the target. Both happen inside the same fan-out and budget, at most
  :data:`MAX_REDIRECTS` times per call. ``TRYAGAIN`` and ``CLUSTERDOWN`` are not
  retried: the call fails (a lock attempt fails closed, renewal retries later).
* A master that cannot be reached fails only the calls routed to it: they get a
  :class:`MasterUnavailable` reply (a ``ResponseError``), per key for split calls;
  when every master of a request failed, the node's reply is that error. The map is
  read again before a later request (at most every :data:`MAP_RECHECK` seconds), so a
  failover is followed; masters that just failed are asked for it last, so a hung
  master does not spend the budget of calls to the healthy ones.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlencode

from redis.connection import AbstractConnection
from redis.crc import key_slot
from redis.exceptions import AskError, MovedError, RedisError, ResponseError

from ..base import forksafe
from ..exceptions import ConfigurationError
from .calls import Call, Leg
from .node import Node
from .urls import parse_hosts, register_node_kind

__all__ = [
    "CLUSTER_FORM",
    "CLUSTER_SCHEMES",
    "ClusterNode",
    "CrossSlotError",
    "MasterUnavailable",
    "is_cluster_url",
]

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
CLUSTER_FORM = "redis+cluster://[[user]:password@]host[:port][,host[:port]...][?option=...]"
DEFAULT_PORT = 6379
SLOTS = 16384
#: Redirections (MOVED/ASK) followed for one call within one fan-out.
MAX_REDIRECTS = 5
#: Seconds between two reads of the slot map after a failure (MOVED patches its slot
#: at once), so a dead master does not add a CLUSTER SLOTS round trip to every call.
MAP_RECHECK = 1.0
#: Seconds a master that failed is asked for the slot map only after the others.
SUSPECT_FOR = 10.0

#: Key arguments of the plain commands the package sends with keys: how many
#: arguments after the command name are keys (None: all of them). Other commands
#: are routed as keyless; a key among their arguments would be answered with MOVED
#: and followed, at the cost of one round trip.
KEYED_COMMANDS: dict[str, int | None] = {
    "EXISTS": None,
    "DEL": None,
    "UNLINK": None,
    "GET": 1,
    "HGET": 1,
    "HGETALL": 1,
    "PTTL": 1,
    "TTL": 1,
    "TYPE": 1,
}


class CrossSlotError(ConfigurationError):
    """A call's keys are in several cluster slots and its script cannot be split."""


class MasterUnavailable(ResponseError):
    """The reply to a call whose cluster master did not answer (refused, timed out...)."""


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster lock node."""
    return url.split("://", 1)[0] in CLUSTER_SCHEMES


def _error(url: str, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"invalid Redis Cluster URL {sanitize_url(url)!r}: {why}; expected {CLUSTER_FORM}, "
        "e.g. redis+cluster://:password@10.0.0.1:7000,10.0.0.2:7000"
    )


def sanitize_url(url: str) -> str:
    """The URL with its password masked."""
    scheme, _, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}:**@{hosts}" if colon else url


def _parse(url: str) -> tuple[str, str, list[tuple[str, int]], str]:
    """(master URL scheme, userinfo as written, seed addresses, query string)."""
    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    if path not in ("", "0"):
        raise _error(url, f"a cluster has database 0 only, got path {path!r}")
    userinfo, at, hostlist = netloc.rpartition("@")
    try:
        seeds = [(unquote(h), p) for h, p in parse_hosts(hostlist, DEFAULT_PORT)]
    except ValueError as exc:
        raise _error(url, str(exc)) from None
    try:
        options = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise _error(url, str(exc)) from exc
    master_scheme = "rediss" if scheme == "rediss+cluster" else "redis"
    return master_scheme, userinfo + at, seeds, urlencode(options)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _keys_of(call: Call) -> tuple[Any, ...]:
    """The keys a call touches, for routing."""
    if call.script is not None:
        return call.keys
    name = str(call.args[0]).upper() if call.args else ""
    if name not in KEYED_COMMANDS:
        return ()
    count = KEYED_COMMANDS[name]
    return tuple(call.args[1:] if count is None else call.args[1 : 1 + count])


def _slot(key: Any) -> int:
    return key_slot(key if isinstance(key, bytes) else str(key).encode())


class ClusterNode:
    """A Redis Cluster used as one lock node (see the module documentation).

    Keeps one :class:`~celery_redlock.nodes.Node` per master address (its own small
    connection pool, same timeouts, no retries) and the slot map.
    """

    slotted = True

    def __init__(self, url: str, *, timeout: float) -> None:
        self.url = url
        self.safe_url = sanitize_url(url)
        self.timeout = timeout
        self._scheme, self._userinfo, self._seeds, self._query = _parse(url)
        self._lock = threading.Lock()
        forksafe.track(self)
        self._masters: dict[str, Node] = {}
        #: slot -> master address; None until the first refresh.
        self._slots: list[str] | None = None
        self._stale = True
        self._next_refresh = 0.0
        #: address -> when it last failed (monotonic): asked last for the slot map, so a
        #: blackholed master does not spend the budget of calls to the healthy ones.
        self._suspects: dict[str, float] = {}
        self._rotation = itertools.count()
        for host, port in self._seeds:  # validates the URL's options up front
            self._master(_address(host, port))

    def __repr__(self) -> str:
        return f"<ClusterNode {self.safe_url}>"

    def _after_fork_in_child(self) -> None:
        # Held by a parent thread at fork, it would be held here for ever. The
        # masters' own Nodes reset themselves.
        self._lock = threading.Lock()

    def widen_timeout(self, timeout: float) -> None:
        """Let calls through this shared node take up to ``timeout`` (see ``Node``)."""
        if timeout > self.timeout:
            self.timeout = timeout
            for node in list(self._masters.values()):
                node.widen_timeout(timeout)

    def _master(self, address: str) -> Node:
        """The per-master node for ``host:port`` (created on first use)."""
        node = self._masters.get(address)
        if node is None:
            with self._lock:
                node = self._masters.get(address)
                if node is None:
                    query = f"?{self._query}" if self._query else ""
                    node = Node(
                        f"{self._scheme}://{self._userinfo}{address}/0{query}",
                        timeout=self.timeout,
                    )
                    node.safe_url = f"{self.safe_url} master {address}"
                    self._masters[address] = node
        return node

    # -- the slot map ------------------------------------------------------------

    def refresh(self, deadline: float | None = None) -> None:
        """Read the slot map from the first master or seed that answers in time.

        Raises the last error when none does; the previous map (if any) is kept.
        """
        known = [a for a in dict.fromkeys(self._slots or ()) if a]
        candidates = list(dict.fromkeys([*known, *(_address(h, p) for h, p in self._seeds)]))
        now = time.monotonic()
        self._next_refresh = now + MAP_RECHECK
        candidates.sort(key=lambda a: now - self._suspects.get(a, -SUSPECT_FOR) < SUSPECT_FOR)
        error: BaseException = RedisError("no seed to ask")
        for address in candidates:
            budget = self.timeout if deadline is None else deadline - time.monotonic()
            if budget <= 0:
                raise RedisError(f"{self.safe_url}: no time left to read the slot map ({error})")
            conn = self._master(address).new_connection()
            conn.socket_connect_timeout = conn.socket_timeout = min(self.timeout, budget)
            try:
                conn.connect()
                conn.send_command("CLUSTER", "SLOTS")
                ranges = conn.read_response()
            except (RedisError, OSError) as exc:
                error = exc
                self._suspects[address] = time.monotonic()
                continue
            finally:
                conn.disconnect()
            self._install(ranges, address)
            return
        raise error

    def _install(self, ranges: list[Any], asked: str) -> None:
        slots: list[str] = [""] * SLOTS
        for first, last, master, *_ in ranges:
            host = master[0] or asked.rpartition(":")[0]  # "" or "?": the node we asked
            if host == "?":
                host = asked.rpartition(":")[0]
            address = _address(str(host), int(master[1]))
            slots[int(first) : int(last) + 1] = [address] * (int(last) - int(first) + 1)
        with self._lock:
            self._slots = slots
            self._stale = False

    def _owner(self, slot: int) -> Node:
        slots = self._slots
        address = slots[slot] if slots else ""
        if not address:
            raise MasterUnavailable(f"{self.safe_url}: no master serves slot {slot}")
        return self._master(address)

    def _ensure_map(self, deadline: float | None) -> None:
        if self._slots is None or (self._stale and time.monotonic() >= self._next_refresh):
            try:
                self.refresh(deadline)
            except (RedisError, OSError):
                if self._slots is None:
                    raise
                # Keep routing with the old map; MOVED replies correct it.

    def masters(self, deadline: float | None = None) -> list[Node]:
        """The masters that serve slots now (for SCAN and per-master checks)."""
        self._ensure_map(deadline)
        return [self._master(a) for a in dict.fromkeys(self._slots or ()) if a]

    # -- routing ------------------------------------------------------------------

    def route(self, calls: Sequence[Call], deadline: float | None = None) -> list[Leg]:
        """One leg per master for ``calls`` (see the module documentation).

        Raises:
            CrossSlotError: a call's keys span slots and its script cannot be split.
            RedisError, OSError: no slot map could be read.
        """
        self._ensure_map(deadline)
        legs: dict[int, Leg] = {}

        def add(node: Node, call: Call, place: tuple[int, Any]) -> None:
            leg = legs.get(id(node))
            if leg is None:
                leg = legs[id(node)] = Leg(node, [], [])
            leg.calls.append(call)
            leg.places.append(place)  # type: ignore[union-attr]

        home: Node | None = None
        for call in calls:
            keys = _keys_of(call)
            if keys:
                home = self._owner(_slot(keys[0]))
                break
        if home is None:  # keyless requests (INFO, TIME...): the first master will do
            masters = self.masters(deadline)
            if not masters:
                raise MasterUnavailable(f"{self.safe_url}: no master serves any slot")
            home = masters[0]
        current = home
        for position, call in enumerate(calls):
            keys = _keys_of(call)
            if not keys:
                add(current, call, (position, None))
                continue
            by_slot: dict[int, list[int]] = {}
            for index, key in enumerate(keys):
                by_slot.setdefault(_slot(key), []).append(index)
            if len(by_slot) == 1:
                current = self._owner(next(iter(by_slot)))
                add(current, call, (position, None))
                continue
            for slot, indices in self._split(call, by_slot):
                add(self._owner(slot), _part(call, indices), (position, tuple(indices)))
        return list(legs.values())

    def _split(self, call: Call, by_slot: dict[int, list[int]]) -> list[tuple[int, list[int]]]:
        script = call.script
        per_key = script.per_key_args if script is not None else None
        if per_key is None or len(call.args) != per_key * len(call.keys):
            what = script.name if script is not None else str(call.args[0])
            raise CrossSlotError(
                f"{what}: keys {list(_keys_of(call))!r} are in {len(by_slot)} Redis Cluster "
                f"slots of {self.safe_url} and the call cannot be split by key; keys used "
                "together must share a hash tag ({...})"
            )
        return list(by_slot.items())

    def redirect(self, leg: Leg, value: Any) -> tuple[Node, bool] | None:
        """Where to send again a call answered with MOVED or ASK: (master, asking?)."""
        if leg.hops >= MAX_REDIRECTS or not isinstance(value, AskError):
            return None
        target = self._master(_address(value.host, value.port))
        if isinstance(value, MovedError):
            with self._lock:
                if self._slots is not None:
                    self._slots[value.slot_id] = _address(value.host, value.port)
                self._stale = True
            return target, False
        return target, True

    def failed(self, leg: Leg, error: BaseException) -> ResponseError:
        """The reply value for the calls of a leg whose master did not answer."""
        self._stale = True
        address = next((a for a, node in self._masters.items() if node is leg.node), "?")
        self._suspects[address] = time.monotonic()
        return MasterUnavailable(f"master {address}: {type(error).__name__}: {error}")

    # -- the Node API used outside fan-outs ------------------------------------------

    def new_connection(self) -> AbstractConnection:
        """An unconnected connection to one of the masters, in rotation.

        Used by the release listener: in a cluster, PUBLISH is broadcast to every
        node, so a subscriber on any master hears every release. Rotating means a
        listener that reconnects after its master died tries the next one.
        """
        try:
            masters = self.masters()
        except (RedisError, OSError):
            masters = [self._master(_address(h, p)) for h, p in self._seeds]
        return masters[next(self._rotation) % len(masters)].new_connection()

    def close(self) -> None:
        """Close every pooled connection of every master (see :meth:`Node.close`)."""
        for node in list(self._masters.values()):
            node.close()


def _part(call: Call, indices: list[int]) -> Call:
    """The call restricted to the keys at ``indices`` (and their arguments)."""
    # Only calls of a script with per_key_args are split.
    per_key = cast(int, call.script.per_key_args)  # type: ignore[union-attr]
    if len(indices) == 1:  # the usual part: every lock has a slot of its own
        i = indices[0]
        return Call(call.script, (call.keys[i],), call.args[i * per_key : (i + 1) * per_key])
    keys = tuple(call.keys[i] for i in indices)
    args = tuple(a for i in indices for a in call.args[i * per_key : (i + 1) * per_key])
    return Call(call.script, keys, args)


register_node_kind(is_cluster_url, ClusterNode, sanitize_url)
