"""The event log: what happened to each locked run, kept on a lock node for operators.

"Why didn't my task run, why is it waiting, who holds this key, since when?" The
state (``celery redlock ls``, ``inspect``) answers for now; the event log answers for
the last hour. Each step of a locked run that changes its fate is one event, with the
node's time, the task name and id, the worker's host and pid, and what the step
decided (:data:`EVENTS`). ``celery redlock log KEY`` reads a lock's events;
``celery redlock why TASK_ID`` tells a task id's story from them
(:mod:`celery_redlock.ops.events`).

Where events live (``log.lua``): a list per lock, ``<prefix>{NAME}:log``, newest first,
keeping its newest :data:`EVENTS_PER_KEY` and expiring ``redlock_events_ttl`` after
its last event; and the feed of every lock under the prefix, ``<prefix>log``, keeping
the newest :data:`EVENTS_IN_FEED` (and expiring as well). So memory is bounded by the
keys used within the horizon, not by the keys ever used; a task id's events are found
in the feed, and in its keys' logs once the feed has moved on.

Written off the task's path. :func:`record` appends to this process's buffer (no
round trip, no encoding; the writer is woken when it sleeps); a thread of the process
writes the buffer in batches of up to :data:`BATCH` events, :data:`FLUSH` after the
first one, with one ``log.lua`` call on the first lock node that answers (the log is a
diagnosis, not a vote: one copy suffices, and the readers merge every node's). Each
event is stamped with that node's clock less the time it waited here, so events of
different machines sort by one clock. Lost by design: the events of a process killed
within :data:`FLUSH` of them, a batch no node took (logged at debug level), and the
oldest events past :data:`BUFFER` while no node answers. ``redlock_events = False``
turns the log off (then :func:`record` returns at its first check).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from ..base import forksafe
from ..engine import renewal
from ..engine.keys import feed_key, keys_of, lock_name_of
from ..engine.lease import Lease
from ..engine.scripts import LOG
from ..nodes import NodeSet
from . import abort
from .settings import Settings, app_settings

__all__ = [
    "BATCH",
    "BUFFER",
    "EVENTS",
    "EVENTS_IN_FEED",
    "EVENTS_PER_KEY",
    "FLUSH",
    "STARTED_LATE",
    "flush",
    "record",
]

logger = logging.getLogger("celery_redlock.events")

#: The events, by name (``e``), and what each one's fields are. Every event also has
#: ``t`` (ms since the epoch, node clock), ``k`` (the lock's name), ``task``, ``id``
#: (task id), ``host`` and ``pid``.
EVENTS: dict[str, str] = {
    "claimed": "a send took the key's send-time claim (lock_unique); its copy was published",
    "duplicate": "a send found a copy of the key queued or running and returned it "
    "(``id``: that copy; ``then``: return or raise)",
    "claim_expired": "a copy started after its send-time claim had expired",
    "acquired": "the run took its lock (``fence``; ``waited_ms``: how long it waited)",
    "started_late": "a run given a start time (a countdown or eta: a rate slot, a "
    "debounce) took its lock more than STARTED_LATE after it (``late_ms``)",
    "busy": "the run found its key held (``holder``: the holder's task id; ``then``: "
    "skip, retry, raise, wait, requeue; follows: a follow-up (lock_unique, debounce, "
    "throttle) waits for the holder; redelivered: a second delivery of the holder's "
    "own task id waits for it)",
    "deferred": "the run will start later (``reason``: rate, busy, follows, "
    "unavailable, debounce, throttle; ``in_ms``: its countdown; ``parked``: parked on a "
    "lock node, else on the queue; for rate: ``rate`` and ``place``, how many slots of "
    "the budget from now its start is)",
    "claim_freed": "the copy's send-time claim was handed back (it started, until_started; "
    "it ended, until_finished; it was revoked)",
    "released": "the run released its lock (``held_ms``)",
    "renewed_late": "the watchdog renewed the run's lease late (``lag_ms``: more than a "
    "quarter of the renewal interval after it was due: a starved process or a slow node)",
    "lost": "the run's lease was lost while it ran (``then``: abort, revoke, ignore)",
    "reaped": "the worker's main process released the lock of its dead pool process "
    "(``child``: that process's pid)",
    "not_again": "the run did not start: another delivery of its task id ran or runs",
    "leader": "a beat became (``then``: won) or stopped being (lost) the leader",
}

#: Seconds after its eta (countdown) a run may take its lock before ``started_late``.
STARTED_LATE = 1.0

#: Events kept per lock (its ``log`` list).
EVENTS_PER_KEY = 100
#: Events kept in the prefix's feed (every lock's).
EVENTS_IN_FEED = 10_000
#: Most events one ``log.lua`` call writes.
BATCH = 200
#: Seconds the writer lets events gather after the first one, before it writes them.
FLUSH = 0.1
#: Most events waiting to be written; past it the oldest are dropped.
BUFFER = 20_000

_HOST = socket.gethostname()

#: An event waiting to be written: when (monotonic), its name, its lock keys, its fields.
_Pending = tuple[float, str, tuple[str, ...], dict[str, Any]]


class _Writer:
    """The buffer and writing thread of one process for one set of lock nodes."""

    def __init__(self, nodeset: NodeSet, prefix: str, ttl: float) -> None:
        self.nodeset = nodeset
        self.feed = feed_key(prefix)
        self.prefix = prefix
        self.ttl_ms = max(1, round(ttl * 1000))
        # Encoded by the thread, not by record().
        self.buffer: deque[_Pending] = deque(maxlen=BUFFER)
        self.wake = threading.Event()
        self.idle = threading.Event()
        self.idle.set()
        self.thread: threading.Thread | None = None
        self.start_lock = threading.Lock()

    def add(
        self, event: str, keys: tuple[str, ...], fields: dict[str, Any], earlier: float = 0.0
    ) -> None:
        self.buffer.append((time.monotonic() - earlier, event, keys, fields))
        if not self.wake.is_set():
            self.wake.set()
        if self.thread is None:
            self._start()

    def _start(self) -> None:
        with self.start_lock:
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name="celery_redlock-events", daemon=True
                )
                self.thread.start()

    def _run(self) -> None:
        while True:
            self.wake.wait()
            self.idle.clear()
            time.sleep(FLUSH)  # let a burst gather: one call writes it
            self.wake.clear()
            self.write_pending()
            self.idle.set()

    def write_pending(self) -> None:
        """Write every buffered event, in batches (on this thread, or a flush's)."""
        while self.buffer:
            batch: list[_Pending] = []
            while self.buffer and len(batch) < BATCH:
                batch.append(self.buffer.popleft())
            try:
                self._write(batch)
            except Exception:  # a diagnosis must never take a worker down
                logger.debug("Writing %d lock events failed", len(batch), exc_info=True)

    def _write(self, batch: list[_Pending]) -> None:
        now = time.monotonic()
        logs: list[str] = []
        entries: list[object] = []
        for at, event, keys, fields in batch:
            ago = max(0, round((now - at) * 1000))
            name = lock_name_of(keys[0], self.prefix) if keys else ""
            text = json.dumps({"e": event, "k": name, **fields}, separators=(",", ":"))
            for key in keys:
                logs.append(keys_of(key).log)
                entries += (ago, text, EVENTS_PER_KEY, self.ttl_ms)
            logs.append(self.feed)
            entries += (ago, text, EVENTS_IN_FEED, self.ttl_ms)
        call = LOG.call(logs=logs, entries=entries)
        for index in range(len(self.nodeset.nodes)):
            requests: list[list[Any] | None] = [None] * len(self.nodeset.nodes)
            requests[index] = [call]
            reply = self.nodeset.call(requests, per_node=True)[index]
            if reply is not None and reply.ok and not isinstance(reply.values[0], Exception):
                return
        logger.debug("No lock node took %d lock events", len(batch))


_writers: dict[tuple[int, str], _Writer] = {}
_writers_lock = threading.Lock()


def _writer(nodeset: NodeSet, settings: Settings) -> _Writer:
    key = (id(nodeset), settings.key_prefix)
    writer = _writers.get(key)
    if writer is None:
        with _writers_lock:
            writer = _writers.get(key)
            if writer is None:
                writer = _writers[key] = _Writer(nodeset, settings.key_prefix, settings.events_ttl)
    return writer


def record(
    app: Any,
    nodeset: NodeSet | None,
    event: str,
    keys: Sequence[str],
    task: str | None,
    task_id: str | None,
    *,
    earlier: float = 0.0,
    **fields: Any,
) -> None:
    """Log ``event`` of the run ``task_id`` of ``task`` on the locks ``keys`` (lock keys).

    ``app``: the Celery app whose settings say whether the log is on (or its
    :class:`Settings`); ``nodeset``: the locks' nodes (None: nowhere to log).
    ``fields``: the event's own (:data:`EVENTS`). ``earlier``: how many seconds ago it
    happened, if not now (a refusal, as of its request). Returns at once: the event is
    written by this process's writer thread within :data:`FLUSH` or so.
    """
    if nodeset is None:
        return
    settings = app if isinstance(app, Settings) else app_settings(app)
    if not settings.events:
        return
    fields.update(task=task, id=task_id, host=_HOST, pid=forksafe.pid())
    _writer(nodeset, settings).add(event, tuple(keys), fields, earlier)


def flush(timeout: float = 5.0) -> bool:
    """Write this process's buffered events now; whether all were written in time.

    For a worker shutting down, and for tests that read the log right after an event.
    """
    deadline = time.monotonic() + timeout
    for writer in list(_writers.values()):
        # The writer's thread may be inside a write: wait for it, then write the rest.
        if not writer.idle.wait(max(0.0, deadline - time.monotonic())):
            return False
        writer.write_pending()
    return True


def _renewed_late(leases: Sequence[Lease], lag: float) -> None:
    """Log ``renewed_late`` for each lease of a late tick whose body runs in this process.

    Only where a run of this process logged an event on the lease's nodes already (so
    the log is on, and its writer is there): the renewer does not read settings.
    """
    for lease in leases:
        if lag <= lease.timing.renew_interval / 4:
            continue
        key = lease.keys.lock
        writer = _writers.get((id(lease.nodeset), key[: key.index("{")]))
        if writer is None:
            continue
        fields = {"task": lease.task_name, "id": abort.task_of(lease), "host": _HOST,
                  "pid": forksafe.pid(), "lag_ms": round(lag * 1000)}  # fmt: skip
        writer.add("renewed_late", (key,), fields)


renewal.LATE_HOOKS.append(_renewed_late)


@forksafe.at_fork_in_child
def _after_fork_in_child() -> None:
    # The parent's writer threads are not in the child, nor are its events the child's.
    global _writers_lock  # noqa: PLW0603
    _writers_lock = threading.Lock()
    _writers.clear()
