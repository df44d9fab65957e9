"""A celeryconfig that locks tasks by configuration alone (read by ``configonly``).

Nothing in the task module or the app module mentions celery_redlock: listing it in
``imports`` and naming the tasks in ``redlock_tasks`` is the whole setup.
"""

import os

from tests.harness.celery_workers import redis_url_with_db

_url = os.environ.get("REDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

broker_url = redis_url_with_db(_url, 1)
result_backend = redis_url_with_db(_url, 2)
redlock_url = redis_url_with_db(_url, 0)
result_extended = True
worker_hijack_root_logger = False
broker_connection_retry_on_startup = True

imports = ["celery_redlock", "tests.apps.configonly_tasks"]
redlock_ttl = 1.0
redlock_tasks = {
    "tests.apps.configonly_tasks.sync_*": {"args": ["account_id"]},
    "tests.apps.configonly_tasks.nightly_report": {"args": []},
}
# A worker started with REDLOCK_TEST_ON_BUSY=block must refuse to start.
redlock_on_busy = os.environ.get("REDLOCK_TEST_ON_BUSY", "skip")
