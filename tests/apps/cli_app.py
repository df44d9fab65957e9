"""The app ``celery -A tests.apps.cli_app redlock ...`` loads in the CLI tests.

Built at import from the environment, so each test points it at its own servers (and
first drops the module from ``sys.modules`` and from its package, where Celery's
``find_app`` looks first, so that it is built again):

* ``REDLOCK_TEST_REDIS_URL``: broker db 1, results db 2, locks db 0 (see
  ``tests.apps.locked.create_app``, whose locked tasks it registers);
* ``REDLOCK_TEST_CLI_CONF``: a JSON object of extra settings, applied last
  (``{"redlock_nodes": [...]}`` for Redlock).
"""

from __future__ import annotations

import json
import os

from tests.apps.locked import create_app
from tests.harness.celery_workers import APP_URL_ENV

CONF_ENV = "REDLOCK_TEST_CLI_CONF"

REDIS_URL = os.environ.get(APP_URL_ENV, "redis://127.0.0.1:6379")

app = create_app(REDIS_URL, **json.loads(os.environ.get(CONF_ENV) or "{}"))
