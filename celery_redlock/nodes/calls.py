"""What travels between the lock engine and Redis, and what a lock node must offer.

A request is a list of :class:`Call` for one node; its answer is one :class:`Reply`.
:func:`~celery_redlock.nodes.fan_out` sends each node's request as one or more
:class:`Leg` (one per master; always one for a plain node) and merges the replies
back per node.

Two protocols name what the rest of the package may rely on, so that code accepting
"any node" is typed for a plain master and a Redis Cluster alike:

* :class:`LockNode`: one Redlock vote, named by one URL; a plain or Sentinel-managed
  master (:class:`~celery_redlock.nodes.Node`) or a whole Redis Cluster
  (:class:`~celery_redlock.nodes.cluster.ClusterNode`). It routes a request into
  legs, says where a redirected call goes and what a failed leg's calls answer.
* :class:`Server`: one Redis server with its pool of connections, where a leg is
  sent (a :class:`~celery_redlock.nodes.Node`: a plain node is its own server, a
  cluster node has one per master). Every server is also a lock node of its own,
  which is how the operations layer scans each master of a cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.connection import AbstractConnection
from redis.exceptions import ResponseError

__all__ = ["LAG", "Call", "Leg", "LockNode", "Place", "Reply", "Script", "Server", "bulk"]

#: A server lags when its reply comes this much later (seconds) than the first reply of
#: the same fan-out, or is still missing this long after a fan-out decided without it,
#: at the server's next use: a healthy server answers within a millisecond or two.
#: What would wait for every node skips a lagging one (:meth:`NodeSet.lagging`).
LAG = 0.02


class Script(Protocol):
    """What the node layer needs of a Lua script.

    Its source and SHA1 (for EVALSHA with a NOSCRIPT fallback), and whether its keys
    may be split (Redis Cluster).

    The scripts themselves belong to the lock engine (:mod:`celery_redlock.engine.scripts`),
    a layer above this one.
    """

    @property
    def name(self) -> str:
        """The script's name, for error messages."""

    @property
    def sha(self) -> str:
        """The SHA1 of its source, for EVALSHA."""

    @property
    def source(self) -> str:
        """The Lua source, for SCRIPT LOAD."""

    @property
    def per_key_args(self) -> int | None:
        """Arguments per key when its keys are independent (a call may be split); else None."""

    def evalsha(self, keys: Sequence[str], args: Sequence[object]) -> tuple[object, ...]:
        """The EVALSHA command that runs it on ``keys`` with ``args``."""


@dataclass(frozen=True)
class Call:
    """One command for a node: a script with its keys and arguments, or a plain command."""

    script: Script | None
    keys: tuple[Any, ...] = ()
    args: tuple[Any, ...] = ()
    #: The whole command already in RESP (UTF-8), or None: for a call assembled from
    #: pieces its caller encoded once with :func:`bulk` (the renewer's, sent again every
    #: renewal). It must say what ``keys`` and ``args`` say: a Redis Cluster that splits
    #: the call, and any node whose connections use another encoding, encode from them.
    resp: bytes | None = field(default=None, compare=False, repr=False)

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

    node: LockNode
    values: list[Any] = field(default_factory=list)
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        """The node answered every command (each answer may still be an error reply)."""
        return self.error is None

    def describe_error(self) -> str:
        """One line naming the node and what went wrong, for logs and exceptions."""
        return f"{self.node.safe_url}: {type(self.error).__name__}: {self.error}"


def bulk(*args: str | int) -> bytes:
    """``args`` as RESP bulk strings (UTF-8): a piece of a :attr:`Call.resp`."""
    # A loop, not nested generators: every call of a Celery task's lock packs its keys.
    out = []
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else b"%d" % arg
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


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

    node: Server
    calls: list[Call]
    places: list[Place | None] | None = None
    hops: int = 0  # redirections (MOVED/ASK) that led here

    def place(self, k: int) -> Place | None:
        """Where the reply to ``calls[k]`` goes."""
        return (k, None) if self.places is None else self.places[k]


class LockNode(Protocol):
    """One lock node (one Redlock vote): what the fan-out, the engine and the CLI use."""

    #: The URL as configured (with its password: never log it).
    url: str
    #: The URL with its passwords masked, for logs and messages.
    safe_url: str
    #: The longest node timeout asked for (seconds); see :meth:`widen_timeout`.
    timeout: float
    #: Whether the keys of one call must share a hash slot (a Redis Cluster).
    slotted: bool

    def widen_timeout(self, timeout: float) -> None:
        """Let calls through this node (shared by every lock on its URL) take up to ``timeout``."""

    def new_connection(self) -> AbstractConnection:
        """A fresh, unconnected connection (the release listener subscribes on it)."""

    def route(self, calls: Sequence[Call], deadline: float | None = None) -> list[Leg]:
        """The request as legs, one per server that must answer part of it."""

    def redirect(self, leg: Leg, value: Any) -> tuple[Server, bool] | None:
        """Where to send again a call answered with ``value``: (server, asking?), or never."""

    def failed(self, leg: Leg, error: BaseException) -> ResponseError | None:
        """The reply value for a failed leg's calls; None: the node's reply is the error."""

    def masters(self, deadline: float | None = None) -> Sequence[Server]:
        """The servers to ask for node-wide facts (SCAN, INFO)."""

    def close(self) -> None:
        """Close the pooled connections (for a node this process will not use again)."""


class Server(LockNode, Protocol):
    """One Redis server and its connection pool: where a :class:`Leg` is sent."""

    #: When a connection to this server last failed (monotonic; 0: never).
    failed_at: float
    #: When this process last read a reply from this server (monotonic; 0: never).
    answered_at: float
    #: When this server was last seen lagging (monotonic; -inf: never): see :data:`LAG`.
    lagged_at: float

    def has_idle(self) -> bool:
        """Whether a connected connection is ready (a send needs no connect first)."""

    def checkout(
        self, connect_timeout: float | None = None
    ) -> tuple[AbstractConnection, bool, int]:
        """A connection for one request: (connection, just opened?, replies owed)."""

    def checkin(self, conn: AbstractConnection, owed: int = 0, give_up_at: float = 0.0) -> None:
        """Return a connection; ``owed`` replies still in flight are read later."""

    def scripts_unread(self, scripts: Sequence[Script]) -> None:
        """A request calling ``scripts`` leaves its replies to be read later."""

    def scripts_to_load(self) -> list[Script]:
        """Scripts to load before the next request (after a NOSCRIPT nobody acted on)."""

    def scripts_lost(self) -> None:
        """A NOSCRIPT reply was read that no request will act on."""

    def discard(self, conn: AbstractConnection) -> None:
        """Close a connection that failed or cannot be trusted to be in sync."""

    def forget(self, conn: AbstractConnection) -> None:
        """Close a connection whose request was interrupted, wherever it is now."""
