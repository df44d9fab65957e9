"""An asyncio caller and Celery tasks take the same resource locks.

A web view holding ``AsyncRedlock("acct:7")`` and a task with
``lock_key="acct:{account}"`` exclude each other, through a real in-process worker.
"""

from __future__ import annotations

import asyncio

import pytest

from celery_redlock import AsyncRedlock, LockBusy
from tests.apps.locked import create_app
from tests.harness import close_app
from tests.integration.test_task import get


@pytest.fixture
def app(celery_redis):
    app = create_app(celery_redis.url)
    yield app
    close_app(app)


def test_an_async_holder_and_a_task_with_that_lock_key_exclude_each_other(
    app, inprocess_worker_factory
):
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    audit = app.tasks["tests.apps.locked.audit"]
    url = app.conf.redlock_url

    async def scenario():
        async with AsyncRedlock("acct:7", nodes=[url]) as lock:
            held_fence = lock.fence
            busy, free = audit.delay(7), audit.delay(8)
            with pytest.raises(LockBusy):
                await asyncio.to_thread(get, busy)  # lock_on_busy="skip": a LockBusy failure
            assert (await asyncio.to_thread(get, free))["key"] == "redlock:{acct:8}"
        ran = await asyncio.to_thread(get, audit.delay(7, seconds=1.0))
        assert ran["key"] == lock.key and ran["fence"] > held_fence
        # and the task excludes the async caller while it runs
        running = audit.delay(7, seconds=2.0)
        waiter = AsyncRedlock("acct:7", nodes=[url])
        while not await waiter.locked():
            await asyncio.sleep(0.01)  # until the task holds it
        with pytest.raises(LockBusy):
            await waiter.try_acquire()
        assert await waiter.acquire(timeout=30), "woken when the task releases it"
        assert waiter.fence > (await asyncio.to_thread(get, running))["fence"]
        await waiter.release()

    asyncio.run(asyncio.wait_for(scenario(), 90))
