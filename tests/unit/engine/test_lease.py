"""The lease: its deadline on the boot-time clock, renewal confirmations judged when
they are read (issue 12, item 8), and how one node's renewal answer is read."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from redis.connection import Connection
from redis.exceptions import ResponseError

from celery_redlock import LockLost, Redlock
from celery_redlock.engine.keys import lock_keys
from celery_redlock.engine.lease import (
    CHUNK,
    Lease,
    Tally,
    clock,
    lease_verdict,
    renew_call,
    renew_chunks,
    renew_entries,
    renewed_everywhere,
)
from celery_redlock.engine.scripts import RenewStatus
from celery_redlock.engine.timing import Timing
from celery_redlock.nodes import NodeSet, Reply
from celery_redlock.nodes.fanout import pack
from tests.harness.servers import wait_for


def test_wall_clock_jumps_do_not_touch_the_lease(redis_node):
    """An hour's jump of the wall clock (freezegun, which also moves time.monotonic)
    leaves the lease as it was: deadlines use the boot-time clock."""
    import datetime

    from freezegun import freeze_time

    lock = Redlock("job", nodes=[redis_node.url], ttl=5, auto_renew=False)
    assert lock.acquire()
    before = lock.remaining()
    for jump in (datetime.timedelta(hours=1), datetime.timedelta(hours=-1)):
        with freeze_time(datetime.datetime.now() + jump):
            lock.check()
            assert 0 < lock.remaining() <= before
    lock.release()


def _pause_after_next_call(lock: Redlock, pause_until: threading.Event) -> dict:
    """Make the lock's next renewal reply be read only once ``pause_until`` is set.

    Stands for SIGSTOP, a VM pause or a long GC landing between sending a renewal and
    reading its reply: the reply is already there, it is judged late.
    """
    nodeset = lock.nodeset
    real_call = nodeset.call
    seen: dict = {}

    def call(calls, **kw):
        replies = real_call(calls, **kw)
        if "paused" not in seen and any(c.script and "renew" in c.script.name for c in calls):
            seen["paused"] = clock()
            pause_until.wait(30)
            seen["resumed"] = clock()
        return replies

    nodeset.call = call
    return seen


def test_a_renewal_read_after_its_deadline_is_a_loss_at_once(redis_factory):
    """Paused past the lease while a renewal is in flight: lost on resume, not a tick later."""
    (server,) = redis_factory(1)
    lost = []
    lock = Redlock("job", nodes=[server.url], ttl=3, on_lost=lambda exc: lost.append(clock()))
    resume = threading.Event()
    seen = _pause_after_next_call(lock, resume)
    assert lock.acquire()
    wait_for(lambda: "paused" in seen, timeout=10)
    client = server.client()
    wait_for(lambda: not client.exists(lock.key), timeout=10)  # the lease ran out meanwhile
    other = Redlock("job", nodes=[server.url], ttl=3)
    assert other.acquire(blocking=False)
    resume.set()
    wait_for(lambda: lost, timeout=10)
    late = lost[0] - seen["resumed"]
    # Before the fix the stale "renewed" reply was accepted and the loss came one renew
    # interval (1 s here) later, with both bodies running all that time.
    assert late < lock.timing.renew_interval / 2, f"loss reported {late:.3f}s after resuming"
    other.release()
    del lock.nodeset.call  # the shared NodeSet gets its class method back


def test_extend_read_after_its_deadline_raises(redis_factory):
    """The same for an explicit extend(): a confirmation read too late is a loss."""
    (server,) = redis_factory(1)
    lock = Redlock("job", nodes=[server.url], ttl=1, auto_renew=False)
    resume = threading.Event()
    assert lock.acquire()
    _pause_after_next_call(lock, resume)
    timer = threading.Timer(1.2, resume.set)
    timer.start()
    try:
        with pytest.raises(LockLost):
            lock.extend()
    finally:
        timer.cancel()
        del lock.nodeset.call


# -- reading renewal answers (no server: replies built by hand) -----------------------


def _node(url: str = "redis://n1") -> SimpleNamespace:
    return SimpleNamespace(safe_url=url)


def _lease(entries: int = 1, quorum: int = 2, name: str = "job") -> Lease:
    keys = lock_keys(name)
    nodeset = NodeSet.get(["redis://127.0.0.1:1/0"], timeout=0.1)
    return Lease(
        keys,
        "t" * 32,
        7,
        nodeset,
        Timing.of(3),
        clock(),
        entries=((keys.lock, "x"),) * entries,
        quorum=quorum,
    )


def test_renewal_chunks_are_the_calls_renew_entries_builds_already_encoded():
    """A tick's calls, assembled from each lease's pieces encoded once, carry the keys
    and arguments renew_entries gives the same slices, and bytes redis-py would write."""
    leases = [_lease(name=f"job:{i}:é") for i in range(CHUNK + 10)]
    leases.insert(CHUNK - 1, _lease(entries=2, name="two"))  # straddles the first chunk
    entries = [(lease, entry) for lease in leases for entry in lease.entries]
    conn = Connection()
    for _ in range(2):  # the second time from the pieces each lease kept
        calls = renew_chunks(leases)
        assert [len(call.keys) for call in calls] == [CHUNK, 12]
        for i, call in enumerate(calls):
            expected = renew_entries(entries[i * CHUNK : (i + 1) * CHUNK])
            assert (call.script, call.keys, call.args) == (
                expected.script,
                expected.keys,
                expected.args,
            )
            assert call.resp == pack(conn, [expected.packed_args()])[0]


def test_renewed_everywhere_reads_whole_replies_or_leaves_them_to_tally():
    """Per entry, renewed on every node; None whenever any answer needs a closer look."""
    a, b = _node("redis://a"), _node("redis://b")
    ok = Reply(a, [[1] * CHUNK, [1, 0, -1]])
    assert renewed_everywhere([ok], CHUNK + 3) == [True] * CHUNK + [True, False, False]
    other = Reply(b, [[1] * (CHUNK - 1) + [0], [1, 1, 1]])
    assert renewed_everywhere([ok, other], CHUNK + 3) == [True] * (CHUNK - 1) + [
        False,
        True,
        False,
        False,
    ]
    assert renewed_everywhere([ok, None], CHUNK + 3) is None
    assert renewed_everywhere([Reply(a, [], ConnectionError("refused"))], 1) is None
    assert renewed_everywhere([Reply(a, [[1] * CHUNK, ResponseError("OOM")])], CHUNK + 1) is None
    assert renewed_everywhere([ok], CHUNK + 4) is None, "one code per entry, or no verdict"
    split = Reply(a, [[1, ResponseError("MOVED 1 a:1")]])  # a call split per cluster slot
    assert renewed_everywhere([split], 2) == [True, False]


@pytest.mark.parametrize(
    ("codes", "verdict"),
    [
        ([1, 1], RenewStatus.RENEWED),
        ([1, 0], RenewStatus.GONE),
        ([0, -1], RenewStatus.TAKEN),
        ([-1, 1], RenewStatus.TAKEN),
    ],
)
def test_a_lease_straddling_two_chunks_is_judged_on_both(codes, verdict):
    """Entries CHUNK-1 and CHUNK sit in two calls' replies; every one must be renewed."""
    first = [1] * (CHUNK - 1) + [codes[0]]
    reply = Reply(_node(), [first, [codes[1]]])
    assert lease_verdict(reply, CHUNK - 1, 2) == (verdict, "")


def test_no_verdict_without_an_answer_for_every_entry():
    """No reply, a failed node, or an error reply in the lease's chunk: no verdict, why."""
    assert lease_verdict(None, 0, 1) == (None, "no reply")
    failed = Reply(_node(), [], ConnectionError("refused"))
    assert lease_verdict(failed, 0, 1) == (None, "redis://n1: ConnectionError: refused")
    errored = Reply(_node(), [[1] * CHUNK, ResponseError("OOM")])
    assert lease_verdict(errored, CHUNK, 1) == (None, "redis://n1: OOM")
    assert lease_verdict(errored, 0, 1) == (RenewStatus.RENEWED, "")  # its chunk answered
    per_key = Reply(_node(), [[1, ResponseError("MOVED 1 a:1")]])
    assert lease_verdict(per_key, 1, 1) == (None, "redis://n1: MOVED 1 a:1")


def test_an_unknown_renewal_code_is_an_error_not_a_verdict():
    """A code renew_many.lua never returns means a script mismatch: raise, do not guess."""
    with pytest.raises(ValueError, match="unknown code 5"):
        lease_verdict(Reply(_node(), [[5]]), 0, 1)


def test_tally_counts_each_nodes_verdict_on_the_lease():
    """Renewed, refused (gone or taken) and unanswered nodes are counted apart."""
    lease = _lease(entries=2)
    replies = [
        Reply(_node("redis://a"), [[9, 1, 1]]),  # entry 0 is another lease's
        Reply(_node("redis://b"), [[9, 1, 0]]),
        Reply(_node("redis://c"), [[9, -1, 1]]),
        None,
    ]
    assert lease.tally(replies, offset=1) == Tally(1, 2, ["no reply"])
    assert renew_call([lease]).args == ("t" * 32, 3000, "x") * 2


def test_a_confirmation_in_time_moves_the_deadline_from_the_send_time():
    """Read before the give-up time: deadline = send time + ttl - drift."""
    lease = _lease()
    sent_at = clock()
    assert lease.renewed(sent_at, sent_at + 0.01)
    assert lease.deadline == sent_at + lease.timing.ttl - lease.timing.drift
    assert lease.alive and lease.lost is None


def test_a_confirmation_read_after_the_give_up_time_is_a_loss():
    """Read past deadline - margin (the holder was paused): lost, whatever it said."""
    lease = _lease()
    sent_at = clock()
    late = sent_at + lease.timing.ttl
    assert not lease.renewed(sent_at, late)
    assert not lease.alive and "too late" in lease.lost.reason
    with pytest.raises(LockLost, match="too late"):
        lease.check()
