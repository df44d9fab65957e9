"""A lease: the state of one acquisition, and how the nodes' renewal answers judge it.

Shared by the lock that made it, the renewer that keeps it and the callbacks told of
its loss. The deadline is local and monotonic (:data:`clock`): the time the granting
request was *sent*, plus the lease, minus the drift allowance. A confirmation is
judged when it is *read*: one read after the deadline is a loss, whatever it says.

A renewal is one ``renew_many.lua`` call per node per :data:`CHUNK` entries (a lease
has one entry per key it extends); :func:`renew_call` builds it and
:func:`lease_verdict` reads one node's answer for one lease. The renewer
(:mod:`.renewal`) batches many leases into those calls; ``Redlock.extend`` sends one.
The renewer's calls come from :func:`renew_chunks`, already in RESP from pieces each
lease encodes once, and :func:`renewed_everywhere` reads their replies a list at a
time, leaving to :meth:`Lease.tally` only the leases some node did not renew.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from redis.exceptions import ResponseError

from ..base import forksafe, metrics
from ..exceptions import LockLost, NodeUnavailable
from ..nodes import Call
from ..nodes.calls import bulk
from .scripts import RENEW_MANY, RenewStatus

if TYPE_CHECKING:
    from ..nodes import NodeSet, Reply
    from .keys import LockKeys
    from .timing import Timing

__all__ = [
    "CHUNK",
    "Lease",
    "Tally",
    "clock",
    "lease_verdict",
    "renew_call",
    "renew_chunks",
    "renew_entries",
    "renewed_everywhere",
]

# The renewer's logger: a loss is reported under it wherever it is detected.
logger = logging.getLogger("celery_redlock.renewal")

#: Keys renewed by one script call, so the layout of a renewal reply. Large enough
#: that a tick's calls stay few (they go pipelined: one round trip per node), small
#: enough that one call keeps Redis from its other clients for ~3 ms (1,000 keys took
#: 6 ms, and up to 12 ms, while 100,000 locks were renewed: benchmarks/bench_renewal.py).
CHUNK = 500


#: The clock of lease deadlines: like ``time.monotonic`` (never stepped by NTP or an
#: operator), but on Linux it keeps counting while the machine is suspended, so a host
#: that wakes from suspend knows its leases ran out. Elsewhere, ``time.monotonic``.
#: (A partial, not a function of ours: read several times per acquisition, it then
#: costs no Python frame.)
clock: Callable[[], float] = (
    functools.partial(time.clock_gettime, time.CLOCK_BOOTTIME)
    if hasattr(time, "CLOCK_BOOTTIME")
    else time.monotonic
)


class Tally(NamedTuple):
    """How the nodes answered one renewal of one lease."""

    renewed: int  #: nodes that renewed it
    refused: int  #: nodes where it is gone, or held by another owner
    errors: list[str]  #: why each of the other nodes gave no verdict


class Lease:
    """The state of one acquisition, shared by its lock, the renewer and callbacks.

    The deadline is local and monotonic: the time the granting request was *sent*,
    plus the lease, minus the drift allowance. Redis cannot have let anyone else in
    before it, whatever the network did to the reply.
    """

    __slots__ = (
        "__weakref__",  # handoff's record of the process's holds
        "_lock",
        "_wire",
        "deadline",
        "entries",
        "fence",
        "fences",
        "keys",
        "lost",
        "nodeset",
        "on_lost",
        "owner",
        "pid",
        "quorum",
        "released",
        "renewing",
        "sent_at",
        "task_name",
        "timing",
        "token",
    )

    def __init__(
        self,
        keys: LockKeys,
        token: str,
        fence: int,
        nodeset: NodeSet,
        timing: Timing,
        sent_at: float,
        on_lost: list[Callable[[LockLost], object]] | None = None,
        *,
        owner: str = "-",
        task_name: str | None = None,
        entries: tuple[tuple[str, str], ...] | None = None,
        fences: tuple[int, ...] | None = None,
        quorum: int | None = None,
        length: float | None = None,
    ) -> None:
        self.keys = keys
        #: What each renewal extends: (key, kind) pairs as ``renew_many.lua`` takes
        #: them; several for a lock on several resources, two for a share.
        self.entries = entries or ((keys.lock, "x"),)
        self.token = token
        self.fence = fence
        self.fences = fences or (fence,)
        #: Nodes that must confirm a renewal (more than a majority for a limit > 1).
        self.quorum = quorum or nodeset.quorum
        self.nodeset = nodeset
        self.timing = timing
        self.sent_at = sent_at
        # ``length``: a lease the nodes granted for less than the ttl (a grant by a
        # release, .waiting.grant_ms) until its first renewal.
        self.deadline = sent_at + (timing.ttl if length is None else length) - timing.drift
        self.owner = owner
        self.task_name = task_name
        self.on_lost = list(on_lost or ())
        self.lost: LockLost | None = None
        self.released = False
        #: Handed to the renewer (``auto_renew``).
        self.renewing = False
        self.pid = forksafe.pid()
        self._lock = threading.Lock()
        #: Its part of a renewal, encoded on first use: see :func:`renew_chunks`.
        self._wire: _Wire | None = None
        forksafe.track(self)

    def __repr__(self) -> str:
        return f"<Lease {self.keys.lock} fence={self.fence} remaining={self.remaining():.3f}>"

    @property
    def give_up_at(self) -> float:
        """When an unconfirmed lease counts as lost: the deadline minus the margin."""
        return self.deadline - self.timing.margin

    @property
    def alive(self) -> bool:
        """Neither lost nor released: still to be renewed."""
        return self.lost is None and not self.released

    def remaining(self) -> float:
        """Seconds of lease left by the local deadline (0 once lost or released)."""
        if self.lost is not None or self.released or self.pid != forksafe.pid():
            return 0.0
        return max(0.0, self.deadline - clock())

    def renewed(self, sent_at: float, read_at: float) -> bool:
        """A quorum confirmed, at ``read_at``, a renewal sent at ``sent_at``.

        The confirmation is judged when it is read. If the holder was paused between
        sending and reading (SIGSTOP, a VM pause, a stop-the-world GC), the renewed
        lease may already have run out by the local clock: someone else may hold the
        lock by now, so the lease is lost at once rather than at the next renewal.
        Returns True if the lease is still held.
        """
        deadline = max(self.deadline, sent_at + self.timing.ttl - self.timing.drift)
        if read_at >= deadline - self.timing.margin:
            self.mark_lost(
                f"renewal confirmed {read_at - sent_at:.3f}s after it was sent, "
                "too late: the lease may have ended meanwhile"
            )
            return False
        self.deadline = deadline
        return True

    def tally(self, replies: list[Reply | None], offset: int = 0) -> Tally:
        """Count the nodes' verdicts on this lease, whose entries start at ``offset``."""
        renewed = refused = 0
        errors = []
        for reply in replies:
            code, error = lease_verdict(reply, offset, len(self.entries))
            if code == RenewStatus.RENEWED:
                renewed += 1
            elif code in (RenewStatus.GONE, RenewStatus.TAKEN):
                refused += 1
            else:
                errors.append(error)
        return Tally(renewed, refused, errors)

    def extended(self, replies: list[Reply | None], sent_at: float) -> float:
        """Judge an ``extend()`` sent at ``sent_at``: the lease left, in seconds.

        Raises :class:`LockLost` if the nodes say it is gone, and
        :class:`NodeUnavailable` if too few answered.
        """
        renewed, refused, errors = self.tally(replies)
        if renewed >= self.quorum:
            self.renewed(sent_at, clock())
            self.check()
            return self.remaining()
        if refused > len(self.nodeset) - self.quorum:
            self.mark_lost("the key expired, was deleted or is held by another owner")
            self.check()
        raise NodeUnavailable(self.keys.lock, errors)

    def check(self) -> None:
        """Raise :class:`LockLost` unless the lease is held and not in doubt."""
        if self.pid != forksafe.pid():
            raise LockLost(
                self.keys.lock,
                f"acquired by process {self.pid}; a forked child does not hold its parent's locks",
                self.fence,
            )
        if self.lost is None and not self.released and clock() >= self.give_up_at:
            self.mark_lost("renewal not confirmed before the lease deadline")
        if self.lost is not None:
            raise self.lost
        if self.released:
            raise LockLost(self.keys.lock, "released", self.fence)

    def _after_fork_in_child(self) -> None:
        # A renewer or releasing thread of the parent may have held it at fork.
        self._lock = threading.Lock()

    def abandon(self) -> None:
        """Stop renewing this lease, silently (no loss is reported for it afterwards)."""
        with self._lock:  # mark_lost checks ``released`` under it
            self.released = True

    def mark_lost(self, reason: str) -> bool:
        """Record the loss once, log it and run the callbacks; False if already known."""
        with self._lock:
            if self.lost is not None or self.released:
                return False
            self.lost = LockLost(self.keys.lock, reason, self.fence)
        logger.error(
            "Lock(%r) held by %s lost: %s (fence %s, %d node(s))",
            self.keys.lock,
            self.owner,
            reason,
            self.fence,
            len(self.nodeset),
        )
        if metrics.enabled:
            metrics.lost(self.task_name)
        for callback in self.on_lost:
            try:
                callback(self.lost)
            except Exception:
                logger.exception("Lock(%r) on_lost callback %r failed", self.keys.lock, callback)
        return True


def lease_verdict(reply: Reply | None, offset: int, count: int) -> tuple[int | None, str]:
    """One node's verdict on a lease whose entries start at ``offset``, or (None, why not).

    ``reply`` answers renew_many calls of :data:`CHUNK` entries each; a lease is renewed
    on the node when every entry is, lost there when any is gone or taken.
    """
    if reply is None:
        return None, "no reply"
    if reply.error is not None:
        return None, reply.describe_error()
    chunk = offset // CHUNK
    if count == 1:  # a lease on one resource: most of a tick's leases, kept cheap
        value = reply.values[chunk]
        code = value if isinstance(value, ResponseError) else value[offset % CHUNK]
        if isinstance(code, ResponseError):
            return None, f"{reply.node.safe_url}: {code}"
        return (RenewStatus.RENEWED if code == _RENEWED else _verdict((code,))), ""
    for value in reply.values[chunk : (offset + count - 1) // CHUNK + 1]:
        if isinstance(value, ResponseError):
            return None, f"{reply.node.safe_url}: {value}"
    codes = [reply.values[(offset + k) // CHUNK][(offset + k) % CHUNK] for k in range(count)]
    for code in codes:
        if isinstance(code, ResponseError):  # one key's part of a call split per cluster slot
            return None, f"{reply.node.safe_url}: {code}"
    return _verdict(codes), ""


#: The codes renew_many.lua returns, as plain ints (an IntEnum look-up per code cost
#: the renewer a tenth of its time with 100,000 locks).
_CODES = frozenset(int(status) for status in RenewStatus)
_RENEWED = int(RenewStatus.RENEWED)


def _verdict(codes: Sequence[int]) -> int:
    """A lease is renewed on a node when every entry is; lost there when any is not."""
    for code in codes:
        if code not in _CODES:
            raise ValueError(f"renew_many returned unknown code {code!r}")
    if all(code == _RENEWED for code in codes):
        return RenewStatus.RENEWED
    return RenewStatus.TAKEN if RenewStatus.TAKEN in codes else RenewStatus.GONE


def renew_entries(entries: list[tuple[Lease, tuple[str, str]]]) -> Call:
    """One renew_many call for ``entries``: (lease, (key, kind)) pairs, at most :data:`CHUNK`."""
    return RENEW_MANY.call(
        holds=[key for _, (key, _) in entries],
        leases=[
            item
            for lease, (_, kind) in entries
            for item in (lease.token, lease.timing.ttl_ms, kind)
        ],
    )


def renew_call(leases: list[Lease]) -> Call:
    """One renew_many call for every entry of ``leases`` (at most :data:`CHUNK` entries)."""
    return renew_entries([(lease, entry) for lease in leases for entry in lease.entries])


#: A lease's part of every renew_many call, per entry: its keys, their arguments (token,
#: lease in ms and kind per key), and the same two encoded in RESP. A plain tuple of
#: strings, ints and bytes, which the garbage collector stops tracking (a NamedTuple
#: would add one tracked object per lease held to every full collection).
_Wire = tuple[tuple[str, ...], tuple[str | int, ...], tuple[bytes, ...], tuple[bytes, ...]]
_WIRE_FIELDS = [operator.itemgetter(i) for i in range(4)]


def _wire(lease: Lease) -> _Wire:
    ttl_ms, token = lease.timing.ttl_ms, lease.token
    keys = tuple(key for key, _ in lease.entries)
    args = tuple(item for _, kind in lease.entries for item in (token, ttl_ms, kind))
    wire = (
        keys,
        args,
        tuple(bulk(key) for key in keys),
        tuple(bulk(token, ttl_ms, kind) for _, kind in lease.entries),
    )
    lease._wire = wire
    return wire


def renew_chunks(leases: list[Lease]) -> list[Call]:
    """The renew_many calls for every entry of ``leases``, :data:`CHUNK` entries each.

    The calls :func:`renew_entries` would build, already in RESP: a lease's key,
    token, lease and kind never change, so each lease encodes its part once and a
    renewal joins the parts (encoding every argument of every tick was the largest
    part of the renewer's Python work, profiled with 20,000 leases).
    """
    wires = [lease._wire or _wire(lease) for lease in leases]
    keys, args, keys_resp, args_resp = (
        list(itertools.chain.from_iterable(map(field, wires))) for field in _WIRE_FIELDS
    )
    calls = []
    for start in range(0, len(keys), CHUNK):
        end = start + CHUNK
        chunk_keys = keys[start:end]
        n = len(chunk_keys)
        resp = b"".join(
            [RENEW_MANY.evalsha_resp(n, 3 * n), *keys_resp[start:end], *args_resp[start:end]]
        )
        call_keys = RENEW_MANY.build_keys(holds=chunk_keys)
        call_args = RENEW_MANY.build_argv(leases=args[3 * start : 3 * end])
        calls.append(Call(RENEW_MANY, call_keys, call_args, resp))
    return calls


def renewed_everywhere(replies: list[Reply | None], entries: int) -> list[bool] | None:
    """Per entry of a tick's calls, whether every node renewed it.

    None unless every node answered every call with one code per entry; the caller
    then judges each lease with :meth:`Lease.tally`. Read in C, a list at a time:
    the renewer's common case, every lease renewed everywhere, costs no Python work
    per code.
    """
    flags: Iterable[bool] | None = None
    for reply in replies:
        if reply is None or reply.error is not None:
            return None
        if not all(type(value) is list for value in reply.values):
            return None  # an error reply in place of a whole call's codes
        codes = list(itertools.chain.from_iterable(reply.values))
        if len(codes) != entries:
            return None
        renewed = map(operator.eq, codes, itertools.repeat(_RENEWED))
        flags = renewed if flags is None else map(operator.and_, flags, renewed)
    return None if flags is None else list(flags)
