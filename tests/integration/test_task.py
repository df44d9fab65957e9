"""LockedTask with real in-process workers (solo and threads pools) and a real Redis."""

from __future__ import annotations

import logging
import threading
import time

import celery
import pytest
from celery.exceptions import ImproperlyConfigured

from celery_redlock import (
    ConfigurationError,
    LockBusy,
    LockKeyError,
    LockLost,
    NodeUnavailable,
    Redlock,
)
from celery_redlock.engine.renewal import get_renewer
from celery_redlock.integration import abort, policies
from tests.apps.locked import create_app
from tests.harness import close_app, lock_keys, read_intervals, steal_locks, wait_for
from tests.harness.celery_workers import redis_url_with_db
from tests.harness.fences import assert_clock_fence
from tests.harness.servers import free_port

CELERY = tuple(int(part) for part in celery.__version__.split(".")[:2])


@pytest.fixture
def app(celery_redis):
    app = create_app(celery_redis.url)
    yield app
    close_app(app)


def get(result, timeout=30, **kwargs):
    return result.get(timeout=timeout, disable_sync_subtasks=False, **kwargs)


@pytest.mark.smoke
def test_skip_refuses_a_duplicate_and_records_lockbusy(
    app, celery_redis, inprocess_worker_factory, tmp_path, caplog
):
    """A second run on a held key is skipped: get() raises LockBusy naming the holder."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    path = str(tmp_path / "runs")
    first = app.tasks["tests.apps.locked.hold"].delay("acct-1", path, "first", 1.5)
    wait_for((tmp_path / "runs").exists, timeout=10)
    with caplog.at_level(logging.INFO, logger="celery_redlock.task"):
        second = app.tasks["tests.apps.locked.hold"].delay("acct-1", path, "second", 0)
        with pytest.raises(LockBusy) as info:
            get(second)
    assert info.value.holder == first.id
    assert second.state == "FAILURE", "a skipped run is never a SUCCESS"
    assert isinstance(get(second, propagate=False), LockBusy)
    assert any("skipped" in r.message and first.id in r.message for r in caplog.records)
    assert get(first)["label"] == "first"
    assert set(read_intervals(path)) == {"first"}, "the duplicate body never ran"


def test_different_arguments_do_not_contend(app, inprocess_worker_factory, tmp_path):
    """Locks are per key: two accounts run at the same time."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    path = str(tmp_path / "runs")
    hold = app.tasks["tests.apps.locked.hold"]
    results = [hold.delay(f"acct-{i}", path, f"run{i}", 1.0) for i in range(2)]
    assert [get(r)["label"] for r in results] == ["run0", "run1"]
    runs = read_intervals(path)
    assert runs["run0"].overlaps(runs["run1"])


def test_retry_policy_retries_until_the_lock_is_free(app, inprocess_worker_factory, tmp_path):
    """lock_on_busy='retry' reschedules with a countdown; both bodies run, one after the other."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    path = str(tmp_path / "runs")
    first = app.tasks["tests.apps.locked.hold_raise"].delay("r", path, "first", 1.0)
    wait_for((tmp_path / "runs").exists, timeout=10)
    second = app.tasks["tests.apps.locked.hold_retry"].delay("r", path, "second", 0)
    assert get(second)["label"] == "second"
    assert get(first)["label"] == "first"
    runs = read_intervals(path)
    assert not runs["first"].overlaps(runs["second"])
    assert second.info["fence"] > first.info["fence"]
    assert app.backend.get_task_meta(second.id)["retries"] >= 1


def test_a_lock_key_is_the_resource_a_web_process_locks(
    app, celery_redis, inprocess_worker_factory
):
    """lock_key="res:{resource}" and Redlock("res:web") outside Celery are one lock: the
    task is busy while the web process holds it, and its fence follows the web's."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    task = app.tasks["tests.apps.locked.hold_raise"]
    web = Redlock("res:web", nodes=[redis_url_with_db(celery_redis.url, 0)])
    with web:
        with pytest.raises(LockBusy) as info:
            get(task.delay("web"))
        assert info.value.key == web.key == "redlock:{res:web}"
        web_fence = web.fence
    ran = get(task.delay("web"))
    assert ran["key"] == web.key
    assert ran["fence"] > web_fence


def test_raise_policy_fails_with_lockbusy_through_the_result_backend(
    app, inprocess_worker_factory, tmp_path
):
    """lock_on_busy='raise': FAILURE with LockBusy rebuilt from the JSON backend, fields intact."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    path = str(tmp_path / "runs")
    first = app.tasks["tests.apps.locked.hold_wait"].delay("r", path, "first", 1.0)
    wait_for((tmp_path / "runs").exists, timeout=10)
    second = app.tasks["tests.apps.locked.hold_raise"].delay("r", path, "second", 0)
    with pytest.raises(LockBusy) as info:
        get(second)
    assert info.value.key == "redlock:{res:r}"  # lock_key="res:{resource}" names the resource
    assert info.value.holder == first.id
    get(first)


@pytest.mark.smoke
def test_wait_policy_runs_right_after_the_release(app, inprocess_worker_factory, tmp_path):
    """lock_on_busy='wait' is woken by the release: it starts soon after the holder ends."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    path = str(tmp_path / "runs")
    first = app.tasks["tests.apps.locked.hold_raise"].delay("w", path, "first", 1.0)
    wait_for((tmp_path / "runs").exists, timeout=10)
    second = app.tasks["tests.apps.locked.hold_wait"].delay("w", path, "second", 0)
    get(first)
    get(second)
    runs = read_intervals(path)
    assert runs["first"].end_ns < runs["second"].start_ns
    # Woken by the release, not by the holder's lease (1 s) running out after it:
    # a generous bound against a loaded machine, far below a polling interval of 1 s
    # plus the task's own startup.
    assert (runs["second"].start_ns - runs["first"].end_ns) / 1e9 < 0.9


@pytest.mark.parametrize("kind", ["fail", "retry", "ignore", "reject", "ok"])
@pytest.mark.smoke
def test_every_outcome_releases_the_lock(app, celery_redis, inprocess_worker_factory, kind):
    """task_postrun releases after SUCCESS, FAILURE, RETRY, IGNORED and REJECTED."""
    inprocess_worker_factory(app, pool="solo")
    result = app.tasks["tests.apps.locked.outcome"].delay(f"res-{kind}", kind)
    if kind in ("fail", "ok"):
        get(result, propagate=False)
    if kind in ("fail", "retry", "ok") or (kind == "reject" and CELERY >= (5, 7)):
        # Celery stores no state for an ignored task, nor (before 5.7) for a rejected one.
        wait_for(lambda: app.backend.get_task_meta(result.id)["status"] != "PENDING", timeout=10)

    def taken_and_released():
        # The fence counter is created with the lock: it tells a lock already released
        # from one not taken yet.
        fence_keys = list(celery_redis.client().scan_iter("redlock:*:fence"))
        return fence_keys and not lock_keys(celery_redis)

    wait_for(taken_and_released, timeout=10, message=f"lock taken, then released after {kind}")


@pytest.mark.smoke
@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_the_body_sees_its_own_request(app, celery_redis, inprocess_worker_factory, pool):
    """Inside a LockedTask body, ``self.request`` is the execution's, and ``retry()`` works.

    LockedTask overrides ``__call__``, so the tracer calls it rather than ``run``;
    before Celery 5.5, ``Task.__call__`` pushed a request holding only the arguments
    (celery/celery#9208), and the body saw no id, no retries, ``called_directly``.
    """
    inprocess_worker_factory(app, pool=pool)
    whoami = app.tasks["tests.apps.locked.whoami"]
    result = whoami.delay("me")
    seen = get(result)
    assert seen["id"] == result.id
    assert seen["called_directly"] is False
    assert_clock_fence(seen["fence"], celery_redis.client())  # a fresh key's first fence
    retried = whoami.delay("me", retry=True)
    assert get(retried)["retries"] == 1, "self.retry() from the body sent a retry"
    assert get(retried)["id"] == retried.id


@pytest.mark.smoke
def test_apply_body_sees_its_own_request(app, celery_redis):
    """``apply()`` (eager, no worker): the body has its request and its lock."""
    whoami = app.tasks["tests.apps.locked.whoami"]
    result = whoami.apply(("eager",), task_id="eager-id")
    seen = result.get()
    assert seen["id"] == "eager-id"
    assert seen["called_directly"] is False
    assert_clock_fence(seen["fence"], celery_redis.client())
    assert not lock_keys(celery_redis), "released after the eager run"


def test_the_body_is_called_as_a_plain_tasks_unless_a_base_wraps_the_call(app, celery_redis):
    """The tracer pushed the request: LockedTask calls the body as the tracer calls a plain
    task's (Celery's ``Task.__call__`` would push a second one, through ``push_request``);
    a base class between LockedTask and Task that overrides ``__call__`` (an app context)
    runs, and so does that second push."""
    from celery import Task

    from celery_redlock import LockedTask

    pushes: list[dict] = []
    wrapped: list[str | None] = []

    class Counted(LockedTask):
        def push_request(self, *args, **kwargs):
            pushes.append(dict(*args, **kwargs))
            super().push_request(*args, **kwargs)

    class AppContext(Task):
        def __call__(self, *args, **kwargs):
            wrapped.append(self.request.id)
            return super().__call__(*args, **kwargs)

    class Wrapped(Counted, AppContext):
        pass

    def body(self, n):
        return self.request.id, self.lock.fence is not None

    for base, name in ((Counted, "plain-call"), (Wrapped, "wrapped-call")):
        task = app.task(body, base=base, bind=True, shared=False, name=f"tests.{name}")
        pushes.clear()
        assert task.apply((1,), task_id=name).get() == (name, True), "its request, its lock"
        if base is Counted:
            assert pushes == [], "the tracer's request only (pushed on the stack itself)"
            assert not wrapped
        else:
            assert wrapped == [name], "the base's __call__ ran"
            assert len(pushes) == 1, "and Task.__call__'s request"
    assert not lock_keys(celery_redis)


def test_eager_apply_of_a_finished_task_id_that_waited_runs_its_body(app, celery_redis):
    """An eager ``apply()`` is nobody's redelivery: with a final result already stored
    under its task id (a frozen chain applied again) and a wait for the lock, it still
    runs and returns the body's value (Celery's test_chain_in_chain_with_args got None)."""
    hold_wait = app.tasks["tests.apps.locked.hold_wait"]
    app.backend.store_result("frozen-id", {"label": "earlier"}, "SUCCESS")
    holder = Redlock("res:eager", nodes=[redis_url_with_db(celery_redis.url, 0)], ttl=30)
    assert holder.acquire(blocking=False)
    outcome: dict[str, object] = {}

    def run() -> None:
        result = hold_wait.apply(("eager",), {"label": "again"}, task_id="frozen-id")
        outcome["state"], outcome["value"] = result.state, result.result

    thread = threading.Thread(target=run)
    thread.start()
    client = celery_redis.client()
    # The eager run waits on the lock's release channel before the holder lets go.
    wait_for(lambda: any(n for _, n in client.pubsub_numsub(*client.pubsub_channels())), timeout=10)
    holder.release()
    thread.join(30)
    assert outcome["state"] == "SUCCESS", outcome
    assert outcome["value"]["label"] == "again"


def test_self_lock_exposes_fence_key_and_remaining(app, celery_redis, inprocess_worker_factory):
    """Inside the body: fence grows per run (from the node's clock for a fresh key, then
    one by one while its counter lives), key is the hashed task key, lease is counted."""
    inprocess_worker_factory(app, pool="solo")
    hold = app.tasks["tests.apps.locked.hold"]
    one, two = get(hold.delay("acct-9")), get(hold.delay("acct-9"))
    assert_clock_fence(one["fence"], celery_redis.client())
    assert two["fence"] == one["fence"] + 1
    assert one["key"].startswith("redlock:{tests.apps.locked.hold:") and "acct-9" not in one["key"]
    assert 0 < one["remaining"] <= 1.0


def test_unkeyable_argument_fails_naming_task_and_argument(celery_redis, inprocess_worker_factory):
    """An argument with no stable key fails the task clearly; nothing is locked."""
    # Only a pickled message can carry a value JSON could not key.
    app = create_app(
        celery_redis.url,
        accept_content=["json", "pickle"],
        result_serializer="pickle",
        result_accept_content=["json", "pickle"],
    )
    inprocess_worker_factory(app, pool="solo")
    result = app.tasks["tests.apps.locked.anything"].apply_async(
        (ImproperlyConfigured("not keyable"),), serializer="pickle"
    )
    with pytest.raises(LockKeyError) as info:
        get(result)
    assert info.value.args[0] == "tests.apps.locked.anything"
    assert info.value.args[1] == "value"


@pytest.mark.smoke
def test_redis_down_fails_closed(celery_redis, inprocess_worker_factory, tmp_path, monkeypatch):
    """Lock nodes unreachable: the body does not run; the run is put back until
    UNAVAILABLE_BUDGET (1 s here) has passed, then fails with NodeUnavailable."""
    monkeypatch.setattr(policies, "UNAVAILABLE_BUDGET", 1.0)
    app = create_app(
        celery_redis.url,
        redlock_url=f"redis://127.0.0.1:{free_port()}/0",
        redlock_node_timeout=0.05,
    )
    inprocess_worker_factory(app, pool="solo")
    path = tmp_path / "runs"
    result = app.tasks["tests.apps.locked.hold"].delay("acct-1", str(path), "x", 0)
    with pytest.raises(NodeUnavailable):
        get(result)
    assert not path.exists(), "the body must not run without its lock"


def test_redis_down_with_fail_open_runs_unlocked(celery_redis, inprocess_worker_factory, caplog):
    """redlock_fail_open=True runs the body anyway, with a warning."""
    app = create_app(
        celery_redis.url,
        redlock_url=f"redis://127.0.0.1:{free_port()}/0",
        redlock_node_timeout=0.05,
        redlock_fail_open=True,
    )
    inprocess_worker_factory(app, pool="solo")
    with caplog.at_level(logging.WARNING, logger="celery_redlock.task"):
        assert get(app.tasks["tests.apps.locked.outcome"].delay("x", "ok")) == "ok"
        assert get(app.tasks["tests.apps.locked.fence_if_locked"].delay("x")) is None
    assert any("WITHOUT its lock" in r.message for r in caplog.records)


def test_current_lock_is_the_held_lock(app, celery_redis, inprocess_worker_factory):
    """`self.current_lock` is `self.lock` while held (None only when run unlocked)."""
    inprocess_worker_factory(app, pool="solo")
    fences = [get(app.tasks["tests.apps.locked.fence_if_locked"].delay("x")) for _ in "ab"]
    assert all(isinstance(fence, int) for fence in fences) and fences[1] > fences[0]


def test_long_task_keeps_its_lock_while_a_competitor_is_refused(
    app, celery_redis, inprocess_worker_factory, tmp_path
):
    """A body running 5.5 x ttl keeps the lock; every competitor in that time is skipped."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    path = str(tmp_path / "runs")
    hold = app.tasks["tests.apps.locked.hold"]
    long_run = hold.delay("acct-long", path, "long", 5.5)
    wait_for((tmp_path / "runs").exists, timeout=10)
    refused = 0
    while not long_run.ready():
        competitor = hold.delay("acct-long", path, f"c{refused}", 0)
        with pytest.raises(LockBusy):
            get(competitor)
        refused += 1
        time.sleep(0.4)  # the scenario: a competitor every 0.4 s
    assert get(long_run)["label"] == "long"
    assert refused >= 8
    assert set(read_intervals(path)) == {"long"}


@pytest.mark.smoke
def test_lost_lock_aborts_the_body_in_the_threads_pool(
    app, celery_redis, inprocess_worker_factory, tmp_path
):
    """Key deleted mid-run: LockLost is raised in the running body; the result records it."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    path = str(tmp_path / "runs")
    result = app.tasks["tests.apps.locked.hold"].delay("acct-lost", path, "lost", 30)
    wait_for(lambda: lock_keys(celery_redis), timeout=10)
    steal_locks(celery_redis)
    with pytest.raises(LockLost) as info:
        get(result, timeout=10)
    assert "deleted" in info.value.reason
    assert result.state == "FAILURE"
    assert "lost" not in read_intervals(path), "the body was stopped before its end"


def test_ignore_policy_lets_the_body_finish_but_records_the_loss(
    app, celery_redis, inprocess_worker_factory, tmp_path, caplog
):
    """lock_on_lost='ignore': the body completes, logs ERROR, and the result is LockLost."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    path = str(tmp_path / "runs")
    with caplog.at_level(logging.ERROR, logger="celery_redlock"):
        result = app.tasks["tests.apps.locked.ignores_loss"].delay("acct-ign", 2.0, path)
        wait_for(lambda: lock_keys(celery_redis), timeout=10)
        steal_locks(celery_redis)
        with pytest.raises(LockLost):
            get(result, timeout=10)
    assert "ignores" in read_intervals(path), "the body ran to its end"
    assert any("keeps running" in r.message for r in caplog.records)


def test_duplicate_delivery_of_a_running_task_is_ignored(
    app, celery_redis, inprocess_worker_factory, tmp_path
):
    """The same task id delivered twice: the copy neither runs, nor stores, nor releases."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    path = str(tmp_path / "runs")
    hold = app.tasks["tests.apps.locked.hold"]
    first = hold.apply_async(("acct-dup", path, "first", 1.5), task_id="dup-1")
    wait_for(lambda: lock_keys(celery_redis), timeout=10)
    (key,) = lock_keys(celery_redis)
    token = celery_redis.client().hget(key, "token")
    hold.apply_async(("acct-dup", path, "copy", 0), task_id="dup-1")
    assert get(first)["label"] == "first"
    assert first.state == "SUCCESS"
    assert set(read_intervals(path)) == {"first"}
    assert token, "the original held the lock throughout"


def test_invalid_setting_stops_the_worker_with_a_clear_error(celery_redis):
    """A bad redlock_* value makes worker start-up fail, naming the setting."""
    from tests.harness import InProcessWorker

    app = create_app(celery_redis.url, redlock_on_busy="block")
    worker = InProcessWorker(app, pool="solo")
    with pytest.raises((ConfigurationError, Exception)) as info:
        worker.start()
    worker.stop()
    assert "redlock_on_busy must be one of 'skip', 'retry', 'raise', 'wait'" in str(info.value)


def test_redelivery_after_the_holder_died_still_runs(
    app, celery_redis, inprocess_worker_factory, caplog
):
    """Same task id, lock left by a dead delivery: the new delivery waits, then runs.

    It waits parked on the lock node until the key is free (no worker holds it: a
    worker's death would not strand it), not as a message in a worker's timer."""
    from celery_redlock.engine.keys import lock_keys
    from celery_redlock.integration.names import task_lock_name

    hold = app.tasks["tests.apps.locked.hold"]
    key = lock_keys(
        task_lock_name(hold.name, hold.run, ("acct-dead",), {}, lock_args=("resource",))
    ).lock
    celery_redis.client().hset(key, mapping={"token": "dead", "task_id": "dead-1", "pid": 1})
    celery_redis.client().pexpire(key, 1500)
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    with caplog.at_level(logging.INFO, logger="celery_redlock.task"):
        result = hold.apply_async(("acct-dead", None, "after-death", 0), task_id="dead-1")
        assert get(result)["label"] == "after-death"
    assert result.state == "SUCCESS"
    assert "is held by an earlier delivery of itself; parked" in caplog.text


def test_an_immediate_retry_is_not_lost(app, inprocess_worker_factory):
    """retry(countdown=0) races its own release; the retry still runs."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    results = [app.tasks["tests.apps.locked.retry_now"].delay(f"r{i}") for i in range(5)]
    assert [get(r) for r in results] == ["done"] * 5


class Landed(Exception):
    """Stands for an asynchronous exception (a soft time limit) landing in the release."""


def test_a_release_an_exception_cut_short_is_done_in_task_postrun(app, celery_redis, monkeypatch):
    """The lock is released as the body returns; an exception landing right before that
    release (here: in the abort bookkeeping it starts with) fails the run, and
    task_postrun releases the lock instead: it stays recorded until its release ran,
    rather than being left to a lease the watchdog renews with nobody to release it."""
    untrack = abort.untrack
    landed = []

    def land_once(lease):
        if not landed:
            landed.append(lease)
            raise Landed("just before the release")
        untrack(lease)

    monkeypatch.setattr(abort, "untrack", land_once)
    result = app.tasks["tests.apps.locked.hold"].apply(args=("cut",))
    assert result.state == "FAILURE" and isinstance(result.result, Landed), result.traceback
    assert landed, "the exception landed in the body's release"
    assert not lock_keys(celery_redis), "task_postrun released the lock"
    assert len(get_renewer()) == 0, "and the watchdog renews nothing"
