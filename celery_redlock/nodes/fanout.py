"""Concurrent fan-out of requests to lock nodes, without threads and within a budget.

:func:`fan_out` writes the request to every node first and then reads whichever
reply is ready, with ``select``, in the calling thread. N nodes cost one network
round trip, not N, and no thread pool is created or shared. It returns as soon as
the caller's ``decided`` predicate says the outcome is known (a quorum granted or
refused); connections whose replies are still in flight go back to their node's pool
owing those replies, and are drained the next time they are needed, not waited for.

Every request has one budget, connects, slot map reads and cluster redirections
included: a node that cannot answer within it did not answer (for a lock: that node
did not vote). Each node's request is routed by the node itself into legs
(:meth:`~celery_redlock.nodes.calls.LockNode.route`), one per server, and the
replies are merged back into one :class:`~celery_redlock.nodes.calls.Reply` per node.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..base.poll import buffered, readable
from .calls import LAG, Call, Leg, LockNode, Reply, Script, Server

__all__ = ["ALIVE_GRACE", "fan_out", "pack"]

#: How long (seconds) a node may answer nothing to this process before it counts as
#: down: a fan-out goes on waiting past its budget, at most that long, while the nodes
#: it waits for keep answering other requests of this process (:meth:`_FanOut.alive`;
#: four budgets if that is longer), and a blocking acquisition retries failed nodes
#: that long (:meth:`celery_redlock.engine.acquisition.Core.next_step`).
ALIVE_GRACE = 1.0


class _InFlight:
    """One leg of a request, sent on one connection, whose replies are being read."""

    __slots__ = ("calls", "conn", "index", "leg", "noscript", "owed", "skip", "stale", "values")

    def __init__(self, index: int, leg: Leg, conn: AbstractConnection, stale: int = 0) -> None:
        self.index = index  # of the node in the fan-out
        self.leg = leg
        self.conn = conn
        self.calls = leg.calls
        self.values: list[Any] = []
        self.stale = stale  # replies to an earlier request on this connection
        self.owed = stale
        self.skip = 0
        self.noscript = False

    def send(self, load: Sequence[Script] = ()) -> None:
        """Send the calls, preceded by ``SCRIPT LOAD`` of ``load`` (replies skipped)."""
        packed: list[tuple[Any, ...] | bytes] = [("SCRIPT", "LOAD", s.source) for s in load]
        if _utf8(self.conn):
            packed += [
                call.packed_args() if call.resp is None else call.resp for call in self.calls
            ]
        else:
            packed += [call.packed_args() for call in self.calls]
        send(self.conn, pack(self.conn, packed)[0])
        self.skip = len(load)
        self.owed = self.stale + len(packed)

    def read_ready(self, polled: bool = False) -> bool:
        """Read every reply already available; True when the request is complete.

        ``polled``: ``poll`` found the socket readable just now, so the first reply is
        read without asking ``can_read`` first (three system calls a reply).
        """
        while self.owed and (polled or _more(self.conn)):
            polled = False
            try:
                value = self.conn.read_response()
                self.leg.node.answered_at = time.monotonic()
            except ResponseError as exc:
                if isinstance(exc, NoScriptError):
                    if self.stale:  # an earlier request's: nobody re-sends it
                        self.leg.node.scripts_lost()
                    else:
                        self.noscript = True
                value = exc
            self.owed -= 1
            if self.stale:
                self.stale -= 1
                continue
            if self.skip:
                self.skip -= 1
                if isinstance(value, ResponseError):
                    raise value
                continue
            self.values.append(value)
        if self.owed or not self.noscript:
            return not self.owed
        # The node lost its script cache (restart, SCRIPT FLUSH, failover): load the
        # scripts and send the request again. Scripts that answered NOSCRIPT did not
        # run; the plain commands sent with them are read-only (WAIT, EXISTS, ASKING).
        self.values, self.noscript = [], False
        self.send(load=self.scripts())
        return False

    def scripts(self) -> list[Script]:
        """The distinct scripts this request calls."""
        return list({call.script.sha: call.script for call in self.calls if call.script}.values())


def pack(conn: AbstractConnection, commands: Sequence[tuple[Any, ...] | bytes]) -> list[bytes]:
    """The commands in RESP, as redis-py would write them, but several times faster.

    Renewal sends one call per lock slot to a Redis Cluster (10,000 locks: 10,000
    EVALSHA per tick), where redis-py's general packer took most of the tick. This
    handles the argument types the library sends (str, bytes, int) and leaves a
    command with anything else to redis-py. A command given as bytes is already in
    RESP (:attr:`~celery_redlock.nodes.calls.Call.resp`) and is sent as it is.
    """
    encoding, errors = conn.encoder.encoding, conn.encoder.encoding_errors
    out: list[bytes] = []
    for args in commands:
        if isinstance(args, bytes):
            out.append(args)
            continue
        start = len(out)
        out.append(b"*%d\r\n" % len(args))
        for arg in args:
            if isinstance(arg, str):
                data = arg.encode(encoding, errors)
            elif isinstance(arg, bytes):
                data = arg
            elif type(arg) is int:  # not bool, which redis-py refuses
                data = b"%d" % arg
            else:
                del out[start:]
                out += conn.pack_commands([args])
                break
            out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return [b"".join(out)]


def send(conn: AbstractConnection, data: bytes) -> None:
    """Write ``data`` (a request in RESP) to ``conn``, as ``send_packed_command`` does.

    A socket with a timeout makes Python ``poll`` it before every ``send``, to learn
    whether the write would block: one system call per request, answered "no" for a
    request far smaller than the socket's buffer. Such a socket's
    descriptor is non-blocking underneath, so one ``write`` takes what fits at once;
    what does not (a buffer full: a server not reading) goes through redis-py, which
    waits for room within the socket's timeout. TLS sockets and sockets without a
    timeout go through redis-py whole.
    """
    sock = conn._sock
    if sock is not None and type(sock) is socket.socket and sock.gettimeout():
        try:
            written = os.write(sock.fileno(), data)
        except BlockingIOError:
            written = 0
        except OSError as exc:
            conn.disconnect()
            raise RedisConnectionError(
                f"Error {exc.errno} while writing to socket. {exc.strerror}."
            ) from exc
        if written == len(data):
            return
        data = data[written:]
    conn.send_packed_command([data], check_health=False)


def _more(conn: AbstractConnection) -> bool:
    """A reply is there to read on ``conn``, by its buffers, else by asking the socket."""
    more = buffered(conn)
    return conn.can_read(0) if more is None else more


def _utf8(conn: AbstractConnection) -> bool:
    """Whether ``conn`` encodes strings as :func:`~celery_redlock.nodes.calls.bulk` does."""
    return _is_utf8(conn.encoder.encoding)


@functools.cache
def _is_utf8(encoding: str) -> bool:
    return codecs.lookup(encoding).name == "utf-8"


class _Gather:
    """One node's :class:`Reply`, assembled from the replies of its legs."""

    __slots__ = ("answered", "error", "node", "outstanding", "values")

    def __init__(self, node: LockNode, size: int) -> None:
        self.node = node
        self.values: list[Any] = [None] * size
        self.outstanding = 0  # legs sent and not finished
        self.error: BaseException | None = None
        self.answered = False

    def put(self, leg: Leg, k: int, value: Any) -> None:
        """Store the reply to ``leg.calls[k]`` where it belongs."""
        place = leg.place(k)
        if place is None:
            return
        position, indices = place
        if indices is None:
            self.values[position] = value
            return
        merged = self.values[position]
        if merged is None:
            merged = self.values[position] = []
        for n, index in enumerate(indices):
            if len(merged) <= index:
                merged.extend([None] * (index + 1 - len(merged)))
            # A split call answers one entry per key; an error answers for all its keys.
            merged[index] = value if isinstance(value, ResponseError) else value[n]

    def fail(self, leg: Leg, error: BaseException) -> None:
        """The leg got no reply: its calls fail (or, for a plain node, the whole node)."""
        value = self.node.failed(leg, error)
        # A cluster's error names the master; the node's reply is that error when no
        # master answered at all.
        self.error = self.error or (error if value is None else value)
        if value is not None:
            for k in range(len(leg.calls)):
                self.put(leg, k, value)

    def reply(self) -> Reply:
        if self.error is not None and not self.answered:
            return Reply(self.node, error=self.error)
        return Reply(self.node, values=self.values)


class _FanOut:
    """The state of one :func:`fan_out`: legs in flight and replies per node."""

    def __init__(self, nodes: Sequence[LockNode], timeout: float, patient: bool = False) -> None:
        self.nodes = nodes
        self.timeout = timeout
        self.patient = patient
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        # Whether the budget was started again once (see start()).
        self.restarted = False
        self.replies: list[Reply | None] = [None] * len(nodes)
        self.gathers: dict[int, _Gather] = {}
        self.inflight: list[_InFlight] = []
        #: Every connection this fan-out checked out, to close if it is interrupted.
        self.used: list[tuple[Server, AbstractConnection]] = []

    def start(self, index: int, leg: Leg, share: int = 1) -> None:
        """Check out a connection of the leg's server and send the leg.

        A connect may take ``1/share`` of the time left (``share`` connects remain).
        """
        gather = self.gathers[index]
        remaining = self._remaining()
        if remaining <= 0:
            gather.fail(leg, RedisTimeoutError("no time left in the budget"))
            return
        conn = None
        try:
            conn, fresh, stale = leg.node.checkout(connect_timeout=remaining / share)
            if not fresh:  # no connect: a pause in there was this process's, too
                self._remaining()
            self.used.append((leg.node, conn))
            flight = _InFlight(index, leg, conn, stale)
            # A new connection may face a server that never saw our scripts (it was
            # restarted, or is new): load them in the same write instead of paying a
            # NOSCRIPT round trip, which would also run a pipelined WAIT twice.
            load = leg.node.scripts_to_load()
            packing = time.monotonic()
            flight.send(load=[*load, *(flight.scripts() if fresh else ())])
            self._written(packing)
        except (RedisError, OSError) as exc:
            if conn is not None:
                leg.node.discard(conn)
            gather.fail(leg, exc)
            return
        gather.outstanding += 1
        self.inflight.append(flight)

    def _remaining(self) -> float:
        """What is left of the budget; started again, once, if none was left unused.

        Nothing has been sent yet: the budget went to this process (a garbage
        collection, a descheduled thread), not to any node. A lock's validity is
        counted by its caller from before the fan-out, so this costs no safety;
        failing would report a Redis outage that did not happen (seen holding 100k
        locks: full collections of 0.4 s, before the first request and, as often,
        while its pooled connection was being checked out).
        """
        remaining = self.deadline - time.monotonic()
        if remaining <= 0 and not self.used:
            self._restart()
            remaining = self.deadline - time.monotonic()
        return remaining

    def _written(self, packing: float) -> None:
        """The budget starts again if it ran out while this request was packed and written.

        The process paused between ``packing`` (the budget not yet spent) and the end
        of the write (a garbage collection set off by packing the request, a
        descheduled thread): the node had no time at all to answer, and a look at the
        socket right after the write would report it down. A budget spent before
        (a slow connect: the node's time) is not given again.
        """
        if packing < self.deadline <= time.monotonic():
            self._restart()

    def _restart(self) -> None:
        """Give the fan-out its budget again, from now; once.

        The time went to this process, not to any node, and the caller counts the
        lock's validity from before the fan-out, so a later deadline costs no safety.
        """
        if not self.restarted:
            self.restarted = True
            self.deadline = time.monotonic() + self.timeout

    def alive(self) -> bool:
        """Give the budget once more if every node still waited for answered lately.

        A node that answered a request of this process (another thread's, or an earlier
        reply on this connection) within :data:`ALIVE_GRACE` before this fan-out began,
        or since, is up: the reply missing here is late because this process, or the
        machine, is starved (hundreds of threads starting at once, each waiting for the
        interpreter; Redis itself waiting for a CPU), not because the node is down. For
        :data:`ALIVE_GRACE` (or four budgets) past the start at most: a node that
        answers others but never this connection that long is not trusted with it.
        A lock's validity is counted from before the fan-out, so waiting longer costs
        no safety.
        """
        now = time.monotonic()
        if not self.patient or now - self.started >= max(ALIVE_GRACE, 4 * self.timeout):
            return False
        recent = self.started - ALIVE_GRACE
        if not all(f.leg.node.answered_at > recent for f in self.inflight):
            return False
        self.deadline = now + self.timeout
        return True

    def settle(self, index: int) -> None:
        """Set the node's reply once none of its legs is outstanding."""
        gather = self.gathers[index]
        if not gather.outstanding and self.replies[index] is None:
            self.replies[index] = gather.reply()

    def complete(self, flight: _InFlight) -> None:
        """Take a finished leg's replies; follow redirections (cluster nodes)."""
        index, leg = flight.index, flight.leg
        gather, node = self.gathers[index], self.nodes[index]
        gather.outstanding -= 1
        gather.answered = True
        resend: dict[tuple[int, bool], Leg] = {}
        for k, value in enumerate(flight.values):
            target = node.redirect(leg, value) if isinstance(value, ResponseError) else None
            if target is None:
                gather.put(leg, k, value)
                continue
            server, asking = target
            again = resend.get((id(server), asking))
            if again is None:
                again = resend[(id(server), asking)] = Leg(server, [], [], leg.hops + 1)
            if asking:  # ASKING applies to the next command only
                again.calls.append(Call.command("ASKING"))
                again.places.append(None)  # type: ignore[union-attr]  # places is a list here
            again.calls.append(leg.calls[k])
            again.places.append(leg.place(k))  # type: ignore[union-attr]
        for again in resend.values():
            self.start(index, again)

    def failed(self, flight: _InFlight, error: BaseException) -> None:
        gather = self.gathers[flight.index]
        gather.outstanding -= 1
        gather.fail(flight.leg, error)


def fan_out(
    nodes: Sequence[LockNode],
    requests: Sequence[Sequence[Call] | None],
    *,
    timeout: float,
    decided: Callable[[list[Reply | None]], bool] | None = None,
    patient: bool = False,
) -> list[Reply | None]:
    """Send ``requests[i]`` to ``nodes[i]`` concurrently and collect the replies.

    Arguments:
        nodes: the nodes to ask.
        requests: the calls for each node, sent pipelined on one connection (per
            master, for a cluster node); ``None`` leaves that node out.
        timeout: budget in seconds for the whole fan-out, connects, slot map reads
            and cluster redirections included.
        decided: called with the replies so far after each one arrives; when it
            returns True the fan-out returns at once, leaving unanswered nodes as
            ``None`` (their connections are drained later).
        patient: a reply missing at the budget's end from a node that answered other
            requests of this process meanwhile is waited for longer
            (:meth:`_FanOut.alive`). For a call whose lateness costs only time (an
            acquisition counts its validity from the send); never for a renewal, whose
            caller must learn of a failure before the lease's deadline.

    Returns:
        One :class:`Reply` per node (``None`` for a node left out or not waited for).
        A node that missed the budget has a ``Reply`` whose ``error`` is a timeout.

    Raises:
        celery_redlock.nodes.cluster.CrossSlotError: a call cannot be routed on a cluster
            node (nothing was sent to any node).
    """
    state = _FanOut(nodes, timeout, patient)
    legs: list[tuple[int, Leg]] = []
    for i, calls in enumerate(requests):
        if not calls:
            continue
        try:
            routed = nodes[i].route(calls, state.deadline)
        except (RedisError, OSError) as exc:  # a cluster node that cannot read its map
            state.replies[i] = Reply(nodes[i], error=exc)
            continue
        state.gathers[i] = _Gather(nodes[i], len(calls))
        legs += [(i, leg) for leg in routed]

    # Servers with a live connection go first, so a slow connect to a restarted or
    # unreachable node overlaps with the replies of the healthy ones; among the rest,
    # the servers that failed most recently go last. Connects are made one after
    # another, so each gets a fair share of what is left of the budget: one node cut
    # off by a partition must not spend the time the others need, or a minority
    # partition loses the lock (tests/reliability/test_partition.py).
    ordered = sorted(
        ((not leg.node.has_idle(), leg.node.failed_at, i, leg) for i, leg in legs),
        key=lambda item: item[:2],
    )
    try:
        connects = sum(needs_connect for needs_connect, *_ in ordered)
        for needs_connect, _, i, leg in ordered:
            state.start(i, leg, share=connects if needs_connect else 1)
            connects -= needs_connect
        for i in state.gathers:
            state.settle(i)
        _collect(state, decided)
    except BaseException:
        # Only an exception from outside (raised asynchronously, or a bug) gets here:
        # node errors become replies. Replies may be half read: close every
        # connection this request used, pooled again or not.
        for node, conn in state.used:
            node.forget(conn)
        raise
    else:
        now = time.monotonic()
        for flight in state.inflight:
            # (A leg in flight means its node has no reply yet.)
            if now < state.deadline:
                # Decided early: the node is healthy as far as we know, so keep the
                # connection and read its reply the next time it is checked out.
                flight.leg.node.scripts_unread(flight.scripts())
                flight.leg.node.checkin(flight.conn, owed=flight.owed, give_up_at=state.deadline)
            else:
                flight.leg.node.discard(flight.conn)
                flight.leg.node.lagged_at = now  # it did not answer in time
                state.failed(flight, RedisTimeoutError(f"no reply within {timeout:.3f}s"))
                state.settle(flight.index)
    return state.replies


def _collect(state: _FanOut, decided: Callable[[list[Reply | None]], bool] | None) -> None:
    """Read replies as they arrive until all are in, the outcome is decided, or time is up."""
    replies = state.replies
    if decided is not None and decided(replies):
        return
    # No reply to a request just sent can be here yet: wait before the first read
    # instead of asking each connection once for nothing (a poll and two changes of
    # socket mode per call). A reply already there ends the wait at once.
    ready = _wait(state)
    first_done = 0.0
    while state.inflight:
        progressed = False
        for flight in list(state.inflight):
            try:
                complete = flight.read_ready(flight.conn._sock in ready)
            except (RedisError, OSError) as exc:
                flight.leg.node.discard(flight.conn)
                state.inflight.remove(flight)
                state.failed(flight, exc)
                state.settle(flight.index)
                progressed = True
                continue
            if complete:
                done = time.monotonic()
                if not first_done:
                    first_done = done
                elif done - first_done > LAG:
                    flight.leg.node.lagged_at = done  # far behind the first reply
                state.inflight.remove(flight)
                # Back in the pool, another thread may use it: no longer ours to close.
                state.used.remove((flight.leg.node, flight.conn))
                flight.leg.node.checkin(flight.conn)
                state.complete(flight)
                state.settle(flight.index)
                progressed = True
        if progressed and decided is not None and decided(replies):
            return
        if not state.inflight:
            return
        if state.deadline <= time.monotonic() and not progressed and not state.alive():
            return
        # After a reply, look again without waiting: another may be in already (and
        # past the deadline, what is in is still read once before giving up).
        ready = _wait(state, block=not progressed)


def _wait(state: _FanOut, block: bool = True) -> Sequence[Any]:
    """Wait until a connection in flight is readable, or the budget is spent.

    Returns the sockets found readable. With the budget spent (a slow connect to
    another node can spend it before any reply is read), or ``block`` false, it only
    looks: replies already in are still read, as a reply is what decides the vote.
    """
    if not state.inflight:
        return ()
    remaining = max(0.0, state.deadline - time.monotonic()) if block else 0.0
    socks: list[Any] = [flight.conn._sock for flight in state.inflight]
    ready: Sequence[Any] = ()
    # A socket closed under us shows up as an error on the next read.
    with contextlib.suppress(OSError, ValueError):
        ready = readable(socks, remaining)
    return ready
