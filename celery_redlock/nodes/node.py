"""One Redis master as a lock node: a small per-process pool of connections.

A :class:`Node` is a plain master (``redis://``, ``rediss://``, ``unix://``) or a
Sentinel-monitored one (:mod:`celery_redlock.nodes.sentinel`); a Redis Cluster keeps
one per master (:mod:`celery_redlock.nodes.cluster`). It is both a
:class:`~celery_redlock.nodes.calls.LockNode` (one vote) and the
:class:`~celery_redlock.nodes.calls.Server` its requests are sent to.

The pool is shaped by :func:`~celery_redlock.nodes.fan_out`, which returns once the
outcome is decided and leaves the connections whose replies are still in flight
here: they are read (drained) the next time the pool is used, and a thread that left
replies in flight gets that same connection back, so its next request (an undo)
queues behind the earlier one.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from redis.connection import AbstractConnection, ConnectionPool
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.sentinel import SentinelConnectionPool

from ..base import forksafe
from ..base.poll import readable
from ..exceptions import ConfigurationError
from .calls import LAG, Call, Leg, Script
from .sentinel import (
    MASTER_RECHECK,
    SENTINEL_FORM,
    is_sentinel_url,
    sanitize_sentinel_url,
    sentinel_pool,
)
from .urls import connection_options, mask_password, register_node_kind

__all__ = ["MAX_IDLE", "Node"]

logger = logging.getLogger("celery_redlock.nodes")

#: Idle connections kept per node and process; more are opened when needed.
MAX_IDLE = 16


class Node:
    """One Redis master: its URL and a small per-process pool of connections.

    Connections are plain redis-py connections (TCP, TLS or unix socket, with the
    URL's credentials and database), made with the node timeout as both connect and
    socket timeout and with retries switched off. The pool forgets its connections
    in a forked child, which opens its own.
    """

    slotted = False

    def __init__(self, url: str, *, timeout: float) -> None:
        #: The pool of a Sentinel-managed node (None otherwise): it knows the master.
        self._sentinel: SentinelConnectionPool | None = None
        if is_sentinel_url(url):
            self._sentinel = sentinel_pool(url, timeout)
            pool: ConnectionPool = self._sentinel
            self.safe_url = sanitize_sentinel_url(url)
        else:
            try:
                pool = ConnectionPool.from_url(url, **connection_options(timeout))
            except (ValueError, TypeError) as exc:
                raise ConfigurationError(
                    f"invalid Redis URL {mask_password(url)!r}: {exc}; expected "
                    "redis://[[user]:password@]host[:port][/db], rediss://..., unix://path "
                    f"or {SENTINEL_FORM}"
                ) from exc
            self.safe_url = mask_password(url)
        self._recheck_at = 0.0
        #: When a connection to this server last failed (monotonic; 0: never).
        self.failed_at = 0.0
        #: When this process last read a reply from this server (monotonic; 0: never).
        self.answered_at = 0.0
        #: When a reply left in flight here was still missing at this node's next use
        #: (monotonic; -inf: never): the node is slower than its callers' pace.
        self.lagged_at = -math.inf
        self.url = url
        self.timeout = timeout
        self._connection_class = pool.connection_class
        self._connection_kwargs = pool.connection_kwargs
        self._lock = threading.Lock()
        self._idle: list[AbstractConnection] = []
        # Connections returned with replies still in flight:
        # [connection, replies owed, give up at (monotonic), thread ident].
        self._draining: list[list[Any]] = []
        # The scripts of requests returned with replies in flight (whose NOSCRIPT, if
        # any, nobody acts on), and whether such a reply said NOSCRIPT: then the next
        # request loads them first. Else a node whose script cache was flushed, and
        # whose replies always came after the vote was decided, would never run a
        # script again.
        self._unread_scripts: dict[str, Script] = {}
        self._scripts_lost = False
        self._pid = os.getpid()
        forksafe.track(self)

    def _after_fork_in_child(self) -> None:
        # Another thread of the parent may have held the lock at fork; the sockets
        # are the parent's (redis-py only shuts a socket down in its own process).
        self._lock = threading.Lock()
        self._check_pid()

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
        return bool(self._idle) and self._pid == forksafe.pid()

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
                for index, (conn, owed, _, ident, left_at) in enumerate(self._draining):
                    if ident == me:
                        del self._draining[index]
                        if not self._stale(conn):
                            now = time.monotonic()
                            if now - left_at > LAG:
                                self.lagged_at = now  # still owes replies from then
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

    def scripts_unread(self, scripts: Sequence[Script]) -> None:
        """A request calling ``scripts`` leaves its replies to be read later."""
        for script in scripts:
            self._unread_scripts.setdefault(script.sha, script)

    def scripts_to_load(self) -> list[Script]:
        """Scripts to load before the next request.

        None, unless a NOSCRIPT went unanswered (:meth:`scripts_lost`): then those of
        :meth:`scripts_unread`, once.
        """
        if not self._scripts_lost:
            return []
        self._scripts_lost = False
        return list(self._unread_scripts.values())

    def scripts_lost(self) -> None:
        """A NOSCRIPT reply was read that no request will act on."""
        self._scripts_lost = True

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
            if self._pid != forksafe.pid():
                return
            if owed:
                self._draining.append(
                    [conn, owed, give_up_at, threading.get_ident(), time.monotonic()]
                )
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
            conn, owed, give_up_at, *_ = item
            try:
                while owed and conn.can_read(0):
                    try:
                        conn.read_response()
                    except NoScriptError:
                        self._scripts_lost = True
                    except ResponseError:
                        pass
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
                self.lagged_at = now  # it never answered
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
        return bool(readable([sock], 0))
    except (OSError, ValueError):
        return True


# A Sentinel URL makes a Node too; registered so that safe_url masks its passwords.
register_node_kind(is_sentinel_url, Node, sanitize_sentinel_url)
