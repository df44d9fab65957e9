"""Histories of critical sections, and a checker for the invariants of DESIGN §3.

Every process of a scenario records each critical section it ran on a *storage*
Redis that the checker owns (never one of the lock nodes, so faults injected into the
lock nodes cannot touch the evidence):

* a :class:`Section`: key, fence, start, end, process, the lease deadline the holder
  knew at the end, and when (if ever) it learned that the lease was lost;
* writes through a **fenced register** (``fenced_register.lua``): accepted only with a
  fence at least the largest accepted so far (equal only for the same section), every
  attempt logged;
* increments of a **counter** protected by the lock, done non-atomically (GET, pause,
  SET) so that two sections running at once lose an update.

All times come from one clock, :data:`celery_redlock.engine.lease.clock` (CLOCK_BOOTTIME on
Linux): it is system-wide, so processes of one host can be compared, and it is the clock
of the library's own lease deadlines, so a section can be cut at the deadline its holder
knew.

:func:`check` then reports a :class:`Violation` for:

* ``overlap``: two sections of one key whose *valid* parts overlap. A section is valid
  from its start until its end, the lease deadline its holder knew, or the moment its
  holder learned of the loss, whichever is earliest: a holder paused past its lease is
  not "in" the section any more, but it must not write (see the next point);
* ``stale-write``: the register log shows an accepted write with a fence below the
  largest accepted before it, or equal to it from another section;
* ``lost-update``: a counter ends lower than the number of increments recorded;
* ``starved`` (only when :func:`check` is given ``max_run``): service across processes
  (DESIGN invariant 12). While a holder waited for a key (from its ``acquire()`` call,
  ``asked``, to its section's start), another process ran more than ``max_run`` of
  that key's sections in a row (no section of any other process between them): a
  process kept the lock among its own threads while another process waited.
  :func:`service` gives the per-process counts and Jain's index across processes.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from celery_redlock.engine.lease import clock

__all__ = [
    "REGISTER_SOURCE",
    "History",
    "Section",
    "Violation",
    "Write",
    "check",
    "jain",
    "service",
]

#: The fenced register's Lua source (see its header for KEYS/ARGV/returns).
REGISTER_SOURCE = Path(__file__).with_name("fenced_register.lua").read_text()


@dataclass(frozen=True)
class Section:
    """One critical section, as its holder saw it (times from :data:`clock`)."""

    key: str
    fence: int
    start: float
    end: float
    process: int
    #: The local lease deadline at the end (the lease was sure until then).
    valid_until: float
    #: When the holder learned that its lease was lost, if it did.
    lost_at: float | None = None
    #: Counter increments completed inside the section.
    increments: int = 0
    #: Unique id of the section, also its writer id at the register.
    id: str = ""
    #: When its holder called ``acquire()`` (None: not recorded).
    asked: float | None = None

    @property
    def valid_end(self) -> float:
        """Until when the section held a valid lease."""
        lost = math.inf if self.lost_at is None else self.lost_at
        return min(self.end, self.valid_until, lost)


@dataclass(frozen=True)
class Write:
    """One attempt to write through the fenced register, in the register's order."""

    key: str
    fence: int
    writer: str
    accepted: bool


@dataclass(frozen=True)
class Violation:
    """A broken invariant: ``kind`` is overlap, stale-write, lost-update or starved."""

    kind: str
    key: str
    detail: str


class History:
    """The storage side of a scenario: records, register and counters on one Redis.

    ``run`` namespaces the keys, so several scenarios can share a storage server.
    Picklable (only the URL and run travel), so every process of a scenario makes its
    own connection.
    """

    def __init__(self, url: str, run: str = "run") -> None:
        self.url = url
        self.run = run
        self._client: redis.Redis | None = None
        self._pid = 0
        self._sections = itertools.count(1)  # next() is atomic: threads of a holder share it

    def __reduce__(self) -> tuple[type[History], tuple[str, str]]:
        return (History, (self.url, self.run))

    @property
    def client(self) -> redis.Redis:
        """This process's connection (a forked child makes its own)."""
        if self._client is None or self._pid != os.getpid():
            self._client = redis.Redis.from_url(self.url, decode_responses=True)
            self._pid = os.getpid()
        return self._client

    def _key(self, *parts: str) -> str:
        return ":".join(("history", self.run, *parts))

    # -- what holders call ------------------------------------------------------------

    def new_section_id(self) -> str:
        """An id unique to one critical section of this process."""
        return f"{os.getpid()}.{next(self._sections)}"

    def write(self, key: str, fence: int, writer: str) -> bool:
        """Write through the fenced register; True if it accepted the fence."""
        keys = (self._key("register", key), self._key("log", key))
        accepted = self.client.eval(REGISTER_SOURCE, 2, *keys, fence, writer)
        return accepted == 1

    def read_counter(self, key: str) -> int:
        """The counter's value (first half of a non-atomic increment)."""
        return int(self.client.get(self._key("counter", key)) or 0)

    def set_counter(self, key: str, value: int) -> None:
        """Store the counter (second half of a non-atomic increment), and count the update.

        The count goes with the SET in one transaction, so an increment is counted even
        if its holder is killed before it could record its section.
        """
        with self.client.pipeline(transaction=True) as pipe:
            pipe.set(self._key("counter", key), value)
            pipe.incr(self._key("increments", key))
            pipe.execute()

    def increment(self, key: str, pause: float = 0.0) -> None:
        """GET, pause, SET: loses an update whenever two holders overlap."""
        value = self.read_counter(key)
        if pause:
            time.sleep(pause)
        self.set_counter(key, value + 1)

    def record(self, section: Section) -> None:
        """Append a finished section to the history."""
        self.client.rpush(self._key("sections"), json.dumps(asdict(section)))

    def note(self, kind: str, entry: dict[str, Any]) -> None:
        """Append an observation of ``kind`` that is not a section (an audit's finding).

        Holders in other processes note what only they can see (their token, their
        lease) so that the test process can report it with the checker's verdict.
        """
        self.client.rpush(self._key("notes", kind), json.dumps(entry))

    # -- what the checker reads -------------------------------------------------------

    def count(self) -> int:
        """How many sections were recorded so far."""
        return int(self.client.llen(self._key("sections")))

    def sections(self) -> list[Section]:
        """Every recorded section, in recording order."""
        return [Section(**json.loads(s)) for s in self.client.lrange(self._key("sections"), 0, -1)]

    def notes(self, kind: str) -> list[dict[str, Any]]:
        """Every observation of ``kind`` noted so far, in noting order."""
        return [json.loads(n) for n in self.client.lrange(self._key("notes", kind), 0, -1)]

    def writes(self) -> list[Write]:
        """Every register attempt, per key in the register's order."""
        writes = []
        prefix = self._key("log", "")
        for log in sorted(self.client.scan_iter(f"{prefix}*")):
            key = log[len(prefix) :]
            for entry in self.client.lrange(log, 0, -1):
                flag, fence, writer = entry.split(" ", 2)
                writes.append(Write(key, int(fence), writer, flag == "1"))
        return writes

    def counters(self, kind: str = "counter") -> dict[str, int]:
        """Every counter's final value (``kind="increments"``: the updates counted)."""
        prefix = self._key(kind, "")
        return {
            k[len(prefix) :]: int(self.client.get(k)) for k in self.client.scan_iter(f"{prefix}*")
        }

    def check(self, max_run: int | None = None) -> list[Violation]:
        """Check everything recorded so far (``max_run``: see :func:`check`)."""
        return check(
            self.sections(),
            self.writes(),
            self.counters(),
            self.counters("increments"),
            max_run=max_run,
        )


def check(
    sections: Sequence[Section],
    writes: Iterable[Write] = (),
    counters: dict[str, int] | None = None,
    increments: dict[str, int] | None = None,
    *,
    max_run: int | None = None,
) -> list[Violation]:
    """Every violation in a history (an empty list when all invariants held).

    ``increments`` counts the counter updates per key; by default, the sum of the
    sections' own counts (a killed holder's section may never be recorded).
    ``max_run``: also check service across processes (``starved``); scenarios whose
    faults stop a process's waiters on purpose (a paused holder) leave it out.
    """
    if increments is None:
        increments = {}
        for section in sections:
            increments[section.key] = increments.get(section.key, 0) + section.increments
    return [
        *_overlaps(sections),
        *_stale_writes(writes),
        *_lost_updates(increments, counters or {}),
        *([] if max_run is None else _starved(sections, max_run)),
    ]


def _overlaps(sections: Sequence[Section]) -> list[Violation]:
    """Valid parts of two sections of one key that overlap (a sweep by start time)."""
    violations = []
    for key, group in _by_key(sections).items():
        group.sort(key=lambda s: s.start)
        latest: Section | None = None  # the earlier section whose valid part ends last
        for section in group:
            if section.valid_end <= section.start:
                continue  # never valid: lost before its body began
            if latest is not None and section.start < latest.valid_end:
                violations.append(
                    Violation(
                        "overlap",
                        key,
                        f"section {section.id} (fence {section.fence}, pid {section.process}) "
                        f"started {latest.valid_end - section.start:.6f}s before section "
                        f"{latest.id} (fence {latest.fence}, pid {latest.process}) "
                        "stopped being valid",
                    )
                )
            if latest is None or section.valid_end > latest.valid_end:
                latest = section
    return violations


def _stale_writes(writes: Iterable[Write]) -> list[Violation]:
    """Accepted writes below (or equal to, from another section) the largest before."""
    violations = []
    largest: dict[str, tuple[int, str]] = {}
    for write in writes:
        if not write.accepted:
            continue
        best = largest.get(write.key)
        if best is not None and (
            write.fence < best[0] or (write.fence == best[0] and write.writer != best[1])
        ):
            violations.append(
                Violation(
                    "stale-write",
                    write.key,
                    f"write of {write.writer} with fence {write.fence} accepted after "
                    f"{best[1]} had written with fence {best[0]}",
                )
            )
        if best is None or write.fence >= best[0]:
            largest[write.key] = (write.fence, write.writer)
    return violations


def _lost_updates(expected: dict[str, int], counters: dict[str, int]) -> list[Violation]:
    """Counters that do not end at the number of increments made."""
    return [
        Violation("lost-update", key, f"counter is {counters.get(key, 0)}, {want} increments")
        for key, want in sorted(expected.items())
        if counters.get(key, 0) != want
    ]


def _starved(sections: Sequence[Section], max_run: int) -> list[Violation]:
    """Waits during which another process ran more than ``max_run`` sections in a row.

    Per key, sections in start order; for each section with ``asked``, the sections
    that started while it waited, in runs of one process (any other process's section
    ends a run). Only other processes' runs count: a process serving its own threads
    in turn is the handoff working. One violation per waiting section, its longest run.
    """
    violations = []
    for key, group in _by_key(sections).items():
        if len({s.process for s in group}) < 2:
            continue  # one process: nobody elsewhere to starve
        group.sort(key=lambda s: s.start)
        starts = [s.start for s in group]
        for section in group:
            if section.asked is None:
                continue
            first = bisect.bisect_right(starts, section.asked)
            last = bisect.bisect_left(starts, section.start)
            longest, run, runner, worst = 0, 0, None, None
            for other in group[first:last]:
                run = run + 1 if other.process == runner else 1
                runner = other.process
                if runner != section.process and run > longest:
                    longest, worst = run, runner
            if longest > max_run:
                violations.append(
                    Violation(
                        "starved",
                        key,
                        f"section {section.id} (pid {section.process}) waited "
                        f"{section.start - section.asked:.3f}s while pid {worst} ran "
                        f"{longest} sections in a row (bound {max_run})",
                    )
                )
    return violations


def _by_key(sections: Iterable[Section]) -> dict[str, list[Section]]:
    by_key: dict[str, list[Section]] = {}
    for section in sections:
        by_key.setdefault(section.key, []).append(section)
    return by_key


def service(sections: Iterable[Section], contended: bool = False) -> dict[str, dict[int, int]]:
    """Per key, the sections each process ran (its service).

    ``contended``: only sections that started while every process of the key wanted
    the lock: from the last process's first request (``asked``, else start) to the
    first process's last start. A run of fixed iterations per process ends with equal
    totals however unfair it was, and spawned processes start at different moments.
    """
    served = {}
    for key, group in _by_key(sections).items():
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        for s in group:
            began = s.start if s.asked is None else s.asked
            first[s.process] = min(began, first.get(s.process, began))
            last[s.process] = max(s.start, last.get(s.process, s.start))
        since, until = (max(first.values()), min(last.values())) if contended else (-1, math.inf)
        counts = Counter(s.process for s in group if since <= s.start <= until)
        served[key] = {pid: counts[pid] for pid in sorted(first)}  # 0 for one never served
    return served


def jain(counts: Iterable[int]) -> float:
    """Jain's fairness index: 1.0 when all counts are equal, 1/n when one has all."""
    values = list(counts)
    squares = sum(c * c for c in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else 1.0


def now() -> float:
    """The history clock (the library's lease clock)."""
    return clock()
