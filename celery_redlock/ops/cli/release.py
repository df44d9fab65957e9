"""``celery redlock release``: release one lock, or every stale one, with the token read."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NoReturn

import click
from celery.bin.base import CeleryCommand, CeleryOption
from celery.platforms import EX_UNAVAILABLE

from ..inventory import LockView, held_locks, read_locks, release_lock
from ..workers import ACTIVE, STALE, UNKNOWN, ask_workers, classify
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
    "next renewal, and aborts by default).",
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
    (lock,) = read_locks(session.nodeset, [key], session.prefix, timeout=node_timeout)
    errors = {v.node: v.error for v in lock.views if v.error is not None}
    code = check_quorum(ctx, session.nodeset, errors)
    if code:
        _report_release(ctx, as_json, [], [], code, quorum_error(session.nodeset, errors))
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
    released = _release_many(ctx, session, stale, node_timeout)
    _report_release(ctx, as_json, released, refused, code, error)


def _release_many(
    ctx: click.Context, session: Session, locks: Sequence[LockView], timeout: float
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
        echo_json(ctx, {"released": released, "refused": refused, "error": error})
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
        f"{lock.key}: task {lock.task_name or '-'} [{lock.task_id or '-'}] on {holder(lock)}, "
        f"{where}age {duration(None if age is None else max(age, 0.0))}, "
        f"TTL {duration(lock.ttl)}, fence {lock.fence}"
    )
