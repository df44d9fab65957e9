"""Test harness: real redis-server processes and a fault-injecting TCP proxy.

Import from here: ``from tests.harness import RedisServer, FaultProxy, wait_for``.
"""

from .faultproxy import FaultProxy
from .servers import (
    ENV_VAR,
    HOST,
    BinaryInfo,
    RedisServer,
    WaitTimeout,
    binary_summary,
    find_redis_server,
    free_port,
    make_client,
    no_retry,
    pid_exists,
    resolve_redis_server,
    server_version,
    used_binaries,
    wait_for,
)

__all__ = [
    "ENV_VAR",
    "HOST",
    "BinaryInfo",
    "FaultProxy",
    "RedisServer",
    "WaitTimeout",
    "binary_summary",
    "find_redis_server",
    "free_port",
    "make_client",
    "no_retry",
    "pid_exists",
    "resolve_redis_server",
    "server_version",
    "used_binaries",
    "wait_for",
]
