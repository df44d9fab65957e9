"""Reading the event log: a lock's history, and a task id's story in words.

The events are written by :mod:`celery_redlock.integration.events` (one JSON object per
event, newest first, in a list per lock and in the prefix's feed). A batch of events
went to the first lock node that answered, so the nodes' lists are merged, not voted
on: every node is read, and an event found twice is kept once.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

from ..engine.keys import feed_key, keys_of
from ..nodes import Call, NodeSet
from .inventory import answers

__all__ = ["Event", "describe", "feed", "key_log", "story", "summary"]

#: An event as read: its JSON object (``t``, ``e``, ``k``, ``task``, ``id``, ``host``,
#: ``pid`` and the event's own fields; see :data:`celery_redlock.integration.events.EVENTS`).
Event = dict[str, Any]


def _read(
    nodeset: NodeSet, lists: Sequence[str], count: int, timeout: float | None
) -> tuple[list[Event], dict[str, str]]:
    """The newest ``count`` entries of each of ``lists`` on every node, oldest first."""
    calls = [Call.command("LRANGE", name, 0, count - 1) for name in lists]
    seen: set[str] = set()
    found: list[Event] = []
    answered, errors = answers(nodeset, calls, timeout)
    for _, values in answered:
        for entries in values:
            # Newest first in Redis: reversed, so events of one millisecond keep their order.
            for text in reversed(entries or ()):
                if text in seen:
                    continue
                seen.add(text)
                try:
                    event = json.loads(text)
                except ValueError:
                    continue  # not ours: never fail a reader on one bad entry
                if isinstance(event, dict):
                    found.append(event)
    found.sort(key=lambda event: event.get("t", 0))
    return found, errors


def key_log(
    nodeset: NodeSet, lock: str, count: int = 100, *, timeout: float | None = None
) -> tuple[list[Event], dict[str, str]]:
    """The newest ``count`` events of the lock key ``lock``, oldest first; errors per node."""
    return _read(nodeset, [keys_of(lock).log], count, timeout)


def feed(
    nodeset: NodeSet, prefix: str, count: int = 10_000, *, timeout: float | None = None
) -> tuple[list[Event], dict[str, str]]:
    """The newest ``count`` events of every lock under ``prefix``, oldest first."""
    return _read(nodeset, [feed_key(prefix)], count, timeout)


def story(
    nodeset: NodeSet, prefix: str, task_id: str, *, timeout: float | None = None
) -> tuple[list[Event], dict[str, str]]:
    """Every event of ``task_id`` still kept, oldest first; errors per node.

    Found in the feed, then in the logs of the locks those events name: a lock's log
    keeps its events after the feed, shared by every lock, has moved on.
    """
    everything, errors = feed(nodeset, prefix, timeout=timeout)
    mine = [event for event in everything if event.get("id") == task_id]
    locks = {prefix + "{" + str(event["k"]) + "}" for event in mine if event.get("k")}
    if locks:
        more, more_errors = _read(
            nodeset, [keys_of(lock).log for lock in sorted(locks)], 100, timeout
        )
        for node, error in more_errors.items():
            errors.setdefault(node, error)
        texts = {json.dumps(event, sort_keys=True) for event in mine}
        for event in more:
            if event.get("id") == task_id and json.dumps(event, sort_keys=True) not in texts:
                mine.append(event)
        mine.sort(key=lambda event: event.get("t", 0))
    return mine, errors


def clock(event: Event) -> str:
    """The event's time, UTC, to the millisecond: ``12:00:01.234``."""
    moment = datetime.fromtimestamp(event.get("t", 0) / 1000, tz=timezone.utc)
    return moment.strftime("%H:%M:%S.") + f"{moment.microsecond // 1000:03d}"


def _short(task_id: Any) -> str:
    text = str(task_id or "?")
    return text[:8] + "…" if len(text) > 12 else text


def describe(event: Event) -> str:
    """One event in words, without its time: ``acquired account:7 (fence 12) on w1:4242``."""
    kind, key = event.get("e"), event.get("k", "?")
    where = f"on {event.get('host', '?')}:{event.get('pid', '?')}"
    if kind == "claimed":
        return f"sent; claimed {key} (lock_unique) {where}"
    if kind == "duplicate":
        how = "raised LockBusy" if event.get("then") == "raise" else "was given its result"
        return f"a second send for {key} found this copy queued or running and {how} {where}"
    if kind == "claim_freed":
        return f"handed back its send-time claim on {key} {where}"
    if kind == "started_late":
        late = (event.get("late_ms") or 0) / 1000
        return f"took {key} {late:.3f}s after its start time (eta) {where}"
    if kind == "claim_expired":
        return f"started after its send-time claim on {key} had expired {where}"
    if kind == "acquired":
        waited = event.get("waited_ms") or 0
        after = f" after waiting {waited} ms" if waited else ""
        return f"acquired {key} (fence {event.get('fence')}){after}; its body started {where}"
    if kind == "busy":
        then = event.get("then")
        holder = _short(event.get("holder"))
        doing = {
            "skip": "skipped",
            "retry": "retried later (lock_on_busy='retry')",
            "raise": "failed with LockBusy",
            "wait": "waited for it",
            "requeue": "went back to wait for the key (lock_on_busy='requeue')",
            "follows": "waits for that run to end (a follow-up copy)",
            "redelivered": "waits: a second delivery of the holder's own task id",
        }.get(str(then), str(then))
        return f"found {key} held by {holder}: {doing} {where}"
    if kind == "deferred":
        place = "parked on a lock node" if event.get("parked") else "put back on the queue"
        reason = {
            "rate": "its rate budget (lock_rate) was used up",
            "busy": "its key was held (lock_on_busy='requeue')",
            "follows": "it follows the running copy",
            "unavailable": "its lock nodes did not answer",
            "debounce": "it was called again (lock_debounce)",
            "throttle": "its throttle window is not over (lock_throttle)",
        }.get(str(event.get("reason")), str(event.get("reason")))
        seconds = (event.get("in_ms") or 0) / 1000
        slot = f" ({event['rate']}: slot {event['place']} from now)" if event.get("place") else ""
        return f"deferred on {key}: {reason}{slot}; {place}, due in {seconds:.3f}s {where}"
    if kind == "renewed_late":
        lag = (event.get("lag_ms") or 0) / 1000
        return f"its lease on {key} was renewed {lag:.3f}s late (a starved process?) {where}"
    if kind == "released":
        return f"released {key} after {(event.get('held_ms') or 0) / 1000:.3f}s {where}"
    if kind == "lost":
        then = {"abort": "the body was aborted (LockLost)", "revoke": "the task was revoked",
                "ignore": "the body kept running (lock_on_lost='ignore')"}  # fmt: skip
        return f"LOST its lease on {key}: {then.get(str(event.get('then')), '?')} {where}"
    if kind == "reaped":
        return (
            f"its pool process {event.get('child')} died holding {key}; the worker "
            f"released it {where}"
        )
    if kind == "not_again":
        why = event.get("why")
        reason = "an earlier delivery finished it" if why == "finished" else "another copy started"
        return f"did not run on {key}: {reason} {where}"
    if kind == "leader":
        won = event.get("then") == "won"
        return f"beat {'became' if won else 'stopped being'} the leader ({key}) {where}"
    return f"{kind} {key} {where}"


def summary(task_id: str, events: Iterable[Event]) -> str:
    """What happened to ``task_id``, in one sentence, from its events (oldest first)."""
    events = list(events)
    if not events:
        return (
            f"No event of {task_id} is kept: it took no lock, its events are older than "
            "the log keeps (redlock_events_ttl), or the log is off (redlock_events)."
        )
    kinds = Counter(str(event.get("e")) for event in events)
    parts: list[str] = []
    first = events[0]
    if kinds["claimed"]:
        parts.append(f"sent {clock(first)}")
    if kinds["duplicate"]:
        parts.append(f"returned to {kinds['duplicate']} duplicate send(s)")
    deferred = Counter(str(e.get("reason")) for e in events if e.get("e") == "deferred")
    for reason, times in sorted(deferred.items()):
        key = next(e.get("k") for e in events if e.get("reason") == reason)
        parts.append(f"deferred {times} time(s) ({reason}) on {key}")
    busy = [event for event in events if event.get("e") == "busy"]
    retried = sum(1 for event in busy if event.get("then") == "retry")
    if retried:
        parts.append(f"retried {retried} time(s): {busy[0].get('k')} was busy")
    if busy and busy[-1] is events[-1]:
        then = busy[-1].get("then")
        if then == "skip":
            parts.append(f"skipped at {clock(busy[-1])}: {busy[-1].get('k')} was busy")
        elif then == "raise":
            parts.append(f"failed with LockBusy at {clock(busy[-1])}")
    if kinds["claim_expired"]:
        parts.append("its send-time claim had expired when it started")
    acquired = [event for event in events if event.get("e") == "acquired"]
    if acquired:
        parts.append(f"started {clock(acquired[-1])}")
    if kinds["lost"]:
        lost = next(event for event in events if event.get("e") == "lost")
        parts.append(f"lost its lock at {clock(lost)} ({lost.get('then')})")
    if kinds["reaped"]:
        parts.append("its process died; the lock was reaped")
    released = [event for event in events if event.get("e") == "released"]
    if released:
        parts.append(f"ended {clock(released[-1])}")
    elif acquired and not kinds["lost"] and not kinds["reaped"]:
        parts.append("still running, or its end is not logged yet")
    if kinds["not_again"]:
        parts.append("a later delivery did not run it again")
    return f"{task_id}: " + "; ".join(parts) + "."
