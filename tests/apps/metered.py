"""Tasks that make every lock event the Prometheus metrics count, for a prefork worker
that serves them (``redlock_metrics``): the Grafana board's queries run against it
(tests/integration/test_grafana_queries.py, scripts/screenshot_metrics.py).

The broker is db 1 and results db 2 of ``$REDLOCK_TEST_REDIS_URL``; the locks live on a
server of their own, ``$METERED_LOCK_URL`` (db 0), which a test can pause without
pausing the broker; ``$METERED_METRICS_PORT`` is the port the worker serves /metrics on.
Every body that waits, waits for a ``gate`` file, never for a fixed time.
"""

from __future__ import annotations

import os
from pathlib import Path

from celery import Celery

from celery_redlock import LockedTask
from tests.harness.celery_workers import make_app, redis_url_with_db
from tests.harness.servers import wait_for

REDIS_URL = os.environ.get("REDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379")
LOCK_URL = os.environ.get("METERED_LOCK_URL", REDIS_URL)
METRICS_PORT = int(os.environ.get("METERED_METRICS_PORT", "0")) or None
#: A short lease, renewed every 4/3 s: a renewal on a paused lock node fails long
#: (seconds) before the lease's give-up time, even on a loaded machine.
TTL = 4.0
#: How long a gated body waits at most (a test that fails never leaves it running).
GATE_TIMEOUT = 60.0


def make_metered_app(
    redis_url: str = REDIS_URL, lock_url: str = LOCK_URL, metrics_port: int | None = METRICS_PORT
) -> Celery:
    """The app: ``metered.hold`` (skip when busy), ``metered.requeue`` (same key, put back
    when busy), ``metered.rated`` (one start a minute per key), ``metered.later`` (one
    queued copy per key) and ``metered.fanout`` (sends ``later`` twice: one duplicate),
    ``metered.short_claim`` (a 0.3 s send-time claim)."""
    app = make_app(
        redis_url,
        name="metered",
        redlock_url=redis_url_with_db(lock_url, 0),
        redlock_ttl=TTL,
        redlock_metrics=True,
        redlock_metrics_port=metrics_port,
    )
    common = {"base": LockedTask, "bind": True, "shared": False, "max_retries": 0}

    @app.task(name="metered.hold", lock_key="hold:{key}", **common)
    def hold(self, key, gate=""):
        if gate:
            wait_for(Path(gate).exists, timeout=GATE_TIMEOUT, interval=0.02)
        return key

    @app.task(name="metered.requeue", lock_key="hold:{key}", lock_on_busy="requeue", **common)
    def requeue(self, key):
        return key

    @app.task(name="metered.rated", lock_key="rated:{key}", lock_rate="1/m", **common)
    def rated(self, key):
        return key

    @app.task(name="metered.later", lock_key="later:{key}", lock_unique="until_started", **common)
    def later(self, key):
        return key

    @app.task(name="metered.fanout", bind=True, shared=False)
    def fanout(self, key, countdown=60.0):
        # Sent from the worker, whose metrics count the duplicate: the first copy waits
        # out its countdown in the worker's timer, holding its claim.
        first = later.apply_async((key,), countdown=countdown)
        second = later.apply_async((key,), countdown=countdown)
        return [first.id, second.id]

    @app.task(
        name="metered.short_claim",
        lock_key="short:{key}",
        lock_unique="until_started",
        lock_unique_ttl=0.3,
        **common,
    )
    def short_claim(self, key):
        return key

    return app


#: ``celery -A tests.apps.metered worker``.
app = make_metered_app()
