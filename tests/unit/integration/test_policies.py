"""The busy and lost-lock policies, applied to a task outside any worker.

The policies with real workers (skip, retry, raise and wait under contention, a lost
lock aborting a running body, duplicate deliveries requeued) are tested in
``tests/integration/test_task.py``; these pin what each function decides alone.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from celery import Celery, states
from celery.utils import uuid

from celery_redlock import LockBusy, LockLost
from celery_redlock.integration.policies import (
    REQUEUES_HEADER,
    Skipped,
    already_done,
    apply_on_busy,
    apply_on_lost,
    requeues,
)
from celery_redlock.integration.settings import TaskLockOptions
from tests.harness import close_app


@pytest.fixture
def app():
    # The memory result backend is one per process: each test uses fresh task ids.
    app = Celery("policies", set_as_current=False, backend="cache+memory://")
    yield app
    close_app(app)


def body():
    """A task body."""


def options(on_busy: str) -> TaskLockOptions:
    return TaskLockOptions(
        timing=None,  # type: ignore[arg-type]
        args=None,
        key=None,
        on_busy=on_busy,
        on_lost="abort",
        retry_countdown=5.0,
        wait_timeout=60.0,
    )


def test_raise_fails_with_the_lockbusy_itself(app):
    """lock_on_busy='raise' ends the run with the LockBusy naming key and holder."""
    task = app.task(body, shared=False, name="proj.t")
    busy = LockBusy("redlock:{proj.t}", "other-id", 3.0)
    with pytest.raises(LockBusy) as info:
        apply_on_busy(task, "my-id", busy, options("raise"))
    assert info.value is busy


def test_skip_stores_lockbusy_as_the_result_and_ends_ignored(app):
    """lock_on_busy='skip' stores FAILURE with the LockBusy and raises Skipped (an Ignore)."""
    task = app.task(body, shared=False, name="proj.t")
    busy = LockBusy("redlock:{proj.t}", "other-id", 3.0)
    task_id = uuid()
    with pytest.raises(Skipped) as info:
        apply_on_busy(task, task_id, busy, options("skip"))
    assert info.value.busy is busy
    assert task.backend.get_task_meta(task_id)["status"] == states.FAILURE


def test_skip_stores_nothing_for_a_task_that_ignores_its_result(app):
    """With ignore_result, a skipped run leaves the backend untouched."""
    task = app.task(body, shared=False, name="proj.t", ignore_result=True)
    task_id = uuid()
    with pytest.raises(Skipped):
        apply_on_busy(task, task_id, LockBusy("k", "other-id"), options("skip"))
    assert task.backend.get_task_meta(task_id)["status"] == states.PENDING


@pytest.mark.parametrize(
    ("request_", "count"),
    [
        (SimpleNamespace(), 0),
        (SimpleNamespace(**{REQUEUES_HEADER: 3}), 3),
        (SimpleNamespace(headers={REQUEUES_HEADER: "2"}), 2),
        (SimpleNamespace(headers=None), 0),
        (SimpleNamespace(headers={REQUEUES_HEADER: "many"}), 0),
    ],
)
def test_requeues_reads_the_header_and_treats_garbage_as_none(request_, count):
    """The requeue count comes from the request or its headers; an unreadable one is 0."""
    assert requeues(request_) == count


def test_already_done_only_for_a_final_stored_result(app):
    """A stored final state means an earlier delivery ran; no result, or none kept, does not."""
    task = app.task(body, shared=False, name="proj.t")
    task_id = uuid()
    assert not already_done(task, task_id)
    task.backend.mark_as_done(task_id, 1)
    assert already_done(task, task_id)
    quiet = app.task(body, shared=False, name="proj.quiet", ignore_result=True)
    assert not already_done(quiet, task_id)


def test_ignore_logs_the_loss_and_leaves_the_body_running(app, caplog):
    """lock_on_lost='ignore' logs at ERROR under the task's logger and aborts nothing."""
    task = app.task(body, shared=False, name="proj.t")
    lost = LockLost("redlock:{proj.t}", "expired", 7)
    with caplog.at_level(logging.ERROR, logger="celery_redlock.task"):
        apply_on_lost(task, "my-id", "ignore", SimpleNamespace(), lost)  # type: ignore[arg-type]
    assert [r.name for r in caplog.records] == ["celery_redlock.task"]
    assert "keeps running" in caplog.records[0].getMessage()
