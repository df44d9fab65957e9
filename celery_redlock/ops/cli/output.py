"""How ``celery redlock`` prints: JSON, warnings, durations, tables and holders."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from ...engine.rate import UNITS
from ..budgets import BudgetView
from ..inventory import LockView

__all__ = ["budget_used", "duration", "echo_json", "holder", "table", "warn"]


def echo_json(ctx: click.Context, data: Any) -> None:
    """Print ``data`` as indented JSON with sorted (stable) keys."""
    ctx.obj.echo(json.dumps(data, indent=2, sort_keys=True))


def warn(ctx: click.Context, message: str) -> None:
    """Print a warning on stderr."""
    ctx.obj.error(message, fg="yellow")


def duration(seconds: float | None) -> str:
    """``seconds`` as an operator reads it: ``4.2s``, ``3m07s``, ``5h02m``, ``3d04h``.

    None is ``-``; -1 (a key with no TTL) is ``none``; other negatives are ``0s``.
    """
    if seconds is None:
        return "-"
    if seconds < 0:
        return "none" if seconds == -1.0 else "0s"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def table(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (the first is the header) in left-aligned columns two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def holder(lock: LockView) -> str:
    """The holder's ``host:pid`` (``?`` for what the lock does not record)."""
    host, pid = lock.fields.get("host") or "?", lock.fields.get("pid") or "?"
    return f"{host}:{pid}"


def budget_used(view: BudgetView) -> str:
    """A budget's use as ``ls`` and ``inspect`` print it: ``3/5 per 1s`` (``-``: none)."""
    budget = view.budget
    if budget is None:
        return "-"
    unit = next((f"1{u}" for u, s in UNITS.items() if s == budget.window), None)
    return f"{view.used}/{budget.limit} per {unit or duration(budget.window)}"
