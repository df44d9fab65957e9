"""Send-time claims: at most one queued (or running) copy of a task per lock name.

A claim reserves a lock name for one task id, from before the copy is published
until the worker starts it (or finishes it): ``redlock:{NAME}:claim``, a hash of
task_id, task_name and claimed_at with a TTL, on a majority of the lock's nodes.
:mod:`celery_redlock.integration.unique` decides when to take and free one; this module only
speaks to the nodes.

Why a claim is not a :class:`~celery_redlock.Redlock` lease: it is taken in one
process (the sender) and freed in another (the worker), so its owner is the task id,
which both know, not a random token; nothing renews it (a queued copy has no
watchdog: its TTL is the bound); and it has no fence (it guards no write: the
execution lock, taken when the copy starts, still does). The execution lock's
invariants do not depend on claims: a claim lost or forged lets a duplicate be
*queued*, never run beside its original.

With several nodes a claim needs a majority, like a lock. Two senders can split
the nodes between them (neither a majority): each frees what it took and tries
again after a random pause, so one wins within a few rounds.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from redis.exceptions import ResponseError

from ..engine.keys import LockKeys, claim_key
from ..engine.scripts import CLAIM, CLAIM_START, THROTTLE, UNCLAIM, ClaimStatus, UnclaimStatus
from ..exceptions import NodeUnavailable
from ..nodes import NodeSet, Reply

__all__ = ["ClaimResult", "admit", "claim", "start", "unclaim"]

#: Rounds a sender tries when senders split the nodes between them (Redlock only).
SPLIT_ROUNDS = 8


@dataclass(frozen=True)
class ClaimResult:
    """What a claim attempt found: claimed, or held by ``holder`` for ``ttl`` seconds.

    ``again``: claimed, and a majority said the task id held it already (a second send
    of one task id, or the running copy's retry carrying its claim).
    """

    claimed: bool
    holder: str | None = None
    ttl: float | None = None
    again: bool = False


def claim(
    nodeset: NodeSet,
    keys: LockKeys,
    task_id: str,
    ttl: float,
    *,
    task_name: str,
    replace: str = "",
    debounce: float | None = None,
    args: str = "",
    running: bool = False,
) -> ClaimResult:
    """Claim ``keys``' name for ``task_id`` of ``task_name`` for ``ttl`` s, on a majority.

    A claim ``task_id`` holds already is refreshed and counts as claimed (a retry of
    the same copy). ``replace`` names a holder the caller knows has ended: its claim
    is taken over instead of reported. With ``debounce`` (seconds), the claim's copy
    may not run before ``debounce`` after this call, and runs with ``args`` (this
    call's arguments, serialized), whether this call claimed it or found it held.
    With ``running`` (``until_finished``), a copy of ``task_name`` that holds the
    name's execution lock holds the claim too, for as long as its lease is renewed:
    a copy that runs longer than ``ttl`` still turns duplicates away.

    Raises:
        NodeUnavailable: too few nodes answered to decide.
    """
    call = CLAIM.call(
        claim=claim_key(keys, task_name),
        lock=keys.lock,
        task_id=task_id,
        ttl_ms=max(1, round(ttl * 1000)),
        task_name=task_name,
        claimed_at=f"{time.time():.3f}",
        replace=replace,
        debounce_ms="" if debounce is None else max(0, round(debounce * 1000)),
        args=args,
        running="1" if running else "",
    )
    for _ in range(SPLIT_ROUNDS):
        replies = nodeset.call([call], decided=_decided(nodeset) if len(nodeset) > 1 else None)
        granted, holders, errors = _tally(replies)
        if granted >= nodeset.quorum:
            return ClaimResult(True, again=_ours(replies) >= nodeset.quorum)
        if granted or None in replies:
            # A node whose reply was not waited for may have granted it too.
            unclaim(nodeset, keys, task_id, task_name)
        if holders:
            (holder, count), *_ = Counter(h for h, _ in holders).most_common(1)
            if count >= nodeset.quorum:
                ttl_left = min(t for h, t in holders if h == holder)
                return ClaimResult(False, holder, ttl_left)
        if granted + len(holders) < nodeset.quorum:
            raise NodeUnavailable(call.keys[0], errors)
        time.sleep(random.uniform(0.002, 0.02))  # split between senders: one will win
    raise NodeUnavailable(call.keys[0], [f"no majority after {SPLIT_ROUNDS} rounds (split votes)"])


def unclaim(nodeset: NodeSet, keys: LockKeys, task_id: str, task_name: str) -> UnclaimStatus | None:
    """Free ``task_name``'s claim of ``keys``' name if ``task_id`` holds it.

    Returns what a majority of nodes said. FREED: it was ``task_id``'s; GONE: no
    claim (freed, or expired); TAKEN: another task id's, left alone; None: no
    majority agreed (or too few answered). Never raises for unreachable nodes:
    their copy of the claim ends with its TTL.
    """

    def said(replies: list[Reply | None]) -> Counter[UnclaimStatus]:
        return Counter(
            UnclaimStatus(reply.values[0])
            for reply in replies
            if reply is not None and reply.ok and not isinstance(reply.values[0], ResponseError)
        )

    def decided(replies: list[Reply | None]) -> bool:
        # Sent to every node; a node slower than the majority is not waited for.
        return any(count >= nodeset.quorum for count in said(replies).values())

    call = UNCLAIM.call(claim=claim_key(keys, task_name), task_id=task_id)
    replies = nodeset.call([call], decided=decided if len(nodeset) > 1 else None)
    for status, count in said(replies).items():
        if count >= nodeset.quorum:
            return status
    return None


def start(
    nodeset: NodeSet, keys: LockKeys, task_id: str, task_name: str, args: str
) -> tuple[float, str] | None:
    """Whether a debounced copy about to run may: None, or ``(seconds, args)`` to wait.

    None: run now (its claim is freed). ``(seconds, args)``: go back on the queue
    with ``args`` (the last call's) for that long. Runs when a majority says so, or
    when too few nodes answer to say otherwise (the execution lock still guards it).
    """
    replies = nodeset.call(
        [CLAIM_START.call(claim=claim_key(keys, task_name), task_id=task_id, args=args)]
    )
    later: list[tuple[float, str]] = []
    for reply in replies:
        if reply is None or not reply.ok or isinstance(reply.values[0], ResponseError):
            continue
        value = reply.values[0]
        if value[0] == 0:
            later.append((int(value[1]) / 1000, str(value[2])))
    if len(later) < nodeset.quorum:
        if later:
            unclaim(nodeset, keys, task_id, task_name)
        return None
    return max(wait for wait, _ in later), later[0][1]


def admit(nodeset: NodeSet, keys: LockKeys, task_id: str, window: float) -> float | None:
    """Admit one run of ``keys``' name per ``window`` seconds (``lock_throttle``).

    None: admitted; else the seconds until the current window ends. Too few nodes
    answering admits it (the execution lock still guards the body).
    """
    replies = nodeset.call(
        [THROTTLE.on(keys, task_id=task_id, window_ms=max(1, round(window * 1000)))]
    )
    waits = [
        int(reply.values[0][1]) / 1000
        for reply in replies
        if reply is not None
        and reply.ok
        and not isinstance(reply.values[0], ResponseError)
        and reply.values[0][0] == 0
    ]
    return max(waits) if len(waits) >= nodeset.quorum else None


def _decided(nodeset: NodeSet) -> Callable[[list[Reply | None]], bool]:
    """Stop waiting once a majority granted, or too many refused for one to."""
    n, quorum = len(nodeset), nodeset.quorum

    def decided(replies: list[Reply | None]) -> bool:
        granted, holders, _ = _tally(replies)
        return granted >= quorum or len(holders) > n - quorum

    return decided


def _ours(replies: list[Reply | None]) -> int:
    """How many nodes said the task id held the claim already."""
    return sum(
        1
        for reply in replies
        if reply is not None
        and reply.ok
        and not isinstance(reply.values[0], ResponseError)
        and reply.values[0][0] == ClaimStatus.OURS
    )


def _tally(replies: list[Reply | None]) -> tuple[int, list[tuple[str, float]], list[str]]:
    """Nodes that granted, (holder, seconds left) of those that refused, and errors."""
    granted = 0
    holders: list[tuple[str, float]] = []
    errors: list[str] = []
    for reply in replies:
        if reply is None:
            continue
        if not reply.ok:
            errors.append(reply.describe_error())
            continue
        value = reply.values[0]
        if isinstance(value, ResponseError):
            errors.append(f"{reply.node.safe_url}: {value}")
        elif value[0] in (ClaimStatus.CLAIMED, ClaimStatus.OURS):
            granted += 1
        else:
            holders.append((str(value[1]), max(0, int(value[2])) / 1000))
    return granted, holders, errors
