"""``celery redlock web``: serve the live dashboard (:mod:`celery_redlock.ops.web`)."""

from __future__ import annotations

import ipaddress
from typing import Any

import click
from celery.bin.base import CeleryCommand, CeleryOption

from ..web import Dashboard, make_server
from .base import common_options, open_session

__all__ = ["web"]

#: Flower's port is 5555; the next free one of its neighbours, so both run side by side.
DEFAULT_PORT = 5557

#: Why ``--allow-release`` alone is refused (click prints it, exit 2).
NEEDS_AUTH = (
    "--allow-release needs --basic-auth USER:PASSWORD: anyone who can reach the port "
    "could otherwise release locks that running tasks hold"
)


def _credentials(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--basic-auth``'s ``user:password``, checked (both parts non-empty)."""
    if value is None:
        return None
    user, sep, password = value.partition(":")
    if not (user and sep and password):
        raise click.BadParameter("give it as USER:PASSWORD", ctx=ctx, param=param)
    return value


@click.command(cls=CeleryCommand)
@click.option(
    "--port",
    cls=CeleryOption,
    type=click.IntRange(0, 65535),
    default=DEFAULT_PORT,
    show_default=True,
    help_group="Web Options",
    help="Port to listen on (0: any free port, printed at start).",
)
@click.option(
    "--address",
    cls=CeleryOption,
    default="127.0.0.1",
    show_default=True,
    help_group="Web Options",
    help="Address to bind (another than loopback shows the lock state to the network).",
)
@click.option(
    "--allow-release",
    cls=CeleryOption,
    is_flag=True,
    help_group="Web Options",
    help="Add the release control (POST /api/release, as `redlock release KEY`). "
    "Needs --basic-auth.",
)
@click.option(
    "--basic-auth",
    cls=CeleryOption,
    metavar="USER:PASSWORD",
    envvar="CELERY_REDLOCK_WEB_BASIC_AUTH",
    callback=_credentials,
    help_group="Web Options",
    help="Ask every request for these credentials (HTTP basic auth, as Flower). Also "
    "read from $CELERY_REDLOCK_WEB_BASIC_AUTH, which other users cannot see in ps.",
)
@common_options(workers=True, as_json=False)
@click.pass_context
def web(
    ctx: click.Context,
    /,
    port: int,
    address: str,
    allow_release: bool,
    basic_auth: str | None,
    node_timeout: float,
    timeout: float,
    **kwargs: Any,
) -> None:
    """Serve a live, read-only dashboard of the locks (Ctrl-C stops it).

    Locks held, runs waiting and parked, send-time claims, rate budgets and the beat
    leader, refreshed every second, with a search by task id; the JSON behind each
    view is under /api/. It binds to 127.0.0.1 unless --address says otherwise.
    """
    if allow_release and basic_auth is None:
        raise click.UsageError(NEEDS_AUTH, ctx=ctx)
    session = open_session(ctx, node_timeout)
    dashboard = Dashboard(
        ctx.obj.app,
        session.settings,
        session.nodeset,
        worker_timeout=timeout,
        allow_release=allow_release,
    )
    try:
        server = make_server(dashboard, address, port, basic_auth=basic_auth)
    except OSError as exc:
        dashboard.close()
        raise click.UsageError(f"cannot listen on {address}:{port}: {exc}", ctx=ctx) from exc
    bound_port = server.server_address[1]
    host = f"[{address}]" if ":" in address else address
    release = "on (basic auth)" if allow_release else "off"
    ctx.obj.echo(
        f"celery_redlock dashboard of app {ctx.obj.app.main or 'celery'} on "
        f"http://{host}:{bound_port}/ (release {release}; Ctrl-C to stop)"
    )
    if basic_auth is None and not _is_loopback(address):
        ctx.obj.error(
            f"warning: {address} is not a loopback address and there is no --basic-auth: "
            "whoever reaches the port sees every lock and task id",
            fg="yellow",
        )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        dashboard.close()


def _is_loopback(address: str) -> bool:
    """Whether ``address`` can only be reached from this host."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
