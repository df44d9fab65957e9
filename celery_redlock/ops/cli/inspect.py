"""``celery redlock inspect KEY``: one lock's fields, PTTL, fence counter and budget.

Or, given a task id, where that task stands on the lock nodes: the locks it holds, the
lock names its queued copy claims, and its run parked until its turn.
"""

from __future__ import annotations

import time
from typing import Any

import click
from celery.bin.base import CeleryCommand

from ..budgets import read_budgets
from ..inventory import read_locks
from ..parked import WAITS_FOR
from ..tasks import is_task_id, task_story
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
    the next free slot and the runs queued. KEY may also be a task id (a UUID, as
    Celery makes them): then the locks that task holds, the lock names its queued copy
    claims and its parked run are shown; a UUID none of these names is read as a lock
    name.
    """
    session = open_session(ctx, node_timeout)
    try:
        story = None
        if is_task_id(key):
            found = task_story(session.nodeset, session.prefix, key, timeout=node_timeout)
            # A UUID that names no task on the nodes is read as a lock name.
            story = found.as_dict() if found.found else None
        if story is None:
            key = lock_key(session, key)
            (lock,) = read_locks(session.nodeset, [key], session.prefix, timeout=node_timeout)
            (budget,), budget_errors = read_budgets(
                session.nodeset, [key], session.prefix, timeout=node_timeout
            )
    finally:
        session.close()
    if story is not None:
        _echo_task(ctx, key, story, as_json)
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


def _echo_task(ctx: click.Context, task_id: str, story: dict[str, Any], as_json: bool) -> None:
    """Print a task id's story (:func:`~celery_redlock.ops.tasks.task_story`) as lines or JSON."""
    if as_json:
        echo_json(ctx, story)
        ctx.exit(0)
    ctx.obj.echo(f"task id {task_id}")
    for lock in story["holds"]:
        ctx.obj.echo(
            f"holds {lock['key']} ({lock['task_name'] or '-'}), fence {lock['fence']}, "
            f"TTL {duration(lock['ttl'])}"
        )
    for claim in story["claims"]:
        ctx.obj.echo(
            f"claims {claim['key']}: its queued copy keeps the name ({claim['task_name'] or '-'})"
        )
    for run in story["parked"]:
        due = "due now" if run["due_in"] <= 0 else f"due in {duration(run['due_in'])}"
        taken = f", published {run['taken']} time(s), not started yet" if run["taken"] else ""
        ctx.obj.echo(
            f"parked on {run['node']}: waits for {WAITS_FOR.get(run['kind'], run['kind'])} "
            f"of {run['key'] or '-'}, {due}{taken}"
        )
    for node, error in story["errors"].items():
        ctx.obj.echo(f"{node}: {error} (what it holds is not shown)")
    ctx.exit(0)
