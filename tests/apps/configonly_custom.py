"""Plain tasks on a project's own base class, locked by configuration alone.

The base class has its own ``lock(name)`` method, ``lock_key`` attribute and
``before_start`` / ``__call__`` / ``push_request`` / ``on_failure`` overrides: enabling the lock by
``redlock_tasks`` must leave every one of them working as the project wrote it.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from tests.harness.celery_workers import make_app, redis_url_with_db

#: What the project's hooks saw, in order: ``(hook, task id)``; read by the tests.
EVENTS: list[tuple[str, str]] = []


class ProjectTask(Task):
    """A project's base class, written without celery_redlock in mind."""

    #: The project's own meaning of ``lock_key``: not a celery_redlock option.
    lock_key = "project-meaning"

    def lock(self, name: str) -> str:
        """The project's own lock helper."""
        return f"project-lock:{name}"

    def before_start(self, task_id: str, args: tuple, kwargs: dict) -> None:
        EVENTS.append(("before_start", task_id))
        super().before_start(task_id, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        EVENTS.append(("__call__", self.request.id))
        return super().__call__(*args, **kwargs)

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        EVENTS.append(("push_request", dict(*args, **kwargs).get("id")))
        super().push_request(*args, **kwargs)

    def on_failure(self, exc: Exception, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        EVENTS.append(("on_failure", task_id))
        super().on_failure(exc, task_id, args, kwargs, einfo)


def create_app(redis_url: str, **conf: Any) -> Celery:
    """An app whose tasks use ``ProjectTask`` and are locked by ``redlock_tasks`` only.

    ``conf`` overrides the defaults (``redlock_tasks`` too).
    """
    settings = {
        "imports": ["celery_redlock"],
        "redlock_url": redis_url_with_db(redis_url, 0),
        "redlock_ttl": 1.0,
        "redlock_tasks": {
            "custom.sync": {"args": ["account_id"]},
            "custom.explode": {},
            "custom.outer": {},
        },
        **conf,
    }
    app = make_app(redis_url, name="custom", **settings)

    @app.task(base=ProjectTask, bind=True, shared=False, name="custom.sync")
    def sync(self, account_id, seconds=0.0):
        """Uses the project's own ``self.lock`` and ``self.lock_key``."""
        import time

        from celery_redlock.integration.task import held_lock

        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.02)
        held = held_lock(self)
        return {
            "lock": self.lock("x"),
            "lock_key": self.lock_key,
            "held": None if held is None else held.key,
        }

    @app.task(base=ProjectTask, bind=True, shared=False, name="custom.explode")
    def explode(self, account_id):
        """Fails: the project's on_failure must run."""
        raise ValueError(account_id)

    @app.task(base=ProjectTask, bind=True, shared=False, name="custom.outer")
    def outer(self, account_id):
        """Runs ``sync`` eagerly inside its own (configuration-locked) body."""
        return sync.apply(args=(account_id,)).get(disable_sync_subtasks=False)

    return app
