"""``celery redlock inspect KEY``: one lock's fields, PTTL, fence counter and budget."""

from __future__ import annotations

import time
from typing import Any

import click
from celery.bin.base import CeleryCommand

from ..budgets import read_budgets
from ..inventory import read_locks
from .base import check_quorum, common_options, lock_key, open_session
from .output import budget_used, duration, echo_json, holder

__all__ = ["inspect"]


@click.command(cls=CeleryCommand)
@click.argument("key")
@common_options()
@click.pass_context
def inspect(
    ctx: click.Context, /, key: str, as_json: bool, node_timeout: float, **kwargs: Any
) -> None:
    """Show every field of one lock on every node, its PTTL and fence counter.

    KEY is the lock's key (redlock:{NAME}) or its name. A key with a rate budget, or
    with runs waiting on the queue for it, also shows the starts used in the window,
    the next free slot and the runs queued.
    """
    session = open_session(ctx, node_timeout)
    try:
        key = lock_key(session, key)
        (lock,) = read_locks(session.nodeset, [key], session.prefix, timeout=node_timeout)
        (budget,), budget_errors = read_budgets(
            session.nodeset, [key], session.prefix, timeout=node_timeout
        )
    finally:
        session.close()
    errors = {v.node: v.error for v in lock.views if v.error is not None}
    for node, error in budget_errors.items():
        errors.setdefault(node, error)
    code = check_quorum(ctx, session.nodeset, errors)
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
        echo_json(
            ctx,
            {
                "key": lock.key,
                "name": lock.name,
                "held": held,
                "held_on": lock.held_on,
                "quorum": quorum,
                "quorum_size": lock.quorum_size,
                "holder": summary,
                "budget": budget.as_dict() if budget.seen else None,
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
            f"{where}; task {lock.task_name or '-'} [{lock.task_id or '-'}] on {holder(lock)}, "
            f"age {duration(None if age is None else max(age, 0.0))}, TTL {duration(lock.ttl)}, "
            f"fence {lock.fence}"
        )
    elif held is None:
        ctx.obj.echo(f"unknown: too few of the {len(lock.views)} node(s) answered to tell")
    else:
        ctx.obj.echo("not held on any node that answered")
    if budget.seen and budget.budget is None:
        ctx.obj.echo(f"no rate budget recorded, queued {budget.queued}")
    elif budget.seen:
        ctx.obj.echo(
            f"budget {budget_used(budget)}, next free slot in {duration(budget.next_free)}, "
            f"queued {budget.queued}"
        )
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
