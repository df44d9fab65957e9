"""The suite's redis-server processes: :mod:`celery_redlock.testing.servers`.

The discovery and lifecycle live in the package, where the ``celery_redlock.testing``
pytest plugin that projects use finds its servers: one implementation for both.
"""

from celery_redlock.testing.servers import *  # noqa: F403
from celery_redlock.testing.servers import __all__  # noqa: F401
