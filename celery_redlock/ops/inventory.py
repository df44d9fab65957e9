"""What the lock nodes hold: the read model of ``celery redlock``.

Value types for one lock key as each node sees it (:class:`NodeView`) and as a quorum
sees it (:class:`LockView`), and the Redis I/O that builds them: keys are found with
``SCAN ... TYPE hash`` (never ``KEYS``, which blocks a server for as long as it takes
to walk every key), read with the ``inspect.lua`` script, and released with
``release.lua`` and the exact token that was read, so a lock re-acquired in the
meantime is left alone. Shares (read locks, ``limit`` slots) are read by
:mod:`celery_redlock.ops.shares` on top of :func:`scan_lock_keys`.

Nothing here prints or knows about click: the commands in :mod:`celery_redlock.ops.cli`
present what it returns.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from redis.exceptions import RedisError, ResponseError

from ..engine.keys import SUFFIXES, keys_of, lock_keys, lock_name_of, parse_key
from ..engine.kinds import Exclusive
from ..engine.scripts import INSPECT, ReleaseStatus
from ..nodes import Call, NodeSet, Server, fan_out

__all__ = [
    "HeldOnNodes",
    "LockView",
    "NodeView",
    "answers",
    "has_quorum",
    "held_locks",
    "nodes_status",
    "quorum_error",
    "read_locks",
    "release_lock",
    "reply_error",
    "resolve_key",
    "scan_lock_keys",
    "to_float",
    "to_int",
]

#: Keys asked for per SCAN call, and keys read per pipelined request.
SCAN_COUNT = 1000
READ_CHUNK = 500

#: ``release.lua``'s status codes by the names ``release_lock`` reports.
RELEASE_RESULTS = {status.value: status.name.lower() for status in ReleaseStatus}


class HeldOnNodes:
    """What a share and a claim have in common: a live copy on some nodes.

    ``remaining`` holds the seconds left on each node that has it; ``quorum_size`` is
    how many nodes a majority is.
    """

    remaining: list[float]
    quorum_size: int

    @property
    def held_on(self) -> int:
        """Nodes where it is live."""
        return len(self.remaining)

    @property
    def ttl(self) -> float | None:
        """Seconds it keeps its quorum (the quorum-th longest of ``remaining``)."""
        if not self.remaining:
            return None
        ordered = sorted(self.remaining, reverse=True)
        return ordered[min(self.quorum_size, len(ordered)) - 1]


@dataclass
class NodeView:
    """One node's view of one lock key (the reply of ``inspect.lua``, or an error)."""

    node: str
    error: str | None = None
    pttl: int | None = None
    fence_counter: int | None = None
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def held(self) -> bool:
        """The node holds the lock (the hash exists and has a token)."""
        return self.error is None and self.pttl != -2 and bool(self.fields.get("token"))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form: node, ok, error, held, pttl, fence_counter, fields."""
        return {
            "node": self.node,
            "ok": self.error is None,
            "error": self.error,
            "held": self.held,
            "pttl": self.pttl,
            "fence_counter": self.fence_counter,
            "fields": dict(self.fields),
        }


@dataclass
class LockView:
    """One lock key across every node, with its holder as a quorum sees it.

    The holder is the token held on the most nodes (the largest fence breaks a tie).
    ``ttl`` is how long that holder keeps a quorum: the quorum-th largest PTTL among
    the nodes holding its token (with one node, simply its PTTL).
    """

    key: str
    name: str
    views: list[NodeView]
    quorum_size: int

    @cached_property
    def _holders(self) -> list[NodeView]:
        held = [v for v in self.views if v.held]
        if not held:
            return []
        counts = Counter(v.fields["token"] for v in held)
        token = max(counts, key=lambda t: (counts[t], _fence_of(held, t)))
        return [v for v in held if v.fields["token"] == token]

    @property
    def held(self) -> bool:
        """Some node holds it."""
        return bool(self._holders)

    @property
    def token(self) -> str | None:
        """The holder's token (what ``release`` deletes)."""
        return self._holders[0].fields["token"] if self._holders else None

    @property
    def fields(self) -> dict[str, str]:
        """The holder's fields, from the node with the largest fence."""
        if not self._holders:
            return {}
        return max(self._holders, key=lambda v: to_int(v.fields.get("fence")) or 0).fields

    @property
    def held_on(self) -> int:
        """Nodes holding the holder's token."""
        return len(self._holders)

    @property
    def has_quorum(self) -> bool:
        """The holder's token is on a quorum of nodes: the lock is held."""
        return self.held_on >= self.quorum_size

    @property
    def other_tokens(self) -> int:
        """Nodes holding a different token (left over from a failed acquisition)."""
        return sum(1 for v in self.views if v.held) - self.held_on

    @property
    def ttl(self) -> float | None:
        """Seconds the holder keeps its quorum (see the class docs); None if free."""
        pttls = sorted((v.pttl for v in self._holders if v.pttl is not None), reverse=True)
        if not pttls:
            return None
        if any(p < 0 for p in pttls):  # -1: no TTL at all (not made by this library)
            return -1.0
        index = self.quorum_size - 1 if len(pttls) >= self.quorum_size else 0
        return pttls[index] / 1000

    @property
    def fence(self) -> int | None:
        """The holder's fencing token."""
        return to_int(self.fields.get("fence"))

    @property
    def task_id(self) -> str | None:
        """The holder's task id (None when the holder is not a task)."""
        return self.fields.get("task_id") or None

    @property
    def task_name(self) -> str | None:
        """The holder's task name, as recorded at acquisition."""
        return self.fields.get("task_name") or None

    @property
    def acquired_at(self) -> float | None:
        """Unix time of the acquisition, on the holder's clock."""
        return to_float(self.fields.get("acquired_at"))

    def age(self, now: float) -> float | None:
        """Seconds since the acquisition (by the holder's clock against ``now``)."""
        acquired = self.acquired_at
        return None if acquired is None else now - acquired

    def unreachable(self) -> list[str]:
        """Nodes that could not be asked about this key."""
        return [v.node for v in self.views if v.error is not None]

    def as_dict(self, now: float) -> dict[str, Any]:
        """JSON-ready form (stable keys; the token is left out, ``inspect`` shows it)."""
        age = self.age(now)
        return {
            "key": self.key,
            "name": self.name,
            "task_name": self.task_name,
            "task_id": self.task_id,
            "host": self.fields.get("host") or None,
            "pid": to_int(self.fields.get("pid")),
            "acquired_at": self.acquired_at,
            "age": None if age is None else round(age, 3),
            "ttl": None if self.ttl is None else round(self.ttl, 3),
            "lease": _float_ms(self.fields.get("ttl")),
            "fence": self.fence,
            "held_on": self.held_on,
            "nodes": len(self.views),
            "quorum": self.has_quorum,
            "other_tokens": self.other_tokens,
        }


def _fence_of(views: Iterable[NodeView], token: str) -> int:
    return max(to_int(v.fields.get("fence")) or 0 for v in views if v.fields["token"] == token)


def _float_ms(value: Any) -> float | None:
    ms = to_float(value)
    return None if ms is None else ms / 1000


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def resolve_key(text: str, prefix: str) -> str:
    """The lock key for any key of a lock (``redlock:{name}``, ``...:fence``...) or a name."""
    parsed = parse_key(text, prefix)
    if parsed is not None:
        return parsed[0].lock
    return lock_keys(text, prefix).lock


def _is_field_of(key: str, prefix: str, field: str, lock: str | None) -> bool:
    """Whether ``key`` is the ``field`` key of a lock (of ``lock``, if given)."""
    parsed = parse_key(key, prefix)
    return parsed is not None and parsed[1] == field and lock in (None, parsed[0].lock)


def scan_lock_keys(
    nodeset: NodeSet,
    prefix: str,
    *,
    timeout: float | None = None,
    field: str = "lock",
    key_type: str = "hash",
    lock: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Every lock key on any node, with SCAN (never KEYS); and the nodes that failed.

    All nodes are scanned concurrently: each round sends the next ``SCAN`` to every
    node whose cursor is not back at 0 (every master, for a Redis Cluster node).
    ``TYPE hash`` leaves out fence counters (strings) on the server;
    :func:`is_lock_key` drops beat state hashes. With ``field`` (a
    :class:`~celery_redlock.engine.keys.LockKeys` field, e.g. ``"shared"`` with
    ``key_type="zset"``) it finds that key of every lock instead; with ``lock`` (a
    lock key), only that lock's (its claims, one per task: ``field="claim"``).

    Returns:
        (sorted keys, {node url: error}) for nodes that failed part-way.
    """
    locks = _glob_escape(prefix) + "{*}" if lock is None else _glob_escape(lock)
    pattern = locks + _glob_escape(SUFFIXES[field])
    if field == "claim":  # one per task: <lock>:claim:<task tag> (keys.claim_key)
        pattern += "*"
    # A cluster node is scanned on every master; its errors are reported under its URL.
    servers: list[Server] = []
    owners: list[str] = []
    errors: dict[str, str] = {}
    for node in nodeset.nodes:
        try:
            masters = node.masters()
        except (RedisError, OSError) as exc:
            errors[node.safe_url] = f"{type(exc).__name__}: {exc}"
            continue
        servers += masters
        owners += [node.safe_url] * len(masters)
    cursors: dict[int, str] = {i: "0" for i in range(len(servers))}
    keys: set[str] = set()
    while cursors:
        requests: list[list[Call] | None] = [None] * len(servers)
        for i, cursor in cursors.items():
            scan = ("SCAN", cursor, "MATCH", pattern, "COUNT", SCAN_COUNT, "TYPE", key_type)
            requests[i] = [Call.command(*scan)]
        replies = fan_out(
            servers, requests, timeout=nodeset.timeout if timeout is None else timeout
        )
        for i in list(cursors):
            reply = replies[i]
            error = reply_error(reply)
            if error is not None:
                label = servers[i].safe_url
                errors[owners[i]] = error if label == owners[i] else f"{label}: {error}"
                del cursors[i]
                continue
            cursor, found = reply.values[0]  # type: ignore[union-attr]
            keys.update(k for k in found if _is_field_of(k, prefix, field, lock))
            if str(cursor) == "0":
                del cursors[i]
            else:
                cursors[i] = str(cursor)
    return sorted(keys), errors


def reply_error(reply: Any) -> str | None:
    """Why a node's reply (or its absence) is an error; None for a good reply."""
    if reply is None:
        return "no reply"
    if reply.error is not None:
        return f"{type(reply.error).__name__}: {reply.error}"
    for value in reply.values:
        if isinstance(value, ResponseError):
            return f"{type(value).__name__}: {value}"
    return None


def answers(
    nodeset: NodeSet, calls: Sequence[Call], timeout: float | None = None
) -> tuple[list[tuple[str, list[Any]]], dict[str, str]]:
    """Send ``calls`` to every node: each answering node's URL and values; errors per node.

    For what each node holds alone (joined by the reader, not voted on).
    """
    answered: list[tuple[str, list[Any]]] = []
    errors: dict[str, str] = {}
    for node, reply in zip(nodeset.nodes, nodeset.call(calls, timeout=timeout), strict=True):
        error = reply_error(reply)
        if error is not None:
            errors[node.safe_url] = error
        else:
            answered.append((node.safe_url, list(reply.values)))  # type: ignore[union-attr]
    return answered, errors


def read_locks(
    nodeset: NodeSet, keys: Sequence[str], prefix: str, *, timeout: float | None = None
) -> list[LockView]:
    """Read ``keys`` on every node with ``inspect.lua`` (pipelined, in chunks)."""
    per_key: dict[str, list[NodeView]] = {key: [] for key in keys}
    for start in range(0, len(keys), READ_CHUNK):
        chunk = keys[start : start + READ_CHUNK]
        calls = [INSPECT.on(keys_of(key)) for key in chunk]
        for i, reply in enumerate(nodeset.call(calls, timeout=timeout)):
            node = nodeset.nodes[i].safe_url
            if reply is None or reply.error is not None:
                error = reply_error(reply)
                for key in chunk:
                    per_key[key].append(NodeView(node, error=error))
                continue
            for key, value in zip(chunk, reply.values, strict=True):
                if isinstance(value, ResponseError):
                    per_key[key].append(NodeView(node, error=f"ResponseError: {value}"))
                    continue
                flat = value[2:]
                per_key[key].append(
                    NodeView(
                        node,
                        pttl=int(value[0]),
                        fence_counter=int(value[1]),
                        fields=dict(zip(flat[::2], flat[1::2], strict=True)),
                    )
                )
    return [
        LockView(key, lock_name_of(key, prefix), views, nodeset.quorum)
        for key, views in per_key.items()
    ]


def release_lock(
    nodeset: NodeSet, lock: LockView, *, timeout: float | None = None
) -> list[dict[str, Any]]:
    """Delete the holder's token on every node with ``release.lua``.

    A node where the key is gone answers ``gone``; one where another token holds it
    (re-acquired since it was read) answers ``taken`` and keeps it.

    Returns:
        One ``{"node", "result", "error"}`` per node; result is ``released``,
        ``gone``, ``taken`` or ``error``.
    """
    if lock.token is None:
        return []
    # As the holder's own release: the oldest recorded waiter is named (and the lock kept
    # for it a moment), else one waiter per process is woken.
    release = Exclusive((keys_of(lock.key),)).release_call(lock.token)
    replies = nodeset.call([release], timeout=timeout)
    results: list[dict[str, str | None]] = []
    for node, reply in zip(nodeset.nodes, replies, strict=True):
        error = reply_error(reply)
        if error is not None:
            results.append({"node": node.safe_url, "result": "error", "error": error})
        else:
            code = int(reply.values[0])  # type: ignore[union-attr]
            results.append(
                {"node": node.safe_url, "result": RELEASE_RESULTS.get(code, "error"), "error": None}
            )
    return results


def held_locks(
    nodeset: NodeSet, prefix: str, task: str | None, *, timeout: float | None = None
) -> tuple[list[LockView], dict[str, str]]:
    """The locks held on some node (of tasks matching the glob ``task``, if given).

    Returns:
        (locks, {node url: error}) for every node that failed the SCAN or a read.
    """
    keys, errors = scan_lock_keys(nodeset, prefix, timeout=timeout)
    locks = read_locks(nodeset, keys, prefix, timeout=timeout)
    for lock in locks:
        for view in lock.views:
            if view.error is not None:
                errors.setdefault(view.node, view.error)
    locks = [lock for lock in locks if lock.held]
    if task is not None:
        locks = [lock for lock in locks if fnmatch.fnmatchcase(lock.task_name or "", task)]
    return locks, errors


def has_quorum(nodeset: NodeSet, errors: dict[str, str]) -> bool:
    """Whether enough nodes answered (all but those in ``errors``) to tell who holds a lock."""
    return len(nodeset) - len(errors) >= nodeset.quorum


def quorum_error(nodeset: NodeSet, errors: dict[str, str]) -> str:
    """Why nothing can be told when the nodes in ``errors`` did not answer."""
    answered = len(nodeset) - len(errors)
    return (
        f"only {answered} of {len(nodeset)} lock node(s) answered, fewer than the "
        f"{nodeset.quorum} needed to tell who holds a lock"
    )


def nodes_status(nodeset: NodeSet, errors: dict[str, str]) -> list[dict[str, Any]]:
    """Each node as ``ls --json`` lists it: ``{"node", "ok", "error"}`` (URLs without secrets)."""
    return [
        {"node": n.safe_url, "ok": n.safe_url not in errors, "error": errors.get(n.safe_url)}
        for n in nodeset.nodes
    ]


def to_int(value: Any) -> int | None:
    """``int(value)``, or None when it is not a number (fields read from Redis)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def to_float(value: Any) -> float | None:
    """``float(value)``, or None when it is not a number (fields read from Redis)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
