"""``celery -A proj redlock web``: a live, read-only dashboard of the app's lock state.

The locks held, the runs waiting (on the queue for a key, and parked), the send-time
claims, the rate budgets and the beat leader, each a panel of one page that polls
its JSON view (``/api/locks``, ``/api/queued``, ``/api/claims``, ``/api/budgets``,
``/api/leader``) every second; a search box shows where a task id stands
(``/api/task/<task id>``, what ``inspect TASK_ID`` prints). Every view is read with
the functions ``ls`` and ``inspect`` use (:mod:`celery_redlock.ops`); nothing here
reads Redis another way.

Why the standard library's :class:`~http.server.ThreadingHTTPServer` and no web
framework: the dashboard serves a handful of JSON views and three static files to a
few operators; a framework would be a new dependency (and an extra to install) for
routing that fits in a table (:data:`.server.ROUTES`). The page is plain HTML, CSS
and JavaScript shipped in the package (``static/``), with no CDN, so it works on a
host without internet access.

Safety: it binds to 127.0.0.1 unless ``--address`` says otherwise. It changes nothing
unless started with ``--allow-release``, which needs ``--basic-auth user:password``
(Flower's convention: every request must then carry it); the release control is
``POST /api/release``, the same code as ``celery redlock release KEY``
(:mod:`celery_redlock.ops.releasing`), and without ``--allow-release`` that path does
not exist (404) and the page has no release button.
"""

from __future__ import annotations

from .server import ROUTES, Dashboard, Reply, Route, make_server

__all__ = ["ROUTES", "Dashboard", "Reply", "Route", "make_server"]
