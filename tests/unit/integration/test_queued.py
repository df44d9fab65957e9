"""What the lock nodes know of a budget and of the runs waiting on the queue for a key:
``rate.lua`` records the budget and a refused run in the admission's own call,
``note_queued.lua`` records a busy run, ``budget_read.lua`` reads it all back, against a
real redis-server."""

from __future__ import annotations

import pytest

from celery_redlock import RateLimit
from celery_redlock.engine.keys import QUEUED_GRACE, lock_keys
from celery_redlock.engine.rate import Budget, rate_calls
from celery_redlock.engine.scripts import BUDGET_READ, NOTE_QUEUED, NOTE_STARTED, RATE
from celery_redlock.integration.queued import note_queued, note_started
from celery_redlock.nodes import NodeSet
from tests.harness.lua import run
from tests.harness.servers import wait_for

KEYS = lock_keys("api:acme")
GRACE = round(QUEUED_GRACE * 1000)


def node_ms(client):
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def start(client, member, task_id="", limit=2, window=60_000, jitter=0, grace=GRACE):
    """One admission of ``member`` (for the run ``task_id``) as rate_calls sends it."""
    call = rate_calls(KEYS, Budget(limit, window / 1000), member, task_id=task_id)
    args = list(call.args)
    if task_id:
        args[4:6] = [jitter, grace]
    return client.eval(RATE.source, len(call.keys), *call.keys, *args)


def read(client, grace=GRACE):
    return run(client, BUDGET_READ, KEYS, grace_ms=grace, most=0)[:4]


def test_an_admission_records_its_budget_beside_the_log_and_it_expires_with_it(redis_node):
    """The node learns N and the window from the admission (one call, nothing more):
    a string beside the log with the same expiry; the log still holds only the starts,
    so a third start of 2 per minute is refused exactly as before."""
    c = redis_node.client()
    redis_node.reset_stats()
    assert start(c, "a")[0] == 1 and start(c, "b")[0] == 1
    assert redis_node.commandstats()["eval"] == 2, "one call per admission"
    assert c.get(KEYS.budget) == "2/60000"
    assert c.zrange(KEYS.rate, 0, -1) == ["a", "b"], "the log is exactly the starts"
    assert abs(c.pttl(KEYS.budget) - c.pttl(KEYS.rate)) < 50, "expires with the log"
    assert start(c, "c")[:2] == [0, 2]
    assert read(c) == ["2/60000", 2, pytest.approx(60_000, abs=1000), 0]
    short = lock_keys("api:short")
    run(
        c, RATE, short, limit=1, window_ms=300, member="x", task_id="", jitter_ms="", grace_ms="",
        at_ms=0, ahead_ms=0,
    )  # fmt: skip
    wait_for(lambda: not c.exists(short.rate, short.budget), timeout=5)


def test_a_refused_run_waits_on_the_queue_until_its_slot_and_leaves_it_when_admitted(
    redis_node,
):
    """The refusal records the run, due when its slot frees plus its jitter; a run
    refused again replaces its entry (counted once); its admission removes it."""
    c = redis_node.client()
    assert start(c, "a", limit=1, window=400)[0] == 1
    status, _, wait = start(c, "b", task_id="run-1", limit=1, window=400, jitter=250)
    assert status == 0
    due = c.zscore(KEYS.queued, "run-1")
    assert due == pytest.approx(node_ms(c) + wait + 250, abs=50)
    now = node_ms(c)  # before the PTTL, which counts down from the same clock
    assert 0 < c.pttl(KEYS.queued) <= due - now + GRACE + 1, "+1: the clocks' ms rounding"
    assert start(c, "c", task_id="run-1", limit=1, window=400)[0] == 0
    assert c.zcard(KEYS.queued) == 1, "deferred again: still one run"
    assert start(c, "d", task_id="run-2", limit=1, window=400)[0] == 0
    assert read(c)[3] == 2
    wait_for(lambda: start(c, "e", task_id="run-1", limit=1, window=400)[0] == 1, timeout=5)
    assert c.zrange(KEYS.queued, 0, -1) == ["run-2"], "run-1 started"
    assert start(c, "f", limit=1, window=400)[0] == 0
    assert c.zrange(KEYS.queued, 0, -1) == ["run-2"], "a start without a task id queues nothing"


def test_busy_runs_are_noted_and_entries_past_their_grace_are_neither_counted_nor_kept(
    redis_node,
):
    """note_queued.lua: an entry per run, due after its delay; an entry due longer ago
    than the grace is not counted, is dropped by the next write, and the key expires
    its grace after the latest due."""
    c = redis_node.client()
    note = lambda task_id, delay, grace=300: run(  # noqa: E731
        c, NOTE_QUEUED, queued=[KEYS.queued], task_id=task_id, delay_ms=delay, grace_ms=grace
    )
    assert note("gone", 0) == 1
    assert note("later", 5_000) == 1
    assert read(c, grace=300)[:4] == ["", 0, -1, 2]
    wait_for(lambda: read(c, grace=300)[3] == 1, timeout=5)
    assert c.zcard(KEYS.queued) == 2, "reading drops nothing"
    assert note("later", 5_000) == 1
    assert c.zrange(KEYS.queued, 0, -1) == ["later"], "the next write drops it"
    assert 5_000 < c.pttl(KEYS.queued) <= 5_300
    assert run(c, NOTE_STARTED, queued=[KEYS.queued], task_id="later") == 1
    assert not c.exists(KEYS.queued), "the last run started: nothing left"
    with pytest.raises(Exception, match="celery_redlock note_queued"):
        note("x", -1)


def test_the_engine_notes_and_removes_a_run_on_every_node(redis_factory):
    """note_queued / note_started write each node (a node that is down is skipped)."""
    servers = redis_factory(3)
    nodeset = NodeSet([s.url for s in servers], timeout=0.5)
    note_queued(nodeset, KEYS, "run-9", 2.0)
    for server in servers:
        c = server.client()
        assert c.zscore(KEYS.queued, "run-9") == pytest.approx(node_ms(c) + 2000, abs=100)
    servers[0].stop()
    note_started(nodeset, [KEYS], "run-9")
    assert [s.client().exists(KEYS.queued) for s in servers[1:]] == [0, 0]
    nodeset.close()


def test_reading_a_budget_writes_nothing_and_says_when_a_start_fits(redis_node):
    """budget_read.lua counts the starts of the current window only, and the wait for
    the next slot (when the oldest start of the window leaves it), without trimming
    the log as an admission does."""
    c = redis_node.client()
    limit = RateLimit("api:acme", rate="3/s", nodes=[redis_node.url])
    assert limit.try_acquire() == 0.0
    first = c.zscore(KEYS.rate, c.zrange(KEYS.rate, 0, 0)[0])
    wait_for(lambda: node_ms(c) >= first + 500, timeout=5)
    assert [limit.try_acquire() for _ in range(2)] == [0.0, 0.0]
    budget, used, wait, queued = read(c)
    assert (budget, used, queued) == ("3/1000", 3, 0)
    assert wait == pytest.approx(first + 1000 - node_ms(c), abs=50)
    wait_for(lambda: read(c)[1] == 2, timeout=5)
    assert read(c)[2] == 0, "a start fits now"
    assert c.zcard(KEYS.rate) == 3, "the start that left the window stays until the next start"
