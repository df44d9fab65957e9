"""The dashboard's HTTP side: a routing table of JSON views over the ops read layer.

:class:`Dashboard` turns the read functions ``ls`` and ``inspect`` use into JSON views
(one method per view); :data:`ROUTES` maps paths to them; :func:`make_server` serves
them, the page (``static/``) and, when allowed, the release control, with the
standard library's :class:`~http.server.ThreadingHTTPServer`.

A view is ``{"now", "complete", "quorum", "nodes", <its items>}``: as ``ls --json``,
its items are ``null`` (never an empty list) when fewer than a quorum of nodes
answered, so a dead node never reads as "no locks".
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import unquote

from celery.exceptions import CeleryCommandException

from ...engine.keys import lock_keys
from ...exceptions import ConfigurationError
from ...integration.settings import Settings
from ...nodes import NodeSet
from ..budgets import held_budgets
from ..claims import held_claims
from ..events import Event, clock, describe, feed, key_log, story, summary
from ..inventory import has_quorum, held_locks, nodes_status, quorum_error, resolve_key
from ..leader import read_leader
from ..parked import parked_runs
from ..releasing import carry_out, plan_release
from ..shares import held_shares
from ..tasks import task_story
from ..workers import ask_workers

__all__ = ["ROUTES", "Dashboard", "Reply", "Route", "make_server"]

logger = logging.getLogger("celery_redlock.web")

#: The page's files, served from the package (no CDN: the page works offline), by the
#: path the page asks for. Nothing else of the package can be read through the server.
STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/app.css": ("app.css", "text/css; charset=utf-8"),
}

#: Sent with every reply. The page loads only its own files (no inline script), may
#: not be framed (a framed release button could be clicked through), and the browser
#: keeps nothing: every view is live.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

#: The largest request body read (a release names one key).
MAX_BODY = 64 * 1024


#: Events the recent-events view shows (the feed's newest).
RECENT_EVENTS = 50


@dataclass(frozen=True)
class Reply:
    """A view's answer: an HTTP status and a JSON-ready body."""

    status: int
    body: dict[str, Any]


class Dashboard:
    """The app's lock state as JSON views; and its release control, when allowed.

    Arguments:
        app: The Celery app (its workers are asked whether a holder runs).
        settings: Its ``redlock_*`` settings.
        nodeset: Its lock nodes; shared by the server's threads (calls to a node are
            thread-safe) and closed by :meth:`close`.
        worker_timeout: Seconds to wait for the workers' replies before a release.
        allow_release: Whether :meth:`release` may run (``--allow-release``).
    """

    def __init__(
        self,
        app: Any,
        settings: Settings,
        nodeset: NodeSet,
        *,
        worker_timeout: float = 1.0,
        allow_release: bool = False,
    ) -> None:
        self.app = app
        self.settings = settings
        self.nodeset = nodeset
        self.worker_timeout = worker_timeout
        self.allow_release = allow_release

    @property
    def prefix(self) -> str:
        """The app's key prefix."""
        return self.settings.key_prefix

    def close(self) -> None:
        """Close the connections to the lock nodes."""
        self.nodeset.close()

    def _view(self, errors: dict[str, str], **items: Any) -> Reply:
        """A view's reply; its ``items`` are null without a quorum (as ``ls --json``)."""
        complete = has_quorum(self.nodeset, errors)
        body: dict[str, Any] = {
            "now": time.time(),
            "complete": complete,
            "quorum": self.nodeset.quorum,
            "nodes": nodes_status(self.nodeset, errors),
        }
        body.update((name, value if complete else None) for name, value in items.items())
        return Reply(HTTPStatus.OK, body)

    def meta(self) -> Reply:
        """What the page needs to know before it draws: the app, its nodes, release or not."""
        return Reply(
            HTTPStatus.OK,
            {
                "app": self.app.main or "celery",
                "prefix": self.prefix,
                "nodes": [node.safe_url for node in self.nodeset.nodes],
                "allow_release": self.allow_release,
            },
        )

    def locks(self) -> Reply:
        """The locks held (``ls``'s first table) and the shares (its second)."""
        now = time.time()
        locks, errors = held_locks(self.nodeset, self.prefix, None)
        shares, share_errors = held_shares(self.nodeset, self.prefix, None)
        _merge(errors, share_errors)
        return self._view(
            errors,
            locks=[lock.as_dict(now) for lock in locks],
            shares=[share.as_dict(now) for share in shares],
        )

    def budgets(self) -> Reply:
        """The rate budgets: starts used of the limit, the next free slot, runs queued."""
        budgets, errors = held_budgets(self.nodeset, self.prefix)
        return self._view(errors, budgets=[budget.as_dict() for budget in budgets])

    def claims(self) -> Reply:
        """The send-time claims: the queued copies of ``lock_unique`` tasks."""
        now = time.time()
        claims, errors = held_claims(self.nodeset, self.prefix)
        return self._view(errors, claims=[claim.as_dict(now) for claim in claims])

    def queued(self) -> Reply:
        """The runs waiting: on the queue for a key (with their place) and parked."""
        budgets, errors = held_budgets(self.nodeset, self.prefix)
        parked, parked_errors = parked_runs(self.nodeset, self.prefix)
        _merge(errors, parked_errors)
        waiting = [
            {"key": budget.key, "name": budget.name, **run}
            for budget in budgets
            for run in budget.as_dict()["waiting"]
        ]
        return self._view(errors, waiting=waiting, parked=[run.as_dict() for run in parked])

    def leader(self) -> Reply:
        """The beat leader lock and the beat that holds it."""
        try:
            leader, errors = read_leader(self.app, self.settings, self.nodeset)
        except ConfigurationError as exc:  # the broker URL cannot be read
            return Reply(HTTPStatus.OK, {"now": time.time(), "error": str(exc), "leader": None})
        return self._view(errors, leader=leader)

    def task(self, task_id: str) -> Reply:
        """Where ``task_id`` stands (``inspect TASK_ID``): its locks, claims, parked run."""
        story = task_story(self.nodeset, self.prefix, task_id)
        return self._view(story.errors, task={**story.as_dict(), "found": story.found})

    def _events(self, events: list[Event], errors: dict[str, str], **more: Any) -> Reply:
        """A view of events, each with its time and words (as ``why`` and ``log`` print).

        The log is not voted on (a batch of events went to one node): what the nodes
        that answered keep is shown, ``complete`` says whether every node answered,
        and the events are null only when none did.
        """
        answered = len(errors) < len(self.nodeset)
        body: dict[str, Any] = {
            "now": time.time(),
            "complete": not errors,
            "quorum": self.nodeset.quorum,
            "nodes": nodes_status(self.nodeset, errors),
            "events": [
                {**e, "key": self._lock_key(e), "time": clock(e), "text": describe(e)}
                for e in events
            ]
            if answered
            else None,
        }
        body.update(more)
        return Reply(HTTPStatus.OK, body)

    def _lock_key(self, event: Event) -> str | None:
        """The lock key of the name an event gives (None: no name, or not a lock's)."""
        try:
            return lock_keys(str(event.get("k") or ""), self.prefix).lock
        except ConfigurationError:
            return None

    def recent(self) -> Reply:
        """The newest events of every lock (the feed), newest last."""
        events, errors = feed(self.nodeset, self.prefix, RECENT_EVENTS)
        return self._events(events, errors)

    def log(self, key: str) -> Reply:
        """One lock's history (``celery redlock log KEY``), newest last."""
        try:
            lock = resolve_key(key, self.prefix)
        except ConfigurationError as exc:
            return Reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
        events, errors = key_log(self.nodeset, lock)
        return self._events(events, errors, key=lock)

    def why(self, task_id: str) -> Reply:
        """A task id's story (``celery redlock why TASK_ID``): a summary and its events."""
        events, errors = story(self.nodeset, self.prefix, task_id)
        return self._events(events, errors, task_id=task_id, summary=summary(task_id, events))

    def release(self, request: dict[str, Any]) -> Reply:
        """Release ``request["key"]`` as ``celery redlock release KEY [--force]`` does.

        A running (or maybe running) holder and the name's send-time claims are refused
        (409) unless ``request["force"]``; the reply is ``release --json``'s.
        """
        if not self.allow_release:  # the route is absent then; this guards direct calls
            return Reply(HTTPStatus.NOT_FOUND, {"error": "release is not allowed"})
        text, force = request.get("key"), request.get("force", False)
        if not isinstance(text, str) or not isinstance(force, bool):
            return Reply(HTTPStatus.BAD_REQUEST, {"error": 'give {"key": str, "force": bool}'})
        try:
            key = resolve_key(text, self.prefix)
        except ConfigurationError as exc:
            return Reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
        try:
            plan = plan_release(
                self.nodeset,
                self.prefix,
                key,
                force=force,
                ask_workers=lambda: ask_workers(self.app, self.worker_timeout),
            )
        except CeleryCommandException as exc:  # the broker cannot be reached
            return _release_reply(HTTPStatus.SERVICE_UNAVAILABLE, error=exc.message)
        if not plan.quorum:
            error = quorum_error(self.nodeset, plan.errors)
            return _release_reply(HTTPStatus.SERVICE_UNAVAILABLE, error=error)
        if not plan.found:
            return _release_reply(HTTPStatus.NOT_FOUND, error=f"{key} is not held")
        if not plan.allowed:
            return _release_reply(HTTPStatus.CONFLICT, refused=plan.refused)
        released, cleared = carry_out(self.nodeset, plan)
        logger.warning(
            "web: released %s (fence %s, force %s) and cleared %d claim(s)",
            key,
            plan.lock.fence,
            force,
            len(cleared),
        )
        return _release_reply(HTTPStatus.OK, released=released, cleared=cleared)


def _merge(errors: dict[str, str], more: dict[str, str]) -> None:
    for node, error in more.items():
        errors.setdefault(node, error)


def _release_reply(
    status: int,
    *,
    released: list[dict[str, Any]] | None = None,
    cleared: list[dict[str, Any]] | None = None,
    refused: list[dict[str, Any]] | None = None,
    error: str | None = None,
) -> Reply:
    """A reply in the form of ``release --json``: released, cleared, refused, error."""
    return Reply(
        status,
        {
            "released": released or [],
            "cleared": cleared or [],
            "refused": refused or [],
            "error": error,
        },
    )


@dataclass(frozen=True)
class Route:
    """A path pattern (its named groups are the view's arguments) and its view.

    ``body`` views get the request's JSON object as their one argument.
    """

    method: str
    pattern: re.Pattern[str]
    view: Callable[..., Reply]
    body: bool = False


def _get(path: str, view: Callable[..., Reply]) -> Route:
    return Route("GET", re.compile(path), view)


#: Every JSON view: a new one (``/api/log/<key>``...) is a line here and a method above.
#: Path arguments are percent-decoded before the view sees them.
ROUTES: list[Route] = [
    _get("/api/meta", Dashboard.meta),
    _get("/api/locks", Dashboard.locks),
    _get("/api/budgets", Dashboard.budgets),
    _get("/api/claims", Dashboard.claims),
    _get("/api/queued", Dashboard.queued),
    _get("/api/leader", Dashboard.leader),
    _get("/api/task/(?P<task_id>[^/]+)", Dashboard.task),
    _get("/api/events", Dashboard.recent),
    _get("/api/log/(?P<key>.+)", Dashboard.log),
    _get("/api/why/(?P<task_id>[^/]+)", Dashboard.why),
]

#: Added to :data:`ROUTES` only with ``--allow-release``: without it the path is unknown.
RELEASE_ROUTE = Route("POST", re.compile("/api/release"), Dashboard.release, body=True)


class _Handler(BaseHTTPRequestHandler):
    """Serves one request: authenticates it, then a route, a static file or an error."""

    server: _Server
    server_version = "celery_redlock-web"

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def log_message(self, format: str, *args: Any) -> None:
        # The page polls every second: one line per request belongs at DEBUG.
        logger.debug("%s %s", self.address_string(), format % args)

    def _handle(self, method: str) -> None:
        if not self._authorized():
            self._send_json(HTTPStatus.UNAUTHORIZED, {"error": "authentication required"})
            return
        path = self.path.split("?", 1)[0]
        if method in ("GET", "HEAD") and path in STATIC:
            self._send_static(*STATIC[path], head=method == "HEAD")
            return
        known_path = False
        for route in self.server.routes:
            match = route.pattern.fullmatch(path)
            if match is None:
                continue
            known_path = True
            if route.method == method:
                self._run(route, match)
                return
        if known_path:
            self._send_json(HTTPStatus.METHOD_NOT_ALLOWED, {"error": f"{method} not allowed"})
        else:
            self._send_json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {path}"})

    def _run(self, route: Route, match: re.Match[str]) -> None:
        args: dict[str, Any] = {name: unquote(value) for name, value in match.groupdict().items()}
        try:
            if route.body:
                request = self._json_body()
                if isinstance(request, Reply):
                    self._send_json(request.status, request.body)
                    return
                reply = route.view(self.server.dashboard, request)
            else:
                reply = route.view(self.server.dashboard, **args)
        except Exception as exc:  # a bug must not take the server down: say it, log it
            logger.exception("web: %s %s failed", self.command, self.path)
            self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(exc).__name__}"})
            return
        self._send_json(reply.status, reply.body)

    def _json_body(self) -> dict[str, Any] | Reply:
        """The request's JSON object, or the reply refusing it.

        Only ``application/json`` from this page's origin: a page elsewhere cannot send
        that cross-site without a CORS preflight, which this server never grants, so it
        cannot make a logged-in browser release a lock.
        """
        content_type = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            return Reply(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, {"error": "send application/json"})
        origin, host = self.headers.get("Origin"), self.headers.get("Host", "")
        # https too: the page may be reached through a TLS-terminating proxy.
        if origin is not None and origin not in (f"http://{host}", f"https://{host}"):
            return Reply(HTTPStatus.FORBIDDEN, {"error": f"origin {origin} not allowed"})
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            return Reply(HTTPStatus.BAD_REQUEST, {"error": "bad Content-Length"})
        try:
            request = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            return Reply(HTTPStatus.BAD_REQUEST, {"error": "the body is not JSON"})
        if not isinstance(request, dict):
            return Reply(HTTPStatus.BAD_REQUEST, {"error": "the body is not a JSON object"})
        return request

    def _authorized(self) -> bool:
        """Whether the request carries the ``--basic-auth`` credentials (if any are set)."""
        expected = self.server.credentials
        if expected is None:
            return True
        scheme, _, encoded = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            given = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            return False
        # Constant time: a timing difference must not tell how much of it was right.
        return hmac.compare_digest(given, expected.encode())

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, sort_keys=True).encode()
        self._send(status, data, "application/json")

    def _send_static(self, name: str, content_type: str, *, head: bool) -> None:
        data = (resources.files(__package__) / "static" / name).read_bytes()
        self._send(HTTPStatus.OK, b"" if head else data, content_type, length=len(data))

    def _send(self, status: int, data: bytes, content_type: str, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data) if length is None else length))
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        if status == HTTPStatus.UNAUTHORIZED:
            self.send_header("WWW-Authenticate", 'Basic realm="celery_redlock", charset="UTF-8"')
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    """A threading HTTP server that knows its dashboard, routes and credentials."""

    # A slow client must not keep the process from exiting.
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        dashboard: Dashboard,
        routes: list[Route],
        credentials: str | None,
    ) -> None:
        self.dashboard = dashboard
        self.routes = routes
        self.credentials = credentials
        super().__init__(address, _Handler)


def make_server(
    dashboard: Dashboard, address: str = "127.0.0.1", port: int = 5557, *, basic_auth: str | None
) -> ThreadingHTTPServer:
    """A server (bound, not yet serving) of ``dashboard`` on ``address:port``.

    ``basic_auth`` (``user:password``) is then asked of every request, as Flower's
    ``--basic-auth``. The release route exists only when the dashboard allows release,
    which needs ``basic_auth``: anyone who can reach the port could release locks.

    Raises:
        ValueError: release allowed without ``basic_auth``.
    """
    if dashboard.allow_release and not basic_auth:
        raise ValueError("the release control needs basic auth (user:password)")
    routes = [*ROUTES, RELEASE_ROUTE] if dashboard.allow_release else list(ROUTES)
    return _Server((address, port), dashboard, routes, basic_auth)
