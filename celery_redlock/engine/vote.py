"""One acquisition attempt's vote: what is sent to every node, and how it is tallied.

The acquire call goes to every node and the answers are tallied as they come; where
the granting nodes disagree on the fence, the largest is stored back on them
(:func:`fence_requests`, :func:`fences_stored`).

The clock starts when the requests are *sent*: a reply can be delayed arbitrarily,
but Redis cannot have set the key before the request left. The fan-out returns as
soon as the outcome is decided (a quorum granted, or too many refused for one), so
a silent node costs nothing while a quorum answers.

With ``min_replicas`` each node also runs ``WAIT`` after the script, and its vote
counts only once that many replicas acknowledged it.

What to make of the tally (a hold, an undo, a retry) is the acquisition's business
(:mod:`.acquisition`, which also sends the calls): this module builds and counts.
"""

from __future__ import annotations

from collections.abc import Callable

from redis.exceptions import ResponseError

from ..nodes import Call, Reply
from .scripts import AcquireStatus, FenceSyncStatus, ReleaseStatus

__all__ = [
    "Attempt",
    "budget",
    "fence_requests",
    "fences_stored",
    "granted_fences",
    "is_busy",
    "release_decided",
    "sent_only",
    "tally",
    "undone_on",
    "vote_calls",
    "vote_decided",
]


class Attempt:
    """What one acquisition attempt learned from the nodes."""

    __slots__ = (
        "busy_ttl",
        "elapsed",
        "errors",
        "fences",
        "granted",
        "holder",
        "number",
        "replies",
    )

    def __init__(self, replies: list[Reply | None], elapsed: float) -> None:
        #: Each node's reply, or None where it did not answer before the vote was decided.
        self.replies = replies
        #: Seconds from sending to the decision: spent from the lease.
        self.elapsed = elapsed
        self.granted: list[int] = []  # indices of the granting nodes
        self.fences: list[tuple[int, ...]] = []  # per granting node, one per resource
        self.busy_ttl: list[float] = []  # per node that found it held: when that may change
        self.holder: str | None = None
        self.errors: list[str] = []
        #: The attempt's number among its acquisition's (:meth:`.kinds.Waiter.next_attempt`):
        #: its undo names it.
        self.number = 0

    def top_fences(self) -> tuple[int, ...]:
        """Per resource, the largest fence among the granting nodes."""
        return tuple(max(column) for column in zip(*self.fences, strict=True))

    def agreeing(self, fences: tuple[int, ...]) -> int:
        """Granting nodes whose fences are ``fences`` already."""
        return sum(1 for node_fences in self.fences if node_fences == fences)

    def all_busy(self) -> bool:
        """Every node answered that someone else holds the lock: nothing to undo."""
        return all(is_busy(reply) for reply in self.replies)

    def failed(self) -> bool:
        """Some node failed or did not answer within the budget (its request is unsettled)."""
        return any(reply is not None and not reply.ok for reply in self.replies)

    def _tally(self, i: int, reply: Reply, min_replicas: int) -> None:
        fences = granted_fences(reply, min_replicas)
        if fences is not None:
            self.granted.append(i)
            self.fences.append(fences)
            return
        if reply.error is not None:
            self.errors.append(reply.describe_error())
            return
        value = reply.values[0]
        if isinstance(value, ResponseError):
            self.errors.append(f"{reply.node.safe_url}: {value}")
        elif value[0] == AcquireStatus.BUSY:
            self.busy_ttl.append(max(0, int(value[1])) / 1000)
            self.holder = self.holder or value[2] or None
        elif value[0] == AcquireStatus.ABANDONED:  # a takeover for a waiter that gave up
            self.errors.append(f"{reply.node.safe_url}: acquisition abandoned")
        elif value[0] in (AcquireStatus.ACQUIRED, AcquireStatus.REENTERED):
            self.errors.append(
                f"{reply.node.safe_url}: only {reply.values[1]} of {min_replicas} "
                "replicas acknowledged"
            )
        else:
            raise ValueError(f"acquire.lua returned unknown code {value[0]!r}")


def budget(node_timeout: float, min_replicas: int) -> float:
    """Time one acquisition fan-out may take.

    With ``min_replicas`` each node also runs WAIT for up to one node timeout,
    and Redis checks WAIT timeouts on its cron (every 100 ms at the default hz).
    """
    return node_timeout if not min_replicas else 2 * node_timeout + 0.1


def vote_calls(acquire: Call, min_replicas: int, node_timeout: float) -> list[Call]:
    """What each node is sent: the acquire call, then ``WAIT`` with ``min_replicas``."""
    calls = [acquire]
    if min_replicas:
        calls.append(Call.command("WAIT", min_replicas, max(1, round(node_timeout * 1000))))
    return calls


def tally(replies: list[Reply | None], elapsed: float, min_replicas: int) -> Attempt:
    """The attempt the nodes' ``replies`` make, ``elapsed`` seconds after sending."""
    attempt = Attempt(replies, elapsed)
    for i, reply in enumerate(replies):
        if reply is not None:
            attempt._tally(i, reply, min_replicas)
    return attempt


def vote_decided(
    quorum: int, nodes: int, min_replicas: int, wait_for: frozenset[int] = frozenset()
) -> Callable[[list[Reply | None]], bool] | None:
    """When a vote's outcome is known: a quorum granted, or too many refused for one.

    The fan-out returns then, whatever the other nodes are doing: a minority of slow or
    silent nodes does not set the pace (their requests run on; their undo, if the vote
    failed, names the attempt it undoes), except the nodes of ``wait_for``, whose
    replies are read too (see :meth:`.acquisition.Core.vote`). None on one node: its
    reply is the outcome.
    """
    if nodes == 1:
        return None

    def decided(replies: list[Reply | None]) -> bool:
        yes = no = 0
        for reply in replies:
            if reply is not None:
                if granted_fences(reply, min_replicas) is not None:
                    yes += 1
                else:
                    no += 1
        if yes < quorum and no <= nodes - quorum:
            return False
        return all(replies[i] is not None for i in wait_for)

    return decided


def release_decided(
    quorum: int, lagging: frozenset[int] = frozenset()
) -> Callable[[list[Reply | None]], bool]:
    """When a release need not wait for more nodes.

    Every node answered, or a quorum confirmed it and only ``lagging`` nodes have not
    answered. A lagging node (:meth:`~celery_redlock.nodes.NodeSet.lagging`) is not waited for
    once a quorum let the lock go: no later holder can count on it anyway (it needs a
    quorum of its own), and the release request runs on there. A node that keeps pace
    is waited for (a moment), so its reply is read in band: one that lost its scripts
    (NOSCRIPT) gets them and the release again, which an unread reply would not.
    """

    def decided(replies: list[Reply | None]) -> bool:
        released = 0
        for i, reply in enumerate(replies):
            if reply is None:
                if i not in lagging:
                    return False
            elif reply.ok and reply.values[0] == ReleaseStatus.RELEASED:
                released += 1
        return released >= quorum or None not in replies

    return decided


def sent_only(replies: list[Reply | None]) -> bool:
    """A fan-out that waits for no reply (a release on nodes a takeover did not reach)."""
    return True


def undone_on(attempt: Attempt, lagging: frozenset[int]) -> Callable[[list[Reply | None]], bool]:
    """When an attempt's undo is done: the nodes that may hold the attempt answered it.

    Those are the nodes that answered without refusing (granted, or wrote it but their
    replicas did not confirm), and those that had not answered yet unless they lag
    (:meth:`~celery_redlock.nodes.NodeSet.lagging`): a lagging node is not waited for,
    and its undo runs on there (named by the attempt, it removes nothing a later
    attempt wrote). Nodes that refused or failed hold nothing of it.
    """
    wait = [
        i
        for i, reply in enumerate(attempt.replies)
        if (reply is None and i not in lagging)
        or (reply is not None and reply.ok and not is_busy(reply))
    ]

    def decided(replies: list[Reply | None]) -> bool:
        return all(replies[i] is not None for i in wait)

    return decided


def granted_fences(reply: Reply, min_replicas: int) -> tuple[int, ...] | None:
    """The fences a node granted (one per resource), or None if it refused or failed."""
    if reply.error is not None:
        return None
    value = reply.values[0]
    if isinstance(value, ResponseError) or value[0] not in (
        AcquireStatus.ACQUIRED,
        AcquireStatus.REENTERED,
    ):
        return None
    if min_replicas and (
        isinstance(reply.values[1], ResponseError) or reply.values[1] < min_replicas
    ):
        return None
    return tuple(int(fence) for fence in value[1:])


def is_busy(reply: Reply | None) -> bool:
    """The node answered that someone else holds the lock (so nothing to undo there)."""
    return (
        reply is not None
        and reply.ok
        and not isinstance(reply.values[0], ResponseError)
        and reply.values[0][0] == AcquireStatus.BUSY
    )


def fence_requests(nodes: int, calls: list[Call], granted: list[int]) -> list[list[Call] | None]:
    """Per node, the fence stores to send: ``calls`` to the ``granted`` nodes only."""
    requests: list[list[Call] | None] = [None] * nodes
    for i in granted:
        requests[i] = calls
    return requests


def fences_stored(replies: list[Reply | None]) -> int:
    """Nodes that stored every fence sent to them."""
    return sum(
        1
        for r in replies
        if r is not None and r.ok and all(v == FenceSyncStatus.SYNCED for v in r.values)
    )
