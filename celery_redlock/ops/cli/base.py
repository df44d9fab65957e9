"""What every ``celery redlock`` sub-command shares: its options, session and quorum check.

The command modules import it as Celery's import ``celery.bin.base``. It is not the
package's ``__init__``, which defines the ``redlock`` group and imports the command
modules: a command importing from there would meet it half-initialised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click
from celery.bin.base import CeleryOption
from celery.exceptions import CeleryCommandException
from celery.platforms import EX_FAILURE, EX_UNAVAILABLE

from ...exceptions import ConfigurationError
from ...integration.settings import Settings, from_conf
from ...nodes import NodeSet
from ..inventory import has_quorum, quorum_error, resolve_key
from .output import warn

__all__ = [
    "DEFAULT_NODE_TIMEOUT",
    "Session",
    "check_any",
    "check_quorum",
    "common_options",
    "lock_key",
    "no_worker_error",
    "open_session",
    "quorum_error",
]

#: Default budget of one call to the lock nodes from this command. Larger than the
#: library's (min(0.25 s, ttl/10)): an operator may be further from Redis than the
#: workers are, and nothing here holds a lease that could run out.
DEFAULT_NODE_TIMEOUT = 1.0


@dataclass
class Session:
    """The app's settings and a NodeSet of its lock nodes, for one command."""

    settings: Settings
    nodeset: NodeSet

    @property
    def prefix(self) -> str:
        """The app's key prefix (``redlock_key_prefix``)."""
        return self.settings.key_prefix

    def close(self) -> None:
        """Close the NodeSet's connections: the command is done with the nodes."""
        self.nodeset.close()


def open_session(ctx: click.Context, node_timeout: float) -> Session:
    """The session of the app in ``ctx``; settings that do not validate exit 1."""
    try:
        settings = from_conf(ctx.obj.app.conf)
        nodeset = NodeSet(settings.node_urls(), timeout=node_timeout)
    except ConfigurationError as exc:
        raise CeleryCommandException(message=str(exc), exit_code=EX_FAILURE) from exc
    return Session(settings, nodeset)


def lock_key(session: Session, text: str) -> str:
    """The lock key that a command's KEY argument names (a key of a lock, or its name).

    A KEY that names no lock (empty, too long) is a usage error, exit 2, not a traceback.
    """
    try:
        return resolve_key(text, session.prefix)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="'KEY'") from exc


def check_quorum(ctx: click.Context, nodeset: NodeSet, errors: dict[str, str]) -> int:
    """Warn about failed nodes; EX_UNAVAILABLE when fewer than a quorum answered."""
    for node, error in errors.items():
        warn(ctx, f"node {node} did not answer: {error}")
    if not has_quorum(nodeset, errors):
        ctx.obj.error(quorum_error(nodeset, errors), fg="red")
        return int(EX_UNAVAILABLE)
    return 0


def check_any(ctx: click.Context, nodeset: NodeSet, errors: dict[str, str]) -> int:
    """Warn about failed nodes; EX_UNAVAILABLE when none answered.

    For what one node may hold alone (an event log's batch, a parked run): any node
    that answers tells its part, which is not all of it while another is silent.
    """
    for node, error in errors.items():
        warn(ctx, f"node {node} did not answer: {error}")
    return int(EX_UNAVAILABLE) if len(errors) == len(nodeset) else 0


def no_worker_error(timeout: float) -> str:
    """Why only locks whose holder's process is gone can be stale: no worker answered."""
    return (
        f"no worker answered within {timeout}s: only locks whose holder's process is "
        "gone on this host are proven stale (raise --timeout, or check the workers "
        "and the broker)"
    )


def common_options(
    *, workers: bool = False, as_json: bool = True
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options every sub-command takes (and ``--timeout`` where workers are asked).

    ``as_json=False`` leaves out ``--json``, for a command that prints no result (``web``).
    """

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        if as_json:
            f = click.option(
                "-j",
                "--json",
                "as_json",
                cls=CeleryOption,
                is_flag=True,
                help_group="Output Options",
                help="Print JSON with stable keys instead of text.",
            )(f)
        f = click.option(
            "--node-timeout",
            cls=CeleryOption,
            type=click.FloatRange(min=0.001),
            default=DEFAULT_NODE_TIMEOUT,
            show_default=True,
            help_group="Redis Options",
            help="Budget in seconds of each call to the lock nodes (no retries).",
        )(f)
        if workers:
            f = click.option(
                "-t",
                "--timeout",
                cls=CeleryOption,
                type=click.FloatRange(min=0.0),
                default=1.0,
                show_default=True,
                help_group="Remote Control Options",
                help="Seconds to wait for the workers' replies (inspect active).",
            )(f)
        return f

    return decorate
