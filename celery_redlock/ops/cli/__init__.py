"""``celery -A proj redlock ...``: list, inspect, release and check the app's locks.

Registered as a Celery sub-command through the ``celery.commands`` entry point (as
Flower registers ``celery flower``)::

    celery -A proj redlock ls [--task GLOB] [--stale] [--json]
    celery -A proj redlock inspect KEY [--json]
    celery -A proj redlock release KEY [--yes] [--force] [--json]
    celery -A proj redlock release --stale [--task GLOB] [--yes] [--json]
    celery -A proj redlock doctor [--json]

The lock nodes are the app's: ``redlock_nodes``, else ``redlock_url``, else a
``redis://`` broker. Keys are found with ``SCAN ... TYPE hash`` (never ``KEYS``, which
blocks a server for as long as it takes to walk every key), read with the
``inspect.lua`` script, and released with ``release.lua`` and the exact token that
was read, so a lock re-acquired in the meantime is left alone. Every call has the
node timeout as its budget and no retries: a dead node costs one budget per round.

Whether a holder still runs is asked of the workers (``inspect().active()``, then
``stats()`` of those that answered, for their pids). A lock is **stale** only when it
names a task id and its holder is proven dead: the holder's process (the host and pid
the lock records) is gone on this host; or the holder's own worker (the answering
worker on that host whose main or pool process has that pid) does not have the task
active and runs no task in that process. Anything less is **unknown**: listed, never
released by ``--stale``, and released by ``release KEY`` only with ``--force``. A busy
solo worker cannot answer, and another worker on the same host says nothing about it.
A lock with no task id (a lock taken with ``Redlock`` in code, the beat leader lock)
is never stale.

A node that does not answer is never reported as holding no locks: with fewer than a
quorum answering, ``ls`` prints no "No locks held" (``--json``: ``"complete": false``
and ``"locks": null``), ``inspect`` says "unknown" (``"held": null``), and ``release``
releases nothing (``"error"``), all with exit status 69.

Exit status:

* 0: done (for ``doctor``: no error-level finding).
* 1: ``release`` refused (the holder runs, or whether it runs is unknown; for
  ``--stale``: some lock could not be classified) or was not confirmed; ``doctor``
  found an error; the ``redlock_*`` settings do not validate.
* 2: wrong usage (click).
* 69 (``EX_UNAVAILABLE``): fewer than a quorum of lock nodes answered; or workers had
  to be asked and none answered (for ``release --stale``: and some lock was refused
  for it), or the broker could not be reached; for ``doctor``,
  a node could not be asked at all.
"""

from __future__ import annotations

import fnmatch
import json
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NoReturn

import click
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options
from celery.exceptions import CeleryCommandException
from celery.platforms import EX_FAILURE, EX_UNAVAILABLE
from click_didyoumean import DYMGroup
from kombu.exceptions import OperationalError
from redis.exceptions import RedisError, ResponseError

from ...engine.keys import (
    SUFFIXES,
    is_lock_key,
    keys_of,
    lock_keys,
    lock_name_of,
    parse_key,
    release_keys,
)
from ...engine.scripts import INSPECT, RELEASE, ReleaseStatus
from ...exceptions import ConfigurationError
from ...nodes import Call, NodeSet, Server, fan_out
from ...settings import Settings, from_conf
from .. import doctor as doctor_module
from ..shares import ShareView, read_shares
from ..shares import to_float as _float
from ..shares import to_int as _int

__all__ = [
    "ACTIVE",
    "NO_TASK",
    "STALE",
    "UNKNOWN",
    "LockView",
    "NodeView",
    "Workers",
    "ask_workers",
    "classify",
    "is_lock_key",
    "read_locks",
    "redlock",
    "release_lock",
    "resolve_key",
    "scan_lock_keys",
]

#: Default budget of one call to the lock nodes from this command. Larger than the
#: library's (min(0.25 s, ttl/10)): an operator may be further from Redis than the
#: workers are, and nothing here holds a lease that could run out.
DEFAULT_NODE_TIMEOUT = 1.0
#: Keys asked for per SCAN call, and keys read per pipelined request.
SCAN_COUNT = 1000
READ_CHUNK = 500

ACTIVE, STALE, UNKNOWN, NO_TASK = "active", "stale", "unknown", "no-task"

RELEASE_RESULTS = {status.value: status.name.lower() for status in ReleaseStatus}


# -- reading locks -----------------------------------------------------------------


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
        return max(self._holders, key=lambda v: _int(v.fields.get("fence")) or 0).fields

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
        return _int(self.fields.get("fence"))

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
        return _float(self.fields.get("acquired_at"))

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
            "pid": _int(self.fields.get("pid")),
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
    return max(_int(v.fields.get("fence")) or 0 for v in views if v.fields["token"] == token)


def _float_ms(value: Any) -> float | None:
    ms = _float(value)
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


def _field_of(key: str, prefix: str) -> str | None:
    parsed = parse_key(key, prefix)
    return None if parsed is None else parsed[1]


def scan_lock_keys(
    nodeset: NodeSet,
    prefix: str,
    *,
    timeout: float | None = None,
    field: str = "lock",
    key_type: str = "hash",
) -> tuple[list[str], dict[str, str]]:
    """Every lock key on any node, with SCAN (never KEYS); and the nodes that failed.

    All nodes are scanned concurrently: each round sends the next ``SCAN`` to every
    node whose cursor is not back at 0 (every master, for a Redis Cluster node).
    ``TYPE hash`` leaves out fence counters (strings) on the server;
    :func:`is_lock_key` drops beat state hashes. With ``field`` (a
    :class:`~celery_redlock.keys.LockKeys` field, e.g. ``"shared"`` with
    ``key_type="zset"``) it finds that key of every lock instead.

    Returns:
        (sorted keys, {node url: error}) for nodes that failed part-way.
    """
    pattern = _glob_escape(prefix) + "{*}" + _glob_escape(SUFFIXES[field])
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
            error = _reply_error(reply)
            if error is not None:
                label = servers[i].safe_url
                errors[owners[i]] = error if label == owners[i] else f"{label}: {error}"
                del cursors[i]
                continue
            cursor, found = reply.values[0]  # type: ignore[union-attr]
            keys.update(k for k in found if _field_of(k, prefix) == field)
            if str(cursor) == "0":
                del cursors[i]
            else:
                cursors[i] = str(cursor)
    return sorted(keys), errors


def _reply_error(reply: Any) -> str | None:
    if reply is None:
        return "no reply"
    if reply.error is not None:
        return f"{type(reply.error).__name__}: {reply.error}"
    for value in reply.values:
        if isinstance(value, ResponseError):
            return f"{type(value).__name__}: {value}"
    return None


def read_locks(
    nodeset: NodeSet, keys: Sequence[str], prefix: str, *, timeout: float | None = None
) -> list[LockView]:
    """Read ``keys`` on every node with ``inspect.lua`` (pipelined, in chunks)."""
    per_key: dict[str, list[NodeView]] = {key: [] for key in keys}
    for start in range(0, len(keys), READ_CHUNK):
        chunk = keys[start : start + READ_CHUNK]
        calls = [Call(INSPECT, keys_of(key).inspect) for key in chunk]
        for i, reply in enumerate(nodeset.call(calls, timeout=timeout)):
            node = nodeset.nodes[i].safe_url
            if reply is None or reply.error is not None:
                error = _reply_error(reply)
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
    replies = nodeset.call(
        [Call(RELEASE, release_keys([keys_of(lock.key)]), (lock.token,))], timeout=timeout
    )
    results: list[dict[str, str | None]] = []
    for node, reply in zip(nodeset.nodes, replies, strict=True):
        error = _reply_error(reply)
        if error is not None:
            results.append({"node": node.safe_url, "result": "error", "error": error})
        else:
            code = int(reply.values[0])  # type: ignore[union-attr]
            results.append(
                {"node": node.safe_url, "result": RELEASE_RESULTS.get(code, "error"), "error": None}
            )
    return results


# -- workers -----------------------------------------------------------------------


@dataclass(frozen=True)
class Workers:
    """What the workers answered to ``inspect().active()`` and ``inspect().stats()``.

    ``pids`` maps each worker to its main pid followed by its pool's processes (prefork
    children; solo lists the main pid again); ``busy`` to the pids running its active
    tasks (``None`` for a task whose process is not known yet). A worker missing from
    ``pids`` answered ``active`` but not ``stats``: it cannot be named as a holder's.
    """

    answered: tuple[str, ...]
    active: dict[str, str]  # task id -> worker node name
    pids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    busy: dict[str, tuple[int | None, ...]] = field(default_factory=dict)

    def holders_worker(self, host: str, pid: int | None) -> str | None:
        """The answering worker whose process ``pid`` on ``host`` is, if any.

        The host is the one the lock recorded (``socket.gethostname()`` of the holder)
        against the host part of the worker's node name (full or short).
        """
        if pid is None or not host:
            return None
        hosts = {host, host.split(".", 1)[0]}
        for name, pids in self.pids.items():
            node_host = name.split("@", 1)[-1]
            if {node_host, node_host.split(".", 1)[0]} & hosts and pid in pids:
                return name
        return None

    def runs_tasks_in(self, name: str, pid: int) -> bool:
        """Whether worker ``name`` runs any task in process ``pid`` (or may: unknown pid).

        A holder in the worker's main process (solo, threads, gevent) shares it with
        every task of that worker, so any active task counts.
        """
        busy = self.busy.get(name, ())
        if self.pids.get(name, (None,))[0] == pid:
            return bool(busy)
        return any(p is None or p == pid for p in busy)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form: answered, active task ids, pids per worker."""
        return {
            "answered": list(self.answered),
            "active": sorted(self.active),
            "pids": {name: list(pids) for name, pids in sorted(self.pids.items())},
        }


def _remote_error(command: str, exc: Exception) -> NoReturn:
    """Raise the CLI error for a failed remote-control call (exit ``EX_UNAVAILABLE``).

    The same as ``celery.bin.base.handle_remote_command_error``, which exists only
    from Celery 5.6: importing it kept this command from loading on 5.3 to 5.5.
    """
    if isinstance(exc, click.ClickException):
        raise exc
    if isinstance(exc, OperationalError):
        message = (
            "Could not connect to the message broker. Please make sure your broker "
            "(e.g., RabbitMQ or Redis) is running and the connection settings are "
            f"correct. Reason: {exc}"
        )
    else:
        message = f"Unable to run the `{command}` command. Reason: {exc}"
    raise CeleryCommandException(message=message, exit_code=EX_UNAVAILABLE) from exc


def ask_workers(app: Any, timeout: float) -> Workers | None:
    """Ask every worker for its active tasks, then those that answered for their pids.

    Returns None when no worker answered. ``stats`` goes only to the workers that
    answered ``active`` and returns as soon as they all have, so it costs one round
    trip rather than another ``timeout``.

    Raises:
        CeleryCommandException: the broker cannot be reached (exit ``EX_UNAVAILABLE``).
    """
    try:
        replies = app.control.inspect(timeout=timeout).active()
        if not replies:
            return None
        names = sorted(replies)
        stats = app.control.inspect(names, timeout=timeout, limit=len(names)).stats() or {}
    except Exception as exc:
        _remote_error("redlock", exc)
    active: dict[str, str] = {}
    busy: dict[str, tuple[int | None, ...]] = {}
    for name, requests in replies.items():
        running = [r for r in requests or () if isinstance(r, dict) and r.get("id")]
        for request in running:
            active[request["id"]] = name
        busy[name] = tuple(_int(r.get("worker_pid")) for r in running)
    pids: dict[str, tuple[int, ...]] = {}
    for name, info in stats.items():
        main = _int(info.get("pid")) if isinstance(info, dict) else None
        if name not in replies or main is None:
            continue
        pool = info.get("pool") if isinstance(info.get("pool"), dict) else {}
        children = [p for p in map(_int, pool.get("processes") or ()) if p is not None]
        pids[name] = (main, *children)
    return Workers(tuple(names), active, pids, busy)


def pid_gone(host: str, pid: int | None) -> bool:
    """Whether process ``pid`` of ``host`` is known not to exist.

    That is: ``host`` is this host and no process has that pid (a live process of
    another user still counts as alive).

    Note:
        A pid namespace (a container) that shares this host's name but not its
        processes would look gone from here: run the command where the workers run.
    """
    if pid is None or pid <= 0 or host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it exists
        return False
    return False


def classify(lock: LockView, workers: Workers | None) -> tuple[str, str]:
    """``(state, reason)`` of a lock's holder: active, stale, unknown or no-task.

    Stale needs proof that no body runs under the lock: the holder's process (its
    host and pid) is gone on this host; or the holder's own worker answered, does not
    have the task active and runs no task in the holder's process. Anything less is
    unknown: a busy solo worker cannot answer, and another worker on the same host
    says nothing about it.
    """
    task_id = lock.task_id
    if task_id is None:
        return NO_TASK, "the holder is not a task"
    if workers is not None and task_id in workers.active:
        return ACTIVE, f"task {task_id} is running on {workers.active[task_id]}"
    host = lock.fields.get("host") or ""
    pid = _int(lock.fields.get("pid"))
    where = f"pid {pid if pid is not None else '?'} on {host or '?'}"
    if pid_gone(host, pid):
        return STALE, f"the holder's process ({where}) is gone"
    if workers is None:
        return UNKNOWN, f"no worker answered, and the holder's process ({where}) is not gone"
    worker = workers.holders_worker(host, pid)
    if worker is None:
        return UNKNOWN, f"the holder's worker ({where}) did not answer"
    if workers.runs_tasks_in(worker, pid):  # type: ignore[arg-type]
        return UNKNOWN, (
            f"the holder's worker {worker} ({where}) runs other tasks in that process, "
            "one of which may hold it"
        )
    return STALE, f"task {task_id} is not active on the holder's worker {worker} ({where})"


# -- command plumbing --------------------------------------------------------------


@dataclass
class _Session:
    """The app's settings and a NodeSet of its lock nodes, for one command."""

    settings: Settings
    nodeset: NodeSet

    @property
    def prefix(self) -> str:
        return self.settings.key_prefix

    def close(self) -> None:
        doctor_module.close_nodeset(self.nodeset)


def _session(ctx: click.Context, node_timeout: float) -> _Session:
    try:
        settings = from_conf(ctx.obj.app.conf)
        nodeset = NodeSet(settings.node_urls(), timeout=node_timeout)
    except ConfigurationError as exc:
        raise CeleryCommandException(message=str(exc), exit_code=EX_FAILURE) from exc
    return _Session(settings, nodeset)


def _echo_json(ctx: click.Context, data: Any) -> None:
    ctx.obj.echo(json.dumps(data, indent=2, sort_keys=True))


def _warn(ctx: click.Context, message: str) -> None:
    ctx.obj.error(message, fg="yellow")


def _nodes_status(nodeset: NodeSet, errors: dict[str, str]) -> list[dict[str, Any]]:
    return [
        {"node": n.safe_url, "ok": n.safe_url not in errors, "error": errors.get(n.safe_url)}
        for n in nodeset.nodes
    ]


def _check_quorum(ctx: click.Context, nodeset: NodeSet, errors: dict[str, str]) -> int:
    """Warn about failed nodes; EX_UNAVAILABLE when fewer than a quorum answered."""
    for node, error in errors.items():
        _warn(ctx, f"node {node} did not answer: {error}")
    if len(nodeset) - len(errors) < nodeset.quorum:
        ctx.obj.error(_quorum_error(nodeset, errors), fg="red")
        return EX_UNAVAILABLE
    return 0


def _inventory(
    session: _Session, task: str | None, timeout: float
) -> tuple[list[LockView], dict[str, str]]:
    keys, errors = scan_lock_keys(session.nodeset, session.prefix, timeout=timeout)
    locks = read_locks(session.nodeset, keys, session.prefix, timeout=timeout)
    for lock in locks:
        for view in lock.views:
            if view.error is not None:
                errors.setdefault(view.node, view.error)
    locks = [lock for lock in locks if lock.held]
    if task is not None:
        locks = [lock for lock in locks if fnmatch.fnmatchcase(lock.task_name or "", task)]
    return locks, errors


def _share_inventory(
    session: _Session, task: str | None, timeout: float
) -> tuple[list[ShareView], dict[str, str]]:
    keys, errors = scan_lock_keys(
        session.nodeset, session.prefix, timeout=timeout, field="shared", key_type="zset"
    )
    shares, read_errors = read_shares(session.nodeset, keys, session.prefix, timeout=timeout)
    for node, error in read_errors.items():
        errors.setdefault(node, error)
    if task is not None:
        shares = [s for s in shares if fnmatch.fnmatchcase(s.task_name or "", task)]
    return shares, errors


def _share_rows(shares: Sequence[ShareView], now: float) -> list[list[str]]:
    redlock = bool(shares) and shares[0].nodes > 1
    header = ["SHARED KEY", *_HOLDER_COLUMNS] + (["NODES"] if redlock else [])
    rows = [header]
    for share in shares:
        item = share.as_dict(now)
        row = _holder_cells(
            share.key,
            share.task_name,
            share.task_id,
            f"{item['host'] or '?'}:{item['pid'] or '?'}",
            item["age"],
            share.ttl,
            item["fence"],
        )
        rows.append(row + ([f"{share.held_on}/{share.nodes}"] if redlock else []))
    return rows


#: The columns every row of ``ls`` has after its key.
_HOLDER_COLUMNS = ["TASK", "TASK ID", "HOLDER", "AGE", "TTL", "FENCE"]


def _holder_cells(
    key: str,
    task_name: str | None,
    task_id: str | None,
    holder: str,
    age: float | None,
    ttl: float | None,
    fence: int | None,
) -> list[str]:
    """One ``ls`` row's key and holder columns, as printed."""
    return [
        key,
        task_name or "-",
        task_id or "-",
        holder,
        _duration(None if age is None else max(age, 0.0)),
        _duration(ttl),
        str(fence) if fence is not None else "-",
    ]


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 0:
        return "none" if seconds == -1.0 else "0s"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def _holder(lock: LockView) -> str:
    host, pid = lock.fields.get("host") or "?", lock.fields.get("pid") or "?"
    return f"{host}:{pid}"


def _nodes_cell(lock: LockView) -> str:
    quorum = "quorum" if lock.has_quorum else "NO QUORUM"
    return f"{lock.held_on}/{len(lock.views)} {quorum}"


def _lock_rows(
    locks: Sequence[LockView], now: float, states: dict[str, tuple[str, str]] | None
) -> list[list[str]]:
    redlock = bool(locks) and len(locks[0].views) > 1
    header = ["KEY", *_HOLDER_COLUMNS]
    header += ["NODES"] if redlock else []
    header += ["STATE"] if states is not None else []
    rows = [header]
    for lock in locks:
        row = _holder_cells(
            lock.key,
            lock.task_name,
            lock.task_id,
            _holder(lock),
            lock.age(now),
            lock.ttl,
            lock.fence,
        )
        row += [_nodes_cell(lock)] if redlock else []
        row += [states[lock.key][0]] if states is not None else []
        rows.append(row)
    return rows


def _common(*, workers: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options every sub-command takes (and ``--timeout`` where workers are asked)."""

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option(
            "-j",
            "--json",
            "as_json",
            cls=CeleryOption,
            is_flag=True,
            help_group="Output Options",
            help="Print JSON with stable keys instead of text.",
        )(f)
        f = click.option(
            "--node-timeout",
            cls=CeleryOption,
            type=click.FloatRange(min=0.001),
            default=DEFAULT_NODE_TIMEOUT,
            show_default=True,
            help_group="Redis Options",
            help="Budget in seconds of each call to the lock nodes (no retries).",
        )(f)
        if workers:
            f = click.option(
                "-t",
                "--timeout",
                cls=CeleryOption,
                type=click.FloatRange(min=0.0),
                default=1.0,
                show_default=True,
                help_group="Remote Control Options",
                help="Seconds to wait for the workers' replies (inspect active).",
            )(f)
        return f

    return decorate


# -- commands ----------------------------------------------------------------------


@click.group(name="redlock", cls=DYMGroup)
@click.pass_context
@handle_preload_options
def redlock(ctx: click.Context, **kwargs: Any) -> None:
    """Inspect, release and check celery_redlock locks.

    The lock nodes are the app's (redlock_nodes, redlock_url, or a redis:// broker).
    """


@redlock.command(cls=CeleryCommand, name="ls")
@click.option(
    "--task",
    cls=CeleryOption,
    metavar="NAME_OR_GLOB",
    help_group="Filter Options",
    help="Only locks held by tasks whose name matches (fnmatch glob).",
)
@click.option(
    "--stale",
    cls=CeleryOption,
    is_flag=True,
    help_group="Filter Options",
    help="Only locks whose holder is proven dead (its process is gone on this host, or "
    "its own worker answered and does not run the task); the others are named on stderr.",
)
@_common(workers=True)
@click.pass_context
def ls(
    ctx: click.Context,
    task: str | None,
    stale: bool,
    as_json: bool,
    node_timeout: float,
    timeout: float,
    **kwargs: Any,
) -> None:
    """List the locks and shares held on the lock nodes (SCAN, never KEYS).

    Shares (``lock_mode="shared"``, ``lock_limit``) are listed after the exclusive
    locks; ``--stale`` applies to exclusive locks only (a share ends by itself within
    one TTL of its holder's death).
    """
    session = _session(ctx, node_timeout)
    try:
        locks, errors = _inventory(session, task, node_timeout)
        shares: list[ShareView] = []
        if not stale:
            shares, share_errors = _share_inventory(session, task, node_timeout)
            for node, error in share_errors.items():
                errors.setdefault(node, error)
    finally:
        session.close()
    code = _check_quorum(ctx, session.nodeset, errors)
    # Fewer than a quorum answered: nobody can tell which locks are held. The locks
    # seen are still shown (each with its NO QUORUM), but never "No locks held".
    complete = not code
    now = time.time()
    states: dict[str, tuple[str, str]] | None = None
    workers: Workers | None = None
    unknown: list[LockView] = []
    if stale and not complete:
        locks = []  # no holder can be judged without its lock's quorum
    elif stale:
        workers = ask_workers(ctx.obj.app, timeout)
        states = {lock.key: classify(lock, workers) for lock in locks}
        if workers is None:
            ctx.obj.error(
                f"no worker answered within {timeout}s: only locks whose holder's process "
                "is gone on this host are proven stale (raise --timeout, or check the "
                "workers and the broker)",
                fg="red",
            )
            code = code or EX_UNAVAILABLE
        unknown = [lock for lock in locks if states[lock.key][0] == UNKNOWN]
        locks = [lock for lock in locks if states[lock.key][0] == STALE]
        _report_unknown(ctx, unknown, states)
    if as_json:
        _echo_json(
            ctx,
            {
                "nodes": _nodes_status(session.nodeset, errors),
                "quorum": session.nodeset.quorum,
                "complete": complete,
                "locks": _lock_items(locks, now, states) if complete else None,
                "shares": [share.as_dict(now) for share in shares] if complete else None,
                "unknown": _lock_items(unknown, now, states) if stale else None,
                "workers": None if not stale else (workers.as_dict() if workers else None),
            },
        )
    elif locks or shares:
        if locks:
            ctx.obj.echo(_table(_lock_rows(locks, now, states)))
        if shares:
            ctx.obj.echo(("\n" if locks else "") + _table(_share_rows(shares, now)))
    elif complete and not unknown:
        answered = len(session.nodeset) - len(errors)
        partial = f" ({answered} of {len(session.nodeset)} nodes answered)" if errors else ""
        ctx.obj.echo(("No stale locks" if stale else "No locks held") + partial + ".")
    ctx.exit(code)


def _lock_items(
    locks: Sequence[LockView], now: float, states: dict[str, tuple[str, str]] | None
) -> list[dict[str, Any]]:
    items = []
    for lock in locks:
        item = lock.as_dict(now)
        if states is not None:
            item["state"], item["reason"] = states[lock.key]
        items.append(item)
    return items


def _report_unknown(
    ctx: click.Context, unknown: Sequence[LockView], states: dict[str, tuple[str, str]]
) -> None:
    """Say on stderr which locks could be neither proven stale nor seen running."""
    if not unknown:
        return
    _warn(ctx, f"{len(unknown)} lock(s) could not be classified (not released by --stale):")
    for lock in unknown:
        _warn(ctx, f"  {lock.key}: {states[lock.key][1]}")


@redlock.command(cls=CeleryCommand)
@click.argument("key")
@_common()
@click.pass_context
def inspect(
    ctx: click.Context, key: str, as_json: bool, node_timeout: float, **kwargs: Any
) -> None:
    """Show every field of one lock on every node, its PTTL and fence counter.

    KEY is the lock's key (redlock:{NAME}) or its name.
    """
    session = _session(ctx, node_timeout)
    try:
        key = resolve_key(key, session.prefix)
        (lock,) = read_locks(session.nodeset, [key], session.prefix, timeout=node_timeout)
    finally:
        session.close()
    errors = {v.node: v.error for v in lock.views if v.error is not None}
    code = _check_quorum(ctx, session.nodeset, errors)
    now = time.time()
    # What the nodes that did not answer hold is unknown: "not held" and "no quorum"
    # are only said when the answers decide them.
    held = True if lock.held else (None if code else False)
    if lock.has_quorum:
        quorum: bool | None = True
    elif lock.held_on + len(errors) < lock.quorum_size:
        quorum = False
    else:
        quorum = None
    if as_json:
        summary = lock.as_dict(now) if lock.held else None
        _echo_json(
            ctx,
            {
                "key": lock.key,
                "name": lock.name,
                "held": held,
                "held_on": lock.held_on,
                "quorum": quorum,
                "quorum_size": lock.quorum_size,
                "holder": summary,
                "nodes": [view.as_dict() for view in lock.views],
            },
        )
        ctx.exit(code)
    ctx.obj.echo(f"{lock.key}  (lock name {lock.name!r})")
    if lock.held:
        where = f"held on {lock.held_on} of {len(lock.views)} node(s)"
        if len(lock.views) > 1:
            verdict = {True: "yes", False: "NO", None: "unknown (nodes did not answer)"}
            where += f", quorum {lock.quorum_size}: {verdict[quorum]}"
        age = lock.age(now)
        ctx.obj.echo(
            f"{where}; task {lock.task_name or '-'} [{lock.task_id or '-'}] on {_holder(lock)}, "
            f"age {_duration(None if age is None else max(age, 0.0))}, TTL {_duration(lock.ttl)}, "
            f"fence {lock.fence}"
        )
    elif held is None:
        ctx.obj.echo(f"unknown: too few of the {len(lock.views)} node(s) answered to tell")
    else:
        ctx.obj.echo("not held on any node that answered")
    for view in lock.views:
        ctx.obj.echo("")
        ctx.obj.echo(ctx.obj.style(view.node, bold=True))
        if view.error is not None:
            ctx.obj.echo(f"  error: {view.error}")
            continue
        pttl = "key absent" if view.pttl == -2 else f"{view.pttl} ms"
        ctx.obj.echo(f"  pttl           {pttl}")
        ctx.obj.echo(f"  fence counter  {view.fence_counter}")
        for name in sorted(view.fields):
            ctx.obj.echo(f"  {name:<14} {view.fields[name]}")
    ctx.exit(code)


def _release_many(
    ctx: click.Context, session: _Session, locks: Sequence[LockView], timeout: float
) -> list[dict[str, Any]]:
    done = []
    for lock in locks:
        results = release_lock(session.nodeset, lock, timeout=timeout)
        released_on = sum(r["result"] == "released" for r in results)
        done.append(
            {
                "key": lock.key,
                "task_id": lock.task_id,
                "fence": lock.fence,
                "released_on": released_on,
                "nodes": results,
            }
        )
    return done


def _report_release(
    ctx: click.Context,
    as_json: bool,
    released: list[dict[str, Any]],
    refused: list[dict[str, Any]],
    code: int,
    error: str | None = None,
) -> NoReturn:
    """Print what was released and refused, and exit with ``code``.

    ``error`` says why nothing could be decided (JSON ``error``; the text form has
    already said it on stderr).
    """
    if as_json:
        _echo_json(ctx, {"released": released, "refused": refused, "error": error})
        ctx.exit(code)
    for item in refused:
        ctx.obj.error(f"refused {item['key']}: {item['reason']}", fg="red")
    for item in released:
        parts = ", ".join(f"{r['node']}: {r['result']}" for r in item["nodes"])
        ctx.obj.echo(
            f"released {item['key']} (fence {item['fence']}) "
            f"on {item['released_on']} node(s): {parts}"
        )
    ctx.exit(code)


def _describe(lock: LockView, now: float) -> str:
    age = lock.age(now)
    where = f"{lock.held_on}/{len(lock.views)} nodes, " if len(lock.views) > 1 else ""
    return (
        f"{lock.key}: task {lock.task_name or '-'} [{lock.task_id or '-'}] on {_holder(lock)}, "
        f"{where}age {_duration(None if age is None else max(age, 0.0))}, "
        f"TTL {_duration(lock.ttl)}, fence {lock.fence}"
    )


@redlock.command(cls=CeleryCommand)
@click.argument("key", required=False)
@click.option(
    "--stale",
    cls=CeleryOption,
    is_flag=True,
    help_group="Release Options",
    help="Release every stale lock instead of KEY.",
)
@click.option(
    "--task",
    cls=CeleryOption,
    metavar="NAME_OR_GLOB",
    help_group="Release Options",
    help="With --stale: only locks of tasks whose name matches.",
)
@click.option(
    "-y",
    "--yes",
    cls=CeleryOption,
    is_flag=True,
    help_group="Release Options",
    help="Do not ask for confirmation.",
)
@click.option(
    "--force",
    cls=CeleryOption,
    is_flag=True,
    help_group="Release Options",
    help="Release KEY even if its holder task is running (it loses the lock at its "
    "next renewal, and aborts by default).",
)
@_common(workers=True)
@click.pass_context
def release(
    ctx: click.Context,
    key: str | None,
    stale: bool,
    task: str | None,
    yes: bool,
    force: bool,
    as_json: bool,
    node_timeout: float,
    timeout: float,
    **kwargs: Any,
) -> None:
    """Release a lock (KEY: its key or name), or every stale lock with --stale.

    Only the token that was read is deleted, so a lock re-acquired meanwhile stays.
    A lock whose holder task is running, or may be, is refused without --force.
    """
    if stale == (key is not None):
        raise click.UsageError("give either KEY or --stale")
    if stale and force:
        raise click.UsageError("--force releases one KEY; it cannot be combined with --stale")
    if task is not None and not stale:
        raise click.UsageError("--task filters --stale; give KEY alone")
    session = _session(ctx, node_timeout)
    try:
        if stale:
            _release_stale(ctx, session, task, yes, as_json, node_timeout, timeout)
        else:
            _release_key(ctx, session, key, yes, force, as_json, node_timeout, timeout)  # type: ignore[arg-type]
    finally:
        session.close()


def _release_key(
    ctx: click.Context,
    session: _Session,
    key: str,
    yes: bool,
    force: bool,
    as_json: bool,
    node_timeout: float,
    timeout: float,
) -> None:
    key = resolve_key(key, session.prefix)
    (lock,) = read_locks(session.nodeset, [key], session.prefix, timeout=node_timeout)
    errors = {v.node: v.error for v in lock.views if v.error is not None}
    code = _check_quorum(ctx, session.nodeset, errors)
    if code:
        _report_release(ctx, as_json, [], [], code, _quorum_error(session.nodeset, errors))
    if not lock.held:
        ctx.obj.error(f"{key} is not held on any node that answered: nothing to release")
        _report_release(ctx, as_json, [], [], 0)
    now = time.time()
    # With --json, stdout carries the JSON alone; the description goes to stderr.
    say = ctx.obj.error if as_json else ctx.obj.echo
    say(_describe(lock, now))
    if not force and lock.task_id is not None:
        workers = ask_workers(ctx.obj.app, timeout)
        state, reason = classify(lock, workers)
        if state in (ACTIVE, UNKNOWN):
            refusal = {"key": key, "task_id": lock.task_id, "state": state, "reason": reason}
            hint = " (use --force to release it anyway)"
            refusal["reason"] += hint
            _report_release(ctx, as_json, [], [refusal], EX_UNAVAILABLE if workers is None else 1)
    if not yes:
        click.confirm(f"Release {key}?", err=True, abort=True)
    _report_release(ctx, as_json, _release_many(ctx, session, [lock], node_timeout), [], 0)


def _release_stale(
    ctx: click.Context,
    session: _Session,
    task: str | None,
    yes: bool,
    as_json: bool,
    node_timeout: float,
    timeout: float,
) -> None:
    locks, errors = _inventory(session, task, node_timeout)
    code = _check_quorum(ctx, session.nodeset, errors)
    if code:
        _report_release(ctx, as_json, [], [], code, _quorum_error(session.nodeset, errors))
    # Ask the workers after reading the locks: a task that took its lock before the
    # SCAN is in its worker's active list by the time it is asked.
    workers = ask_workers(ctx.obj.app, timeout)
    error = None
    if workers is None:
        error = (
            f"no worker answered within {timeout}s: only locks whose holder's process is "
            "gone on this host are proven stale (raise --timeout, or check the workers "
            "and the broker)"
        )
        ctx.obj.error(error, fg="red")
    states = {lock.key: classify(lock, workers) for lock in locks}
    stale = [lock for lock in locks if states[lock.key][0] == STALE]
    # In doubt, a lock is listed and refused, never released.
    refused = [
        {"key": lock.key, "task_id": lock.task_id, "state": UNKNOWN, "reason": states[lock.key][1]}
        for lock in locks
        if states[lock.key][0] == UNKNOWN
    ]
    code = (EX_UNAVAILABLE if workers is None else 1) if refused else 0
    error = error if refused else None
    if not stale:
        if not refused:
            ctx.obj.error("No stale locks.")
        _report_release(ctx, as_json, [], refused, code, error)
    now = time.time()
    say = ctx.obj.error if as_json else ctx.obj.echo
    for lock in stale:
        say(_describe(lock, now))
    if not yes:
        click.confirm(f"Release these {len(stale)} stale lock(s)?", err=True, abort=True)
    released = _release_many(ctx, session, stale, node_timeout)
    _report_release(ctx, as_json, released, refused, code, error)


def _quorum_error(nodeset: NodeSet, errors: dict[str, str]) -> str:
    answered = len(nodeset) - len(errors)
    return (
        f"only {answered} of {len(nodeset)} lock node(s) answered, fewer than the "
        f"{nodeset.quorum} needed to tell who holds a lock"
    )


@redlock.command(cls=CeleryCommand)
@_common()
@click.pass_context
def doctor(ctx: click.Context, as_json: bool, node_timeout: float, **kwargs: Any) -> None:
    """Check that the lock nodes and the settings are safe for locks.

    Exits 1 when an error-level finding exists, 69 when a node could not be asked.
    """
    app = ctx.obj.app
    # The tasks' own lock options count (their leases, their policies): import the
    # modules a worker would, as `celery report` does.
    app.loader.import_default_modules()
    report = doctor_module.diagnose(app, timeout=node_timeout)
    if as_json:
        _echo_json(ctx, report.as_dict())
        ctx.exit(report.exit_code)
    styles: dict[str, dict[str, Any]] = {
        doctor_module.OK: {"fg": "green"},
        doctor_module.WARN: {"fg": "yellow", "bold": True},
        doctor_module.ERROR: {"fg": "red", "bold": True},
    }
    host = socket.gethostname()
    ctx.obj.echo(f"celery_redlock doctor, from {host}, {len(report.facts)} lock node(s)")
    current: object = object()
    for finding in report.findings:
        if finding.node != current:
            current = finding.node
            ctx.obj.echo("")
            ctx.obj.echo(ctx.obj.style(finding.node or "setup", bold=True))
        level = ctx.obj.style(f"{finding.level.upper():<5}", **styles[finding.level])
        ctx.obj.echo(f"  {level} {finding.code}: {finding.message}")
    counts = report.as_dict()["counts"]
    ctx.obj.echo("")
    ctx.obj.echo(
        f"{counts['error']} error(s), {counts['warn']} warning(s), {counts['ok']} ok "
        f"(exit {report.exit_code})"
    )
    ctx.exit(report.exit_code)
