"""Runs that wait their turn are parked in Redis, and published once, when due.

A run refused by its rate budget (``lock_rate``), put back because its key is busy
(``lock_on_busy="requeue"``), or whose lock nodes did not answer in time when it
started, must run later. Its message is not published again with a countdown (an ETA
message, which some worker would hold unacknowledged in its memory until due, and
which a dead worker strands until the broker's ``visibility_timeout``: an hour on
Redis). Instead the run is **parked** on a lock node (:func:`park`: ``park.lua``, the
task's message and how it waits, under ``redlock:parked``) and its delivery ends,
acknowledged. Every worker's main process runs a :class:`Publisher`: a thread that
takes the runs that are due (``take_due.lua``, one call per node per tick; atomic, so
one worker takes a run) and publishes each one's copy: the same task id, arguments,
options and headers, so ``AsyncResult.get()`` and the result backend see one task.

What makes a parked run due:

* refused by its budget: its place in line (``rate.lua``). The publisher reserves the
  run's start in the budget *before* publishing it (the admission of the task, with
  its own task id, so it keeps its place), and the copy carries that start
  (:data:`MEMBER_HEADER`): its admission finds it reserved and is not refused again.
  A run that waits for nothing else is taken :data:`AHEAD` of its slot: its start is
  reserved at the slot and its copy published with a countdown to it (a newcomer,
  such as a :class:`~celery_redlock.RateLimit` drawing on the budget, is placed after
  the reserved starts). A run whose slot is gone (its budget is full past
  :data:`AHEAD`) is parked again, without going through the broker.
* put back because its key was busy: its key's release. It waits in its key's line
  (so does a rate run that must also find its key free), in order of due time,
  and a line's first run is taken only while the lock is free (no holder; fewer
  holders than ``lock_limit``) and no other run of the line was just handed it (a
  short hand-off mark), so one run per release goes through the broker, not every
  waiting one. A take reads the first run of each line, not every run waiting: a
  backlog of runs for one held key costs a take one look.
* its nodes did not answer: a backoff
  (:data:`~celery_redlock.integration.policies.UNAVAILABLE_BUDGET` bounds how long a run
  is put back so).

Crashes. A take holds the run under a lease (:data:`LEASE`): a worker that dies after
taking a run and before its copy starts leaves it due again when the lease ends, and
another worker publishes it. So a copy may be published twice (its first worker died
holding it, or it waited in a busy queue longer than the lease); exactly one copy
starts: the copy's last step before its body (:func:`claim_start`, ``unpark.lua``)
removes the run from the parked runs, and a copy that finds the run gone under its
token does not run. A message the broker gives again after its worker died (``acks_late``)
whose run is parked meanwhile does not run either: its parked copy will.

What is not covered: a lock node restarted without persistence loses the runs parked
on it, as it loses its locks (``doctor`` warns of such nodes); parking needs one node or
Redlock masters, not a Redis Cluster (the due set is one key for every lock): there,
and whenever no node takes the run, it goes back on the queue with a countdown as
before (:func:`celery_redlock.integration.policies.put_back`).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import secrets
import threading
from dataclasses import dataclass
from typing import Any

from celery import Celery, Task
from celery.result import denied_join_result
from kombu.exceptions import ChannelError
from kombu.serialization import dumps, loads, prepare_accept_content
from redis.exceptions import ResponseError

from ..base import forksafe
from ..engine.keys import handed_key, keys_of, line_key, parked_keys
from ..engine.rate import Budget, judge, rate_calls, return_calls
from ..engine.scripts import PARK, TAKE_DUE, UNPARK, UnparkStatus
from ..nodes import Call, NodeSet, Reply

__all__ = [
    "AHEAD",
    "LEASE",
    "MAYBE_HEADER",
    "MEMBER_HEADER",
    "PARKED_HEADER",
    "Parking",
    "Publisher",
    "Spot",
    "can_park",
    "claim_start",
    "line_of",
    "park",
    "spot",
    "start_publisher",
    "stop_publisher",
]

logger = logging.getLogger("celery_redlock.task")

#: Header of a parked run's copy: the token of its parking (its copies share it).
PARKED_HEADER = "redlock_parked"

#: Header of a copy put back on the queue after a parking whose reply did not come back:
#: that parking's token (the node may keep the run; of the two copies, the first to
#: start runs). Not :data:`PARKED_HEADER`: no record is known to bring this copy back.
MAYBE_HEADER = "redlock_parked_maybe"

#: Header of a parked rate run's copy: the member of the start its publisher reserved for
#: it in the budget (its admission finds it reserved: the copy owns its slot).
MEMBER_HEADER = "redlock_rate_member"

#: Seconds before its slot a rate run that waits for nothing else is taken: its start is
#: reserved in its budget and its copy published with a countdown to it, so that the
#: copy waits at a worker when the slot comes (a window's runs come due together, and
#: publishing them one after the other takes a while: about 0.2 s for 50 on a 2-core
#: machine, which would otherwise delay each window by that much). At most half the
#: shortest window (1 s), so that a copy a little late still finds room to start then.
AHEAD = 0.5

#: Messages on its queue above which a rate run's copy is not published: it would wait
#: behind them past its slot, and leave the slot unused (a backlog sent at once: its
#: runs, still on the queue, take the budget's slots meanwhile, and are parked in turn).
#: The run is looked at again :data:`RECHECK_DEEP` later, for at most :data:`HOLD`
#: seconds: longer than a backlog's first deliveries take to leave the queue (1,000 on
#: two 2-process workers of a 2-core machine: about 11 s; held 10 s, the runs published
#: behind the rest came late, gave their reservations up and were parked again: 1.15x
#: the ideal drain instead of 1.04x), and a bound on how long a queue that stays deep
#: (other tasks) delays a run's publication.
DEEP = 50
RECHECK_DEEP = 0.25
HOLD = 30.0

#: Seconds a worker that took a due run has to get its copy started; after that the run
#: is due again and any worker publishes it. The bound on how late a dead worker makes
#: a parked run: its slot (or release) + LEASE + a tick.
LEASE = 10.0

#: Seconds a parked run nobody takes is kept after it was due (no worker ran at all).
LIFETIME = 86400.0

#: Seconds between two looks at a run whose key is still held, at least: a quarter of
#: how long the lock has been held (since its acquisition or last renewal), up to
#: :data:`IDLE`. A short hold (a rate run's body) is seen to end within a few ms, so a
#: key's runs follow each other about as fast as the broker carries them; a long hold
#: is looked at a few dozen times per renewal, not every few ms.
RECHECK = 0.005

#: Seconds a run published for its key's release has to start before the next one
#: waiting for that key may be published.
HANDOFF = 2.0

#: Seconds between the publisher's takes while runs are due or about to be; and at
#: most, when none is.
TICK = 0.005
IDLE = 0.25

#: Most runs one take returns (a bound on one script call's work).
BATCH = 64


@dataclass(frozen=True)
class Spot:
    """Where and how a run waits: its nodes, and what besides its time makes it due.

    ``lock``: the run's lock key (``<prefix>{NAME}``). ``kind``: ``"rate"`` (the
    publisher admits it in ``budget`` first), ``"busy"`` (taken only while the lock is
    free: ``check`` the lock key of an exclusive lock, or ``shared`` and ``limit`` for a
    limit of holders; one run at a time per key), or ``"later"`` (its time only).
    """

    nodeset: NodeSet
    kind: str
    lock: str
    budget: Budget | None = None
    check: str | None = None
    shared: str | None = None
    limit: int | None = None

    @property
    def prefix(self) -> str:
        """The key prefix of the run's lock (a prefix has no braces)."""
        return self.lock[: self.lock.index("{")]

    def record(self) -> dict[str, Any]:
        """What ``take_due.lua`` and the publisher read of the run (JSON-ready)."""
        record: dict[str, Any] = {"kind": self.kind, "lock": self.lock}
        if self.kind == "rate" and self.budget is not None:
            record.update(rate=self.budget.limit, window=self.budget.window)
        if self.kind == "busy" or self.check is not None or self.shared is not None:
            # It waits in its key's line, taken only while the key is free, one run at a
            # time: runs published together would find each other holding it (a rate
            # run of an exclusive lock too: N of them come due at one window's end).
            record["gate"] = self.gate
            if self.shared is not None:
                record.update(shared=self.shared, limit=self.limit or 1)
            elif self.check is not None:
                record["check"] = self.check
        return record

    @property
    def gate(self) -> str:
        """The hand-off mark of the run's lock."""
        return self.line[0]

    @property
    def line(self) -> tuple[str, str]:
        """The hand-off mark and the line of the run's lock (``park.lua``'s ``line*``)."""
        return line_of(self.lock)


def line_of(lock: str) -> tuple[str, str]:
    """The hand-off mark and the line of the lock ``lock``: where its runs wait for it."""
    keys = keys_of(lock)
    return handed_key(keys), line_key(keys)


def spot(
    nodeset: NodeSet, kind: str, lock: str, options: Any, *, budget: Budget | None = None
) -> Spot:
    """The :class:`Spot` of a run of a task with lock ``options`` (mode, limit).

    What says its key is free: ``lock_limit``, fewer holders than the limit; else no
    holder of the lock key (an exclusive holder, for a shared run put back as busy). A
    rate run of ``lock_mode="shared"`` without a limit waits for nothing but its slot.
    """
    keys = keys_of(lock)
    if options.limit is not None:
        return Spot(nodeset, kind, lock, budget, shared=keys.shared, limit=options.limit)
    if kind == "rate" and options.mode == "shared":
        return Spot(nodeset, kind, lock, budget)
    return Spot(nodeset, kind, lock, budget, check=keys.lock)


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))


@dataclass(frozen=True)
class Parking:
    """What became of a parking: its token, and whether a node kept it.

    ``parked``: a node answered that it keeps the run; ``maybe``: a node's reply did
    not come back (it may keep it).
    """

    value: str
    parked: bool
    maybe: bool


def can_park(nodeset: NodeSet) -> bool:
    """Whether runs can be parked on ``nodeset``: no Redis Cluster among its nodes.

    The parked runs of every lock are a few keys (the due set is one sorted set), which
    a cluster would spread over several slots; there runs go back on the queue.
    """
    return not any(node.slotted for node in nodeset.nodes)


def park(
    task: Task,
    delay: float,
    headers: dict[str, Any],
    spot: Spot,
    *,
    args: Any = None,
    kwargs: Any = None,
) -> Parking:
    """Park the running delivery's run for ``delay`` seconds (see :class:`Parking`).

    The copy is the delivery's message (same task id, arguments, options, retries) with
    ``headers`` merged into its own and a fresh token (:data:`PARKED_HEADER`);
    ``args``/``kwargs`` replace its arguments when given (a debounced copy runs with the
    last call's). Tried on each node in turn: a run needs one place to wait, and the
    first node that answers keeps it (every publisher takes from every node).
    """
    token = secrets.token_hex(8)
    if not can_park(spot.nodeset):
        return Parking(token, parked=False, maybe=False)
    signature = task.signature_from_request(task.request, args=args, kwargs=kwargs)
    signature.set(
        headers={
            **(signature.options.get("headers") or {}),
            **headers,
            PARKED_HEADER: token,
            MAYBE_HEADER: None,
            MEMBER_HEADER: None,
        }
    )
    content_type, encoding, body = dumps(  # type: ignore[no-untyped-call]
        dict(signature), serializer=task.serializer
    )
    raw = body if isinstance(body, bytes) else body.encode(encoding or "utf-8")
    record = {
        **spot.record(),
        "token": token,
        "task": task.name,
        "type": content_type,
        "encoding": encoding,
        "body": base64.b64encode(raw).decode("ascii"),
    }
    keys = parked_keys(spot.prefix)
    call = PARK.call(
        due=keys.due, runs=keys.runs, taken=keys.taken, lines=keys.lines, line=spot.line,
        task_id=task.request.id, run=json.dumps(record), delay_ms=_ms(delay),
        lifetime_ms=_ms(LIFETIME),
    )  # fmt: skip
    index, maybe = _first_node(spot.nodeset, call)
    return Parking(token, index is not None, maybe)


def _first_node(nodeset: NodeSet, call: Call) -> tuple[int | None, bool]:
    """Send ``call`` to one node after the other until one answers 1: its index.

    And whether a node that gave no reply may have run it.
    """
    maybe = False
    for index in range(len(nodeset.nodes)):
        reply = _call_on(nodeset, index, call)
        value = None if reply is None or not reply.ok else reply.values[0]
        if isinstance(value, ResponseError):
            logger.debug("Parking on %s failed: %s", reply.node.safe_url if reply else "?", value)
        elif value == 1:
            return index, maybe
        else:
            maybe = True
    return None, maybe


def _call_on(nodeset: NodeSet, index: int, call: Call) -> Reply | None:
    """Send ``call`` to the node ``index`` of ``nodeset`` alone: its reply."""
    requests: list[list[Call] | None] = [None] * len(nodeset.nodes)
    requests[index] = [call]
    return nodeset.call(requests, per_node=True)[index]


def claim_start(
    nodeset: NodeSet, prefix: str, task_id: str, token: str, lock: str | None, horizon: float
) -> bool:
    """Whether this delivery may start its body: no other copy of its run started.

    ``token``: the copy's :data:`PARKED_HEADER` or :data:`MAYBE_HEADER` (``""`` for a
    message the broker gave again after its worker died: it may not run while its run
    is parked); ``lock``: its lock key (the run may wait in that lock's line). The run
    leaves the parked runs. A node that does not answer counts as no record: the run
    starts (at least once, rather than never).
    """
    keys = parked_keys(prefix)
    call = UNPARK.call(
        due=keys.due, runs=keys.runs, taken=keys.taken, started=keys.started,
        lines=keys.lines, line=line_of(lock) if lock else (), task_id=task_id, token=token,
        horizon_ms=_ms(horizon),
        member=f"{task_id}:{token}" if token else "",
    )  # fmt: skip
    for reply in nodeset.call([call]):
        value = None if reply is None or not reply.ok else reply.values[0]
        if value == UnparkStatus.DUPLICATE:
            return False
    return True


class Publisher:
    """The thread of a worker's main process that publishes the parked runs when due.

    One per worker (prefork: in the main process, not in each child). It sleeps until
    the earliest run parked is due (at most :data:`IDLE`, so that a run parked by
    another worker is seen), and makes one ``take_due.lua`` call per node per tick.
    """

    def __init__(self, app: Celery, nodeset: NodeSet, prefix: str) -> None:
        self.app = app
        self.nodeset = nodeset
        self.keys = parked_keys(prefix)
        # As the worker reads messages: only the content types the app accepts.
        self.accept = prepare_accept_content(  # type: ignore[no-untyped-call]
            app.conf.accept_content
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The thread's own broker connection, producer and channel for queue depths,
        # kept: a producer from Celery's pool costs new broker connections per copy
        # (its channel is closed at each release), about 20 ms on a busy machine: more
        # than a run's turn at 50/s.
        self._connection: Any = None
        self._producer: Any = None
        self._channel: Any = None
        #: Copies published (for tests and benchmarks: counts, never timing).
        self.published = 0

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="celery_redlock-publisher", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread; a take in flight finishes (its runs are published)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._disconnect()

    def _broker(self) -> Any:
        """The thread's producer, on its own broker connection (made on first use)."""
        if self._producer is None:
            self._connection = self.app.connection_for_write()
            self._producer = self._connection.Producer()
        return self._producer

    def _disconnect(self) -> None:
        """Drop the broker connection (after a failure: the next copy makes another)."""
        connection = self._connection
        self._connection = self._producer = self._channel = None
        if connection is not None:
            try:
                connection.release()
            except Exception:  # it is gone either way
                logger.debug("celery_redlock: closing the publisher's connection", exc_info=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pause = self.tick()
            except Exception:  # never end the thread: the runs would wait for another worker
                logger.exception("celery_redlock: publishing parked runs failed")
                pause = IDLE
            self._stop.wait(pause)

    def tick(self) -> float:
        """Take and publish the runs due on every node; seconds until the next look."""
        call = TAKE_DUE.call(
            due=self.keys.due, runs=self.keys.runs, taken=self.keys.taken, lines=self.keys.lines,
            most=BATCH, lease_ms=_ms(LEASE), recheck_ms=_ms(RECHECK), handoff_ms=_ms(HANDOFF),
            ahead_ms=_ms(AHEAD), longest_ms=_ms(IDLE),
        )  # fmt: skip
        pause = IDLE
        for index, reply in enumerate(self.nodeset.call([call])):
            value = None if reply is None or not reply.ok else reply.values[0]
            if not isinstance(value, list):
                continue
            next_ms, rest = int(value[0]), value[1:]
            depths: dict[str, int] = {}
            for at in range(0, len(rest) - 3, 4):
                task_id, text, taken, due_ms = rest[at : at + 4]
                self._publish(
                    index, str(task_id), str(text), int(taken), int(due_ms) / 1000, depths
                )
            if len(rest) // 4 >= BATCH:
                pause = 0.0  # more are due
            elif next_ms >= 0:
                pause = min(pause, max(TICK, next_ms / 1000))
        return pause

    def _publish(
        self, index: int, task_id: str, text: str, taken: int, due_in: float, depths: dict[str, int]
    ) -> None:
        """Publish one taken run, due in ``due_in`` seconds; or park it again.

        A rate run's start is reserved in its budget first, and its copy published with
        a countdown to it; unless its queue is deep (``depths``: messages per queue,
        filled as asked), and it was held so less than :data:`HOLD`.
        """
        try:
            record = json.loads(text)
            raw = base64.b64decode(record["body"])
            encoding = record.get("encoding")
            body = raw if encoding == "binary" else raw.decode(encoding or "utf-8")
            fields = loads(  # type: ignore[no-untyped-call]
                body, record["type"], encoding, accept=self.accept
            )
            signature = self.app.signature(fields)
            if record.get("kind") == "rate":
                queue = self._queue_of(signature)
                if queue not in depths:
                    depths[queue] = self._depth(queue)
                if depths[queue] > DEEP and taken * RECHECK_DEEP < HOLD:
                    self._again(index, task_id, record, RECHECK_DEEP)
                    return
                member, countdown = self._admit(task_id, record, due_in)
                if member is None:
                    self._again(index, task_id, record, countdown)
                    return
                headers = {**(signature.options.get("headers") or {}), MEMBER_HEADER: member}
                signature.set(headers=headers)
                if countdown > 0:
                    signature.set(countdown=countdown)
            # Nobody here waits for its result: without this, a prefork worker's main
            # process (where joins are allowed) would subscribe its result backend to
            # every copy it publishes, for ever, and a pool child forked while this
            # thread was subscribing inherited the subscription's lock held, and hung.
            with denied_join_result():
                signature.apply_async(add_to_parent=False, producer=self._broker())
            self.published += 1
            logger.info("Task %s[%s] published: its turn came", record.get("task"), task_id)
        except Exception:
            # The broker or a node failed: its lease ends and a worker publishes it then.
            logger.exception("celery_redlock: publishing parked run %s failed", task_id)
            self._disconnect()

    def _queue_of(self, signature: Any) -> str:
        """The queue a copy goes to: as the delivery it copies was routed."""
        options = signature.options
        return str(
            options.get("queue") or options.get("routing_key") or self.app.conf.task_default_queue
        )

    def _depth(self, queue: str) -> int:
        """Messages waiting on ``queue`` for a worker to take them (0 if none or unknown).

        A passive declare, which kombu answers for its transports (for Redis, the
        length of the queue's lists); a queue the broker does not know holds none.
        """
        try:
            if self._channel is None:
                self._channel = self._broker().connection.channel()
            return int(self._channel.queue_declare(queue=queue, passive=True).message_count)
        except Exception as exc:
            # No such queue (kombu's Redis transport: its channel stays open; AMQP closes
            # it), or the broker is gone: a closed channel is made again next time.
            channel = self._channel
            if not isinstance(exc, ChannelError) or not _is_open(channel):
                self._channel = None
                try:
                    if channel is not None:
                        channel.close()
                except Exception:
                    logger.debug("celery_redlock: closing a channel", exc_info=True)
            return 0

    def _admit(
        self, task_id: str, record: dict[str, Any], due_in: float
    ) -> tuple[str | None, float]:
        """Reserve the run's start in its budget: (member, seconds until the start).

        Or (None, seconds until it may start) if its budget has no slot for it. A run
        taken ahead (``due_in`` > 0) takes the first slot from its due time to
        :data:`AHEAD` from now; one taken when due, a slot now.
        """
        keys = keys_of(record["lock"])
        budget = Budget(int(record["rate"]), float(record["window"]))
        member = secrets.token_hex(8)
        at = min(due_in, budget.window)
        ahead = min(max(at, AHEAD), budget.window) if due_in > 0 else 0.0
        call = rate_calls(keys, budget, member, task_id=task_id, at=at, ahead=ahead)
        verdict = judge(self.nodeset.call([call]), self.nodeset.quorum)
        if verdict.admitted:
            return member, verdict.start
        if any(verdict.undo):
            self.nodeset.call(return_calls(keys, member, verdict.undo), per_node=True)
        return None, 1.0 if verdict.wait == math.inf else verdict.wait

    def _again(self, index: int, task_id: str, record: dict[str, Any], delay: float) -> None:
        """Park a taken run again on its node, ``delay`` seconds on (its record kept).

        Its hand-off mark, if it holds it, is cleared: the next run may go.
        """
        call = PARK.call(
            due=self.keys.due, runs=self.keys.runs, taken=self.keys.taken, lines=self.keys.lines,
            line=line_of(record["lock"]), task_id=task_id, run="", delay_ms=_ms(delay),
            lifetime_ms=_ms(LIFETIME),
        )  # fmt: skip
        _call_on(self.nodeset, index, call)


def _is_open(channel: Any) -> bool:
    """Whether a kombu channel is still usable (py-amqp's ``is_open``, virtual ``closed``)."""
    return channel is not None and bool(
        getattr(channel, "is_open", not getattr(channel, "closed", False))
    )


_publishers: dict[int, Publisher] = {}
_publishers_lock = threading.Lock()


def start_publisher(app: Celery, nodeset: NodeSet, prefix: str) -> Publisher:
    """Start ``app``'s publisher in this process (one per app and process)."""
    with _publishers_lock:
        publisher = _publishers.get(id(app))
        if publisher is None:
            publisher = _publishers[id(app)] = Publisher(app, nodeset, prefix)
        publisher.start()
        return publisher


def stop_publisher(app: Celery) -> None:
    """Stop ``app``'s publisher in this process, if it runs."""
    with _publishers_lock:
        publisher = _publishers.pop(id(app), None)
    if publisher is not None:
        publisher.stop()


@forksafe.at_fork_in_child
def _after_fork_in_child() -> None:
    # A pool child publishes nothing (its parent's publisher does); its thread is gone.
    global _publishers_lock  # noqa: PLW0603
    _publishers_lock = threading.Lock()
    _publishers.clear()
