"""A lock node that is a master monitored by Redis Sentinel: its URL and its pool.

The URL names the sentinels and the master's service name::

    redis+sentinel://[[username]:password@]host[:port][,host[:port]...]/service[/db]
        [?sentinel_username=...&sentinel_password=...]

e.g. ``redis+sentinel://:secret@10.0.0.1:26379,10.0.0.2:26379,10.0.0.3/mymaster/0``.
The hosts are the sentinels (port 26379 by default), ``service`` is the master's name
in ``sentinel monitor`` (kombu's ``master_name``), ``db`` defaults to 0. The URL's
credentials are the master's (as in kombu's ``sentinel://`` broker URLs); sentinels
that require a password of their own get it from ``sentinel_password``. Such a URL is
*one* lock node: for Redlock, list several (independent) sentinel-managed masters.

Every new connection to a sentinel node first asks the sentinels for the current
master (redis-py's ``SentinelManagedConnection``; the sentinels are queried in turn,
each with the node timeout as connect and socket timeout and no retries). A READONLY
reply (the master was demoted to a replica) is turned into a connection error by
that class, so the fan-out drops the connection like any other broken one. The node
(:class:`~celery_redlock.nodes.Node`) also asks the sentinels again at most every
:data:`MASTER_RECHECK` seconds when a connection is checked out, and drops
connections to a server that is no longer the master, so a failover whose old master
is still up (and still writable until the sentinels demote it, up to ~10 s later) is
noticed within that delay.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, quote, unquote

from redis.sentinel import Sentinel, SentinelConnectionPool

from ..exceptions import ConfigurationError
from .urls import connection_options, parse_hosts

__all__ = [
    "MASTER_RECHECK",
    "SENTINEL_FORM",
    "SENTINEL_SCHEME",
    "is_sentinel_url",
    "sanitize_sentinel_url",
    "sentinel_pool",
]

#: URL scheme of a lock node that is a Sentinel-monitored master.
SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
SENTINEL_FORM = (
    "redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service_name[/db]"
    "[?sentinel_username=...&sentinel_password=...]"
)
#: Seconds between two checks of a sentinel node's master address on checkout.
MASTER_RECHECK = 1.0


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names a Sentinel-monitored master."""
    return url.startswith(f"{SENTINEL_SCHEME}://")


def _sentinel_error(url: str, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"invalid Redis Sentinel URL {sanitize_sentinel_url(url)!r}: {why}; expected "
        f"{SENTINEL_FORM}, e.g. redis+sentinel://:password@host1:26379,host2:26379/mymaster/0"
    )


def sanitize_sentinel_url(url: str) -> str:
    """The URL with its passwords masked (kombu's helper cannot parse a host list)."""
    rest = url.split("://", 1)[-1]
    netloc, sep, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:**@{hosts}" if colon else f"{user}@{hosts}"
    path, question, query = path.partition("?")
    if question:
        query = "&".join(
            f"{k}=**" if k == "sentinel_password" else f"{k}={quote(v, safe='')}"
            for k, v in parse_qsl(query, keep_blank_values=True)
        )
    return f"{SENTINEL_SCHEME}://{netloc}{sep}{path}{question}{query}"


def _parse_sentinel_url(
    url: str,
) -> tuple[list[tuple[str, int]], str, dict[str, Any], dict[str, Any]]:
    """(sentinel addresses, service name, master credentials and db, sentinel credentials)."""
    rest = url[len(SENTINEL_SCHEME) + 3 :]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    master: dict[str, Any] = {}
    if at:
        user, colon, password = userinfo.partition(":")
        master["username"] = unquote(user) or None
        master["password"] = unquote(password) if colon else None
    try:
        sentinels = parse_hosts(hostlist, SENTINEL_PORT, what="sentinel host")
    except ValueError as exc:
        raise _sentinel_error(url, str(exc)) from None
    parts = [unquote(p) for p in path.split("/")] if path else []
    if parts and parts[-1] == "":
        parts.pop()  # a trailing slash
    if not parts or not parts[0]:
        raise _sentinel_error(url, "no service (master) name")
    if len(parts) > 2:
        raise _sentinel_error(url, f"unexpected path {path!r}")
    try:
        master["db"] = int(parts[1]) if len(parts) == 2 else 0
    except ValueError:
        raise _sentinel_error(url, f"db must be a number, got {parts[1]!r}") from None
    if master["db"] < 0:
        raise _sentinel_error(url, f"db must be >= 0, got {master['db']}")
    sentinel_auth: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key not in ("sentinel_username", "sentinel_password"):
            raise _sentinel_error(url, f"unknown option {key!r}")
        sentinel_auth[key.removeprefix("sentinel_")] = value
    return sentinels, parts[0], master, sentinel_auth


def sentinel_pool(url: str, timeout: float) -> SentinelConnectionPool:
    """A pool whose connections reach the master the sentinels report when they connect.

    Only its ``connection_class`` and ``connection_kwargs`` are used (the kwargs hold
    the pool's proxy, which asks the sentinels); sentinel queries get the same
    timeouts, no retries and no handshakes as the lock connections.
    """
    try:
        sentinels, service, master, sentinel_auth = _parse_sentinel_url(url)
    except ValueError as exc:  # parse_qsl(strict_parsing=True)
        raise _sentinel_error(url, str(exc)) from exc
    options = connection_options(timeout)
    # redis.Redis deprecates retry_on_timeout; Retry(NoBackoff(), 0) retries nothing anyway.
    sentinel_options = {k: v for k, v in options.items() if k != "retry_on_timeout"}
    manager = Sentinel(sentinels, sentinel_kwargs={**sentinel_options, **sentinel_auth})
    return SentinelConnectionPool(service, manager, **master, **options)
