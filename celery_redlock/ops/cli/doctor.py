"""``celery redlock doctor``: print what :mod:`celery_redlock.ops.doctor` finds."""

from __future__ import annotations

import socket
from typing import Any

import click
from celery.bin.base import CeleryCommand

from ..doctor import ERROR, OK, WARN, diagnose
from .base import common_options
from .output import echo_json

__all__ = ["doctor"]


@click.command(cls=CeleryCommand)
@common_options()
@click.pass_context
def doctor(ctx: click.Context, /, as_json: bool, node_timeout: float, **kwargs: Any) -> None:
    """Check that the lock nodes and the settings are safe for locks.

    Exits 1 when an error-level finding exists, 69 when a node could not be asked.
    """
    app = ctx.obj.app
    # The tasks' own lock options count (their leases, their policies): import the
    # modules a worker would, as `celery report` does.
    app.loader.import_default_modules()
    report = diagnose(app, timeout=node_timeout)
    if as_json:
        echo_json(ctx, report.as_dict())
        ctx.exit(report.exit_code)
    styles: dict[str, dict[str, Any]] = {
        OK: {"fg": "green"},
        WARN: {"fg": "yellow", "bold": True},
        ERROR: {"fg": "red", "bold": True},
    }
    host = socket.gethostname()
    ctx.obj.echo(f"celery_redlock doctor, from {host}, {len(report.facts)} lock node(s)")
    current: object = object()
    for finding in report.findings:
        if finding.node != current:
            current = finding.node
            ctx.obj.echo("")
            ctx.obj.echo(ctx.obj.style(finding.node or "setup", bold=True))
        level = ctx.obj.style(f"{finding.level.upper():<5}", **styles[finding.level])
        ctx.obj.echo(f"  {level} {finding.code}: {finding.message}")
    counts = report.as_dict()["counts"]
    ctx.obj.echo("")
    ctx.obj.echo(
        f"{counts['error']} error(s), {counts['warn']} warning(s), {counts['ok']} ok "
        f"(exit {report.exit_code})"
    )
    ctx.exit(report.exit_code)
