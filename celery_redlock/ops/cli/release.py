"""``celery redlock release``: release one lock, or every stale one, with the token read.

``release KEY --force`` also clears the name's send-time claims (``lock_unique``),
each by the task id read: a claim whose copy is gone (a purged queue, a revoke that
no worker heard) otherwise holds the name until its TTL.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

import click
from celery.bin.base import CeleryCommand, CeleryOption
from celery.platforms import EX_UNAVAILABLE

from ..claims import ClaimView
from ..inventory import LockView, held_locks
from ..releasing import carry_out, plan_release, release_locks
from ..workers import STALE, UNKNOWN, ask_workers, classify
from .base import (
    Session,
    check_quorum,
    common_options,
    lock_key,
    no_worker_error,
    open_session,
    quorum_error,
)
from .output import duration, echo_json, holder

__all__ = ["release"]


@click.command(cls=CeleryCommand)
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
    "next renewal, and aborts by default), and clear its send-time claims "
    "(lock_unique), whose copies may still be queued.",
)
@common_options(workers=True)
@click.pass_context
def release(
    ctx: click.Context,
    /,
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
    The send-time claims of KEY's name (lock_unique) are cleared with --force only.
    """
    if stale == (key is not None):
        raise click.UsageError("give either KEY or --stale")
    if stale and force:
        raise click.UsageError("--force releases one KEY; it cannot be combined with --stale")
    if task is not None and not stale:
        raise click.UsageError("--task filters --stale; give KEY alone")
    session = open_session(ctx, node_timeout)
    try:
        if stale:
            _release_stale(ctx, session, task, yes, as_json, node_timeout, timeout)
        else:
            _release_key(ctx, session, key, yes, force, as_json, node_timeout, timeout)  # type: ignore[arg-type]
    finally:
        session.close()


def _release_key(
    ctx: click.Context,
    session: Session,
    key: str,
    yes: bool,
    force: bool,
    as_json: bool,
    node_timeout: float,
    timeout: float,
) -> None:
    key = lock_key(session, key)
    plan = plan_release(
        session.nodeset,
        session.prefix,
        key,
        force=force,
        ask_workers=lambda: ask_workers(ctx.obj.app, timeout),
        timeout=node_timeout,
    )
    lock, claims = plan.lock, plan.claims
    code = check_quorum(ctx, session.nodeset, plan.errors)
    if code:
        _report_release(ctx, as_json, [], [], code, quorum_error(session.nodeset, plan.errors))
    if not plan.found:
        ctx.obj.error(f"{key} is not held on any node that answered: nothing to release")
        _report_release(ctx, as_json, [], [], 0)
    now = time.time()
    # With --json, stdout carries the JSON alone; the description goes to stderr.
    say = ctx.obj.error if as_json else ctx.obj.echo
    if lock.held:
        say(_describe(lock, now))
    for claim in claims:
        say(_describe_claim(claim, now))
    if plan.refusal is not None:
        refusal = dict(plan.refusal)
        refusal["reason"] += " (use --force to release it anyway)"
        code = 1 if plan.workers_answered else EX_UNAVAILABLE
        _report_release(ctx, as_json, [], [refusal, *plan.kept], code)
    if not plan.allowed:  # claims alone, without --force
        _report_release(ctx, as_json, [], plan.kept, 1)
    if not yes:
        prompt = f"Release {key}" if lock.held else ""
        if force and claims:
            also = " and clear" if lock.held else "Clear"
            prompt += f"{also} {len(claims)} send-time claim(s) of {key}"
        click.confirm(prompt + "?", err=True, abort=True)
    released, cleared = carry_out(session.nodeset, plan, timeout=node_timeout)
    _report_release(ctx, as_json, released, plan.kept, 1 if plan.kept else 0, cleared=cleared)


def _release_stale(
    ctx: click.Context,
    session: Session,
    task: str | None,
    yes: bool,
    as_json: bool,
    node_timeout: float,
    timeout: float,
) -> None:
    locks, errors = held_locks(session.nodeset, session.prefix, task, timeout=node_timeout)
    code = check_quorum(ctx, session.nodeset, errors)
    if code:
        _report_release(ctx, as_json, [], [], code, quorum_error(session.nodeset, errors))
    # Ask the workers after reading the locks: a task that took its lock before the
    # SCAN is in its worker's active list by the time it is asked.
    workers = ask_workers(ctx.obj.app, timeout)
    error = None
    if workers is None:
        error = no_worker_error(timeout)
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
    released = release_locks(session.nodeset, stale, timeout=node_timeout)
    _report_release(ctx, as_json, released, refused, code, error)


def _report_release(
    ctx: click.Context,
    as_json: bool,
    released: list[dict[str, Any]],
    refused: list[dict[str, Any]],
    code: int,
    error: str | None = None,
    *,
    cleared: list[dict[str, Any]] | None = None,
) -> NoReturn:
    """Print what was released, cleared and refused, and exit with ``code``.

    ``error`` says why nothing could be decided (JSON ``error``; the text form has
    already said it on stderr). ``cleared``: the send-time claims cleared.
    """
    cleared = cleared or []
    if as_json:
        data = {"released": released, "cleared": cleared, "refused": refused, "error": error}
        echo_json(ctx, data)
        ctx.exit(code)
    for item in refused:
        ctx.obj.error(f"refused {item['key']}: {item['reason']}", fg="red")
    for item in released:
        parts = ", ".join(f"{r['node']}: {r['result']}" for r in item["nodes"])
        ctx.obj.echo(
            f"released {item['key']} (fence {item['fence']}) "
            f"on {item['released_on']} node(s): {parts}"
        )
    for item in cleared:
        parts = ", ".join(f"{r['node']}: {r['result']}" for r in item["nodes"])
        ctx.obj.echo(
            f"cleared claim {item['key']} (task {item['task_name'] or '-'} "
            f"[{item['task_id']}]) on {item['cleared_on']} node(s): {parts}"
        )
    ctx.exit(code)


def _describe_claim(claim: ClaimView, now: float) -> str:
    age = claim.age(now)
    where = f"{claim.held_on}/{claim.nodes} nodes, " if claim.nodes > 1 else ""
    return (
        f"{claim.claim_key}: send-time claim of task {claim.task_name or '-'} "
        f"[{claim.task_id}], {where}age {duration(None if age is None else max(age, 0.0))}, "
        f"TTL {duration(claim.ttl)}"
    )


def _describe(lock: LockView, now: float) -> str:
    age = lock.age(now)
    where = f"{lock.held_on}/{len(lock.views)} nodes, " if len(lock.views) > 1 else ""
    return (
        f"{lock.key}: task {lock.task_name or '-'} [{lock.task_id or '-'}] on {holder(lock)}, "
        f"{where}age {duration(None if age is None else max(age, 0.0))}, "
        f"TTL {duration(lock.ttl)}, fence {lock.fence}"
    )
