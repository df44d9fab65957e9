"""Releasing one lock by hand: read it, judge its holder, delete the token read.

The one way ``celery redlock release KEY`` and the web dashboard's release control
(``POST /api/release``) release a lock. :func:`plan_release` reads the lock and the
send-time claims of its name and, unless forced, asks the workers whether the holder
task still runs; :func:`carry_out` then deletes the token that was read (a lock
re-acquired meanwhile stays) and, when forced, clears the claims by the task id read.
Between the two the caller confirms (the CLI asks, the web page asked before posting).

A holder that runs, or may run (:data:`~celery_redlock.ops.workers.UNKNOWN`), is
refused without ``force``; so is a claim, whose copy may still be queued.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..nodes import NodeSet
from .claims import ClaimView, clear_claim, held_claims
from .inventory import LockView, has_quorum, read_locks, release_lock
from .workers import ACTIVE, UNKNOWN, Workers, classify

__all__ = [
    "ReleasePlan",
    "carry_out",
    "claim_refusal",
    "clear_claims",
    "plan_release",
    "release_locks",
]


@dataclass
class ReleasePlan:
    """What a release of ``key`` found, and what it may do.

    ``refusal`` is the holder's (``{"key", "task_id", "state", "reason"}``) when its task
    runs or may run, unless forced; ``workers_answered`` is False when the workers were
    asked and none answered.
    """

    key: str
    lock: LockView
    claims: list[ClaimView]
    errors: dict[str, str]
    force: bool
    quorum: bool
    refusal: dict[str, Any] | None = None
    workers_answered: bool = True
    kept: list[dict[str, Any]] = field(init=False)

    def __post_init__(self) -> None:
        # Without force a claim stays: nothing here sees the broker's queues, and its copy
        # may be waiting there (its run would free it).
        self.kept = [] if self.force else [claim_refusal(claim) for claim in self.claims]

    @property
    def found(self) -> bool:
        """The lock is held, or a claim holds its name, on some node that answered."""
        return self.lock.held or bool(self.claims)

    @property
    def refused(self) -> list[dict[str, Any]]:
        """Everything this release will not touch: the holder's refusal, then the claims."""
        return [self.refusal, *self.kept] if self.refusal is not None else list(self.kept)

    @property
    def allowed(self) -> bool:
        """There is something to do and nothing refuses it (claims alone need force)."""
        return self.quorum and self.refusal is None and (self.lock.held or self.force)


def plan_release(
    nodeset: NodeSet,
    prefix: str,
    key: str,
    *,
    force: bool,
    ask_workers: Callable[[], Workers | None],
    timeout: float | None = None,
) -> ReleasePlan:
    """Read lock ``key`` and its name's claims; without ``force``, judge the holder.

    ``ask_workers`` is called (it costs the workers' reply timeout) only when the answer
    matters: enough nodes answered, the lock is held by a task, and not forced.
    """
    (lock,) = read_locks(nodeset, [key], prefix, timeout=timeout)
    claims, errors = held_claims(nodeset, prefix, timeout=timeout, lock=key)
    errors.update((v.node, v.error) for v in lock.views if v.error is not None)
    plan = ReleasePlan(key, lock, claims, errors, force, has_quorum(nodeset, errors))
    if plan.quorum and not force and lock.held and lock.task_id is not None:
        workers = ask_workers()
        state, reason = classify(lock, workers)
        plan.workers_answered = workers is not None
        if state in (ACTIVE, UNKNOWN):
            plan.refusal = {"key": key, "task_id": lock.task_id, "state": state, "reason": reason}
    return plan


def carry_out(
    nodeset: NodeSet, plan: ReleasePlan, *, timeout: float | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Release the lock read (if held) and, when forced, clear the claims read.

    Returns:
        (released, cleared), in the forms of ``release --json``.
    """
    released = release_locks(nodeset, [plan.lock], timeout=timeout) if plan.lock.held else []
    cleared = clear_claims(nodeset, plan.claims, timeout=timeout) if plan.force else []
    return released, cleared


def release_locks(
    nodeset: NodeSet, locks: Sequence[LockView], *, timeout: float | None = None
) -> list[dict[str, Any]]:
    """Release each lock's token read; one ``release --json`` ``released`` item per lock."""
    done = []
    for lock in locks:
        results = release_lock(nodeset, lock, timeout=timeout)
        done.append(
            {
                "key": lock.key,
                "task_id": lock.task_id,
                "fence": lock.fence,
                "released_on": sum(r["result"] == "released" for r in results),
                "nodes": results,
            }
        )
    return done


def clear_claims(
    nodeset: NodeSet, claims: Sequence[ClaimView], *, timeout: float | None = None
) -> list[dict[str, Any]]:
    """Clear each claim by the task id read; one ``release --json`` ``cleared`` item each."""
    done = []
    for claim in claims:
        results = clear_claim(nodeset, claim, timeout=timeout)
        done.append(
            {
                "key": claim.claim_key,
                "lock": claim.key,
                "task_id": claim.task_id,
                "task_name": claim.task_name,
                "cleared_on": sum(r["result"] == "cleared" for r in results),
                "nodes": results,
            }
        )
    return done


def claim_refusal(claim: ClaimView) -> dict[str, Any]:
    """Why a release without force keeps ``claim`` (a ``release --json`` ``refused`` item)."""
    return {
        "key": claim.claim_key,
        "task_id": claim.task_id,
        "state": "claimed",
        "reason": (
            f"a send-time claim of task {claim.task_name or '-'} (lock_unique) holds the "
            "name: its copy may still be queued, and sends of that task get it instead of "
            "publishing. If the copy is gone (a purged queue, a revoke no worker heard), "
            "use --force to clear the claim"
        ),
    }
