"""``celery redlock why TASK_ID``: the story of one task id, from the event log."""

from __future__ import annotations

from typing import Any

import click
from celery.bin.base import CeleryCommand

from ..events import clock, describe, story, summary
from .base import check_any, common_options, open_session
from .output import echo_json

__all__ = ["why"]


@click.command(cls=CeleryCommand)
@click.argument("task_id")
@common_options()
@click.pass_context
def why(
    ctx: click.Context, /, task_id: str, as_json: bool, node_timeout: float, **kwargs: Any
) -> None:
    """Tell what happened to TASK_ID's run: sent, deferred, busy, started, ended...

    Read from the event log (redlock_events): one line per event, oldest first, with
    the node's time (UTC), after a one-sentence summary. Events are kept
    redlock_events_ttl after a lock's last one.
    """
    session = open_session(ctx, node_timeout)
    try:
        events, errors = story(session.nodeset, session.prefix, task_id, timeout=node_timeout)
    finally:
        session.close()
    code = check_any(ctx, session.nodeset, errors)
    if as_json:
        echo_json(ctx, {"task_id": task_id, "summary": summary(task_id, events),
                        "events": events, "complete": not errors})  # fmt: skip
    else:
        ctx.obj.echo(summary(task_id, events))
        for event in events:
            ctx.obj.echo(f"  {clock(event)}  {describe(event)}")
    ctx.exit(code)
