"""A Celery app with the plain test tasks, for ``celery -A tests.apps.plain worker``.

Its Redis server comes from ``$REDLOCK_TEST_REDIS_URL`` (broker db 1, results db 2; see
``tests.harness.make_app``).
"""

from __future__ import annotations

import os

from tests.apps import APP_URL_ENV, register_plain_tasks
from tests.harness.celery_workers import make_app

app = make_app(os.environ[APP_URL_ENV], name="plain")
_tasks = register_plain_tasks(app)

add = _tasks.add
sleep_then = _tasks.sleep_then
pid = _tasks.pid
record = _tasks.record

__all__ = ["add", "app", "pid", "record", "sleep_then"]
