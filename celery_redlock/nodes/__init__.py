"""Connections to 1..N independent Redis masters, and concurrent fan-out to them.

Two properties matter more here than convenience:

* **Bounded time.** redis-py's ready-made client retries a failing command (10
  times in some versions: 8.7 s against a blackholed node with a 0.5 s socket
  timeout). Every connection made here has explicit connect and socket timeouts and
  no retries; a call that cannot finish within its budget fails, and the caller
  decides what that means (for a lock: that node did not vote).
* **Concurrency without threads.** :func:`fan_out` writes the request to every node
  first and then reads whichever reply is ready, with ``select``, in the calling
  thread. N nodes cost one network round trip, not N, and no thread pool is
  created or shared. It returns as soon as the caller's ``decided`` predicate says
  the outcome is known (a quorum granted or refused); connections whose replies are
  still in flight are drained the next time they are needed, not waited for.

A node is one Redis master, named by a URL: ``redis://``, ``rediss://`` and
``unix://`` as in redis-py, or a master monitored by Redis Sentinel::

    redis+sentinel://[[username]:password@]host[:port][,host[:port]...]/service[/db]
        [?sentinel_username=...&sentinel_password=...]

e.g. ``redis+sentinel://:secret@10.0.0.1:26379,10.0.0.2:26379,10.0.0.3/mymaster/0``.
The hosts are the sentinels (port 26379 by default), ``service`` is the master's name
in ``sentinel monitor`` (kombu's ``master_name``), ``db`` defaults to 0. The URL's
credentials are the master's (as in kombu's ``sentinel://`` broker URLs); sentinels
that require a password of their own get it from ``sentinel_password``. Such a URL is
*one* lock node: for Redlock, list several (independent) sentinel-managed masters.

Every new connection to a sentinel node first asks the sentinels for the current
master (redis-py's ``SentinelManagedConnection``; the sentinels are queried in turn,
each with the node timeout as connect and socket timeout and no retries). A READONLY
reply (the master was demoted to a replica) is turned into a connection error by
that class, so the fan-out drops the connection like any other broken one. The node
also asks the sentinels again at most every :data:`MASTER_RECHECK` seconds when a
connection is checked out, and drops connections to a server that is no longer the
master, so a failover whose old master is still up (and still writable until the
sentinels demote it, up to ~10 s later) is noticed within that delay.

A whole Redis Cluster is also one lock node, ``redis+cluster://host:port[,...]``:
see :mod:`celery_redlock.cluster`, which routes each call to the master of its
keys' slot. :func:`fan_out` sends every node's request as one or more
:class:`Leg` (one per master; always one for a plain node) and merges the
replies back per node.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import parse_qsl, quote, unquote

from kombu.utils.url import maybe_sanitize_url
from redis.backoff import NoBackoff
from redis.connection import AbstractConnection, ConnectionPool
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from ..exceptions import ConfigurationError

__all__ = ["Call", "Leg", "Node", "NodeSet", "Reply", "fan_out", "make_node", "safe_url"]

logger = logging.getLogger("celery_redlock.nodes")

#: Idle connections kept per node and process; more are opened when needed.
MAX_IDLE = 16

#: URL scheme of a lock node that is a Sentinel-monitored master.
SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
SENTINEL_FORM = (
    "redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service_name[/db]"
    "[?sentinel_username=...&sentinel_password=...]"
)
#: Seconds between two checks of a sentinel node's master address on checkout.
MASTER_RECHECK = 1.0


class Script(Protocol):
    """What the node layer needs of a Lua script.

    Its source and SHA1 (for EVALSHA with a NOSCRIPT fallback), and whether its keys
    may be split (Redis Cluster).

    The scripts themselves belong to the lock engine (:mod:`celery_redlock.scripts`),
    a layer above this one.
    """

    @property
    def name(self) -> str: ...
    @property
    def sha(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def per_key_args(self) -> int | None: ...
    def evalsha(self, keys: Sequence[str], args: Sequence[object]) -> tuple[object, ...]: ...


#: Other kinds of lock node, registered by their modules (a Redis Cluster:
#: :mod:`celery_redlock.cluster`): (does this URL name one?, its factory, its sanitizer).
_NODE_KINDS: list[tuple[Callable[[str], bool], Callable[..., Any], Callable[[str], str]]] = []


def register_node_kind(
    matches: Callable[[str], bool],
    factory: Callable[..., Any],
    sanitize: Callable[[str], str],
) -> None:
    """Let :func:`make_node` and :func:`safe_url` handle another kind of URL.

    A higher module registers itself here, so this module never imports it: the node
    layer stays free of import cycles.
    """
    _NODE_KINDS.append((matches, factory, sanitize))


@dataclass(frozen=True)
class Call:
    """One command for a node: a script with its keys and arguments, or a plain command."""

    script: Script | None
    keys: tuple[Any, ...] = ()
    args: tuple[Any, ...] = ()

    @classmethod
    def command(cls, *args: Any) -> Call:
        """A plain Redis command, e.g. ``Call.command("EXISTS", key)``."""
        return cls(None, (), args)

    def packed_args(self) -> tuple[Any, ...]:
        """The command as sent (EVALSHA for a script)."""
        if self.script is None:
            return self.args
        return self.script.evalsha(self.keys, self.args)


@dataclass
class Reply:
    """What one node answered to one request.

    ``values`` holds one entry per :class:`Call`: the decoded reply, or the
    :class:`~redis.exceptions.ResponseError` the node returned for that command.
    ``error`` is set instead when the node could not be asked or did not answer in
    time (connection refused, timeout, authentication failure...).
    """

    node: Node
    values: list[Any] = field(default_factory=list)
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        """The node answered every command (each answer may still be an error reply)."""
        return self.error is None

    def describe_error(self) -> str:
        """One line naming the node and what went wrong, for logs and exceptions."""
        return f"{self.node.safe_url}: {type(self.error).__name__}: {self.error}"


#: Where one reply goes in a node's :class:`Reply`: (position, key indices or None).
Place = tuple[int, Any]


@dataclass
class Leg:
    """The part of one node's request that goes to one server, on one connection.

    ``places`` maps each call to where its reply goes in the node's :class:`Reply`:
    ``(position, None)`` for the whole value of call ``position``, ``(position,
    key indices)`` for the part of a split call, ``None`` for a reply to skip
    (``ASKING``). ``places=None`` means call i answers position i (a plain node).
    """

    node: Node
    calls: list[Call]
    places: list[Place | None] | None = None
    hops: int = 0  # redirections (MOVED/ASK) that led here

    def place(self, k: int) -> Place | None:
        """Where the reply to ``calls[k]`` goes."""
        return (k, None) if self.places is None else self.places[k]


def _connection_options(timeout: float) -> dict[str, Any]:
    """Connection settings for a lock node, for the installed redis-py.

    Every round trip a connection makes by itself on connect (``HELLO`` for RESP3,
    ``CLIENT SETINFO``, maintenance notifications) is one more place a hung node can
    stall us, so only the URL's own AUTH and SELECT remain.
    """
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
        "retry_on_timeout": False,
        "health_check_interval": 0,
        "decode_responses": True,
        "protocol": 2,
    }
    accepted = inspect.signature(AbstractConnection.__init__).parameters
    if "driver_info" in accepted:  # redis-py >= 7.1; lib_name is deprecated there
        options["driver_info"] = None
    elif "lib_name" in accepted:
        options.update(lib_name=None, lib_version=None)
    if "maint_notifications_config" in accepted:
        from redis.maint_notifications import MaintNotificationsConfig  # noqa: PLC0415 (redis-py >= 6.4 only)

        options["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    return options


def parse_hosts(hostlist: str, default_port: int, *, what: str = "host") -> list[tuple[str, int]]:
    """``host[:port][,host[:port]...]`` (``[IPv6]:port`` too) as (host, port) pairs.

    Raises:
        ValueError: naming the item that has no host or a bad port.
    """
    hosts = []
    for item in hostlist.split(","):
        if item.startswith("["):  # [IPv6]:port
            host, _, port = item[1:].partition("]")
            port = port[1:] if port.startswith(":") else port
        else:
            host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
        if not host:
            raise ValueError(f"no {what} in {item!r}")
        try:
            number = int(port) if port else default_port
        except ValueError:
            raise ValueError(f"bad port in {item!r}") from None
        if not 0 < number < 65536:
            raise ValueError(f"bad port in {item!r}")
        hosts.append((host, number))
    return hosts


def _sentinel_error(url: str, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"invalid Redis Sentinel URL {_sanitize_sentinel_url(url)!r}: {why}; expected "
        f"{SENTINEL_FORM}, e.g. redis+sentinel://:password@host1:26379,host2:26379/mymaster/0"
    )


def _sanitize_sentinel_url(url: str) -> str:
    """The URL with its passwords masked (kombu's helper cannot parse a host list)."""
    rest = url.split("://", 1)[-1]
    netloc, sep, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:**@{hosts}" if colon else f"{user}@{hosts}"
    path, question, query = path.partition("?")
    if question:
        query = "&".join(
            f"{k}=**" if k == "sentinel_password" else f"{k}={quote(v, safe='')}"
            for k, v in parse_qsl(query, keep_blank_values=True)
        )
    return f"{SENTINEL_SCHEME}://{netloc}{sep}{path}{question}{query}"


def _parse_sentinel_url(
    url: str,
) -> tuple[list[tuple[str, int]], str, dict[str, Any], dict[str, Any]]:
    """(sentinel addresses, service name, master credentials and db, sentinel credentials)."""
    rest = url[len(SENTINEL_SCHEME) + 3 :]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    master: dict[str, Any] = {}
    if at:
        user, colon, password = userinfo.partition(":")
        master["username"] = unquote(user) or None
        master["password"] = unquote(password) if colon else None
    try:
        sentinels = parse_hosts(hostlist, SENTINEL_PORT, what="sentinel host")
    except ValueError as exc:
        raise _sentinel_error(url, str(exc)) from None
    parts = [unquote(p) for p in path.split("/")] if path else []
    if parts and parts[-1] == "":
        parts.pop()  # a trailing slash
    if not parts or not parts[0]:
        raise _sentinel_error(url, "no service (master) name")
    if len(parts) > 2:
        raise _sentinel_error(url, f"unexpected path {path!r}")
    try:
        master["db"] = int(parts[1]) if len(parts) == 2 else 0
    except ValueError:
        raise _sentinel_error(url, f"db must be a number, got {parts[1]!r}") from None
    if master["db"] < 0:
        raise _sentinel_error(url, f"db must be >= 0, got {master['db']}")
    sentinel_auth: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key not in ("sentinel_username", "sentinel_password"):
            raise _sentinel_error(url, f"unknown option {key!r}")
        sentinel_auth[key.removeprefix("sentinel_")] = value
    return sentinels, parts[0], master, sentinel_auth


def _sentinel_pool(url: str, timeout: float) -> SentinelConnectionPool:
    """A pool whose connections reach the master the sentinels report when they connect.

    Only its ``connection_class`` and ``connection_kwargs`` are used (the kwargs hold
    the pool's proxy, which asks the sentinels); sentinel queries get the same
    timeouts, no retries and no handshakes as the lock connections.
    """
    try:
        sentinels, service, master, sentinel_auth = _parse_sentinel_url(url)
    except ValueError as exc:  # parse_qsl(strict_parsing=True)
        raise _sentinel_error(url, str(exc)) from exc
    options = _connection_options(timeout)
    # redis.Redis deprecates retry_on_timeout; Retry(NoBackoff(), 0) retries nothing anyway.
    sentinel_options = {k: v for k, v in options.items() if k != "retry_on_timeout"}
    manager = Sentinel(sentinels, sentinel_kwargs={**sentinel_options, **sentinel_auth})
    return SentinelConnectionPool(service, manager, **master, **options)


class Node:
    """One Redis master: its URL and a small per-process pool of connections.

    Connections are plain redis-py connections (TCP, TLS or unix socket, with the
    URL's credentials and database), made with the node timeout as both connect and
    socket timeout and with retries switched off. The pool forgets its connections
    in a forked child, which opens its own.
    """

    def __init__(self, url: str, *, timeout: float) -> None:
        #: The pool of a Sentinel-managed node (None otherwise): it knows the master.
        self._sentinel: SentinelConnectionPool | None = None
        if url.startswith(f"{SENTINEL_SCHEME}://"):
            self._sentinel = _sentinel_pool(url, timeout)
            pool: ConnectionPool = self._sentinel
            self.safe_url = _sanitize_sentinel_url(url)
        else:
            try:
                pool = ConnectionPool.from_url(url, **_connection_options(timeout))
            except (ValueError, TypeError) as exc:
                raise ConfigurationError(
                    f"invalid Redis URL {maybe_sanitize_url(url)!r}: {exc}; expected "
                    "redis://[[user]:password@]host[:port][/db], rediss://..., unix://path "
                    f"or {SENTINEL_FORM}"
                ) from exc
            self.safe_url = maybe_sanitize_url(url)
        self._recheck_at = 0.0
        #: When a connection to this server last failed (monotonic; 0: never).
        self.failed_at = 0.0
        self.url = url
        self.timeout = timeout
        self._connection_class = pool.connection_class
        self._connection_kwargs = pool.connection_kwargs
        self._lock = threading.Lock()
        self._idle: list[AbstractConnection] = []
        # Connections returned with replies still in flight:
        # [connection, replies owed, give up at (monotonic), thread ident].
        self._draining: list[list[Any]] = []
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"<Node {self.safe_url}>"

    def widen_timeout(self, timeout: float) -> None:
        """Let calls through this node take up to ``timeout``.

        Nodes are shared by every lock on the same URL whatever its node timeout
        (ttl / 10 by default): connections made from now on use the longest timeout
        asked for. A call's own budget still bounds it (see :func:`fan_out`).
        """
        if timeout > self.timeout:
            self.timeout = timeout
            self._connection_kwargs = {
                **self._connection_kwargs,
                "socket_timeout": timeout,
                "socket_connect_timeout": timeout,
            }

    def new_connection(self) -> AbstractConnection:
        """A fresh, unconnected connection with this node's settings."""
        conn: AbstractConnection = self._connection_class(**self._connection_kwargs)
        return conn

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            # A forked child must never use its parent's sockets: dropping them is
            # safe, redis-py only shuts a socket down in the process that opened it.
            self._idle = []
            self._draining = []
            self._pid = os.getpid()

    def has_idle(self) -> bool:
        """Whether a connected connection is ready (a send needs no connect first)."""
        return bool(self._idle) and self._pid == os.getpid()

    def checkout(
        self, connect_timeout: float | None = None
    ) -> tuple[AbstractConnection, bool, int]:
        """A connection for one request: (connection, just opened?, replies owed).

        A thread that left replies in flight here (a fan-out decided before this node
        answered) gets that same connection back, with the count of replies it must
        skip first. Its next request is thus queued behind the earlier one: an undo
        (release) can never overtake the acquisition it undoes. Return the
        connection with :meth:`checkin`.
        """
        if self._sentinel is not None:
            self._recheck_master()
        with self._lock:
            self._check_pid()
            if self._draining:
                self._drain_locked()
                me = threading.get_ident()
                for index, (conn, owed, _, ident) in enumerate(self._draining):
                    if ident == me:
                        del self._draining[index]
                        if not self._stale(conn):
                            return conn, False, owed
                        conn.disconnect()  # the earlier request went to the old master
                        break
            conn = self._idle.pop() if self._idle else None
            while conn is not None and (self._stale(conn) or _closed_by_peer(conn)):
                conn.disconnect()
                conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self.new_connection()
        if conn._sock is not None:
            return conn, False, 0
        if connect_timeout is not None:
            conn.socket_connect_timeout = min(self.timeout, max(connect_timeout, 0.001))
        try:
            conn.connect()
        except BaseException:
            conn.disconnect()
            raise
        return conn, True, 0

    def _stale(self, conn: AbstractConnection) -> bool:
        """A sentinel node's connection to a server the sentinels no longer call master."""
        pool = self._sentinel
        if pool is None or conn._sock is None:
            return False
        return bool((conn.host, conn.port) != pool.master_address)

    def _recheck_master(self) -> None:
        """Ask the sentinels for the master, at most every MASTER_RECHECK seconds.

        Bounded by the sentinel connections' timeouts; if no sentinel answers, the
        connections we have are kept (their own errors will tell).
        """
        now = time.monotonic()
        with self._lock:
            if now < self._recheck_at:
                return
            self._recheck_at = now + MASTER_RECHECK
        try:
            self._sentinel.get_master_address()  # type: ignore[union-attr]
        except (RedisError, OSError) as exc:
            logger.debug("%s: sentinels did not name a master: %s", self.safe_url, exc)

    def checkin(self, conn: AbstractConnection, owed: int = 0, give_up_at: float = 0.0) -> None:
        """Return a connection; ``owed`` replies still in flight are read later."""
        with self._lock:
            if self._pid != os.getpid():
                return
            if owed:
                self._draining.append([conn, owed, give_up_at, threading.get_ident()])
            elif len(self._idle) < MAX_IDLE and conn._sock is not None:
                self._idle.append(conn)
                return
            else:
                conn.disconnect()

    def _drain_locked(self) -> None:
        """Read replies owed on returned connections, without waiting for any."""
        now = time.monotonic()
        still: list[list[Any]] = []
        draining, self._draining = self._draining, []
        for index, item in enumerate(draining):
            conn, owed, give_up_at, _ = item
            try:
                while owed and conn.can_read(0):
                    with contextlib.suppress(ResponseError):
                        conn.read_response()
                    owed -= 1
            except (RedisError, OSError):
                conn.disconnect()
                continue
            except BaseException:
                # Interrupted mid-reply: the connection is out of step, close it. Those
                # not reached yet stay owed; those before it are already settled.
                conn.disconnect()
                self._draining = still + draining[index + 1 :]
                raise
            if not owed:
                if len(self._idle) < MAX_IDLE:
                    self._idle.append(conn)
                else:
                    conn.disconnect()
            elif now >= give_up_at:
                conn.disconnect()
            else:
                item[1] = owed
                still.append(item)
        self._draining = still

    def discard(self, conn: AbstractConnection) -> None:
        """Close a connection that failed or cannot be trusted to be in sync."""
        self.failed_at = time.monotonic()
        conn.disconnect()

    def forget(self, conn: AbstractConnection) -> None:
        """Close a connection whose request was interrupted, wherever it is now.

        An exception raised asynchronously in the caller (a soft time limit, an
        abort, Ctrl-C) may leave a reply half read: the connection must never carry
        another request, whether or not it was already returned to the pool.
        """
        with self._lock:
            self._idle = [c for c in self._idle if c is not conn]
            self._draining = [item for item in self._draining if item[0] is not conn]
        conn.disconnect()

    # The routing interface :func:`fan_out` uses; a cluster node routes per master.

    def route(self, calls: Sequence[Call], deadline: float | None = None) -> list[Leg]:
        """The request as legs: all of it to this server, in order."""
        return [Leg(self, list(calls))]

    def redirect(self, leg: Leg, value: Any) -> tuple[Node, bool] | None:
        """Where to resend a call answered with ``value``: never, for a plain node."""
        return None

    def failed(self, leg: Leg, error: BaseException) -> ResponseError | None:
        """The reply value for a failed leg's calls; None: the node's reply is the error."""
        return None

    def masters(self, deadline: float | None = None) -> list[Node]:
        """The servers to ask for node-wide facts (SCAN, INFO): this one."""
        return [self]

    def close(self) -> None:
        """Close the pooled connections (for a NodeSet this process will not use again)."""
        with self._lock:
            connections = list(self._idle) + [item[0] for item in self._draining]
            self._idle, self._draining = [], []
        for conn in connections:
            conn.disconnect()


def _closed_by_peer(conn: AbstractConnection) -> bool:
    """Whether an idle connection was closed by the server (restarted, timed out).

    An idle connection owes no reply, so anything readable on it is the end of the
    stream (or garbage): using it would cost this call's vote on the node. One
    ``select`` with no wait, far cheaper than the round trip it saves.
    """
    sock = conn._sock
    if sock is None:
        return False
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


def safe_url(url: str) -> str:
    """``url`` with its passwords masked, for any lock node URL form."""
    if url.startswith(f"{SENTINEL_SCHEME}://"):
        return _sanitize_sentinel_url(url)
    for matches, _, sanitize in _NODE_KINDS:
        if matches(url):
            return sanitize(url)
    return str(maybe_sanitize_url(url))


def make_node(url: str, *, timeout: float) -> Node:
    """The lock node for ``url``: a :class:`Node`, or a registered kind (a cluster)."""
    for matches, factory, _ in _NODE_KINDS:
        if matches(url):
            node: Node = factory(url, timeout=timeout)
            return node
    return Node(url, timeout=timeout)


class _InFlight:
    """One leg of a request, sent on one connection, whose replies are being read."""

    __slots__ = ("calls", "conn", "index", "leg", "noscript", "owed", "skip", "stale", "values")

    def __init__(self, index: int, leg: Leg, conn: AbstractConnection, stale: int = 0) -> None:
        self.index = index  # of the node in the fan-out
        self.leg = leg
        self.conn = conn
        self.calls = leg.calls
        self.values: list[Any] = []
        self.stale = stale  # replies to an earlier request on this connection
        self.owed = stale
        self.skip = 0
        self.noscript = False

    def send(self, load: Sequence[Script] = ()) -> None:
        """Send the calls, preceded by ``SCRIPT LOAD`` of ``load`` (replies skipped)."""
        packed = [("SCRIPT", "LOAD", script.source) for script in load]
        packed += [call.packed_args() for call in self.calls]
        self.conn.send_packed_command(_pack(self.conn, packed), check_health=False)
        self.skip = len(load)
        self.owed = self.stale + len(packed)

    def read_ready(self) -> bool:
        """Read every reply already available; True when the request is complete."""
        while self.owed and self.conn.can_read(0):
            try:
                value = self.conn.read_response()
            except ResponseError as exc:
                if isinstance(exc, NoScriptError) and not self.stale:
                    self.noscript = True
                value = exc
            self.owed -= 1
            if self.stale:
                self.stale -= 1
                continue
            if self.skip:
                self.skip -= 1
                if isinstance(value, ResponseError):
                    raise value
                continue
            self.values.append(value)
        if self.owed or not self.noscript:
            return not self.owed
        # The node lost its script cache (restart, SCRIPT FLUSH, failover): load the
        # scripts and send the request again. Scripts that answered NOSCRIPT did not
        # run; the plain commands sent with them are read-only (WAIT, EXISTS, ASKING).
        self.values, self.noscript = [], False
        self.send(load=self.scripts())
        return False

    def scripts(self) -> list[Script]:
        """The distinct scripts this request calls."""
        return list({call.script.sha: call.script for call in self.calls if call.script}.values())


def _pack(conn: AbstractConnection, commands: list[tuple[Any, ...]]) -> list[bytes]:
    """The commands in RESP, as redis-py would write them, but several times faster.

    Renewal sends one call per lock slot to a Redis Cluster (10,000 locks: 10,000
    EVALSHA per tick), where redis-py's general packer took most of the tick. This
    handles the argument types the library sends (str, bytes, int) and leaves
    anything else to redis-py.
    """
    encoding, errors = conn.encoder.encoding, conn.encoder.encoding_errors
    out = []
    for args in commands:
        out.append(b"*%d\r\n" % len(args))
        for arg in args:
            if isinstance(arg, str):
                data = arg.encode(encoding, errors)
            elif isinstance(arg, bytes):
                data = arg
            elif type(arg) is int:  # not bool, which redis-py refuses
                data = b"%d" % arg
            else:
                packed: list[bytes] = conn.pack_commands(commands)
                return packed
            out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return [b"".join(out)]


class _Gather:
    """One node's :class:`Reply`, assembled from the replies of its legs."""

    __slots__ = ("answered", "error", "node", "outstanding", "values")

    def __init__(self, node: Node, size: int) -> None:
        self.node = node
        self.values: list[Any] = [None] * size
        self.outstanding = 0  # legs sent and not finished
        self.error: BaseException | None = None
        self.answered = False

    def put(self, leg: Leg, k: int, value: Any) -> None:
        """Store the reply to ``leg.calls[k]`` where it belongs."""
        place = leg.place(k)
        if place is None:
            return
        position, indices = place
        if indices is None:
            self.values[position] = value
            return
        merged = self.values[position]
        if merged is None:
            merged = self.values[position] = []
        for n, index in enumerate(indices):
            if len(merged) <= index:
                merged.extend([None] * (index + 1 - len(merged)))
            # A split call answers one entry per key; an error answers for all its keys.
            merged[index] = value if isinstance(value, ResponseError) else value[n]

    def fail(self, leg: Leg, error: BaseException) -> None:
        """The leg got no reply: its calls fail (or, for a plain node, the whole node)."""
        value = self.node.failed(leg, error)
        # A cluster's error names the master; the node's reply is that error when no
        # master answered at all.
        self.error = self.error or (error if value is None else value)
        if value is not None:
            for k in range(len(leg.calls)):
                self.put(leg, k, value)

    def reply(self) -> Reply:
        if self.error is not None and not self.answered:
            return Reply(self.node, error=self.error)
        return Reply(self.node, values=self.values)


class _FanOut:
    """The state of one :func:`fan_out`: legs in flight and replies per node."""

    def __init__(self, nodes: Sequence[Node], deadline: float) -> None:
        self.nodes = nodes
        self.deadline = deadline
        self.replies: list[Reply | None] = [None] * len(nodes)
        self.gathers: dict[int, _Gather] = {}
        self.inflight: list[_InFlight] = []
        #: Every connection this fan-out checked out, to close if it is interrupted.
        self.used: list[tuple[Node, AbstractConnection]] = []

    def start(self, index: int, leg: Leg, share: int = 1) -> None:
        """Check out a connection of the leg's server and send the leg.

        A connect may take ``1/share`` of the time left (``share`` connects remain).
        """
        gather = self.gathers[index]
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            gather.fail(leg, RedisTimeoutError("no time left in the budget"))
            return
        conn = None
        try:
            conn, fresh, stale = leg.node.checkout(connect_timeout=remaining / share)
            self.used.append((leg.node, conn))
            flight = _InFlight(index, leg, conn, stale)
            # A new connection may face a server that never saw our scripts (it was
            # restarted, or is new): load them in the same write instead of paying a
            # NOSCRIPT round trip, which would also run a pipelined WAIT twice.
            flight.send(load=flight.scripts() if fresh else ())
        except (RedisError, OSError) as exc:
            if conn is not None:
                leg.node.discard(conn)
            gather.fail(leg, exc)
            return
        gather.outstanding += 1
        self.inflight.append(flight)

    def settle(self, index: int) -> None:
        """Set the node's reply once none of its legs is outstanding."""
        gather = self.gathers[index]
        if not gather.outstanding and self.replies[index] is None:
            self.replies[index] = gather.reply()

    def complete(self, flight: _InFlight) -> None:
        """Take a finished leg's replies; follow redirections (cluster nodes)."""
        index, leg = flight.index, flight.leg
        gather, node = self.gathers[index], self.nodes[index]
        gather.outstanding -= 1
        gather.answered = True
        resend: dict[tuple[int, bool], Leg] = {}
        for k, value in enumerate(flight.values):
            target = node.redirect(leg, value) if isinstance(value, ResponseError) else None
            if target is None:
                gather.put(leg, k, value)
                continue
            server, asking = target
            again = resend.get((id(server), asking))
            if again is None:
                again = resend[(id(server), asking)] = Leg(server, [], [], leg.hops + 1)
            if asking:  # ASKING applies to the next command only
                again.calls.append(Call.command("ASKING"))
                again.places.append(None)  # type: ignore[union-attr]  # places is a list here
            again.calls.append(leg.calls[k])
            again.places.append(leg.place(k))  # type: ignore[union-attr]
        for again in resend.values():
            self.start(index, again)

    def failed(self, flight: _InFlight, error: BaseException) -> None:
        gather = self.gathers[flight.index]
        gather.outstanding -= 1
        gather.fail(flight.leg, error)


def fan_out(
    nodes: Sequence[Node],
    requests: Sequence[Sequence[Call] | None],
    *,
    timeout: float,
    decided: Callable[[list[Reply | None]], bool] | None = None,
) -> list[Reply | None]:
    """Send ``requests[i]`` to ``nodes[i]`` concurrently and collect the replies.

    Arguments:
        nodes: the nodes to ask.
        requests: the calls for each node, sent pipelined on one connection (per
            master, for a cluster node); ``None`` leaves that node out.
        timeout: budget in seconds for the whole fan-out, connects, slot map reads
            and cluster redirections included.
        decided: called with the replies so far after each one arrives; when it
            returns True the fan-out returns at once, leaving unanswered nodes as
            ``None`` (their connections are drained later).

    Returns:
        One :class:`Reply` per node (``None`` for a node left out or not waited for).
        A node that missed the budget has a ``Reply`` whose ``error`` is a timeout.

    Raises:
        celery_redlock.cluster.CrossSlotError: a call cannot be routed on a cluster
            node (nothing was sent to any node).
    """
    state = _FanOut(nodes, time.monotonic() + timeout)
    legs: list[tuple[int, Leg]] = []
    for i, calls in enumerate(requests):
        if not calls:
            continue
        try:
            routed = nodes[i].route(calls, state.deadline)
        except (RedisError, OSError) as exc:  # a cluster node that cannot read its map
            state.replies[i] = Reply(nodes[i], error=exc)
            continue
        state.gathers[i] = _Gather(nodes[i], len(calls))
        legs += [(i, leg) for leg in routed]

    # Servers with a live connection go first, so a slow connect to a restarted or
    # unreachable node overlaps with the replies of the healthy ones; among the rest,
    # the servers that failed most recently go last. Connects are made one after
    # another, so each gets a fair share of what is left of the budget: one node cut
    # off by a partition must not spend the time the others need (found by
    # tests/reliability/test_partition.py: a minority partition lost the lock).
    ordered = sorted(
        ((not leg.node.has_idle(), leg.node.failed_at, i, leg) for i, leg in legs),
        key=lambda item: item[:2],
    )
    try:
        connects = sum(needs_connect for needs_connect, *_ in ordered)
        for needs_connect, _, i, leg in ordered:
            state.start(i, leg, share=connects if needs_connect else 1)
            connects -= needs_connect
        for i in state.gathers:
            state.settle(i)
        _collect(state, decided)
    except BaseException:
        # Only an exception from outside (raised asynchronously, or a bug) gets here:
        # node errors become replies. Replies may be half read: close every
        # connection this request used, pooled again or not.
        for node, conn in state.used:
            node.forget(conn)
        raise
    else:
        now = time.monotonic()
        for flight in state.inflight:
            # (A leg in flight means its node has no reply yet.)
            if now < state.deadline:
                # Decided early: the node is healthy as far as we know, so keep the
                # connection and read its reply the next time it is checked out.
                flight.leg.node.checkin(flight.conn, owed=flight.owed, give_up_at=state.deadline)
            else:
                flight.leg.node.discard(flight.conn)
                state.failed(flight, RedisTimeoutError(f"no reply within {timeout:.3f}s"))
                state.settle(flight.index)
    return state.replies


def _collect(state: _FanOut, decided: Callable[[list[Reply | None]], bool] | None) -> None:
    """Read replies as they arrive until all are in, the outcome is decided, or time is up."""
    replies = state.replies
    if decided is not None and decided(replies):
        return
    while state.inflight:
        progressed = False
        for flight in list(state.inflight):
            try:
                complete = flight.read_ready()
            except (RedisError, OSError) as exc:
                flight.leg.node.discard(flight.conn)
                state.inflight.remove(flight)
                state.failed(flight, exc)
                state.settle(flight.index)
                progressed = True
                continue
            if complete:
                state.inflight.remove(flight)
                # Back in the pool, another thread may use it: no longer ours to close.
                state.used.remove((flight.leg.node, flight.conn))
                flight.leg.node.checkin(flight.conn)
                state.complete(flight)
                state.settle(flight.index)
                progressed = True
        if progressed and decided is not None and decided(replies):
            return
        if not state.inflight:
            return
        remaining = state.deadline - time.monotonic()
        if remaining <= 0:
            return
        if not progressed:
            socks: list[Any] = [flight.conn._sock for flight in state.inflight]
            # A socket closed under us shows up as an error on the next read.
            with contextlib.suppress(OSError, ValueError):
                select.select(socks, [], [], remaining)


class NodeSet:
    """The masters a lock lives on: one node, or N independent nodes for Redlock.

    Instances are shared per process for the same URLs and timeout (:meth:`get`),
    and their :class:`Node` objects per URL whatever the timeout: every lock on the
    same servers shares their connections (300 locks with 300 short ttls used to open
    300 sets of connections).
    """

    _registry: dict[tuple[Any, ...], NodeSet] = {}
    _nodes: dict[str, Node] = {}
    _registry_lock = threading.Lock()

    def __init__(
        self, urls: Sequence[str], *, timeout: float, nodes: Sequence[Node] | None = None
    ) -> None:
        if isinstance(urls, str):
            urls = [urls]
        urls = list(urls)
        if not urls:
            raise ConfigurationError(
                "no Redis nodes given: pass nodes=[url, ...] (one URL, or 3, 5, 7... "
                "independent masters for Redlock), or set redlock_url / redlock_nodes"
            )
        if len(set(urls)) != len(urls):
            raise ConfigurationError(f"Redis node URLs must be distinct, got {urls!r}")
        if not timeout or timeout <= 0:
            raise ConfigurationError(f"node timeout must be > 0 seconds, got {timeout!r}")
        if nodes is None:
            nodes = [make_node(url, timeout=timeout) for url in urls]
        self.nodes = tuple(nodes)
        self.timeout = timeout
        self.quorum = len(self.nodes) // 2 + 1

    @classmethod
    def get(cls, urls: Sequence[str], *, timeout: float) -> NodeSet:
        """The process-wide NodeSet for these URLs and timeout."""
        key = (tuple([urls] if isinstance(urls, str) else urls), timeout)
        nodeset = cls._registry.get(key)
        if nodeset is None:
            with cls._registry_lock:
                nodeset = cls._registry.get(key)
                if nodeset is None:
                    if not timeout or timeout <= 0:  # checked before a node is made
                        cls(key[0], timeout=timeout)
                    nodes = [cls._shared_node(url, timeout) for url in key[0]]
                    nodeset = cls._registry[key] = cls(key[0], timeout=timeout, nodes=nodes)
        return nodeset

    @classmethod
    def _shared_node(cls, url: str, timeout: float) -> Node:
        """The process's node for ``url`` (call with the registry lock held)."""
        node = cls._nodes.get(url)
        if node is None:
            node = cls._nodes[url] = make_node(url, timeout=timeout)
        else:
            node.widen_timeout(timeout)
        return node

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"<NodeSet {[n.safe_url for n in self.nodes]} quorum={self.quorum}>"

    def call(
        self,
        calls: Sequence[Call] | Sequence[Sequence[Call] | None],
        *,
        per_node: bool = False,
        timeout: float | None = None,
        decided: Callable[[list[Reply | None]], bool] | None = None,
    ) -> list[Reply | None]:
        """Send the same calls to every node (or ``calls[i]`` to node i with ``per_node``)."""
        requests = calls if per_node else [calls] * len(self.nodes)
        return fan_out(
            self.nodes,
            requests,  # type: ignore[arg-type]
            timeout=self.timeout if timeout is None else timeout,
            decided=decided,
        )
