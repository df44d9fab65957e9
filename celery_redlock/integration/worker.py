"""Wiring into the Celery worker: a bootstep and a few signal receivers.

Importing :mod:`celery_redlock` connects the receivers below (cheaply: no sockets).
That happens before the worker builds its blueprint both for apps that use
``LockedTask`` (the task modules import it) and for configuration-only setups
(``imports = ["celery_redlock", ...]``), so ``worker_init`` can add
:class:`RedlockStep` to the worker's blueprint.

Receivers never decide whether work happens (Celery swallows their exceptions);
the bootstep does: invalid settings raise :class:`~celery_redlock.ConfigurationError`
from it, and the worker does not start.

============================  ==================================================
``worker_init``               add :class:`RedlockStep` to the app's worker steps
``RedlockStep.__init__``      validate settings and every locked task's options;
                              lock the ``redlock_tasks`` of configuration-only
                              setups; prefork: open the pipe children report on
``RedlockStep.start``         start the renewer (solo, threads) or the reaper
                              that releases a dead child's locks (prefork), and
                              the publisher of parked runs (``parking``)
``worker_process_init``       in each prefork child: start its own renewer, and
                              a watch that ends the child if its main process dies
``worker_process_shutdown``   in each prefork child: tell the main process what
                              it released since its last lock
``task_postrun``              release the execution's lock if the body's end
                              did not (it never started, or an exception cut
                              that release short); free the copy's send-time
                              claim (``lock_unique``)
``task_received``             a busy run's copy waiting in this worker's timer:
                              start it when its key is released (``wakeups``)
``task_revoked``              free a revoked or expired copy's send-time claim
``beat_init``                 validate as a worker does (any scheduler; a bad option
                              stops beat: ``SystemExit``, as Celery swallows a
                              receiver's exceptions) and lock the ``redlock_tasks``
                              of configuration-only setups, so that what beat sends
                              is deduplicated
============================  ==================================================
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial
from typing import Any

from celery import bootsteps, signals
from celery.concurrency.prefork import TaskPool as PreforkPool

from ..base import metrics
from ..engine.renewal import get_renewer
from ..engine.threads import start_daemon
from ..exceptions import ConfigurationError
from ..nodes import NodeSet, safe_url
from . import config_only, declared, events, parking, reaper, unique, wakeups
from .beat import check_configuration
from .reaper import Reaper
from .settings import TASK_OPTIONS
from .task import LockedTask, app_settings, config_overrides, lock_options, release_lock, run_ended

__all__ = ["RedlockStep", "install"]

#: The remote-control commands a worker answers (registered with Celery as their module
#: is imported, with the worker's bootstep): ``redlock_options`` (``doctor`` asks it).
INSPECT_COMMANDS = (declared.redlock_options,)

logger = logging.getLogger("celery_redlock.worker")

_reaper: Reaper | None = None


class RedlockStep(bootsteps.StartStopStep):
    """Validates the lock configuration and runs the per-worker lock machinery."""

    label = "Redlock"
    requires = ("celery.worker.components:Hub",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        global _reaper  # noqa: PLW0603
        super().__init__(worker, **kwargs)
        app = worker.app
        settings = app_settings(app)  # raises ConfigurationError: the worker stops
        if settings.metrics:
            metrics.enable()
        self.metrics_port = settings.metrics_port if settings.metrics else None
        config_only.apply(app, settings)
        locked = [task for task in app.tasks.values() if isinstance(task, LockedTask)]
        for task in locked:
            lock_options(task)
            for name, (code, config) in config_overrides(task).items():
                logger.info(
                    "celery_redlock: task %s: %s sets %s=%r over the code's %s=%r",
                    task.name,
                    getattr(type(task), "_redlock_source", "redlock_tasks"),
                    name,
                    config,
                    TASK_OPTIONS[name].attribute,
                    code,
                )
        self.prefork = _is_prefork(worker)
        self.reaper = None
        self.nodeset = None
        if locked:
            self.nodeset = NodeSet.get(settings.node_urls(), timeout=settings.timing.node_timeout)
        if self.nodeset is not None and self.prefork:
            self.reaper = _reaper = Reaper(self.nodeset, settings)
        self.app, self.prefix = app, settings.key_prefix
        logger.info(
            "celery_redlock: %d locked task(s) on %s",
            len(locked),
            ", ".join(n for n in _safe_urls(settings)),
        )

    def start(self, worker: Any) -> None:
        """Start the reaper (prefork) or this process's renewer (solo, threads)."""
        if self.metrics_port is not None:
            metrics.serve(self.metrics_port)
        if self.reaper is not None:
            self.reaper.start()
        if not self.prefork:
            get_renewer().start()
        if self.nodeset is not None and parking.can_park(self.nodeset):
            # Every worker publishes the parked runs that come due, whichever parked them.
            parking.start_publisher(self.app, self.nodeset, self.prefix)

    def stop(self, worker: Any) -> None:
        """Stop watching pool children, publishing parked runs, listening for releases."""
        if self.reaper is not None:
            self.reaper.stop()
        parking.stop_publisher(self.app)
        wakeups.stop()
        events.flush(2.0)

    shutdown = stop


def _is_prefork(worker: Any) -> bool:
    pool_cls = getattr(worker, "pool_cls", None)
    return isinstance(pool_cls, type) and issubclass(pool_cls, PreforkPool)


def _safe_urls(settings: Any) -> list[str]:
    try:
        return [safe_url(url) for url in settings.node_urls()]
    except Exception as exc:  # no node configured: the step reports it elsewhere
        return [str(exc)]


def install(app: Any) -> None:
    """Add :class:`RedlockStep` to ``app``'s worker blueprint (idempotent)."""
    steps = app.steps["worker"]
    if RedlockStep not in steps:
        steps.add(RedlockStep)


@signals.worker_init.connect(dispatch_uid="celery_redlock.worker_init")
def _on_worker_init(sender: Any = None, **kwargs: Any) -> None:
    install(sender.app)


@signals.beat_init.connect(dispatch_uid="celery_redlock.beat_init")
def _on_beat_init(sender: Any = None, **kwargs: Any) -> None:
    try:
        check_configuration(sender.app)
    except ConfigurationError as exc:
        # Any beat, Celery's own scheduler too: it would send tasks no worker runs.
        # Celery logs and swallows a receiver's exceptions; SystemExit stops beat
        # before its first tick.
        logger.critical("celery_redlock: beat cannot start: %s", exc)
        raise SystemExit(f"celery_redlock: {exc}") from exc


@signals.worker_process_init.connect(dispatch_uid="celery_redlock.worker_process_init")
def _on_worker_process_init(**kwargs: Any) -> None:
    if _reaper is not None:
        _reaper.child_init()
    get_renewer().start()
    if _reaper is not None:
        # A prefork child. (The solo pool sends this signal in the worker's own process,
        # whose parent is a shell or a supervisor: it must outlive them.)
        start_daemon(partial(_exit_when_orphaned, os.getppid()), "celery_redlock-orphan-watch")


#: Seconds between a pool child's looks at whether its worker's main process lives.
ORPHAN_CHECK = 1.0


def _exit_when_orphaned(parent: int) -> None:
    """End this pool child once its worker's main process is gone (SIGKILL, OOM).

    Celery asks the kernel to kill pool children with their main process
    (``PR_SET_PDEATHSIG``, Linux only). Where that does not happen, billiard does not
    stop a child whose parent died: it waits on its task pipe, whose write end its
    siblings still hold, and its renewer would go on renewing the lock of the run it
    had, where a whole dead worker's locks must end within one lease. Its results could
    not be reported anyway. The lease it held then ends by its TTL.
    """
    while os.getppid() == parent:
        time.sleep(ORPHAN_CHECK)
    logger.critical("celery_redlock: the worker's main process %d is gone; exiting", parent)
    os._exit(70)  # EX_SOFTWARE; no cleanup that could wait on the dead parent


@signals.worker_process_shutdown.connect(dispatch_uid="celery_redlock.worker_process_shutdown")
def _on_worker_process_shutdown(**kwargs: Any) -> None:
    reaper.flush()  # the releases not announced yet: the main process need not check them
    events.flush(1.0)


@signals.task_postrun.connect(dispatch_uid="celery_redlock.task_postrun")
def _on_task_postrun(
    task: Any = None,
    task_id: str | None = None,
    args: Any = None,
    kwargs: Any = None,
    state: str | None = None,
    retval: Any = None,
    **ignored: Any,
) -> None:
    try:
        release_lock(task, task_id)
    finally:
        run_ended(task_id)
        if isinstance(task, LockedTask) and task_id:
            unique.ended(
                task,
                lock_options(task),
                app_settings(task.app),
                task_id,
                tuple(args or ()),
                dict(kwargs or {}),
                state,
                retval,
            )


@signals.task_received.connect(dispatch_uid="celery_redlock.task_received")
def _on_task_received(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    if sender is not None and request is not None:
        wakeups.on_task_received(sender, request)


@signals.task_revoked.connect(dispatch_uid="celery_redlock.task_revoked")
def _on_task_revoked(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    if isinstance(sender, LockedTask) and request is not None:
        unique.revoked(sender, lock_options(sender), app_settings(sender.app), request)
