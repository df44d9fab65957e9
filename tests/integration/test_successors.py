"""A run never refuses the run it causes: chain steps, ``link`` callbacks, chord bodies
and a caller's next call, on a real prefork ``celery worker -c 4`` (default lock options).

Celery sends a run's successors (the chain's next step, ``link`` callbacks, the chord
body) and stores the result its caller waits for before ``task_postrun``; another pool
process can start the successor (or the caller's next call) at once. While the lock was
released in ``task_postrun``, that successor could find the key still held by its
predecessor and was skipped (issue 38: 5 of 10 chains of 10 steps, 2 or 3 of 20
``debit | credit`` pairs). Here each run's ``after_return`` waits until its successor
settled (:mod:`tests.apps.chained`), so the successor always tries its lock before its
predecessor's ``task_postrun``: certain, not a matter of timing. Every test fails, every
round, where the lock is released only in ``task_postrun``.

Each body also records whether the key on the server holds its own token and task id at
its start and at its end: the lock is not given up early to make room.
"""

from __future__ import annotations

import itertools

import pytest
from celery import chain, chord, states
from celery.utils import uuid

from celery_redlock import LockBusy
from tests.apps.chained import make_chained_app
from tests.harness import close_app, wait_for

#: Chains (or pairs, or calls) run one after another, each on a key of its own only in
#: time: a successor of the same key never waits behind an unrelated run.
ROUNDS = 10


@pytest.fixture
def app(celery_redis, worker_process_factory):
    app = make_chained_app(celery_redis.url)
    worker_process_factory("tests.apps.chained", pool="prefork", concurrency=4)
    yield app
    close_app(app)


def runs_of(out):
    """``{task id: (name, held at start, held at end)}`` of each body recorded."""
    lines = out.read_text().splitlines() if out.exists() else []
    runs = [line.split()[1:] for line in lines if line.startswith("run ")]
    return {i: (n, s == "1", e == "1") for i, n, _, _, _, s, e in runs}


def gates_of(out):
    """``{task id: (successor id, its state)}``: what each run's end waited for."""
    lines = out.read_text().splitlines() if out.exists() else []
    gates = [line.split()[1:] for line in lines if line.startswith("gate ")]
    return {i: (successor, state) for i, successor, state in gates}


def settle(results, timeout=60):
    """Wait until the last of ``results`` succeeded or one failed; the first failure.

    A refused step ends FAILURE with LockBusy (and so do the chain's steps after it,
    which never run): waiting for the last result alone would do for neither.
    """

    def settled():
        found = [r.state for r in results]
        failed = [(r.id, r.result) for r in results if r.state == states.FAILURE]
        if failed:
            return failed[0]
        return "ok" if found[-1] == states.SUCCESS else None

    outcome = wait_for(settled, timeout=timeout, interval=0.01, message="the runs to settle")
    return None if outcome == "ok" else outcome


def steps_of(result):
    """A chain's results, first step first (the last step's result links its parents)."""
    steps = []
    while result is not None:
        steps.append(result)
        result = result.parent
    return steps[::-1]


def assert_never_refused(out, rounds):
    """``rounds``: lists of results, each run causing the next. None was refused; each
    body held its key from its start to its end; and each run's end waited for the run
    it caused to succeed (so that run tried its lock while its predecessor had not
    finished)."""
    refused = [failure for failure in map(settle, rounds) if failure is not None]
    assert refused == [], f"{len(refused)} of {len(rounds)} rounds had a run refused: {refused}"
    runs = runs_of(out)
    ids = [r.id for results in rounds for r in results]
    assert set(ids) <= set(runs), "every run's body ran"
    not_held = {i: runs[i] for i in ids if not (runs[i][1] and runs[i][2])}
    assert not not_held, f"bodies that did not hold their key throughout: {not_held}"
    expected = {
        before.id: (after.id, states.SUCCESS)
        for results in rounds
        for before, after in itertools.pairwise(results)
    }
    # A predecessor notes what it waited for once it has seen its successor's result.
    gates = wait_for(
        lambda: (g := gates_of(out)).keys() >= expected.keys() and g,
        timeout=30,
        message="each predecessor's end to see its successor's result",
    )
    assert {i: gates[i] for i in expected} == expected


def test_a_chain_of_identical_steps_is_never_refused(app, tmp_path):
    """10 chains of 10 ``identity.si(1337)`` steps (one key), one chain after another:
    no step is refused, and each holds the key throughout its body."""
    out = tmp_path / "runs"
    identity = app.tasks["chained.identity"]
    rounds = []
    for _ in range(ROUNDS):
        rounds.append(steps_of(chain(identity.si(1337, str(out)) for _ in range(10))()))
        settle(rounds[-1])
    assert_never_refused(out, rounds)


def test_a_chain_over_one_shared_lock_key_is_never_refused(app, tmp_path):
    """``debit.si(acct=7) | credit.si(acct=7)``, two tasks sharing ``account:{acct}``, 20
    times one after another: no credit is refused by the debit before it."""
    out = tmp_path / "runs"
    debit, credit = app.tasks["chained.debit"], app.tasks["chained.credit"]
    rounds = []
    for _ in range(2 * ROUNDS):
        rounds.append(steps_of((debit.si(7, str(out)) | credit.si(7, str(out)))()))
        settle(rounds[-1])
    assert_never_refused(out, rounds)


@pytest.mark.parametrize("how", ["link", "chord"])
def test_a_callback_on_the_same_key_is_never_refused(how, app, tmp_path):
    """A ``link`` callback, or a chord body, locked on the same account as the run whose
    end sends it, 20 times one after another: never refused."""
    out = tmp_path / "runs"
    debit, credit = app.tasks["chained.debit"], app.tasks["chained.credit"]
    rounds = []
    for _ in range(2 * ROUNDS):
        then = credit.si(7, str(out))
        callback = then.freeze()  # its task id, before it is sent
        if how == "link":
            first = debit.apply_async((7, str(out)), link=then)
        else:
            header = debit.si(7, str(out))
            first = header.freeze()
            chord([header], then)()
        rounds.append([first, app.AsyncResult(callback.id)])
        settle(rounds[-1])
    assert_never_refused(out, rounds)


def test_the_call_after_get_returns_is_never_refused(app, tmp_path):
    """A caller that sends the next call of the same key as soon as ``get()`` returned
    the last one's result, 40 times: never refused."""
    out = tmp_path / "runs"
    identity = app.tasks["chained.identity"]
    ids = [uuid() for _ in range(4 * ROUNDS)]
    calls, refused = [], []
    for task_id, successor in zip(ids, [*ids[1:], None], strict=True):
        # The successor header names the next call, for this run's end to wait for it.
        headers = {"successor": successor} if successor else {}
        calls.append(identity.apply_async((1337, str(out)), task_id=task_id, headers=headers))
        try:
            calls[-1].get(timeout=30, disable_sync_subtasks=False)
        except LockBusy as busy:
            refused.append(busy)
    assert refused == [], f"{len(refused)} of {len(calls)} calls refused: {refused}"
    assert_never_refused(out, [calls])
