"""Lock node URLs: host lists, connection settings, masking, and which node a URL makes.

A node is named by a URL: ``redis://``, ``rediss://`` and ``unix://`` as in
redis-py, a Sentinel-monitored master (``redis+sentinel://``, see
:mod:`celery_redlock.nodes.sentinel`) or a whole Redis Cluster
(``redis+cluster://``, see :mod:`celery_redlock.nodes.cluster`).

This module knows no node class. The kinds of URL other than the plain ones are
registered here by the modules that implement them (:func:`register_node_kind`), and
:func:`make_node` takes the factory for plain URLs from its caller: so the modules
that build nodes import this one, never the other way round, and the node layer has
no import cycle, not even a lazy import of the cluster module from here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import parse_qsl, quote

from redis.backoff import NoBackoff
from redis.connection import AbstractConnection
from redis.retry import Retry

from .calls import LockNode

__all__ = [
    "NodeFactory",
    "connection_options",
    "make_node",
    "mask_password",
    "parse_hosts",
    "register_node_kind",
    "safe_url",
]


class NodeFactory(Protocol):
    """Makes the lock node for a URL (a node class: ``Node``, ``ClusterNode``)."""

    def __call__(self, url: str, *, timeout: float) -> LockNode:
        """The node for ``url`` whose calls take up to ``timeout`` seconds each."""


#: Kinds of lock node registered by their modules: (does this URL name one?, its
#: factory, its sanitizer).
_NODE_KINDS: list[tuple[Callable[[str], bool], NodeFactory, Callable[[str], str]]] = []


def register_node_kind(
    matches: Callable[[str], bool],
    factory: NodeFactory,
    sanitize: Callable[[str], str],
) -> None:
    """Let :func:`make_node` and :func:`safe_url` handle another kind of URL.

    The module of a node kind registers itself here when it is imported, so this
    module never imports it. A Redis Cluster (:mod:`celery_redlock.nodes.cluster`) is
    registered by the import in :mod:`celery_redlock.engine.lock`, which the package
    itself imports: any use of ``celery_redlock`` loads it first.
    """
    _NODE_KINDS.append((matches, factory, sanitize))


def make_node(url: str, *, timeout: float, default: NodeFactory) -> LockNode:
    """The lock node for ``url``: a registered kind's, else ``default(url, timeout=...)``."""
    for matches, factory, _ in _NODE_KINDS:
        if matches(url):
            return factory(url, timeout=timeout)
    return default(url, timeout=timeout)


def safe_url(url: str) -> str:
    """``url`` with its passwords masked, for any lock node URL form."""
    for matches, _, sanitize in _NODE_KINDS:
        if matches(url):
            return sanitize(url)
    return mask_password(url)


#: Query parameters of a redis-py URL that carry a secret.
_SECRET_PARAMETERS = frozenset({"password"})


def mask_password(url: str) -> str:
    """``url`` as written, its password (userinfo or ``?password=``) shown as ``**``.

    Only the secret changes: no credentials stay none (kombu's masking writes
    ``redis://@host`` or adds a ``/`` in some versions), a user stays, an IPv6 host
    keeps its brackets and ``unix://`` keeps its ``?db=``, so the URL still names the
    node it names. For ``redis://``, ``rediss://`` and ``unix://`` URLs (and any
    ``scheme://[user[:password]@]rest`` form).
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, question, query = rest.partition("?")
    # The userinfo ends at the last "@" before the path, as redis-py reads it (a
    # unix:// path may hold an "@" of its own).
    netloc, slash, path = rest.partition("/")
    userinfo, at, host = netloc.rpartition("@")
    if at:
        user, colon, password = userinfo.partition(":")
        if colon and password:
            userinfo = f"{user}:**"
        netloc = f"{userinfo}@{host}" if userinfo else host
    if question:
        query = "&".join(
            f"{k}=**" if k in _SECRET_PARAMETERS else f"{k}={quote(v, safe='/:,')}"
            for k, v in parse_qsl(query, keep_blank_values=True)
        )
    return f"{scheme}://{netloc}{slash}{path}{question}{query}"


def parse_hosts(hostlist: str, default_port: int, *, what: str = "host") -> list[tuple[str, int]]:
    """``host[:port][,host[:port]...]`` (``[IPv6]:port`` too) as (host, port) pairs.

    Raises:
        ValueError: naming the item that has no host or a bad port.
    """
    hosts = []
    for item in hostlist.split(","):
        if item.startswith("["):  # [IPv6]:port
            host, _, port = item[1:].partition("]")
            port = port[1:] if port.startswith(":") else port
        else:
            host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
        if not host:
            raise ValueError(f"no {what} in {item!r}")
        try:
            number = int(port) if port else default_port
        except ValueError:
            raise ValueError(f"bad port in {item!r}") from None
        if not 0 < number < 65536:
            raise ValueError(f"bad port in {item!r}")
        hosts.append((host, number))
    return hosts


def connection_options(
    timeout: float, connection: type = AbstractConnection, retry: type = Retry
) -> dict[str, Any]:
    """Connection settings for a lock node, for the installed redis-py.

    Explicit connect and socket timeouts and no retries: redis-py's ready-made client
    retries a failing command (10 times in some versions: 8.7 s against a blackholed
    node with a 0.5 s socket timeout), and a lock call must fail within its budget.
    Every round trip a connection makes by itself on connect (``HELLO`` for RESP3,
    ``CLIENT SETINFO``, maintenance notifications) is one more place a hung node can
    stall us, so only the URL's own AUTH and SELECT remain. ``connection`` and
    ``retry`` are the classes the options are for (``redis.asyncio``'s for asyncio).
    """
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": retry(NoBackoff(), 0),
        "retry_on_timeout": False,
        "health_check_interval": 0,
        "decode_responses": True,
        "protocol": 2,
    }
    accepted = inspect.signature(connection).parameters
    if "driver_info" in accepted:  # redis-py >= 7.1; lib_name is deprecated there
        options["driver_info"] = None
    elif "lib_name" in accepted:
        options.update(lib_name=None, lib_version=None)
    if "maint_notifications_config" in accepted:
        from redis.maint_notifications import MaintNotificationsConfig  # noqa: PLC0415 (redis-py >= 6.4 only)

        options["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    return options
