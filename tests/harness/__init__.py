"""Test harness: real redis-server processes, a fault-injecting TCP proxy, Celery workers.

Import from here: ``from tests.harness import RedisServer, FaultProxy, wait_for``.
"""

from . import celery_workers, locks, servers
from .celery_workers import *  # noqa: F403 (re-exports exactly celery_workers.__all__)
from .faultproxy import FaultProxy
from .locks import *  # noqa: F403 (re-exports exactly locks.__all__)
from .servers import *  # noqa: F403 (re-exports exactly servers.__all__)

__all__ = ["FaultProxy", *servers.__all__, *celery_workers.__all__, *locks.__all__]  # noqa: PLE0604
