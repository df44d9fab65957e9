"""Who holds a lock, and whether it is stale: the workers' answers, judged.

Whether a holder still runs is asked of the workers (``inspect().active()``, then
``stats()`` of those that answered, for their pids). A lock is **stale** only when it
names a task id and its holder is proven dead: the holder's process (the host and pid
the lock records) is gone on this host; or the holder's own worker (the answering
worker on that host whose main or pool process has that pid) does not have the task
active and runs no task in that process. Anything less is **unknown**. A lock with no
task id (a lock taken with ``Redlock`` in code, the beat leader lock) is never stale.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, NoReturn

import click
from celery.exceptions import CeleryCommandException
from celery.platforms import EX_UNAVAILABLE
from kombu.exceptions import OperationalError

from .inventory import LockView, to_int

__all__ = [
    "ACTIVE",
    "NO_TASK",
    "STALE",
    "UNKNOWN",
    "Workers",
    "ask_workers",
    "classify",
    "pid_gone",
]

#: The states :func:`classify` gives a lock's holder.
ACTIVE, STALE, UNKNOWN, NO_TASK = "active", "stale", "unknown", "no-task"


@dataclass(frozen=True)
class Workers:
    """What the workers answered to ``inspect().active()`` and ``inspect().stats()``.

    ``pids`` maps each worker to its main pid followed by its pool's processes (prefork
    children; solo lists the main pid again); ``busy`` to the pids running its active
    tasks (``None`` for a task whose process is not known yet). A worker missing from
    ``pids`` answered ``active`` but not ``stats``: it cannot be named as a holder's.
    """

    answered: tuple[str, ...]
    active: dict[str, str]  # task id -> worker node name
    pids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    busy: dict[str, tuple[int | None, ...]] = field(default_factory=dict)

    def holders_worker(self, host: str, pid: int | None) -> str | None:
        """The answering worker whose process ``pid`` on ``host`` is, if any.

        The host is the one the lock recorded (``socket.gethostname()`` of the holder)
        against the host part of the worker's node name (full or short).
        """
        if pid is None or not host:
            return None
        hosts = {host, host.split(".", 1)[0]}
        for name, pids in self.pids.items():
            node_host = name.split("@", 1)[-1]
            if {node_host, node_host.split(".", 1)[0]} & hosts and pid in pids:
                return name
        return None

    def runs_tasks_in(self, name: str, pid: int) -> bool:
        """Whether worker ``name`` runs any task in process ``pid`` (or may: unknown pid).

        A holder in the worker's main process (solo, threads, gevent) shares it with
        every task of that worker, so any active task counts.
        """
        busy = self.busy.get(name, ())
        if self.pids.get(name, (None,))[0] == pid:
            return bool(busy)
        return any(p is None or p == pid for p in busy)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form: answered, active task ids, pids per worker."""
        return {
            "answered": list(self.answered),
            "active": sorted(self.active),
            "pids": {name: list(pids) for name, pids in sorted(self.pids.items())},
        }


def _remote_error(command: str, exc: Exception) -> NoReturn:
    """Raise the CLI error for a failed remote-control call (exit ``EX_UNAVAILABLE``).

    The same as ``celery.bin.base.handle_remote_command_error``, which exists only
    from Celery 5.6: importing it kept this command from loading on 5.3 to 5.5.
    """
    if isinstance(exc, click.ClickException):
        raise exc
    if isinstance(exc, OperationalError):
        message = (
            "Could not connect to the message broker. Please make sure your broker "
            "(e.g., RabbitMQ or Redis) is running and the connection settings are "
            f"correct. Reason: {exc}"
        )
    else:
        message = f"Unable to run the `{command}` command. Reason: {exc}"
    raise CeleryCommandException(message=message, exit_code=EX_UNAVAILABLE) from exc


def ask_workers(app: Any, timeout: float) -> Workers | None:
    """Ask every worker for its active tasks, then those that answered for their pids.

    Returns None when no worker answered. ``stats`` goes only to the workers that
    answered ``active`` and returns as soon as they all have, so it costs one round
    trip rather than another ``timeout``.

    Raises:
        CeleryCommandException: the broker cannot be reached (exit ``EX_UNAVAILABLE``).
    """
    try:
        replies = app.control.inspect(timeout=timeout).active()
        if not replies:
            return None
        names = sorted(replies)
        stats = app.control.inspect(names, timeout=timeout, limit=len(names)).stats() or {}
    except Exception as exc:
        _remote_error("redlock", exc)
    active: dict[str, str] = {}
    busy: dict[str, tuple[int | None, ...]] = {}
    for name, requests in replies.items():
        running = [r for r in requests or () if isinstance(r, dict) and r.get("id")]
        for request in running:
            active[request["id"]] = name
        busy[name] = tuple(to_int(r.get("worker_pid")) for r in running)
    pids: dict[str, tuple[int, ...]] = {}
    for name, info in stats.items():
        main = to_int(info.get("pid")) if isinstance(info, dict) else None
        if name not in replies or main is None:
            continue
        pool = info.get("pool") if isinstance(info.get("pool"), dict) else {}
        children = [p for p in map(to_int, pool.get("processes") or ()) if p is not None]
        pids[name] = (main, *children)
    return Workers(tuple(names), active, pids, busy)


def pid_gone(host: str, pid: int | None) -> bool:
    """Whether process ``pid`` of ``host`` is known not to exist.

    That is: ``host`` is this host and no process has that pid (a live process of
    another user still counts as alive).

    Note:
        A pid namespace (a container) that shares this host's name but not its
        processes would look gone from here: run the command where the workers run.
    """
    if pid is None or pid <= 0 or host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it exists
        return False
    return False


def classify(lock: LockView, workers: Workers | None) -> tuple[str, str]:
    """``(state, reason)`` of a lock's holder: active, stale, unknown or no-task.

    Stale needs proof that no body runs under the lock: the holder's process (its
    host and pid) is gone on this host; or the holder's own worker answered, does not
    have the task active and runs no task in the holder's process. Anything less is
    unknown: a busy solo worker cannot answer, and another worker on the same host
    says nothing about it.
    """
    task_id = lock.task_id
    if task_id is None:
        return NO_TASK, "the holder is not a task"
    if workers is not None and task_id in workers.active:
        return ACTIVE, f"task {task_id} is running on {workers.active[task_id]}"
    host = lock.fields.get("host") or ""
    pid = to_int(lock.fields.get("pid"))
    where = f"pid {pid if pid is not None else '?'} on {host or '?'}"
    if pid_gone(host, pid):
        return STALE, f"the holder's process ({where}) is gone"
    if workers is None:
        return UNKNOWN, f"no worker answered, and the holder's process ({where}) is not gone"
    worker = workers.holders_worker(host, pid)
    if worker is None:
        return UNKNOWN, f"the holder's worker ({where}) did not answer"
    if workers.runs_tasks_in(worker, pid):  # type: ignore[arg-type]
        return UNKNOWN, (
            f"the holder's worker {worker} ({where}) runs other tasks in that process, "
            "one of which may hold it"
        )
    return STALE, f"task {task_id} is not active on the holder's worker {worker} ({where})"
