"""Locked tasks for the Celery integration tests, run in-process and by worker subprocesses.

The Redis URL comes from ``REDLOCK_TEST_REDIS_URL`` (broker on db 1, results on db 2,
locks on db 0). Tasks that tests inspect write their critical sections to a file as
``start|end <label> <monotonic_ns> <pid>`` lines (read by
``tests.harness.read_intervals``), so intervals are data.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from celery import Celery
from celery.exceptions import Ignore, Reject

from celery_redlock import LockedTask
from tests.harness.celery_workers import make_app, redis_url_with_db

REDIS_URL = os.environ.get("REDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379")
#: Short leases so loss and expiry happen within a test's time.
TTL = float(os.environ.get("REDLOCK_TEST_TTL", "1.0"))


#: A task name no line-based protocol may mangle.
ODD_NAME = "tests.apps.locked.odd\nname with spaces"


def note(path: str | None, event: str, label: str) -> None:
    if path:
        with Path(path).open("a") as out:
            out.write(f"{event} {label} {time.monotonic_ns()} {os.getpid()}\n")


def work(self, path, label, seconds):
    note(path, "start", label)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    note(path, "end", label)
    return {
        "label": label,
        "fence": self.lock.fence,
        "key": self.lock.key,
        "remaining": self.lock.remaining(),
    }


def create_app(redis_url: str = REDIS_URL, **conf: object) -> Celery:
    """A fresh app with every test task registered (names: ``tests.apps.locked.<fn>``)."""
    settings = {
        "redlock_url": redis_url_with_db(redis_url, 0),
        "redlock_ttl": TTL,
        **conf,
    }
    app = make_app(redis_url, name="locked", **settings)

    @app.task(base=LockedTask, bind=True, shared=False, lock_args=("resource",))
    def hold(self, resource, path=None, label="", seconds=0.0):
        """Hold ``resource`` for ``seconds``; the default policy (skip) on a busy lock."""
        return work(self, path, label, seconds)

    @app.task(
        base=LockedTask,
        shared=False,
        bind=True,
        lock_key="res:{resource}",
        lock_on_busy="retry",
        lock_retry_countdown=0.2,
        max_retries=100,
    )
    def hold_retry(self, resource, path=None, label="", seconds=0.0):
        """Retry while busy (shares the lock of hold_raise and hold_wait)."""
        return work(self, path, label, seconds)

    @app.task(
        base=LockedTask, bind=True, shared=False, lock_key="res:{resource}", lock_on_busy="raise"
    )
    def hold_raise(self, resource, path=None, label="", seconds=0.0):
        """Fail with LockBusy while busy."""
        return work(self, path, label, seconds)

    @app.task(
        base=LockedTask,
        shared=False,
        bind=True,
        lock_key="res:{resource}",
        lock_on_busy="wait",
        lock_wait_timeout=30,
    )
    def hold_wait(self, resource, path=None, label="", seconds=0.0):
        """Wait for the holder's release."""
        return work(self, path, label, seconds)

    @app.task(base=LockedTask, bind=True, shared=False, lock_args=("resource",))
    def sleeper(self, resource, seconds, path=None):
        """One long blocking sleep: the abort must interrupt it (main-thread pools)."""
        note(path, "start", "sleeper")
        time.sleep(seconds)
        note(path, "end", "sleeper")
        return "slept"

    @app.task(base=LockedTask, bind=True, shared=False, lock_args=("resource",))
    def reader(self, resource, seconds, path=None):
        """Block in a socket read that never gets data (for ``seconds`` at most)."""
        left, right = socket.socketpair()
        left.settimeout(seconds)
        note(path, "start", "reader")
        try:
            left.recv(1)
        except TimeoutError:
            pass
        finally:
            left.close()
            right.close()
        note(path, "end", "reader")
        return "read"

    @app.task(
        base=LockedTask, bind=True, shared=False, lock_args=("resource",), lock_on_lost="ignore"
    )
    def ignores_loss(self, resource, seconds, path=None):
        """Keeps running after a loss; its result must still record the loss."""
        return work(self, path, "ignores", seconds)

    @app.task(
        base=LockedTask, bind=True, shared=False, lock_args=("resource",), lock_on_lost="revoke"
    )
    def revoked_on_loss(self, resource, seconds, path=None):
        """Terminated through Celery's revoke when its lock is lost."""
        note(path, "start", "revoke")
        time.sleep(seconds)
        return "not revoked"

    @app.task(base=LockedTask, bind=True, shared=False)
    def fence_if_locked(self, resource):
        """The fence of the lock this run holds, or None when it ran without one."""
        lock = self.current_lock
        return None if lock is None else lock.fence

    @app.task(base=LockedTask, bind=True, shared=False, lock_args=("resource",))
    def outcome(self, resource, kind):
        """End with the given outcome, to check that every outcome releases the lock."""
        if kind == "fail":
            raise ValueError("failed on purpose")
        if kind == "retry":
            raise self.retry(countdown=60, max_retries=1)
        if kind == "ignore":
            raise Ignore()
        if kind == "reject":
            raise Reject("rejected on purpose", requeue=False)
        return kind

    @app.task(base=LockedTask, bind=True, shared=False, lock_args=("resource",))
    def retry_now(self, resource):
        """Retry at once the first time: the retry may arrive before the release."""
        if self.request.retries == 0:
            raise self.retry(countdown=0, max_retries=3)
        return "done"

    @app.task(base=LockedTask, bind=True, shared=False, lock_args=("resource",))
    def whoami(self, resource, retry=False):
        """What the body sees of its own request; retries once first when asked."""
        if retry and self.request.retries == 0:
            raise self.retry(countdown=0, max_retries=1)
        return {
            "id": self.request.id,
            "retries": self.request.retries,
            "called_directly": self.request.called_directly,
            "fence": self.lock.fence,
        }

    # -- the lock family ------------------------------------------------------------

    family = {"base": LockedTask, "bind": True, "shared": False, "lock_wait_timeout": 30}

    @app.task(**family, lock_key="doc:{resource}", lock_mode="shared", lock_on_busy="wait")
    def read_doc(self, resource, path=None, label="", seconds=0.0):
        """A reader: shares the document with other readers, never with a writer."""
        return work(self, path, label, seconds)

    @app.task(**family, lock_key="doc:{resource}", lock_on_busy="wait")
    def write_doc(self, resource, path=None, label="", seconds=0.0):
        """A writer of the same document: alone."""
        return work(self, path, label, seconds)

    @app.task(**family, lock_key="tenant:{resource}", lock_limit=2, lock_on_busy="wait")
    def call_api(self, resource, path=None, label="", seconds=0.0):
        """At most two calls per tenant at once."""
        return work(self, path, label, seconds)

    @app.task(**family, lock_key="tenant:{resource}", lock_limit=1)
    def one_slot(self, resource, seconds):
        """Holds the tenant's only slot (a share) for ``seconds``; skipped when taken."""
        time.sleep(seconds)
        return "done"

    @app.task(**family, lock_key=("acct:{source}", "acct:{target}"))
    def transfer(self, source, target, path=None, label="", seconds=0.0):
        """Locks both accounts, all or nothing."""
        return {**work(self, path, label, seconds), "fences": self.lock.fences}

    @app.task(**family, lock_key="acct:{account}")
    def audit(self, account, path=None, label="", seconds=0.0):
        """Locks one account: excluded by a transfer involving it."""
        return work(self, path, label, seconds)

    # -- nested runs in one thread (eager apply, errbacks run inline) -----------------

    @app.task(base=LockedTask, bind=True, shared=False, lock_args=("x",))
    def inner(self, x):
        """Locked on its own key; run eagerly from ``outer``'s body."""
        return {"x": x, "fence": self.lock.fence, "key": self.lock.key}

    @app.task(base=LockedTask, bind=True, shared=False, lock_args=("x",))
    def outer(self, x):
        """Runs ``inner`` with ``apply()`` inside its own locked body."""
        key = self.lock.key
        nested = inner.apply(args=(x,)).get(disable_sync_subtasks=False)
        # Back in the outer body: its own lock is still the one it holds.
        return {"outer_key": key, "still": self.lock.key, "inner": nested}

    @app.task(base=LockedTask, bind=True, shared=False, lock_args=("x",))
    def recurse(self, x, depth):
        """Calls itself directly (``self(...)``) inside its locked body, ``depth`` deep."""
        below = self(x, depth - 1) if depth else None
        # The lock is the outermost run's: a nested call neither checks nor releases it.
        return {"owned": self.lock.owned(), "fence": self.lock.fence, "below": below}

    @app.task(base=LockedTask, bind=True, shared=False, lock_args=("x",))
    def fail(self, x):
        """Fails; its errback runs inline when it is applied eagerly."""
        raise ValueError(x)

    @app.task(base=LockedTask, bind=True, shared=False, lock_args=())
    def on_error(self, task_id):
        """A locked errback: Celery runs it inside ``fail``'s failure handling."""
        return task_id

    @app.task(base=LockedTask, bind=True, shared=False, name=ODD_NAME, lock_args=("resource",))
    def odd_name(self, resource, seconds):
        """A task name with a newline and spaces (its lock key has them too)."""
        time.sleep(seconds)
        return "slept"

    @app.task(base=LockedTask, bind=True, shared=False)
    def anything(self, value):
        """Keyed by all arguments, to exercise values that cannot be keyed."""
        return "ran"

    return app


#: The app worker subprocesses load with ``-A tests.apps.locked``.
app = create_app()
