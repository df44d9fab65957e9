"""The shares held on the lock nodes (read locks and ``limit`` slots), as ``ls`` shows them.

A share is a member of ``<lock key>:shared`` (a sorted set: token -> deadline in ms on
the node's clock) with its holder's details in ``<lock key>:holders``; see
:mod:`celery_redlock.engine.keys`. Reading them takes no lock and changes nothing.
The exclusive locks' side of the read model is :mod:`celery_redlock.ops.inventory`,
whose SCAN finds the shared sets.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from typing import Any

from ..engine.keys import WRITER_MARK, LockKeys, lock_name_of, parse_key
from ..nodes import Call, NodeSet
from .inventory import HeldOnNodes, scan_lock_keys, to_float, to_int

__all__ = ["ShareView", "held_shares", "read_shares"]

#: Shared sets read per round trip.
READ_CHUNK = 200


@dataclass
class ShareView(HeldOnNodes):
    """One share across the nodes: who holds it and for how long."""

    key: str
    name: str
    token: str
    details: dict[str, Any]
    remaining: list[float] = field(default_factory=list)  # seconds left, per holding node
    nodes: int = 1
    quorum_size: int = 1

    @property
    def task_name(self) -> str | None:
        """The holder's task name."""
        return self.details.get("task_name") or None

    @property
    def task_id(self) -> str | None:
        """The holder's task id."""
        return self.details.get("task_id") or None

    def as_dict(self, now: float) -> dict[str, Any]:
        """JSON-ready form, with the same field names as an exclusive lock's."""
        acquired = to_float(self.details.get("acquired_at"))
        return {
            "key": self.key,
            "name": self.name,
            "kind": "shared",
            "task_name": self.task_name,
            "task_id": self.task_id,
            "host": self.details.get("host") or None,
            "pid": to_int(self.details.get("pid")),
            "acquired_at": acquired,
            "age": None if acquired is None else round(now - acquired, 3),
            "ttl": None if self.ttl is None else round(self.ttl, 3),
            "fence": to_int(self.details.get("fence")),
            "held_on": self.held_on,
            "nodes": self.nodes,
        }


def read_shares(
    nodeset: NodeSet, keys: list[str], prefix: str, *, timeout: float | None = None
) -> tuple[list[ShareView], dict[str, str]]:
    """Every live share of the shared sets ``keys`` on every node (expired ones left out).

    Returns:
        (shares, {node url: error}) for the nodes that could not be read: a node that
        answered the SCAN may fail here, and its shares must not pass for none.
    """
    views: dict[tuple[str, str], ShareView] = {}
    errors: dict[str, str] = {}
    for start in range(0, len(keys), READ_CHUNK):
        chunk = keys[start : start + READ_CHUNK]
        calls = [Call.command("TIME")]
        for key in chunk:
            holders = _lock_of(key, prefix).holders
            calls += [
                Call.command("ZRANGE", key, 0, -1, "WITHSCORES"),
                Call.command("HGETALL", holders),
            ]
        for node, reply in zip(nodeset.nodes, nodeset.call(calls, timeout=timeout), strict=True):
            if reply is None:
                errors[node.safe_url] = "no reply"
                continue
            failed = reply.error if reply.error is not None else reply.values[0]
            if isinstance(failed, Exception):
                errors[node.safe_url] = f"{type(failed).__name__}: {failed}"
                continue
            seconds, micros = reply.values[0]
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            for index, key in enumerate(chunk):
                members, details = reply.values[1 + 2 * index], reply.values[2 + 2 * index]
                failed = next((v for v in (members, details) if isinstance(v, Exception)), None)
                if failed is not None:
                    errors.setdefault(node.safe_url, f"{type(failed).__name__}: {failed}")
                    continue
                info = dict(zip(details[::2], details[1::2], strict=True))
                lock_key = _lock_of(key, prefix).lock
                for token, score in zip(members[::2], members[1::2], strict=True):
                    left = (float(score) - now_ms) / 1000
                    if token == WRITER_MARK or left <= 0:
                        continue
                    view = views.get((lock_key, token))
                    if view is None:
                        view = views[(lock_key, token)] = ShareView(
                            lock_key,
                            lock_name_of(lock_key, prefix),
                            token,
                            _details(info.get(token)),
                            nodes=len(nodeset),
                            quorum_size=nodeset.quorum,
                        )
                    view.remaining.append(left)
    shares = sorted(views.values(), key=lambda v: (v.key, to_int(v.details.get("fence")) or 0))
    return shares, errors


def held_shares(
    nodeset: NodeSet, prefix: str, task: str | None, *, timeout: float | None = None
) -> tuple[list[ShareView], dict[str, str]]:
    """The live shares on the nodes (of tasks matching the glob ``task``, if given).

    Returns:
        (shares, {node url: error}) for every node that failed the SCAN or a read.
    """
    keys, errors = scan_lock_keys(nodeset, prefix, timeout=timeout, field="shared", key_type="zset")
    shares, read_errors = read_shares(nodeset, keys, prefix, timeout=timeout)
    for node, error in read_errors.items():
        errors.setdefault(node, error)
    if task is not None:
        shares = [s for s in shares if fnmatch.fnmatchcase(s.task_name or "", task)]
    return shares, errors


def _lock_of(key: str, prefix: str) -> LockKeys:
    """The keys of the lock whose shared set is ``key``."""
    parsed = parse_key(key, prefix)
    if parsed is None or parsed[1] != "shared":
        raise ValueError(f"not the shared set of a lock under {prefix!r}: {key!r}")
    return parsed[0]


def _details(raw: str | None) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
