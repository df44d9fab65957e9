"""Test harness: real redis-server processes and a fault-injecting TCP proxy.

Import from here: ``from tests.harness import RedisServer, FaultProxy, wait_for``.
"""

from . import servers
from .faultproxy import FaultProxy
from .servers import *  # noqa: F403 (re-exports exactly servers.__all__)

__all__ = ["FaultProxy", *servers.__all__]  # noqa: PLE0604
