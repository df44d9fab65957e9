"""The nodes of a lock for asyncio callers: :class:`AsyncNodeSet`.

The same rules as :func:`~celery_redlock.nodes.fan_out`: every node's request goes
out at once, one budget bounds the whole fan-out (the time the event loop was stalled
not counted: :func:`_wait_budget`), a node that fails or does not answer in time
becomes a :class:`Reply` with its ``error`` (a vote that did not come), and nothing is
retried behind the caller's back. Scripts run by EVALSHA and
are loaded (``SCRIPT LOAD``) only when a node answers NOSCRIPT.

Connections are ``redis.asyncio`` pools, one per node URL and event loop (an
asyncio connection belongs to the loop that opened it), shared by every lock object
of that loop. Only plain masters
(``redis://``, ``rediss://``, ``unix://``): Sentinel and Cluster URLs are refused
with a :class:`~celery_redlock.ConfigurationError`.

As the threaded fan-out, it returns once the caller's ``decided`` says the outcome is
known (a quorum granted or refused): a minority of slow nodes does not set the pace.
A request left running is never interrupted (below); unlike the threaded fan-out's, it
keeps its connection to itself, so the caller's next request to that node may arrive
first. The lock's scripts make that harmless: an attempt's undo names its attempt,
and removes nothing a later one wrote.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection as AsyncConnection
from redis.asyncio.retry import Retry
from redis.exceptions import NoScriptError, RedisError

from ..exceptions import ConfigurationError
from .calls import Call, LockNode, Reply
from .nodeset import NodeSet
from .sentinel import is_sentinel_url
from .urls import connection_options, safe_url

__all__ = ["AsyncNodeSet", "aclose_loop_clients"]

#: Failures of one node's request that make it a missing vote, not a crash.
_NODE_FAILURES = (RedisError, OSError, asyncio.TimeoutError)


#: The least time an asyncio connection gives a connect or a reply (s). Not the node
#: timeout: that is the fan-out's budget (:func:`_wait_budget`). A connection's
#: timeouts are loop timers too, and one that a stalled loop reaches late throws away
#: a reply already in the socket; past the budget they only bound how long a request
#: left in flight keeps its connection.
_CONNECTION_TIMEOUT = 2.0


class _LoopClients:
    """One event loop's clients, one per node URL, shared by every lock in that loop.

    Locks are cheap objects made per request (a web view); their connections are not:
    a pool per lock object would open connections per request and keep them until the
    loop ends.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.by_url: dict[str, aioredis.Redis] = {}
        self.keeper = loop.create_task(self._close_at_shutdown())

    def client(self, node: LockNode) -> aioredis.Redis:
        client = self.by_url.get(node.url)
        if client is None:
            timeout = max(node.timeout, _CONNECTION_TIMEOUT)
            options = connection_options(timeout, AsyncConnection, Retry)
            pool = aioredis.ConnectionPool.from_url(node.url, **options)
            client = self.by_url[node.url] = aioredis.Redis(connection_pool=pool)
        return client

    async def _close_at_shutdown(self) -> None:
        """Close the loop's connections when the loop shuts down.

        An asyncio connection must be closed in its loop, and a loop has no hook for
        its end; but ``asyncio.run`` (and servers that stop alike) cancel every task
        left before closing the loop, this one included.
        """
        try:
            await asyncio.Event().wait()
        finally:
            clients, self.by_url = list(self.by_url.values()), {}
            for client in clients:
                await client.connection_pool.disconnect()  # aclose() keeps a given pool


_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopClients] = (
    weakref.WeakKeyDictionary()
)


def _clients_of_this_loop() -> _LoopClients:
    loop = asyncio.get_running_loop()
    clients = _loops.get(loop)
    if clients is None or clients.keeper.done():
        clients = _loops[loop] = _LoopClients(loop)
    return clients


async def aclose_loop_clients() -> None:
    """Close the running loop's lock connections now (they reopen on the next call)."""
    clients = _loops.pop(asyncio.get_running_loop(), None)
    if clients is not None:
        clients.keeper.cancel()
        await asyncio.gather(clients.keeper, return_exceptions=True)


class AsyncNodeSet:
    """The nodes of a :class:`NodeSet`, called from asyncio.

    The sync set stays the one the renewer and the release listener use: an
    asynchronous lock's lease is renewed by the process's watchdog thread like any
    other, so that a coroutine that blocks its event loop keeps its lock.
    """

    def __init__(self, nodeset: NodeSet) -> None:
        for node in nodeset.nodes:
            if is_sentinel_url(node.url) or not node.url.startswith(
                ("redis://", "rediss://", "unix://")
            ):
                raise ConfigurationError(
                    f"AsyncRedlock supports redis://, rediss:// and unix:// nodes, not "
                    f"{safe_url(node.url)!r} (Sentinel and Cluster: use Redlock)"
                )
        self.sync = nodeset
        self.nodes: tuple[LockNode, ...] = nodeset.nodes
        self.quorum = nodeset.quorum
        self.timeout = nodeset.timeout

    #: A request not waited for runs on, on a connection of its own: a later request
    #: to that node may arrive first.
    queues_behind = False

    def __len__(self) -> int:
        return len(self.nodes)

    def lagging(self) -> frozenset[int]:
        """Every node: a quorum's answer is never held up by the others.

        This fan-out keeps no connection owing replies, so nothing tells which node lags.
        """
        return frozenset(range(len(self.nodes)))

    async def call(
        self,
        calls: Sequence[Call] | Sequence[Sequence[Call] | None],
        *,
        timeout: float | None = None,
        per_node: bool = False,
        decided: Callable[[list[Reply | None]], bool] | None = None,
    ) -> list[Reply | None]:
        """Send ``calls`` to every node (``per_node``: node i gets ``calls[i]``, or nothing).

        Returns each node's :class:`Reply` (None where nothing was sent), within
        ``timeout`` (default: the node timeout) for the whole fan-out, or as soon as
        ``decided`` (called with the replies so far, None where none came yet)
        returns True: the nodes not heard then are None.

        A request is never interrupted once sent, neither by the budget nor by the
        caller's cancellation: a connection cut mid-command can hand a later request
        the earlier one's reply (older redis-py), and an undo sent meanwhile on another
        connection could overtake the request it undoes. A request that outlives its
        budget or its caller runs on (its connection's socket timeout ends it).
        """
        loop_clients = _clients_of_this_loop()
        clients = [loop_clients.client(node) for node in self.nodes]
        requests: list[Sequence[Call] | None]
        if per_node:
            requests = list(cast("Sequence[Sequence[Call] | None]", calls))
        else:
            requests = [cast("Sequence[Call]", calls)] * len(self.nodes)
        budget = self.timeout if timeout is None else timeout
        sent = [
            (node, asyncio.ensure_future(_send(node, client, request)))
            for node, client, request in zip(self.nodes, clients, requests, strict=True)
            if request is not None
        ]
        for _, request in sent:
            request.add_done_callback(_retrieve)

        def replies(so_far: bool = False) -> list[Reply | None]:
            answers = iter(
                [
                    None if so_far and not request.done() else _reply(node, request)
                    for node, request in sent
                ]
            )
            return [None if request is None else next(answers) for request in requests]

        if sent:
            settled = None if decided is None else (lambda: decided(replies(so_far=True)))
            if settled is not None and settled():
                return replies(so_far=True)
            if await _wait_budget([request for _, request in sent], budget, settled):
                return replies(so_far=True)
        return replies()


#: How late the loop may wake from a wait before the difference counts as a stall (s):
#: timers fire up to a millisecond late (epoll's resolution) on an idle loop.
_STALL = 0.002
#: Waits per budget: a stall is seen when the wait it spans wakes late.
_TICKS = 4
#: Loop steps of the last look at the sockets after the budget (:func:`_wait_budget`).
_LOOK_STEPS = 4


async def _wait_budget(
    requests: list[asyncio.Future[list[Any]]],
    budget: float,
    settled: Callable[[], bool] | None = None,
) -> bool:
    """Wait up to ``budget`` for ``requests``, not counting the time the loop was stalled.

    True as soon as ``settled`` says the caller needs no more replies; else False once
    every request is done or the budget is spent.

    A coroutine that blocks the event loop (CPU-bound work, a synchronous call)
    spends this process's time, not any node's: before a request is written (it goes
    out late, with too little budget left) or while replies that came in time wait
    unread in the sockets. The wait is cut into :data:`_TICKS` shorter ones; one that
    wakes more than :data:`_STALL` late was held up by the loop, and the budget is
    extended by as much (as a pause before the write in the threaded fan-out). The
    requests still get at most ``budget`` of the loop's running time, plus a last look
    at what already reached the sockets. Safety is not touched: a lock's validity is
    counted from before the fan-out.
    """
    loop = asyncio.get_running_loop()
    pending = set(requests)
    due = loop.time() + budget
    tick = budget / _TICKS
    when = asyncio.ALL_COMPLETED if settled is None else asyncio.FIRST_COMPLETED
    while pending:
        now = loop.time()
        if now >= due:
            break
        step = min(tick, due - now)
        done, pending = await asyncio.wait(pending, timeout=step, return_when=when)
        if done and settled is not None and settled():
            return True
        late = loop.time() - (now + step)
        if pending and late > _STALL:
            due += late
    # A last look: replies already in the sockets are read before their requests count
    # as unanswered. A stall that ends just after the budget's end, too soon to count as
    # one, leaves them there; reading one takes a few loop steps (the socket's event,
    # then the request's task).
    for _ in range(_LOOK_STEPS):
        if not pending:
            return False
        await asyncio.sleep(0)
        pending = {request for request in pending if not request.done()}
        if settled is not None and settled():
            return True
    return False


def _reply(node: LockNode, request: asyncio.Future[list[Any]]) -> Reply:
    """One node's reply, or a reply carrying why there is none (yet)."""
    if not request.done():
        return Reply(node, error=TimeoutError("no reply within the budget"))
    error = request.exception()
    if error is None:
        return Reply(node, request.result())
    if isinstance(error, _NODE_FAILURES):
        return Reply(node, error=error)
    raise error


def _retrieve(request: asyncio.Future[Any]) -> None:
    """Read a finished request's exception, so asyncio does not log it as unretrieved."""
    if not request.cancelled():
        request.exception()


async def _send(node: LockNode, client: aioredis.Redis, calls: Sequence[Call]) -> list[Any]:
    """Run ``calls`` in one round trip; load the scripts a node lost and run them again.

    Marks ``node`` as having answered this process (:meth:`.nodeset.NodeSet.answering`).
    """
    values = await _pipeline(client, calls)
    node.answered_at = time.monotonic()  # type: ignore[attr-defined]  # a plain Node here
    missing = {
        call.script.sha: call.script
        for call, value in zip(calls, values, strict=True)
        if isinstance(value, NoScriptError) and call.script is not None
    }
    if not missing:
        return values
    # The node lost its script cache (restart, SCRIPT FLUSH, failover). A call that
    # answered NOSCRIPT did not run, so sending the request again runs nothing twice
    # (except a WAIT behind it, which only waits).
    return await _pipeline(
        client, [Call.command("SCRIPT", "LOAD", s.source) for s in missing.values()], *calls
    )


async def _pipeline(client: aioredis.Redis, calls: Sequence[Call], *more: Call) -> list[Any]:
    """Send ``calls``, then ``more``, on one connection; each reply or its ``ResponseError``.

    With ``more`` (what ``calls`` prepare, such as ``SCRIPT LOAD``), only their replies.
    """
    pipe = client.pipeline(transaction=False)
    for call in (*calls, *more):
        pipe.execute_command(*call.packed_args())
    values: list[Any] = await pipe.execute(raise_on_error=False)
    return values[len(calls) :] if more else values
