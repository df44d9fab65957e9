"""``celery redlock log KEY [--follow]``: a lock's events, newest last."""

from __future__ import annotations

import json
import time
from typing import Any

import click
from celery.bin.base import CeleryCommand, CeleryOption

from ..events import Event, clock, describe, key_log
from .base import check_any, common_options, lock_key, open_session

__all__ = ["log"]

#: Seconds between two reads of the log with ``--follow``.
FOLLOW_EVERY = 0.5


@click.command(cls=CeleryCommand)
@click.argument("key")
@click.option(
    "-n",
    "--count",
    cls=CeleryOption,
    type=click.IntRange(1, 100),
    default=20,
    show_default=True,
    help_group="Output Options",
    help="How many of the newest events to show first.",
)
@click.option(
    "-f",
    "--follow",
    cls=CeleryOption,
    is_flag=True,
    help_group="Output Options",
    help="Keep printing new events as they come (Ctrl-C ends).",
)
@common_options()
@click.pass_context
def log(
    ctx: click.Context,
    /,
    key: str,
    count: int,
    follow: bool,
    as_json: bool,
    node_timeout: float,
    **kwargs: Any,
) -> None:
    """Print the newest events of one lock, oldest first (the event log).

    KEY is the lock's key (redlock:{NAME}) or its name. Each line: the node's time
    (UTC), the task id, and what happened. With --json, one JSON object per line.
    """
    session = open_session(ctx, node_timeout)
    seen: set[str] = set()

    def show(events: list[Event]) -> None:
        for event in events:
            text = json.dumps(event, sort_keys=True)
            if text in seen:
                continue
            seen.add(text)
            if as_json:
                ctx.obj.echo(text)
            else:
                ctx.obj.echo(f"{clock(event)}  {event.get('id') or '-'}  {describe(event)}")

    try:
        lock = lock_key(session, key)
        events, errors = key_log(session.nodeset, lock, count, timeout=node_timeout)
        code = check_any(ctx, session.nodeset, errors)
        if not events and not as_json and not follow:
            ctx.obj.echo(f"No event of {lock} is kept.")
        show(events)
        while follow:
            time.sleep(FOLLOW_EVERY)  # polling the list: a new event shows within this
            events, _ = key_log(session.nodeset, lock, 100, timeout=node_timeout)
            show(events)
    except KeyboardInterrupt:
        code = 0
    finally:
        session.close()
    ctx.exit(code)
