"""An app whose one task is locked by ``redlock_tasks`` with the arguments that
``REDLOCK_TEST_DRIFT_ARGS`` names (JSON list): two workers started with different
values are a deployment whose hosts disagree on one task's lock
(``celery redlock doctor``: ``settings-drift``).

The Redis URL comes from ``REDLOCK_TEST_REDIS_URL`` (broker db 1, results db 2, locks db 0).
"""

from __future__ import annotations

import json
import os

from celery import Celery

from tests.harness.celery_workers import APP_URL_ENV, make_app, redis_url_with_db

ARGS_ENV = "REDLOCK_TEST_DRIFT_ARGS"

REDIS_URL = os.environ.get(APP_URL_ENV, "redis://127.0.0.1:6379")


def make_drift_app(redis_url: str, args: list[str]) -> Celery:
    """The app, its task locked by ``args``."""
    app = make_app(
        redis_url,
        name="drift",
        redlock_url=redis_url_with_db(redis_url, 0),
        redlock_tasks={"drift.charge": {"args": args}},
    )

    @app.task(name="drift.charge", shared=False)
    def charge(account: str, amount: int) -> int:
        """Charge ``amount`` to ``account`` (a body that does nothing)."""
        return amount

    return app


#: The app ``-A tests.apps.drift`` loads.
app = make_drift_app(REDIS_URL, json.loads(os.environ.get(ARGS_ENV) or '["account"]'))
