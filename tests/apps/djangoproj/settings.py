"""Django settings; Celery's and celery_redlock's are ``CELERY_``-prefixed.

Environment: ``REDLOCK_TEST_REDIS_URL`` (broker db 1, results db 2, locks db 0),
``REDLOCK_TEST_DJANGO_DB`` (the SQLite file), ``REDLOCK_TEST_BEAT_TTL``.
"""

from __future__ import annotations

import os

from tests.harness.celery_workers import redis_url_with_db

REDIS_URL = os.environ.get("REDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379")

SECRET_KEY = "celery_redlock tests"
INSTALLED_APPS = ["django_celery_beat"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("REDLOCK_TEST_DJANGO_DB", ":memory:"),
        # two beats and a check write to one file: wait for its lock, do not fail
        "OPTIONS": {"timeout": 20},
    }
}
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

CELERY_BROKER_URL = redis_url_with_db(REDIS_URL, 1)
CELERY_RESULT_BACKEND = redis_url_with_db(REDIS_URL, 2)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_IMPORTS = ["celery_redlock"]
CELERY_BEAT_SCHEDULER = "celery_redlock.beat:DatabaseLeaderScheduler"
# the leader records each run in the database as soon as it is sent
CELERY_BEAT_SYNC_EVERY = 1

CELERY_REDLOCK_URL = redis_url_with_db(REDIS_URL, 0)
CELERY_REDLOCK_TTL = 7
CELERY_REDLOCK_BEAT_TTL = float(os.environ.get("REDLOCK_TEST_BEAT_TTL", "2.0"))
CELERY_REDLOCK_TASKS = {"tests.apps.djangoproj.celery.hold": {"args": []}}
