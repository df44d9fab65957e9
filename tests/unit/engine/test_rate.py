"""Rate budgets (``rate.lua``, ``rate_return.lua``, :mod:`celery_redlock.engine.rate`)
against real redis-servers: one node, and three (Redlock) with nodes cut off in turn."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from celery_redlock import AsyncRateLimit, ConfigurationError, NodeUnavailable, RateLimit
from celery_redlock.engine.keys import lock_keys
from celery_redlock.engine.rate import Budget, parse_rate
from celery_redlock.engine.scripts import RATE, RATE_OWNED, RATE_PEEK, RATE_RETURN
from tests.harness.servers import wait_for

KEYS = lock_keys("api:stripe")


def rate(client, member, limit=3, window=60_000, peek=False):
    return client.eval((RATE_PEEK if peek else RATE).source, 1, KEYS.rate, limit, window, member)


def node_ms(client):
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def test_the_script_admits_n_starts_per_window_and_says_when_the_next_fits(redis_node):
    """3 per minute: three starts are logged, the fourth is refused with the time until
    the oldest leaves the window; the key lives one window; a member sent again is not
    logged twice; peek writes nothing."""
    c = redis_node.client()
    assert [rate(c, m) for m in "abc"] == [[1, 1, 0], [1, 2, 0], [1, 3, 0]]
    status, used, wait = rate(c, "d")
    assert (status, used) == (0, 3)
    oldest = float(c.zrange(KEYS.rate, 0, 0, withscores=True)[0][1])
    assert wait == pytest.approx(oldest + 60_000 - node_ms(c), abs=50)
    assert 0 < c.pttl(KEYS.rate) <= 60_010, "expires a window and its guard after its last start"
    assert rate(c, "b") == [1, 3, 0], "the same admission sent again"
    assert c.zcard(KEYS.rate) == 3
    status, used, wait = rate(c, "-", peek=True)
    assert (status, used) == (2, 3) and 59_000 < wait <= 60_010
    assert c.zcard(KEYS.rate) == 3, "peek logs nothing"
    assert c.eval(RATE_RETURN.source, 1, KEYS.rate, "a") == 1
    assert c.eval(RATE_RETURN.source, 1, KEYS.rate, "a") == 0
    assert rate(c, "d")[0] == 1, "a start given back frees its place"


def test_the_window_slides_on_the_node_clock(redis_node):
    """Starts leave the window one window after they were logged: never sooner."""
    c = redis_node.client()
    assert rate(c, "a", limit=1, window=300)[0] == 1
    first = float(c.zscore(KEYS.rate, "a"))
    assert rate(c, "b", limit=1, window=300)[0] == 0
    wait_for(lambda: rate(c, "b", limit=1, window=300)[0] == 1, timeout=5, interval=0.01)
    assert float(c.zscore(KEYS.rate, "b")) - first >= 300
    assert c.zrange(KEYS.rate, 0, -1) == ["b"], "the old start was dropped"
    wait_for(lambda: not c.exists(KEYS.rate), timeout=5)


@pytest.mark.parametrize("bad", [(0, 1000, "m"), (2, 0, "m"), (2, 1000, ""), ("x", 1, "m")])
def test_the_script_refuses_bad_arguments_with_its_own_message(redis_node, bad):
    c = redis_node.client()
    limit, window, member = bad
    with pytest.raises(Exception, match="celery_redlock rate"):
        c.eval(RATE.source, 1, KEYS.rate, limit, window, member)
    assert not c.exists(KEYS.rate)


@pytest.mark.parametrize(
    "value",
    ["fast", "0/s", "-3/m", "5/fortnight", "5/S", "1.5/s", " 5/s", "5", 5, None, "2000000/s"],
)
def test_bad_rates_are_refused_naming_the_option_and_the_form(value):
    with pytest.raises(ConfigurationError, match=r'lock_rate must be a rate "N/s", "N/m" or "N/h"'):
        parse_rate("lock_rate", value)


def test_rates_parse_as_celery_writes_them():
    assert parse_rate("r", "5/s") == Budget(5, 1.0)
    assert parse_rate("r", "100/m") == Budget(100, 60.0)
    assert parse_rate("r", "1/h") == Budget(1, 3600.0)
    assert str(parse_rate("r", "100/m")) == "100/m"


def test_try_acquire_admits_exactly_n_among_racing_threads(redis_node):
    """20 threads race for a 7-per-minute budget: exactly 7 are admitted, and the others
    are told how long until a start fits (about one minute)."""
    limit = RateLimit("api:race", rate="7/m", nodes=[redis_node.url])
    barrier = threading.Barrier(20)
    waits: list[float] = []

    def take():
        barrier.wait()
        waits.append(limit.try_acquire())

    threads = [threading.Thread(target=take) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(waits)[:8].count(0.0) == 7
    assert all(55 < w <= 60.01 for w in waits if w)  # a minute and the guard
    assert limit.used()[0] == 7


def test_acquire_waits_for_a_slot_or_gives_up_at_its_timeout(redis_node):
    """2/s: the third acquire waits until the first start leaves the window (by the
    node's clock); a timeout shorter than the wait gives up at once."""
    limit = RateLimit("api:wait", rate="2/s", nodes=[redis_node.url])
    c = redis_node.client()
    assert limit.try_acquire() == 0.0 and limit.try_acquire() == 0.0
    first = min(s for _, s in c.zrange(limit.key, 0, -1, withscores=True))
    assert limit.acquire(timeout=0.01) is False
    assert limit.acquire(blocking=False) is False
    assert limit.acquire(timeout=5) is True
    third = max(s for _, s in c.zrange(limit.key, 0, -1, withscores=True))
    assert third - first >= 1000


def test_asyncio_and_sync_callers_share_one_budget(redis_node):
    """A RateLimit and an AsyncRateLimit of one name take from the same 3 per minute."""
    sync = RateLimit("api:shared", rate="3/m", nodes=[redis_node.url])
    assert sync.try_acquire() == 0.0

    async def main():
        limit = AsyncRateLimit("api:shared", rate="3/m", nodes=[redis_node.url])
        got = [await limit.try_acquire() for _ in range(3)]
        timed_out = await limit.acquire(timeout=0.01)
        return got, timed_out, await limit.used()

    got, timed_out, (used, wait) = asyncio.run(main())
    assert got[:2] == [0.0, 0.0] and got[2] > 50
    assert timed_out is False
    assert used == 3 and wait > 50
    assert sync.try_acquire() > 50


def test_a_budget_without_reachable_nodes_raises_node_unavailable():
    limit = RateLimit("api:down", rate="3/m", nodes=["redis://127.0.0.1:1"], node_timeout=0.2)
    with pytest.raises(NodeUnavailable):
        limit.try_acquire()


# -- Redlock: three nodes ----------------------------------------------------------------


def test_three_nodes_admit_n_when_all_answer_and_give_back_a_refused_start(redis_factory):
    """N=2 on three healthy nodes: two starts, then refusals. A node that admitted a
    start the majority refused (its log was behind) gives it back."""
    servers = redis_factory(3)
    limit = RateLimit("api:three", rate="2/m", nodes=[s.url for s in servers])
    assert [limit.try_acquire() for _ in range(2)] == [0.0, 0.0]
    assert limit.try_acquire() > 50
    assert [s.client().zcard(limit.key) for s in servers] == [2, 2, 2]
    a = servers[0].client()
    a.delete(limit.key)  # node a forgot its log (restarted without persistence)
    assert limit.try_acquire() > 50, "b and c refuse"
    assert a.zcard(limit.key) == 0, "a gave back the start it admitted"


def test_a_majority_admits_up_to_n_times_nodes_over_quorum_not_n(redis_factory, fault_proxy):
    """What holds with Redlock, shown: N=2 on three nodes, each start reaching another
    pair (the third node cut off in turn) is admitted by a majority, so three starts
    are admitted in one window: floor(3 * 2 / 2) = 3 = 1.5 N. Never more: every node then
    has 2 starts logged, and a fourth is refused."""
    servers = redis_factory(3)
    proxies = [fault_proxy(s) for s in servers]
    limit = RateLimit("api:split", rate="2/m", nodes=[p.url for p in proxies], node_timeout=0.2)
    admitted = 0
    for cut in proxies:
        cut.blackhole()
        admitted += limit.try_acquire() == 0.0
        cut.restore()
    assert admitted == 3, "a majority each: more than N"
    assert [s.client().zcard(limit.key) for s in servers] == [2, 2, 2]
    wait_for(lambda: limit.try_acquire() > 0, timeout=5)  # a reconnect may time out once
    assert [s.client().zcard(limit.key) for s in servers] == [2, 2, 2], "a fourth: refused"


def test_racing_starts_on_three_nodes_stay_within_the_redlock_bound(redis_factory):
    """30 threads race for 5 per minute on three nodes: at most floor(3 * 5 / 2) = 7
    admitted and no node logs more than 5. Racing starts that each reach a different
    node first can all be refused (fewer than 5 in the race); once their give-backs
    are done, starts taken one by one fill the budget to at least 5."""
    servers = redis_factory(3)
    limit = RateLimit("api:race3", rate="5/m", nodes=[s.url for s in servers])
    barrier = threading.Barrier(30)
    waits: list[float] = []

    def take():
        barrier.wait()
        waits.append(limit.try_acquire())

    threads = [threading.Thread(target=take) for _ in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    admitted = waits.count(0.0)
    assert 1 <= admitted <= 7
    assert all(s.client().zcard(limit.key) <= 5 for s in servers)
    while limit.try_acquire() == 0.0:
        admitted += 1
    assert 5 <= admitted <= 7
    assert all(s.client().zcard(limit.key) <= 5 for s in servers)


def test_too_few_nodes_answering_raises_node_unavailable(redis_factory, fault_proxy):
    servers = redis_factory(3)
    proxies = [fault_proxy(s) for s in servers]
    limit = RateLimit("api:gone", rate="2/m", nodes=[p.url for p in proxies], node_timeout=0.2)
    proxies[0].blackhole()
    proxies[1].blackhole()
    with pytest.raises(NodeUnavailable):
        limit.try_acquire()
    assert servers[2].client().zcard(limit.key) == 0, "the one node that admitted gave it back"


def _refuse(client, task_id, limit=2, window=1000):
    """A refusal of ``task_id`` (rate_calls' arguments: no margin, 60 s grace)."""
    keys = (KEYS.rate, KEYS.budget, KEYS.queued)
    member = f"m-{task_id}"
    return client.eval(RATE.source, 3, *keys, limit, window, member, task_id, 0, 60_000)


def test_refused_runs_get_places_in_line_n_per_window(redis_node):
    """2 per second, used up at once: six runs refused in turn are due two by two, one
    window apart (the k-th when the (k mod N)+1-th start leaves, k div N windows later,
    plus a small allowance per window for the starts' delivery lag), not all at the next
    slot; one refused again keeps its place; one that is admitted
    leaves the line. Before, all six were due at the next slot (B²/2N deliveries)."""
    with redis_node.client() as c:
        _places_in_line(c)


def _places_in_line(c):
    assert [rate(c, m, limit=2, window=1000)[0] for m in "ab"] == [1, 1]
    waits = [_refuse(c, f"run-{k}")[2] for k in range(6)]
    first = waits[0]
    assert 900 < first <= 1010  # the window and its guard
    for k, wait in enumerate(waits):
        # A window and its guard (10 ms) later per two ahead, and 30 ms for the lag of
        # each window's starts.
        assert wait == pytest.approx(first + (k // 2) * 1040, abs=20), (k, waits)
    again = _refuse(c, "run-3")[2]
    assert again == pytest.approx(first + 1040, abs=20), "run-3 keeps its place"
    assert c.zcard(KEYS.queued) == 6, "one entry per run, however often refused"


def test_two_starts_of_a_one_per_second_budget_are_a_full_second_apart(redis_node):
    """On the node's clock, to the microsecond: the log once kept whole ms, so a start
    could be admitted up to 1 ms less than a window after the previous one (measured
    999.4-999.55 ms, 4 of 4). Measured from before the first admission's call to after
    the second's, so the span bounds the gap from above."""
    with redis_node.client() as c:
        _full_seconds_apart(c, redis_node.url)


def _full_seconds_apart(c, url):
    def micros():
        seconds, us = c.time()
        return seconds * 1_000_000 + us

    limit = RateLimit("api:stripe", rate="1/s", nodes=[url])
    for attempt in range(4):
        c.delete(KEYS.rate)
        # Start late in a millisecond: the whole-ms log lost most there.
        wait_for(lambda: 650 <= micros() % 1000 < 700, timeout=5, interval=0)
        before_first = micros()
        assert limit.try_acquire() == 0.0
        wait_for(lambda: limit.try_acquire() == 0.0, timeout=3, interval=0)
        after_second = micros()
        assert after_second - before_first >= 1_000_000, (attempt, after_second - before_first)


def _start(client, member, *, limit, window, at=0, ahead=0, owned=False):
    """rate.lua (or rate_owned) for ``member`` with a start from ``at`` to ``ahead`` ms on."""
    script = RATE_OWNED if owned else RATE
    keys = (KEYS.rate, KEYS.budget, KEYS.queued)
    return client.eval(script.source, 3, *keys, limit, window, member, "", "", "", at, ahead)


def _spaced(scores, limit, window):
    """Whether every limit+1 consecutive starts span at least one window."""
    scores = sorted(scores)
    return all(b - a >= window - 0.001 for a, b in zip(scores, scores[limit:], strict=False))


def test_a_start_reserved_ahead_holds_its_slot_and_a_newcomer_goes_after_it(redis_node):
    """2 per 2 s, used up: a start reserved up to 3 s ahead takes the next slot, when the
    oldest start leaves (a window and its guard, 10 ms, after it); a second reservation
    the slot after; a third finds none within its horizon and is told when. A newcomer
    now is refused until after the reserved starts (not the slot an admission at the end
    of the window would see), and peek agrees. Every three consecutive starts logged
    span a window."""
    c = redis_node.client()
    kw = {"limit": 2, "window": 2000}
    assert [_start(c, m, **kw)[0] for m in "ab"] == [1, 1]
    a, b = (float(c.zscore(KEYS.rate, m)) for m in "ab")
    status, used, start_in = _start(c, "r1", at=0, ahead=3000, **kw)
    assert (status, used) == (1, 3)
    assert float(c.zscore(KEYS.rate, "r1")) == pytest.approx(a + 2010, abs=0.01)
    assert start_in == pytest.approx(a + 2010 - node_ms(c), abs=50)
    assert _start(c, "r2", at=0, ahead=3000, **kw)[0] == 1
    assert float(c.zscore(KEYS.rate, "r2")) == pytest.approx(b + 2010, abs=0.01)
    status, _, wait = _start(c, "r3", at=0, ahead=3000, **kw)
    assert status == 0 and wait == pytest.approx(a + 4020 - node_ms(c), abs=50)
    status, _, wait = _start(c, "newcomer", **kw)
    assert status == 0 and wait == pytest.approx(a + 4020 - node_ms(c), abs=50)
    assert rate(c, "-", limit=2, window=2000, peek=True)[2] == pytest.approx(wait, abs=50)
    scores = [s for _, s in c.zrange(KEYS.rate, 0, -1, withscores=True)]
    assert len(scores) == 4 and _spaced(scores, 2, 2000)
    assert c.pttl(KEYS.rate) > 2000, "kept one window past the latest reserved start"


def test_a_reserved_copy_waits_if_early_and_starts_now_if_late(redis_node):
    """1 per 600 ms. A copy that comes before the start reserved for it is told to
    wait until then and keeps it; after it, its start moves to now (the body's moment).
    A copy so late that a start was reserved after its own within one window of now
    gives its reservation up and is judged as a newcomer: placed after that start."""
    c = redis_node.client()
    kw = {"limit": 1, "window": 600}
    assert _start(c, "a", **kw)[0] == 1
    assert _start(c, "r", at=0, ahead=1000, **kw)[0] == 1
    reserved = float(c.zscore(KEYS.rate, "r"))
    status, _, wait = _start(c, "r", owned=True, **kw)
    assert status == 0 and 0 < wait <= 610
    assert float(c.zscore(KEYS.rate, "r")) == reserved, "still reserved"
    wait_for(lambda: node_ms(c) > reserved + 20, timeout=5, interval=0.005)
    assert _start(c, "r", owned=True, **kw)[0] == 1
    assert float(c.zscore(KEYS.rate, "r")) >= reserved + 20, "moved to the body's moment"

    c.delete(KEYS.rate)
    assert _start(c, "a", **kw)[0] == 1
    assert _start(c, "late", at=0, ahead=1000, **kw)[0] == 1
    late = float(c.zscore(KEYS.rate, "late"))
    wait_for(lambda: node_ms(c) > late + 20, timeout=5, interval=0.005)
    assert _start(c, "next", at=0, ahead=1000, **kw)[0] == 1
    following = float(c.zscore(KEYS.rate, "next"))
    status, _, wait = _start(c, "late", owned=True, **kw)
    assert status == 0 and wait == pytest.approx(following + 610 - node_ms(c), abs=50)
    assert c.zscore(KEYS.rate, "late") is None, "its reservation is given up"
    assert float(c.zscore(KEYS.rate, "next")) == following


def test_starts_admitted_reserved_and_moved_in_any_order_keep_n_per_window(redis_node):
    """Admissions now, reservations ahead and reserved copies coming early, on time or
    late, at random, for about three seconds on a 3 per 200 ms budget: the starts logged
    (their last place; a reservation given up is none) never hold more than 3 in any
    window of 200 ms."""
    c = redis_node.client()
    kw = {"limit": 3, "window": 200}
    rng = random.Random(7)
    starts: dict[str, float] = {}
    reserved: list[str] = []
    deadline = time.monotonic() + 3.0
    n = 0
    while time.monotonic() < deadline:
        n += 1
        roll = rng.random()
        if roll < 0.4 and reserved:
            member = reserved.pop(rng.randrange(len(reserved)))
            status = _start(c, member, owned=True, **kw)[0]
            if status == 0 and c.zscore(KEYS.rate, member) is not None:
                reserved.append(member)  # early: it comes again later
        elif roll < 0.6:
            member = f"r{n}"
            status = _start(c, member, at=rng.randrange(0, 100), ahead=rng.randrange(0, 200), **kw)[
                0
            ]
            if status == 1:
                reserved.append(member)
        else:
            member = f"n{n}"
            status = _start(c, member, **kw)[0]
        for m, s in c.zrange(KEYS.rate, 0, -1, withscores=True):
            starts[m] = s
        if status == 0 and member not in reserved:
            starts.pop(member, None)
        time.sleep(rng.uniform(0, 0.01))  # spreads the calls over the windows
    assert len(starts) > 20
    assert _spaced(starts.values(), 3, 200)
