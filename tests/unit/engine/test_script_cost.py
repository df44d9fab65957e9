"""What one lock costs Redis: the commands the scripts run inside one acquisition.

Each ``redis.call`` inside a script costs the node one to three microseconds (Redis
7.0: command lookup, checks, propagation), so on an uncontended lock the scripts'
inner commands, not the protocol, set the node's time per acquisition: an
acquire and a release took 26 us per EVALSHA where redis-py's ``SET NX`` and its
release script take 1.4 and 4.9 us (issue 27, P1). Counted here with ``INFO
commandstats`` around one acquisition (counts, not times).
"""

from __future__ import annotations

from celery_redlock import Redlock


def inner_commands(redis_node, action) -> dict[str, int]:
    """The commands ``action`` made the node run, scripts' own calls included."""
    action()  # warm: scripts loaded, connections made, fence counter exists
    redis_node.reset_stats()
    action()
    stats = redis_node.commandstats()
    for command in ("evalsha", "config|resetstat", "hello", "client|setinfo", "select", "ping"):
        stats.pop(command, None)  # the call itself, or a connection being made
    return stats


def test_an_uncontended_acquire_and_release_run_few_commands(redis_node):
    """One node, nobody waiting: 13 commands inside the two scripts (there were 18:
    the fence counter was checked before its INCR, the shared set's writer mark removed
    where no shared set existed, the record left and read in two calls, and the
    release read the clock and lapsed waiters of an empty record)."""
    lock = Redlock("cost", nodes=[redis_node.url], ttl=30)

    def cycle() -> None:
        assert lock.acquire()
        lock.release()

    stats = inner_commands(redis_node, cycle)
    assert sum(stats.values()) <= 13, stats
    assert "time" not in stats and "exists" in stats, stats
