"""The demo's own measurements (example_project/support.py), against a real server."""

from __future__ import annotations

import time

from celery_redlock import Redlock
from example_project.support import count_renewals, task_lock

PATTERN = "redlock:{example_project.tasks.sync_account:*}"


def test_the_demo_follows_its_own_tasks_lease_not_another_key_of_the_pattern(redis_node):
    """A fence counter with a TTL, and another account's lock being released, are not it.

    The demo once said "renewed the lease 0 times": it watched the first key of the
    pattern with a TTL, which can be the previous step's lock on its way out.
    """
    client = redis_node.client(decode_responses=True)
    other = Redlock("example_project.tasks.sync_account:42", nodes=[redis_node.url], ttl=30,
                    task_id="earlier-sync", auto_renew=False)  # fmt: skip
    assert other.acquire(blocking=False)
    client.set("redlock:{example_project.tasks.sync_account:7}:fence", 3, px=60_000)
    ours = Redlock("example_project.tasks.sync_account:7", nodes=[redis_node.url], ttl=0.6,
                   task_id="the-sync")  # fmt: skip
    assert ours.acquire(blocking=False)
    try:
        key = task_lock(client, PATTERN, "the-sync", "the lock")
        assert key == ours.key
        other.release()  # the earlier sync's lock goes: the count must not follow it
        ends = time.monotonic() + 1.6  # about 8 renewals at ttl/3

        renewals = count_renewals(client, key, lambda: time.monotonic() > ends)

        assert renewals >= 2, renewals
    finally:
        ours.release()
    assert count_renewals(client, key, lambda: False) == 0, "released: nothing to count"
