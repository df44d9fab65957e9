"""Locked tasks whose runs cause runs of the same key: chain steps, ``link`` callbacks,
chord bodies, a caller's next call. For ``celery -A tests.apps.chained worker``.

Every task is a :class:`~celery_redlock.LockedTask` with the default lock options (a
busy key is skipped). The Redis URL comes from ``$REDLOCK_TEST_REDIS_URL`` (broker db 1,
results db 2, locks db 0). Each body appends one line ``run <task id> <task name> <start
ns> <end ns> <pid> <held at start> <held at end>`` to the file ``out``: ``held`` is 1
when the lock's key on the server (read there, not from the library's own state) holds
this run's token and task id, so a test sees that the lock covers the whole body.

The race is made certain rather than likely: a run's ``after_return`` (after Celery sent
its successor and stored its result, before ``task_postrun``) waits until that successor
has settled (its result is final: it ran, or was refused), at most :data:`GATE_SECONDS`,
and appends ``gate <task id> <successor id> <state>``. So every successor tries its lock
while its predecessor has not finished; a lock still held until ``task_postrun`` refuses
it every time. The successor is the chain's next step, the first ``link`` callback, the
chord body, or the task id a caller names in the ``successor`` header (its next call).
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery, Task, states

from celery_redlock import LockedTask
from celery_redlock.integration.policies import request_header
from tests.harness.celery_workers import APP_URL_ENV, make_app, redis_url_with_db
from tests.harness.servers import WaitTimeout, wait_for

REDIS_URL = os.environ.get(APP_URL_ENV, "redis://127.0.0.1:6379")

#: How long a run's end waits for its successor to settle: far longer than a successor
#: takes to start on an idle pool process, and short enough that a missing one shows.
GATE_SECONDS = 15.0

# One client per process, made in the process that runs the bodies (a pool child).
_clients: dict[tuple[int, str], redis.Redis] = {}


def _held_by_me(task: Task, locks_url: str) -> bool:
    """Whether the lock's key on the server holds this run's token and task id."""
    key = (os.getpid(), locks_url)
    client = _clients.get(key)
    if client is None:
        client = _clients[key] = redis.Redis.from_url(locks_url, decode_responses=True)
    lock = task.lock
    lease = lock.lease
    token, task_id = client.hmget(lock.key, ["token", "task_id"])
    return lease is not None and token == lease.token and task_id == task.request.id


def _append(out: str, line: str) -> None:
    """Append ``line`` to the file ``out``."""
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{line}\n".encode())  # one write: lines of several processes never mix
    finally:
        os.close(fd)


def _record(task: Task, out: str) -> None:
    """Note the body's run, and whether its key was its own at its start and its end."""
    locks_url = task.app.conf.redlock_url
    started = time.monotonic_ns()
    at_start = _held_by_me(task, locks_url)
    at_end = _held_by_me(task, locks_url)
    ended = time.monotonic_ns()
    _append(
        out,
        f"run {task.request.id} {task.name} {started} {ended} {os.getpid()} "
        f"{int(at_start)} {int(at_end)}",
    )


def successor_of(request: object) -> str | None:
    """The task id of the run this one causes, if any (see the module docs)."""
    named = request_header(request, "successor")
    if named:
        return str(named)
    chain = getattr(request, "chain", None)
    callbacks = getattr(request, "callbacks", None)
    chord = getattr(request, "chord", None)
    nxt = chain[-1] if chain else callbacks[0] if callbacks else chord
    return None if not nxt else str(nxt["options"]["task_id"])


# The successor of each run in this process, by task id: read before the body runs,
# because Celery 5.3's tracer pops the chain's next step off the request to send it.
_successors: dict[str, str | None] = {}


class Gated(LockedTask):
    """A LockedTask whose end waits for its successor to settle (see the module docs)."""

    def before_start(self, task_id, args, kwargs):
        successor = successor_of(self.request)
        super().before_start(task_id, args, kwargs)  # a refused run has no end to hold
        _successors[task_id] = successor

    def after_return(self, status, retval, task_id, args, kwargs, einfo):
        successor, out = _successors.pop(task_id, None), kwargs.get("out") or args[-1]
        if successor is not None:
            result = self.app.AsyncResult(successor)
            try:
                wait_for(lambda: result.state in states.READY_STATES, timeout=GATE_SECONDS)
                state = result.state
            except WaitTimeout:
                state = "TIMEOUT"
            _append(out, f"gate {task_id} {successor} {state}")
        super().after_return(status, retval, task_id, args, kwargs, einfo)


def identity(self: Task, x: int, out: str) -> int:
    """Return ``x``; locked on all its arguments (the default ``lock_args``)."""
    _record(self, out)
    return x


def account_step(self: Task, acct: int, out: str) -> int:
    """A step on account ``acct`` (``debit`` and ``credit`` share ``account:{acct}``)."""
    _record(self, out)
    return acct


def make_chained_app(redis_url: str) -> Celery:
    """The app with ``chained.identity``, ``chained.debit`` and ``chained.credit``."""
    app = make_app(redis_url, name="chained", redlock_url=redis_url_with_db(redis_url, 0))
    common = {"base": Gated, "bind": True, "shared": False}
    app.task(name="chained.identity", **common)(identity)
    for name in ("chained.debit", "chained.credit"):
        app.task(name=name, lock_key="account:{acct}", **common)(account_step)
    return app


#: The app worker subprocesses load with ``-A tests.apps.chained``.
app = make_chained_app(REDIS_URL)
