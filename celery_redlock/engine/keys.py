r"""Redis key names: the only module that builds them.

A lock named ``NAME`` under the prefix ``redlock:`` uses::

    redlock:{NAME}            hash: token, attempt (the largest attempt number of
                              that token that counted it), fence, task_id,
                              task_name, host, pid, acquired_at, ttl
    redlock:{NAME}:fence      fence counter: the last fence granted; expires
                              FENCE_HORIZON_LEASES leases (at least FENCE_HORIZON_MIN
                              seconds) after it, and the next fence then starts from
                              the node's clock in microseconds (scripts/fence.lua)
    redlock:{NAME}:released   pub/sub channel: a release that names no waiter
    redlock:{NAME}:released:HOST:PID
                              pub/sub channel of one process: a release names one of
                              its waiters here (:func:`process_channel`)
    redlock:{NAME}:state      hash of per-entry last run times (beat leader locks only)
    redlock:{NAME}:shared     sorted set: shared holders (read locks, ``limit`` slots),
                              token -> lease deadline in ms on the node's clock; the
                              member :data:`WRITER_MARK` marks a writer waiting for them
    redlock:{NAME}:holders    hash: shared holder token -> JSON object with fence,
                              task_id, host, pid, acquired_at, task_name, ttl
    redlock:{NAME}:queue      sorted set: the record of blocked waiters (an exclusive
                              lock on one resource, fair or not), token -> arrival order
    redlock:{NAME}:waiting    sorted set: the same waiters, token -> deadline in ms
                              (the place lapses unless refreshed)
    redlock:{NAME}:wake       hash: the same waiters, token -> their process channel
    redlock:{NAME}:claim:TAG  hash: task_id, task_name, claimed_at (with debounce, due
                              and args); the send-time claim of a task with
                              ``lock_unique`` (one queued copy per task and name).
                              TAG: 16 hex digits of the task name's SHA-256, so two
                              tasks naming one resource claim apart (their bodies
                              still exclude each other through the lock)
    redlock:{NAME}:throttle   string: the task id of the last run admitted, expiring
                              with its ``lock_throttle`` window
    redlock:{NAME}:abandoned  sorted set: tokens of acquisitions abandoned with a
                              request maybe still on the way -> when that entry
                              expires (ms, node clock; one lease after it was
                              written); the acquire scripts refuse these tokens
    redlock:{NAME}:rate       sorted set: the starts of the last ``lock_rate`` /
                              :class:`~celery_redlock.RateLimit` window, member ->
                              start time in ms on the node's clock; expires one
                              window after its last start (scripts/rate.lua)
    redlock:{NAME}:budget     string ``N/WINDOW_MS``: the budget that log is kept
                              under, written with each admission and expiring
                              with the log (what ``celery redlock ls`` shows as
                              used/limit)
    redlock:{NAME}:queued     sorted set: the runs waiting on the queue for this
                              key (put back by their budget or by
                              ``lock_on_busy="requeue"``), task id -> when it is
                              due, in ms on the node's clock; an entry leaves when
                              its run starts, and is neither counted nor kept
                              QUEUED_GRACE after it was due (a run purged or
                              revoked on the queue); the key expires then too

Beside a lock's keys, one place per prefix holds the runs that wait their turn
(``lock_rate``, ``lock_on_busy="requeue"``; :mod:`celery_redlock.integration.parking`)::

    redlock:parked            sorted set: parked run (task id) -> when it is due, or
                              when its take's lease ends, in ms on the node's clock
    redlock:parked:runs       hash: task id -> the run (JSON: its message, how it
                              waits, its token)
    redlock:parked:taken      hash: task id -> how often a worker took it to publish
    redlock:parked:started    sorted set: ``task id:token`` of runs published more
                              than once whose copy started -> when (ms); kept a
                              horizon (the broker's redelivery time) for the other
                              copies to find
    redlock:{NAME}:log        list: the lock's event log, newest first (JSON
                              events; the newest EVENTS_PER_KEY, expiring
                              ``redlock_events_ttl`` after the last one)
    redlock:log               list: the event feed of every lock under the prefix
                              (the newest EVENTS_IN_FEED), which ``why`` searches
    redlock:{NAME}:handed     string, short-lived: a run waiting for NAME's release
                              was just published (one at a time per key)

The braces are a Redis Cluster hash tag, so a lock's keys always share one slot
and one script can touch them all. Redis hashes a key by the text between its first
``{`` and the first ``}`` after it, and by the whole key when that text is empty; so
a name that begins with ``}`` (``redlock:{}x}`` has an empty tag) or with the escape
``\`` is written with a ``\`` in front: ``}x`` -> ``redlock:{\}x}``, ``\x`` ->
``redlock:{\\x}``. Every other name appears as it is, and the tag is never empty:
it is the name up to its first ``}``. The prefix may not contain braces (they would
move the tag). :func:`lock_name_of` reads the name back from a lock key, and
:func:`parse_key` tells which lock any of these keys belongs to.

The scripts build no key: each receives every key it touches, the release channel
included, in ``KEYS`` (:func:`release_keys` and the ``LockKeys`` methods give each
script's list), so a key's layout is written here only.

Names of task locks (from the task and its arguments) are made in
:mod:`celery_redlock.integration.names`; this module takes any name as given.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

from ..exceptions import ConfigurationError

__all__ = [
    "DEFAULT_PREFIX",
    "FENCE_HORIZON_LEASES",
    "FENCE_HORIZON_MIN",
    "MAX_NAME_LENGTH",
    "QUEUED_GRACE",
    "SUFFIXES",
    "WRITER_MARK",
    "YIELD_MARK",
    "LockKeys",
    "ParkedKeys",
    "claim_key",
    "feed_key",
    "handed_key",
    "is_lock_key",
    "keys_of",
    "line_key",
    "lock_keys",
    "lock_name_of",
    "parked_keys",
    "parse_key",
    "process_channel",
    "release_keys",
    "validate_prefix",
]

DEFAULT_PREFIX = "redlock:"

#: Longest lock name accepted, in characters. Task locks hash their arguments, so
#: their names stay short whatever the arguments are; this only guards hand-made
#: names from growing keys without bound.
MAX_NAME_LENGTH = 512


#: The member of a lock's shared set that marks a writer waiting for the shared
#: holders to leave (never a token: tokens are hex). The scripts get it as the Lua
#: constant ``WRITER_MARK`` (see :mod:`celery_redlock.engine.scripts`).
WRITER_MARK = "!writer"

#: How long a fence counter outlives the acquisition that last wrote it: this many
#: leases, and at least FENCE_HORIZON_MIN seconds (``scripts/fence.lua``). Past it,
#: nothing of a lock is left in Redis; its next fence comes from the node's clock.
FENCE_HORIZON_LEASES = 2
FENCE_HORIZON_MIN = 5.0

#: Seconds a run's entry in ``<lock>:queued`` is still counted after it was due: a
#: due copy may wait that long in a busy worker before it starts (and its start
#: removes the entry); past it the run is taken for gone (purged, revoked) and its
#: entry is dropped. The scripts get it as an argument, the readers use it too.
QUEUED_GRACE = 60.0

#: The token of a lock *reserved* for a moment (never a token: tokens are hex): for
#: other processes, released by a process whose turn was over while another process
#: waited and none was recorded (:mod:`celery_redlock.engine.handoff`), and refused to
#: that process. The scripts get it as the Lua constant ``YIELD_MARK``.
YIELD_MARK = "!yield"


class LockKeys(NamedTuple):
    """The Redis names one lock uses."""

    lock: str
    fence: str
    channel: str  # redlock:{NAME}:released
    state: str
    shared: str
    holders: str
    queue: str
    waiting: str
    claim: str
    throttle: str
    abandoned: str
    rate: str
    budget: str
    queued: str
    wake: str
    log: str

    @property
    def resource(self) -> tuple[str, str, str, str]:
        """The keys every acquisition checks: lock, fence, shared holders, their info."""
        return (self.lock, self.fence, self.shared, self.holders)

    @property
    def record(self) -> tuple[str, str, str]:
        """The record of blocked waiters: queue (arrival), deadlines, process channels."""
        return (self.queue, self.waiting, self.wake)


#: What follows the lock key in each of its keys (``""`` for the lock key itself).
SUFFIXES: dict[str, str] = {
    field: "" if field == "lock" else f":{'released' if field == 'channel' else field}"
    for field in LockKeys._fields
}


def release_keys(resources: Sequence[LockKeys]) -> tuple[str, ...]:
    """The group ``locks*`` of ``release.lua``'s KEYS: each lock with its channel."""
    return tuple(key for resource in resources for key in (resource.lock, resource.channel))


def process_channel(channel: str, host: str, pid: int) -> str:
    """The channel on which a release names a waiter of the process ``host``/``pid``.

    ``<lock channel>:<host>:<pid>``: one process's listener subscribes to it, so an
    announcement meant for one waiter reaches one process, not every subscribed one.
    It keeps the lock's hash tag (pub/sub is not sharded by it; the ACL's channel
    pattern covers it).
    """
    return f"{channel}:{host}:{pid}"


def validate_prefix(prefix: str, setting: str = "redlock_key_prefix") -> str:
    """Return ``prefix`` if it can prefix lock keys, else raise ConfigurationError.

    ``setting`` is the name the error gives the prefix (``key_prefix`` for
    :class:`~celery_redlock.Redlock`'s argument).
    """
    if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
        raise ConfigurationError(
            f"{setting} must be a string without '{{' or '}}' (they would change "
            f"the cluster hash tag), got {prefix!r}"
        )
    return prefix


#: Put in front of a name that begins with ``}`` (whose hash tag would be empty) or
#: with this escape itself (so the escaping stays one-to-one).
TAG_ESCAPE = "\\"


def lock_keys(name: str, prefix: str = DEFAULT_PREFIX) -> LockKeys:
    """The keys of the lock called ``name`` (every one in the slot of one hash tag)."""
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"a lock name must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME_LENGTH:
        raise ConfigurationError(
            f"lock name is {len(name)} characters long, the limit is {MAX_NAME_LENGTH}: "
            "hash long names before using them"
        )
    validate_prefix(prefix, "key_prefix")
    tagged = TAG_ESCAPE + name if name.startswith(("}", TAG_ESCAPE)) else name
    return keys_of(f"{prefix}{{{tagged}}}")


def is_lock_key(key: str, prefix: str = DEFAULT_PREFIX) -> bool:
    """Whether ``key`` is a lock hash ``<prefix>{<name>}`` (not a fence counter or state)."""
    return key.startswith(prefix + "{") and key.endswith("}") and len(key) > len(prefix) + 2


#: Hex digits of a task's tag in its claim keys (:func:`claim_key`).
CLAIM_TAG_LENGTH = 16


def claim_key(keys: LockKeys, task_name: str) -> str:
    """The send-time claim of ``task_name`` on the lock ``keys`` (``<lock>:claim:<tag>``).

    A claim is per task and name: a send of one task is never taken for a duplicate
    of another task that names the same resource.
    """
    tag = hashlib.sha256(task_name.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{keys.claim}:{tag[:CLAIM_TAG_LENGTH]}"


class ParkedKeys(NamedTuple):
    """The keys of the runs parked under one prefix (:mod:`celery_redlock.integration.parking`)."""

    due: str
    runs: str
    taken: str
    started: str
    lines: str


def parked_keys(prefix: str = DEFAULT_PREFIX) -> ParkedKeys:
    """Where the runs that wait their turn are parked, under ``prefix``.

    Not per lock: every worker takes due runs with one call per node, whatever the
    number of keys with runs waiting. (So one slot of a Redis Cluster: parking
    there falls back to the broker, :mod:`celery_redlock.integration.parking`.)
    """
    base = f"{validate_prefix(prefix)}parked"
    return ParkedKeys(base, f"{base}:runs", f"{base}:taken", f"{base}:started", f"{base}:lines")


def feed_key(prefix: str = DEFAULT_PREFIX) -> str:
    """The event feed of every lock under ``prefix`` (:mod:`celery_redlock.integration.events`)."""
    return f"{validate_prefix(prefix)}log"


def handed_key(keys: LockKeys) -> str:
    """The hand-off mark of the lock ``keys``: a run waiting for it was just published."""
    return f"{keys.lock}:handed"


def line_key(keys: LockKeys) -> str:
    """The line of the runs parked for the release of the lock ``keys`` (sorted set)."""
    return f"{keys.lock}:line"


def parse_key(key: str, prefix: str = DEFAULT_PREFIX) -> tuple[LockKeys, str] | None:
    """The lock ``key`` belongs to, and which of its keys it is (a :class:`LockKeys` field).

    None when ``key`` is none of a lock's keys under ``prefix``. A lock key always
    ends with ``}``, so no other key of a lock can be read as one; a claim key ends
    with ``:claim:`` and its task's tag (:func:`claim_key`).
    """
    base, sep, tag = key.rpartition(SUFFIXES["claim"] + ":")
    if (
        sep
        and len(tag) == CLAIM_TAG_LENGTH
        and all(c in "0123456789abcdef" for c in tag)
        and is_lock_key(base, prefix)
    ):
        return keys_of(base), "claim"
    for field, suffix in SUFFIXES.items():
        if key.endswith(suffix):
            lock = key[: len(key) - len(suffix)]
            if is_lock_key(lock, prefix):
                return keys_of(lock), field
    return None


def lock_name_of(lock: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The lock name of a lock key ``<prefix>{<name>}``: :func:`lock_keys` undone."""
    tagged = lock[len(prefix) + 1 : -1]
    return tagged[len(TAG_ESCAPE) :] if tagged.startswith(TAG_ESCAPE) else tagged


def keys_of(lock: str) -> LockKeys:
    """Every key of a lock, from its lock key (``<prefix>{<name>}``)."""
    return LockKeys(*(lock + SUFFIXES[field] for field in LockKeys._fields))
