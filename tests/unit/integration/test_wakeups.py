"""The worker side of ``lock_on_busy="requeue"``'s wake-up
(:mod:`celery_redlock.integration.wakeups`), with a stand-in consumer and timer: which
copies it starts, and which it never does.
The end-to-end behaviour with real workers is in tests/integration/test_requeue_wake.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from celery_redlock.engine.waiting import Wakeup
from celery_redlock.integration import wakeups
from celery_redlock.integration.policies import WAKE_HEADER


class Entry:
    def __init__(self, fun, args):
        self.fun, self.args, self.canceled = fun, args, False

    def cancel(self):
        self.canceled = True


class Timer:
    """kombu's timer as wakeups sees it: call_repeatedly, call_at, and the queue."""

    def __init__(self):
        self.entries = []

    def call_repeatedly(self, secs, fun, args=()):
        entry = Entry(fun, args)
        self.repeating = entry
        return entry

    def call_at(self, eta, fun, args):
        entry = Entry(fun, args)
        self.entries.append(entry)
        return entry

    @property
    def queue(self):  # kombu lists (eta, priority, entry)
        return [SimpleNamespace(entry=e) for e in self.entries if not e.canceled]

    def fire(self, entry):
        self.entries.remove(entry)
        entry.fun(*entry.args)


class Consumer:
    def __init__(self):
        self.timer = Timer()
        self.app = object()
        self.applied = []

    def apply_eta_task(self, request):
        self.applied.append(request.id)


class Subscription:
    def __init__(self, nodes, channel, confirm_timeout):
        self.channel, self.event, self.closed, self.watched = channel, Wakeup(), False, False

    def watch(self):
        self.watched = True

    def close(self):
        self.closed = True


@pytest.fixture
def consumer(monkeypatch):
    monkeypatch.setattr(wakeups, "Subscription", Subscription)
    monkeypatch.setattr(
        wakeups,
        "app_settings",
        lambda app: SimpleNamespace(
            node_urls=lambda: ("redis://127.0.0.1:1",), timing=SimpleNamespace(node_timeout=0.1)
        ),
    )
    monkeypatch.setattr(wakeups.NodeSet, "get", lambda urls, timeout: SimpleNamespace(nodes=()))
    wakeups.stop()  # nothing left by the in-process workers of other tests
    yield Consumer()
    wakeups.stop()


def receive(consumer, task_id, key="redlock:{export:7}", fun=None):
    """A copy received with a countdown, put in the timer as Celery's strategy does."""
    request = SimpleNamespace(
        id=task_id, name="proj.export", eta="soon", request_dict={WAKE_HEADER: key}
    )
    wakeups.on_task_received(consumer, request)
    entry = consumer.timer.call_at(1.0, fun or consumer.apply_eta_task, (request,))
    return request, entry


def test_a_released_key_starts_its_longest_waiting_copy_once(consumer):
    _, first = receive(consumer, "t-1")
    receive(consumer, "t-2")
    sleepers = list(wakeups._sleepers.values())
    assert [s.subscription.channel for s in sleepers] == ["redlock:{export:7}:released"] * 2
    # Read for by the listener thread: the copies never wait in wait().
    assert all(s.subscription.watched for s in sleepers)
    wakeups._tick(consumer)
    assert consumer.applied == [], "nothing released yet"
    sleepers[0].subscription.event.set()  # the listener woke the oldest
    wakeups._tick(consumer)
    assert consumer.applied == ["t-1"] and first.canceled, "started now, its entry cancelled"
    assert sleepers[0].subscription.closed and not sleepers[0].subscription.event.is_set()
    wakeups._tick(consumer)
    assert consumer.applied == ["t-1"], "never twice"
    assert list(wakeups._sleepers) == ["t-2"]


def test_a_copy_the_timer_started_is_never_started_again(consumer):
    _, entry = receive(consumer, "t-1")
    wakeups._tick(consumer)
    consumer.timer.fire(entry)  # its countdown ended first
    wakeups._sleepers["t-1"].subscription.event.set()
    wakeups._tick(consumer)
    assert consumer.applied == ["t-1"], "once, by the timer"
    assert not wakeups._sleepers
    assert consumer.timer.repeating.canceled, "no more looks once nothing waits"


def test_a_copy_under_celerys_rate_limit_keeps_its_countdown(consumer):
    """Its timer entry posts to Celery's token bucket: starting it directly would skip it."""
    _, entry = receive(consumer, "t-1", fun=lambda request, bucket, tokens: None)
    sleeper = wakeups._sleepers["t-1"]
    sleeper.subscription.event.set()
    wakeups._tick(consumer)
    assert consumer.applied == [] and not entry.canceled
    assert sleeper.subscription.closed, "left: the wake-up is passed on to another waiter"


def test_messages_without_a_busy_key_or_a_countdown_are_not_watched(consumer):
    plain = SimpleNamespace(id="p", name="proj.plain", eta="soon", request_dict={})
    due = SimpleNamespace(id="d", name="proj.x", eta=None, request_dict={WAKE_HEADER: "k"})
    for request in (plain, due):
        wakeups.on_task_received(consumer, request)
    assert not wakeups._sleepers


def test_each_consumer_looks_at_its_own_copies_on_its_own_timer(consumer):
    """A consumer restarted (or a second worker in the process) has a timer of its own:
    its copies are watched there, even while another timer's entry is still on."""
    receive(consumer, "t-1")
    other = Consumer()
    receive(other, "t-2")
    assert other.timer.repeating is not consumer.timer.repeating
    wakeups._sleepers["t-2"].subscription.event.set()
    wakeups._tick(consumer)
    assert other.applied == [] and consumer.applied == [], "not this consumer's copy"
    wakeups._tick(other)
    assert other.applied == ["t-2"] and other.timer.repeating.canceled
    assert not consumer.timer.repeating.canceled, "t-1 still waits there"
