"""The app module of a web process in a configuration-only setup (issue 25 item 12).

``redlock_tasks`` makes a plain task unique; nothing here imports celery_redlock (a
web process does, or a module it imports does: ``imports`` is read by workers and beat
only). The Redis server is ``REDLOCK_TEST_REDIS_URL``'s: broker db 1, locks db 0.
"""

import os

from celery import Celery

from tests.harness.celery_workers import BACKEND_DB, BROKER_DB, redis_url_with_db

_url = os.environ.get("REDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery(
    "configonly_web",
    broker=redis_url_with_db(_url, BROKER_DB),
    backend=redis_url_with_db(_url, BACKEND_DB),
)
app.conf.update(
    redlock_url=redis_url_with_db(_url, 0),
    redlock_tasks={"web.report": {"unique": "until_started", "args": ["day"]}},
    broker_connection_retry_on_startup=True,
)


@app.task(name="web.report")
def report(day):
    """Plain: locked (and its sends deduplicated) by redlock_tasks alone."""
    return day
