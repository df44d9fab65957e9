"""``AsyncRedlock``: the same lock as :class:`~celery_redlock.Redlock`, for asyncio callers.

::

    async with AsyncRedlock("account:7", nodes=["redis://redis:6379/0"]) as lock:
        await store(page, fence=lock.fence)

Same scripts, same keys, same quorum, fences, kinds (exclusive, several resources,
shared, ``limit``, ``fair``) and release notifications: an ``AsyncRedlock`` and a
``Redlock`` (or a task with ``lock_key="account:{account_id}"``) on the same nodes
exclude each other, wake each other's waiters and share one fence sequence. What
differs is who holds it: a hold belongs to the asyncio **task** that acquired it, as
a ``Redlock`` hold belongs to a thread.

Only the calls an owner waits for are asyncio (acquire, release, extend, owned,
locked, inspect). Two parts run in the process's threads, as for ``Redlock``, on
purpose:

* **Renewal** is the process's watchdog thread. An event loop that a coroutine
  blocks (CPU-bound work, a synchronous client called by mistake) is the moment a
  lease must go on being renewed: a renewer that was a task on that loop would let
  it lapse while the code it protects runs.
* **Release notifications** come from the process's listener thread (one pub/sub
  connection per node), which wakes the waiting task in its loop.

The tasks of one loop that block on the same exclusive lock take turns
(:mod:`.turns`): one at a time asks the nodes and holds it, the others wait in the
loop without asking, where a thread would be handed the lock (:mod:`.handoff`).

A loss is reported the same way: ``check()`` raises :class:`LockLost`, and
``on_lost`` (a function, or a coroutine function) is called in the holder's event
loop. Plain masters only (``redis://``, ``rediss://``, ``unix://``): Sentinel and
Cluster nodes raise :class:`ConfigurationError` (use ``Redlock`` there).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from ..base import metrics
from ..exceptions import LockLost, NodeUnavailable
from ..nodes import Reply
from ..nodes.aio import AsyncNodeSet
from .acquisition import Core, Send, Step, Steps, agreeing, node_view, report_release
from .holds import Holds
from .keys import DEFAULT_PREFIX
from .kinds import Waiter
from .lease import Lease, clock, renew_call
from .lock import Redlock
from .scripts import INSPECT
from .timing import Timing
from .turns import release_turn, turns_of
from .vote import Attempt
from .waiting import LoopWakeup, Subscription, subscribed

__all__ = ["AsyncRedlock"]

logger = logging.getLogger("celery_redlock.lock")

OnLost = Callable[[LockLost], object] | Callable[[LockLost], Awaitable[object]]
T = TypeVar("T")


def _current_task() -> asyncio.Task[Any] | None:
    return asyncio.current_task()


async def _unless_cancelled(undo: Awaitable[T]) -> T:
    """Run ``undo`` to its end, however often the caller is cancelled meanwhile.

    An undo cut short would leave the lock to its ttl, held by nobody; ``shield``
    alone would let the call return (cancelled) while the undo still runs. The undo
    is bounded by its budget; a cancellation that came meanwhile is raised after it.
    """
    task = asyncio.ensure_future(undo)
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError as exc:
            if task.cancelled():  # the undo itself (the loop is shutting down)
                raise
            cancelled = exc
    if cancelled is not None:
        raise cancelled
    return result


class AsyncRedlock:
    """A distributed lock for asyncio: :class:`~celery_redlock.Redlock`'s, awaited.

    Takes the same arguments as ``Redlock`` (``nodes``, ``ttl``, ``mode``, ``limit``,
    ``fair``, ``key_prefix``, ``min_replicas``, ``timing``...); ``task_id`` is not
    one: the holder recorded is ``task_name`` (default ``asyncio``). ``on_lost`` may
    be a coroutine function; it runs in the holder's event loop.
    """

    def __init__(
        self,
        name: str | Sequence[str],
        *,
        nodes: Sequence[str] | str | None = None,
        ttl: float = 30.0,
        auto_renew: bool = True,
        on_lost: OnLost | None = None,
        renew_interval: float | None = None,
        node_timeout: float | None = None,
        drift_factor: float = 0.01,
        key_prefix: str = DEFAULT_PREFIX,
        min_replicas: int = 0,
        task_name: str | None = "asyncio",
        mode: str | None = None,
        limit: int | None = None,
        fair: bool = False,
        timing: Timing | None = None,
    ) -> None:
        # The sync lock validates the arguments and builds the kind, keys, timing and
        # nodes; its I/O and its holds are never used.
        sync = Redlock(
            name,
            nodes=nodes,
            ttl=ttl,
            auto_renew=auto_renew,
            renew_interval=renew_interval,
            node_timeout=node_timeout,
            drift_factor=drift_factor,
            key_prefix=key_prefix,
            min_replicas=min_replicas,
            task_name=task_name,
            mode=mode,
            limit=limit,
            fair=fair,
            timing=timing,
        )
        self._repr = repr(sync)[1:]
        self.nodeset = AsyncNodeSet(sync.nodeset)
        self.on_lost = on_lost
        self.kind, self.keys, self.timing = sync.kind, sync.keys, sync.timing
        self.names, self.name, self.quorum = sync.names, sync.name, sync.quorum
        self.mode, self.limit, self.fair = sync.mode, sync.limit, sync.fair
        self.task_name = task_name
        self.local_key = sync.local_key  # its turns in the loop (:mod:`.turns`)
        self._core = Core(
            sync.kind,
            sync.timing,
            sync.nodeset,
            min_replicas=min_replicas,
            holds=Holds(owner=_current_task, what="asyncio task"),
            task_id=None,
            task_name=task_name,
            auto_renew=auto_renew,
        )

    def __repr__(self) -> str:
        return "<Async" + self._repr

    # -- acquisition -----------------------------------------------------------

    async def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take the lock; True once held, False if ``timeout`` passed (or not blocking).

        As :meth:`Redlock.acquire`: a blocking call waits for the holder's release
        notification (or the end of its lease), and :class:`NodeUnavailable` is
        raised when too many nodes fail for any quorum. Cancelling it undoes
        whatever the nodes granted. A blocking call on an exclusive lock first waits
        for its turn among the loop's tasks (:mod:`.turns`), within ``timeout``.
        """
        if await self._reenter():
            return True
        started = clock()
        give_up = None if timeout is None or not blocking else started + timeout
        if not (blocking and self.kind.hands_over):
            return await self._acquire(blocking, started, give_up)
        turns = turns_of(self.local_key)
        turn = await turns.take(give_up)
        if turn is None:
            return False
        acquired = False
        try:
            acquired = await self._acquire(blocking, started, give_up)
        finally:
            if acquired:
                turn.lease = self._core.holds.lease()
            else:
                turns.give_back(turn)  # after the leave: the next task's try follows it
        return acquired

    async def _acquire(self, blocking: bool, started: float, give_up: float | None) -> bool:
        """:meth:`acquire`'s attempts and waits, once it is this task's turn."""
        waiter = self.kind.new_waiter(blocking, len(self.nodeset))
        subscription: Subscription | None = None
        wakeup = LoopWakeup(asyncio.get_running_loop())
        acquired = settled = False
        try:
            if blocking and subscribed(self.nodeset.nodes, self.keys.channel):
                # This process still listens to the lock's channel (it waited for it a
                # moment ago): register first, and a refusal waits at once.
                subscription = await self._subscribe(waiter, wakeup)
            while True:
                if subscription is not None and self._granted(waiter, subscription):
                    attempt = None  # granted by a release of another process
                else:
                    attempt = await self._attempt(waiter)
                if attempt is None:
                    acquired = settled = True
                    if metrics.enabled:
                        metrics.acquired(self.task_name, clock() - started)
                    if subscription is not None and self.kind.admits_others:
                        subscription.pass_on()
                    return True
                step, pause = self._core.next_step(attempt, blocking, give_up, started)
                if step is Step.UNAVAILABLE:
                    settled = not waiter.in_doubt  # else abandoned below
                    raise NodeUnavailable(self.keys.lock, attempt.errors)
                if step is Step.GIVE_UP:
                    settled = not waiter.in_doubt
                    return False
                if step is Step.WAIT and subscription is None:
                    subscription = await self._subscribe(waiter, wakeup)
                    continue  # retry once subscribed, so no release is missed
                if step is Step.WAIT and subscription is not None:
                    await subscription.wait_async(pause)
                else:
                    await asyncio.sleep(pause)
                    if step is Step.SPLIT and subscription is not None:
                        subscription.clear()  # the wake-ups our own undo caused
                    elif step is Step.SPLIT:
                        wakeup.clear()
        finally:
            if not settled:
                await _unless_cancelled(self._abandon(waiter))
            if subscription is not None:
                subscription.close()
            if blocking and not acquired:
                leave = self.kind.leave_call(waiter.token)
                if leave is not None:
                    await asyncio.shield(self.nodeset.call([leave]))

    async def _subscribe(self, waiter: Waiter, wakeup: LoopWakeup) -> Subscription:
        """Listen for the lock's releases; wait (in the loop) until one node confirms."""
        named = self.kind.wake_token(waiter)
        subscription = Subscription(
            self.nodeset.nodes,
            self.keys.channel,
            confirm_timeout=None,
            named=named,
            event=wakeup,
            quorum=1 if named is None else self.quorum,
        )
        deadline = time.monotonic() + self.timing.node_timeout
        try:
            subscription.watch()  # it waits in the loop, not in wait(): the listener reads
            while not subscription.confirmed() and time.monotonic() < deadline:
                await asyncio.sleep(0.001)  # the listener thread confirms within a round trip
        except BaseException:
            # Cancelled here: a registration left behind would be handed the wake-up of
            # the next release, which no one would use.
            subscription.close()
            raise
        return subscription

    async def try_acquire(self) -> None:
        """Take the lock now or raise :class:`LockBusy` naming the holder."""
        if await self._reenter():
            return
        started = clock()
        waiter = self.kind.new_waiter(False, len(self.nodeset))
        settled = False
        try:
            attempt = await self._attempt(waiter)
            settled = attempt is None or not waiter.in_doubt
        finally:
            if not settled:
                await _unless_cancelled(self._abandon(waiter))
        self._core.tried(attempt, started)

    async def _attempt(self, waiter: Waiter) -> Attempt | None:
        """One acquisition attempt; None when it succeeded (and the hold is recorded).

        It returns once the vote is decided; requests still running on a minority of
        nodes run on, and the undo of a failed attempt names the attempt, so it can
        arrive before them (or after the next attempt) and remove nothing it should not.
        """
        outcome = await self._drive(self._core.vote(waiter, self.nodeset))
        if isinstance(outcome, Attempt):
            return outcome
        if self._core.record(outcome, self._loss_reporter(), self) is not None:
            return None
        return await self._drive(self._core.undo(outcome.token, outcome.attempt, self.nodeset))

    def _granted(self, waiter: Waiter, subscription: Subscription) -> bool:
        """Hold the lock if releases granted it to ``waiter``'s last attempt; True if held.

        See :meth:`.acquisition.Core.hold_granted`. Else the next attempt finds the grants
        held by the waiter's token, and counts them.
        """
        if not subscription.grants:
            return False
        grants = subscription.granted(waiter.token, waiter.attempt)
        return self._core.hold_granted(waiter, grants, self._loss_reporter(), self) is not None

    async def _drive(self, steps: Steps[T]) -> T:
        """Run an acquisition's steps (:mod:`.acquisition`) with this loop's fan-outs."""
        try:
            send = next(steps)
            while True:
                send = steps.send(await self._send(send))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    async def _send(self, send: Send) -> list[Reply | None]:
        return await self.nodeset.call(
            send.calls, per_node=send.per_node, timeout=send.timeout, decided=send.decided
        )

    def _loss_reporter(self) -> Callable[[LockLost], object] | None:
        """``on_lost``, delivered in this event loop (the watchdog thread finds losses)."""
        on_lost = self.on_lost
        if on_lost is None:
            return None
        loop = asyncio.get_running_loop()

        def report(lost: LockLost) -> None:
            if inspect.iscoroutinefunction(on_lost):
                asyncio.run_coroutine_threadsafe(on_lost(lost), loop)
            else:
                loop.call_soon_threadsafe(on_lost, lost)

        return report

    async def _abandon(self, waiter: Waiter) -> None:
        """Undo an acquisition that was cancelled (or raised), wherever it stopped.

        Requests may still be on their way, on connections the undo cannot queue
        behind: ``abandon.lua`` first makes the nodes refuse the token, then the
        release frees what they granted (:meth:`.acquisition.Core.abandon_calls`).
        """
        if not self._core.end_abandoned(waiter):
            return
        try:
            await self.nodeset.call(self._core.abandon_calls(waiter))
        except Exception:  # the original exception matters more; the lease ends by itself
            self._core.undo_failed()

    async def _unlock(self, token: str) -> list[Reply | None]:
        """Release ``token`` on every node, waiting for a quorum's confirmation at most."""
        return await self._send(self._core.release(token, self.nodeset))

    async def _reenter(self) -> bool:
        """Count one more hold if this task holds the lock on a lease still valid."""
        token = self._core.reenter_or_end()
        if token is True or token is False:
            return token
        await self._unlock(token)
        return False

    # -- holding -----------------------------------------------------------------

    async def release(self) -> None:
        """Release this task's hold (its outermost release frees the lock).

        Only this acquisition's token is deleted. Raises :class:`LockNotOwned` if
        the calling task does not hold the lock. Cancelled, it still ends the hold.
        """
        hold = self._core.holds.own(self.keys.lock, "release")
        hold.count -= 1
        if hold.count:
            return
        lease = hold.lease
        lease.released = True
        try:
            replies = await _unless_cancelled(self._unlock(lease.token))
        finally:
            release_turn(self.local_key, lease)
        report_release(self._core, lease, replies)

    async def extend(self) -> float:
        """Renew the lease now; the lease left, in seconds (as :meth:`Redlock.extend`)."""
        lease = self._core.holds.own(self.keys.lock, "extend").lease
        lease.check()
        sent_at = clock()
        return lease.extended(await self.nodeset.call([renew_call([lease])]), sent_at)

    def check(self) -> None:
        """Raise :class:`LockLost` unless this task holds the lock and the lease is sure."""
        self._core.check()

    async def owned(self) -> bool:
        """True if this task holds the lock: a quorum of nodes has its token."""
        hold = self._core.holds.live()
        if hold is None:
            return False
        token = hold.lease.token
        replies = await self.nodeset.call(self.kind.owned_calls(token))
        return agreeing(replies, lambda values: self.kind.owns(values, token)) >= self.quorum

    async def locked(self) -> bool:
        """True if a quorum of nodes says the lock is held (``acquire`` would wait)."""
        replies = await self.nodeset.call(self.kind.locked_calls())
        return agreeing(replies, self.kind.held) >= self.quorum

    async def inspect(self) -> list[dict[str, Any]]:
        """Each node's view of the lock: holder fields, ``pttl`` and the fence counter."""
        replies = await self.nodeset.call([INSPECT.on(self.keys)])
        return [node_view(reply) for reply in replies]

    @property
    def lease(self) -> Lease | None:
        """The calling task's current (or last) lease on this lock."""
        return self._core.holds.lease()

    @property
    def key(self) -> str:
        """The Redis key of the lock (``<prefix>{<name>}``)."""
        return self.keys.lock

    @property
    def fence(self) -> int:
        """The fencing token of the calling task's acquisition (see ``Redlock.fence``)."""
        return self._core.fence()

    @property
    def fences(self) -> dict[str, int]:
        """Each resource's fencing token for the current acquisition, by name."""
        lease = self.lease
        return {} if lease is None else dict(zip(self.names, lease.fences, strict=True))

    def remaining(self) -> float:
        """Seconds of lease left by the local deadline; 0 when not held."""
        return self._core.remaining()

    async def __aenter__(self) -> AsyncRedlock:
        await self.acquire()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.release()
