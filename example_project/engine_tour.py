"""A tour of the lock engine without Celery: ``python -m example_project.engine_tour``.

It uses ``$REDLOCK_URL`` if set, otherwise starts its own redis-server (and, for
the Redlock part, two more), then walks through what the lock does and prints it
in plain words. It exits by itself and stops every process it started.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import redis

from celery_redlock import LockBusy, LockLost, NodeUnavailable, Redlock

from .redis_runner import RedisProcess


def say(text: str) -> None:
    print(f"  {text}", flush=True)


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def contention(url: str) -> None:
    step("Two workers want the daily report at once")
    first = Redlock("reports:daily", nodes=[url], ttl=5, task_id="worker-A")
    second = Redlock("reports:daily", nodes=[url], ttl=5, task_id="worker-B")
    first.acquire()
    say(f"worker-A took the lock, fencing token {first.fence}")
    try:
        second.try_acquire()
    except LockBusy as busy:
        say(f"worker-B was refused: {busy}")
    first.release()
    second.acquire()
    say(
        f"after A released, worker-B took it with fencing token {second.fence} "
        f"(larger, so storage can reject A's late writes)"
    )
    second.release()


def long_task(url: str) -> None:
    step("A task that runs 4x longer than the lease")
    lock = Redlock("accounts:42", nodes=[url], ttl=1.0)
    rival = Redlock("accounts:42", nodes=[url], ttl=1.0)
    lock.acquire()
    say("lease is 1.0 s; the watchdog renews it every 0.33 s while the task runs")
    refused = tries = 0
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        time.sleep(0.5)  # the task's work
        lock.check()
        tries += 1
        refused += not rival.acquire(blocking=False)
        say(f"still held, {lock.remaining():.2f} s of lease left; a rival was refused")
    lock.release()
    say(f"done after 4 s: the rival was refused {refused} times out of {tries}")


def lost_lock(url: str) -> None:
    step("Someone deletes the lock behind the holder's back")
    noticed = threading.Event()
    lock = Redlock(
        "accounts:7",
        nodes=[url],
        ttl=1.5,
        on_lost=lambda exc: (say(f"watchdog: {exc}"), noticed.set()),
    )
    lock.acquire()
    redis.Redis.from_url(url).delete(lock.keys.lock)
    say("key deleted; waiting for the watchdog's next renewal...")
    noticed.wait(5)
    try:
        lock.check()
    except LockLost as exc:
        say(f"the task's next check() raised LockLost ({exc.reason}): it stops here")
    lock.release()


def handoff(url: str) -> None:
    step("A waiter is woken by the release, not by polling")
    holder = Redlock("exports", nodes=[url], ttl=30)
    waiter = Redlock("exports", nodes=[url], ttl=30)
    holder.acquire()
    got = {}

    def wait() -> None:
        waiter.acquire(timeout=10)
        got["at"] = time.monotonic()

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)  # let the waiter park
    released = time.monotonic()
    holder.release()
    thread.join()
    say(
        f"holder's lease had 30 s left; the waiter got the lock "
        f"{(got['at'] - released) * 1000:.1f} ms after the release"
    )
    waiter.release()


def redlock(extra: list[RedisProcess], url: str) -> None:
    step("Redlock over three independent Redis servers")
    urls = [url] + [p.url for p in extra]
    lock = Redlock("payments:settle", nodes=urls, ttl=5)
    with lock:
        say(f"acquired on a majority of 3 nodes, fencing token {lock.fence}")
    extra[0].kill()
    say("one node killed")
    with lock:
        say(f"still acquired (2 of 3 is a majority), fencing token {lock.fence}")
    extra[1].kill()
    say("a second node killed")
    try:
        lock.acquire(blocking=False)
    except NodeUnavailable as exc:
        say(f"refused, fail closed: {str(exc)[:90]}...")


def main() -> None:
    logging.basicConfig(level=logging.CRITICAL)
    started: list[RedisProcess] = []
    try:
        url = os.environ.get("REDLOCK_URL")
        if not url:
            started.append(RedisProcess("REDLOCK_URL"))
            url = started[0].url
            say(f"started {started[0].description} at {url} (set REDLOCK_URL to use yours)")
        contention(url)
        long_task(url)
        lost_lock(url)
        handoff(url)
        extra = [RedisProcess("REDLOCK_URL"), RedisProcess("REDLOCK_URL")]
        started.extend(extra)
        redlock(extra, url)
        print("\nDemo finished.", flush=True)
    finally:
        for proc in started:
            proc.stop()


if __name__ == "__main__":
    main()
