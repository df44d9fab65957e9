"""The send-time claims on the lock nodes (queued copies of ``lock_unique`` tasks).

A claim is ``<lock key>:claim:<task tag>`` (one per task naming the lock), a hash of
the queued copy's task_id, task_name and claimed_at with a TTL (see
:mod:`celery_redlock.integration.claims`). ``ls`` lists them beside the locks: a claim is a
copy sent and not yet started (``until_started``) or not yet finished
(``until_finished``). Reading them takes no lock and changes nothing;
:func:`clear_claim` (``release KEY --force``) deletes one whose copy is gone (a purged
queue, a revoke no worker heard), by the task id read, as ``release`` does a lock.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..engine.keys import lock_name_of, parse_key
from ..engine.scripts import UNCLAIM, UnclaimStatus
from ..nodes import Call, NodeSet
from .inventory import HeldOnNodes, reply_error, scan_lock_keys, to_float

__all__ = ["ClaimView", "clear_claim", "held_claims"]

#: What ``unclaim.lua`` said on a node, as ``release KEY --force`` reports it.
CLEAR_RESULTS: dict[int, str] = {
    UnclaimStatus.FREED: "cleared",
    UnclaimStatus.GONE: "gone",
    UnclaimStatus.TAKEN: "taken",
}

#: Claims read per round trip.
READ_CHUNK = 500


@dataclass
class ClaimView(HeldOnNodes):
    """One claim across the nodes: the queued copy that holds a lock name."""

    key: str  #: the lock key it is the claim of
    name: str
    task_id: str
    task_name: str | None
    claimed_at: float | None
    remaining: list[float] = field(default_factory=list)  # seconds left, per holding node
    nodes: int = 1
    quorum_size: int = 1
    claim_key: str = ""  #: the claim's own key (``<key>:claim:<task tag>``)

    def age(self, now: float) -> float | None:
        """Seconds since the copy was sent (on the sender's clock)."""
        return None if self.claimed_at is None else now - self.claimed_at

    def as_dict(self, now: float) -> dict[str, Any]:
        """The JSON of ``ls --json``'s ``claims`` list."""
        return {
            "key": self.key,
            "claim_key": self.claim_key,
            "name": self.name,
            "task_id": self.task_id,
            "task_name": self.task_name,
            "age": self.age(now),
            "ttl": self.ttl,
            "held_on": self.held_on,
        }


def held_claims(
    nodeset: NodeSet,
    prefix: str,
    task: str | None = None,
    *,
    timeout: float | None = None,
    lock: str | None = None,
) -> tuple[list[ClaimView], dict[str, str]]:
    """Every claim on the nodes (per task and lock name: its majority holder); errors.

    ``task`` keeps only the claims of task names matching that glob; ``lock`` (a lock
    key) only that lock's claims.
    """
    keys, errors = scan_lock_keys(nodeset, prefix, timeout=timeout, field="claim", lock=lock)
    claims = []
    for start in range(0, len(keys), READ_CHUNK):
        chunk = keys[start : start + READ_CHUNK]
        calls = [
            c for key in chunk for c in (Call.command("HGETALL", key), Call.command("PTTL", key))
        ]
        seen: dict[str, list[tuple[dict[str, str], float]]] = {key: [] for key in chunk}
        for i, reply in enumerate(nodeset.call(calls, timeout=timeout)):
            if reply is None or reply.error is not None:
                errors.setdefault(
                    nodeset.nodes[i].safe_url, "no reply" if reply is None else str(reply.error)
                )
                continue
            for j, key in enumerate(chunk):
                flat, pttl = reply.values[2 * j], reply.values[2 * j + 1]
                if isinstance(flat, Exception) or isinstance(pttl, Exception):
                    errors.setdefault(nodeset.nodes[i].safe_url, f"{flat!r} {pttl!r}")
                    continue
                fields = dict(zip(flat[::2], flat[1::2], strict=True))
                if fields.get("task_id") and int(pttl) > 0:
                    seen[key].append((fields, int(pttl) / 1000))
        for key, views in seen.items():
            if not views:
                continue
            holder, _ = Counter(f["task_id"] for f, _ in views).most_common(1)[0]
            fields = next(f for f, _ in views if f["task_id"] == holder)
            if task is not None and not fnmatch.fnmatchcase(fields.get("task_name", ""), task):
                continue
            parsed = parse_key(key, prefix)
            lock = parsed[0].lock if parsed else key
            claims.append(
                ClaimView(
                    key=lock,
                    name=lock_name_of(lock, prefix),
                    task_id=holder,
                    task_name=fields.get("task_name") or None,
                    claimed_at=to_float(fields.get("claimed_at")),
                    remaining=[ttl for f, ttl in views if f["task_id"] == holder],
                    nodes=len(nodeset),
                    quorum_size=nodeset.quorum,
                    claim_key=key,
                )
            )
    return claims, errors


def clear_claim(
    nodeset: NodeSet, claim: ClaimView, *, timeout: float | None = None
) -> list[dict[str, Any]]:
    """Delete ``claim`` on every node where the task id read still holds it (``unclaim.lua``).

    A node where it is gone answers ``gone``; one where another copy claimed the name
    since it was read answers ``taken`` and keeps that copy's claim.

    Returns:
        One ``{"node", "result", "error"}`` per node; result is ``cleared``, ``gone``,
        ``taken`` or ``error``.
    """
    replies = nodeset.call(
        [UNCLAIM.call(claim=claim.claim_key, task_id=claim.task_id)], timeout=timeout
    )
    results: list[dict[str, Any]] = []
    for node, reply in zip(nodeset.nodes, replies, strict=True):
        error = reply_error(reply)
        if error is not None:
            results.append({"node": node.safe_url, "result": "error", "error": error})
            continue
        code = int(reply.values[0])  # type: ignore[union-attr]
        results.append(
            {"node": node.safe_url, "result": CLEAR_RESULTS.get(code, "error"), "error": None}
        )
    return results
