"""High-availability beat: several ``celery beat`` processes, exactly one dispatching.

::

    celery -A proj beat -S celery_redlock.beat:LeaderScheduler

Every beat competes for one leader lock (``redlock:{beat:<redlock_beat_name>}``, lease
``redlock_beat_ttl``). The default name is ``<main>@<digest>``: the app's main name and
12 hex digits of SHA-256 over the broker's address without its password
(:func:`broker_identity`), so two projects that share a lock Redis but not a broker
never elect one leader between them even when both are ``Celery("proj")``. Set
``redlock_beat_name`` when the beats of one project reach the broker by different
addresses (``localhost`` here, a host name there): they would otherwise each lead.
A standby logs at INFO which beat leads (app, host, pid, broker), and at WARNING when
that beat belongs to another project (another broker).

The leader's lease is renewed in the background by the process's watchdog, not only
when beat ticks. Standbys keep ticking without sending anything and try again each
time the leader's lease could have ended, so a standby takes over within one lease of
the leader dying (SIGKILL) or hanging (SIGSTOP), without a restart. A leader that loses
its lease steps down and keeps competing; it never exits for it.

**No run is sent twice.** Before sending, the leader *claims* the run with one script
(``beat_claim.lua``) that checks, on Redis, both that it still holds the leader lock
and that no later run of that entry has been claimed; only then does it send. A leader
that was paused past its lease and has not noticed yet is refused there. The local
lease is also re-checked right before each claim; a lease in doubt sends nothing.

**No run is lost beyond the failover window.** The claimed run times are kept in Redis
(``redlock:{beat:<name>}:state``). A beat that becomes leader adopts them, so it
continues the schedule where the previous leader left it: runs that fell due while no
one led are sent once, as soon as it takes over (beat's usual catch-up: several missed
runs of one entry become one), and runs already sent are not repeated. A claimed run
whose send then fails (broker down) is lost: delivery is at most once per run.

**Each run says which run it is.** The message carries the claimed run time (unix
seconds, the leader's clock) in the header ``redlock_beat_run``
(``self.request.redlock_beat_run`` in a bound task): two messages never carry the same
value for one entry, so a task can use it as an idempotency key.

**Beat refuses what a worker refuses.** Before it opens its schedule, a leader scheduler
checks the ``redlock_*`` settings, the ``redlock_tasks`` entries and the lock options of
every locked task it knows (:func:`check_configuration`): a bad ``lock_rate`` (on a task,
in its entry, or the ``redlock_rate`` default) stops beat with a
:class:`~celery_redlock.ConfigurationError` naming it and the allowed form, as it stops a
worker.

Schedulers: :class:`LeaderScheduler` is Celery's default ``PersistentScheduler`` (a
shelve file per beat) with leadership. ``DatabaseLeaderScheduler`` is
django-celery-beat's ``DatabaseScheduler`` with leadership (imported only when named,
so that django-celery-beat stays optional)::

    celery -A proj beat -S celery_redlock.beat:DatabaseLeaderScheduler

:class:`LeaderMixin` adds the same to another scheduler class whose entries are
``ScheduleEntry``-like (``name``, ``last_run_at``) and which dispatches through
``apply_entry``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import time
from datetime import datetime, timezone
from typing import Any

from celery.beat import PersistentScheduler
from kombu.utils.url import url_to_parts
from redis.exceptions import ResponseError

from ..engine.lock import Redlock
from ..engine.scripts import BEAT_CLAIM, BeatClaimStatus
from ..exceptions import ConfigurationError, LockBusy, LockLost, NodeUnavailable
from ..nodes import Call
from . import config_only, events
from .settings import Settings
from .task import LockedTask, app_settings, lock_options

# DatabaseLeaderScheduler is left out: a star import would import django-celery-beat.
__all__ = [
    "LeaderMixin",
    "LeaderScheduler",
    "beat_holder",
    "broker_identity",
    "check_configuration",
    "default_beat_name",
    "leader_name",
    "parse_beat_holder",
    "same_broker",
]

logger = logging.getLogger("celery.beat")


#: Message header carrying the claimed run time of a periodic run.
RUN_HEADER = "redlock_beat_run"


#: What a leader records as its ``task_name``: who it is and which broker it sends to.
_HOLDER = re.compile(
    r"^celery beat (?P<app>\S+) (?P<host>\S+):(?P<pid>\d+) broker (?P<broker>\S+)$"
)


def broker_identity(app: Any) -> str:
    """The broker ``app`` sends to, without its password: ``transport://user@host:port/vhost``.

    Spellings of one address that kombu resolves alike compare equal (``redis://h`` and
    ``redis://h:6379/0``); the first URL of a failover list counts; a Redis
    ``global_keyprefix`` is part of it (it separates projects on one database).

    Raises:
        ConfigurationError: the broker URL cannot be read (naming ``redlock_beat_name``).
    """
    try:
        with app.connection_for_write() as conn:
            # as_uri() fills in the transport's default port; its password is masked.
            parts = url_to_parts(conn.as_uri())
    except Exception as exc:
        raise ConfigurationError(
            f"redlock_beat_name is not set and the broker URL cannot be read to derive it "
            f"({type(exc).__name__}: {exc}); set redlock_beat_name"
        ) from exc
    vhost = (parts.path or "").strip("/")
    if parts.scheme in ("redis", "rediss") and not vhost:
        vhost = "0"
    user = f"{parts.username}@" if parts.username else ""  # no "@" without a user
    address = f"{user}{parts.hostname or ''}:{parts.port or ''}"
    identity = f"{parts.scheme}://{address}/{vhost or '/'}"
    options = app.conf.get("broker_transport_options") or {}
    prefix = options.get("global_keyprefix") if isinstance(options, dict) else None
    return f"{identity}?global_keyprefix={prefix}" if prefix else identity


def default_beat_name(app: Any) -> str:
    """``<main>@<12 hex digits of SHA-256 of broker_identity(app)>``.

    The digest, not the address, goes into the key: names stay short, and nothing of
    the broker's credentials is in Redis (the identity has no password to begin with).
    """
    main = re.sub(r"[{}\s]", "_", app.main or "celery")
    digest = hashlib.sha256(_hashed_identity(broker_identity(app)).encode()).hexdigest()[:12]
    return f"{main}@{digest}"


def _hashed_identity(identity: str) -> str:
    """The identity as the default name hashes it: as earlier versions wrote it.

    They wrote ``redis://@host:6379/0`` for a broker URL without a user (shown as is
    by ``celery redlock ls``); the identity no longer has that ``@``, but the leader
    lock's default name must not change, or an upgraded beat and an older one would
    each lead under its own name.
    """
    scheme, _, rest = identity.partition("://")
    netloc, slash, path = rest.partition("/")
    return f"{scheme}://{netloc if '@' in netloc else '@' + netloc}{slash}{path}"


def same_broker(recorded: str, identity: str) -> bool:
    """Whether a leader's recorded broker identity is ``identity`` (either way written)."""
    return _hashed_identity(recorded) == _hashed_identity(identity)


def check_configuration(app: Any) -> Settings:
    """Refuse what a worker refuses at its start; ``app``'s validated settings.

    The ``redlock_*`` settings, the ``redlock_tasks`` entries (applied, as the worker
    does) and the lock options of every locked task ``app`` has (a bad ``lock_rate``,
    on the task, in its entry or as the ``redlock_rate`` default, among them). Beat
    sends those tasks, deduplicating at send time (``lock_unique``): a beat that started
    with options its workers refuse would send what no worker runs.

    Raises:
        ConfigurationError: naming the setting, or the task, its option and what it
            accepts (and the ``redlock_tasks`` entry that set it).
    """
    settings = app_settings(app)
    config_only.apply(app, settings, quiet=True)
    for task in list(app.tasks.values()):
        if isinstance(task, LockedTask):
            lock_options(task)
    return settings


def leader_name(app: Any, beat_name: str | None) -> str:
    """The leader lock's name: ``beat:`` and ``redlock_beat_name`` or the default."""
    return f"beat:{beat_name or default_beat_name(app)}"


def beat_holder(app: Any) -> str:
    """What this beat records as the leader lock's ``task_name``.

    App, host, pid and broker identity, parsed back by :func:`parse_beat_holder`.
    """
    main = re.sub(r"\s", "_", app.main or "celery")
    where = f"{socket.gethostname()}:{os.getpid()}"
    return f"celery beat {main} {where} broker {broker_identity(app)}"


def parse_beat_holder(task_name: str | None) -> dict[str, str] | None:
    """``{"app", "host", "pid", "broker"}`` of a leader's ``task_name``.

    None if it is not one this version writes (an older beat, or not a beat).
    """
    match = _HOLDER.match(task_name or "")
    return match.groupdict() if match else None


class LeaderMixin:
    """Makes a beat scheduler dispatch only while it holds the leader lock."""

    app: Any
    schedule: dict[str, Any]
    _heap: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before the scheduler opens its schedule: a ConfigurationError stops beat at start.
        settings = check_configuration(kwargs["app"] if "app" in kwargs else args[0])
        super().__init__(*args, **kwargs)
        self.broker_identity = broker_identity(self.app)
        self.leader_lock = Redlock(
            leader_name(self.app, settings.beat_name),
            nodes=settings.node_urls(),
            # Validated here so that an error names the setting, not Redlock's argument.
            timing=settings.beat_timing(),
            key_prefix=settings.key_prefix,
            task_name=beat_holder(self.app),
            on_lost=self._on_leader_lost,
        )
        self.leading = False
        #: When to ask for the lease again while standing by (monotonic).
        self._next_try = 0.0
        #: The leader this standby last named in its log (so it says so once per leader).
        self._seen_leader: str | None = None
        #: Entries reserved by this tick, by name: the run ``apply_entry`` then claims.
        self._reserved: dict[str, Any] = {}

    # -- leadership ----------------------------------------------------------------

    def _on_leader_lost(self, exc: LockLost) -> None:
        logger.error("beat: lost leadership (%s); not sending until re-elected", exc.reason)
        self._record_leader("lost")

    def _record_leader(self, then: str) -> None:
        """Log that this beat became (``won``) or stopped being (``lost``) the leader."""
        lock = self.leader_lock
        keys = [resource.lock for resource in lock.resources]
        events.record(self.app, lock.nodeset, "leader", keys, lock.task_name, None, then=then)

    def _still_leading(self) -> bool:
        if not self.leading:
            return False
        try:
            self.leader_lock.check()
        except LockLost as exc:
            self.leading = False
            logger.warning("beat: stepping down (%s); competing again", exc.reason)
            self._record_leader("lost")
            self._next_try = 0.0
            return False
        return True

    def _compete(self) -> float | None:
        """Try to become leader; return how long to stand by, or None when leading."""
        if self._still_leading():
            return None
        if time.monotonic() < self._next_try:
            return self._next_try - time.monotonic()
        try:
            self.leader_lock.try_acquire()
        except LockBusy as busy:
            # Ask again when the holder's lease would end if it stopped renewing.
            wait = max(0.05, (busy.ttl or self.leader_lock.timing.ttl) + 0.01)
            self._next_try = time.monotonic() + wait
            self._name_leader()
            return wait
        except NodeUnavailable as exc:
            logger.warning("beat: cannot reach Redis to compete for leadership: %s", exc)
            self._next_try = time.monotonic() + self.leader_lock.timing.renew_interval
            return self.leader_lock.timing.renew_interval
        self.leading = True
        self._adopt_schedule_state()
        logger.info("beat: elected leader (fence %s)", self.leader_lock.fence)
        self._record_leader("won")
        return None

    def _name_leader(self) -> None:
        """Say once per leader which beat leads; warn if it is another project's."""
        try:
            views = self.leader_lock.inspect()
        except Exception as exc:  # naming the leader is a courtesy: never stop beat
            logger.debug("beat: could not read the leader lock: %s", exc)
            return
        names = [v.get("task_name") for v in views if v.get("task_name")]
        if not names or names[0] == self._seen_leader:
            return
        holder = max(set(names), key=names.count)
        self._seen_leader = holder
        key = self.leader_lock.key
        leader = parse_beat_holder(holder)
        if leader is not None and not same_broker(leader["broker"], self.broker_identity):
            logger.warning(
                "beat: standing by, but the leader lock %s is held by a beat of another "
                "project (app %s on %s:%s, broker %s; this beat's broker is %s): this "
                "project's periodic tasks are not sent while it leads. Give each project "
                "its own redlock_beat_name.",
                key, leader["app"], leader["host"], leader["pid"], leader["broker"],
                self.broker_identity,
            )  # fmt: skip
        elif leader is not None:
            logger.info(
                "beat: standing by; the leader is app %s on %s:%s (lock %s)",
                leader["app"], leader["host"], leader["pid"], key,
            )  # fmt: skip
        else:
            logger.info("beat: standing by; the leader is %r (lock %s)", holder, key)

    def _adopt_schedule_state(self) -> None:
        """Continue the schedule where the previous leader left it."""
        keys = self.leader_lock.keys
        stored: dict[str, float] = {}
        # Any quorum that claimed a run intersects the nodes that answer here, so the
        # latest claimed run of each entry is the largest value any node reports.
        for reply in self.leader_lock.nodeset.call([Call.command("HGETALL", keys.state)]):
            if reply is None or not reply.ok or isinstance(reply.values[0], ResponseError):
                continue
            flat = reply.values[0]
            for entry, value in zip(flat[::2], flat[1::2], strict=True):
                stored[entry] = max(stored.get(entry, 0.0), float(value))
        for name, entry in self.schedule.items():
            if name in stored:
                entry.last_run_at = _datetime(stored[name])
        self._heap = None  # rebuild the run order from the adopted times

    # -- scheduler hooks -----------------------------------------------------------

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One beat iteration; standbys tick too, but only to compete and keep time."""
        standby = self._compete()
        interval = float(super().tick(*args, **kwargs))  # type: ignore[misc]  # a Scheduler follows in the MRO
        return interval if standby is None else min(interval, standby)

    def reserve(self, entry: Any) -> Any:
        """Advance ``entry`` to this run, as the scheduler does; remember it for the claim.

        Beat passes ``apply_entry`` the entry as it was before this run. Its advanced
        copy, which holds this run's time, is kept in ``self.schedule`` by Celery's own
        schedulers but not by every scheduler (django-celery-beat's keeps it only in its
        run order), so it is taken here.
        """
        reserved = super().reserve(entry)  # type: ignore[misc]  # a Scheduler follows in the MRO
        self._reserved[entry.name] = reserved
        return reserved

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Send ``entry`` only if this beat leads and claims the run on Redis."""
        if not self._still_leading():
            logger.debug("beat: standing by, not sending %s", entry.name)
            return
        verdict, run = self._claim(entry)
        if verdict == BeatClaimStatus.CLAIMED:
            headers = {**(entry.options.get("headers") or {}), RUN_HEADER: run}
            entry.options = {**entry.options, "headers": headers}
            super().apply_entry(entry, producer)  # type: ignore[misc]  # a Scheduler follows in the MRO

    def _claim(self, entry: Any) -> tuple[int, str]:
        """Claim this run on Redis: (verdict, the claimed run time)."""
        lease = self.leader_lock.lease
        if lease is None:
            return BeatClaimStatus.NOT_LEADER, ""
        current = self._reserved.pop(entry.name, None) or self.schedule.get(entry.name, entry)
        known = "" if entry.last_run_at is None else repr(_timestamp(entry.last_run_at))
        now = repr(_timestamp(getattr(current, "last_run_at", None) or self.app.now()))
        keys = self.leader_lock.keys
        keep = round(_state_lifetime(current, lease.timing.ttl) * 1000)
        replies = self.leader_lock.nodeset.call(
            [
                BEAT_CLAIM.on(
                    keys, token=lease.token, entry=entry.name, known=known, run_at=now, keep_ms=keep
                )
            ]
        )
        codes, stored = [], []
        for reply in replies:
            if reply is None or not reply.ok or isinstance(reply.values[0], ResponseError):
                continue
            codes.append(int(reply.values[0][0]))
            if codes[-1] == BeatClaimStatus.TAKEN:
                stored.append(float(reply.values[0][1]))
        quorum = self.leader_lock.nodeset.quorum
        if codes.count(BeatClaimStatus.CLAIMED) >= quorum:
            return BeatClaimStatus.CLAIMED, now
        if codes.count(BeatClaimStatus.NOT_LEADER) > len(self.leader_lock.nodeset) - quorum:
            self.leading = False
            logger.warning("beat: not the leader any more; %s not sent", entry.name)
            return BeatClaimStatus.NOT_LEADER, ""
        if stored:
            current.last_run_at = _datetime(max(stored))
            logger.info("beat: %s was already sent by another leader; not sending", entry.name)
            return BeatClaimStatus.TAKEN, ""
        logger.warning("beat: could not claim %s on a quorum of nodes; not sending", entry.name)
        return BeatClaimStatus.TAKEN, ""

    def close(self) -> None:
        """Hand leadership over at once on a clean shutdown."""
        try:
            super().close()  # type: ignore[misc]  # a Scheduler follows in the MRO
        finally:
            if self.leading:
                self.leading = False
                try:
                    self.leader_lock.release()
                except Exception as exc:  # the lease ends by itself
                    logger.warning("beat: releasing leadership failed: %s", exc)

    @property
    def info(self) -> str:
        """Lines for beat's start-up banner."""
        base = super().info  # type: ignore[misc]  # a Scheduler follows in the MRO
        lock = self.leader_lock
        return (
            f"{base}\n    . leader lock -> {lock.key} (lease {lock.timing.ttl}s, "
            f"{len(lock.nodeset)} node(s))"
        )


class LeaderScheduler(LeaderMixin, PersistentScheduler):
    """Celery's default persistent scheduler, dispatching only while elected leader."""


def _database_leader_scheduler() -> type:
    """django-celery-beat's ``DatabaseScheduler`` with leadership (see the module docs).

    A standby reserves nothing: ``DatabaseScheduler.reserve`` records a run in the
    database (``last_run_at``, ``total_run_count``, written at its next sync), and
    every beat shares that database, so a standby that reserved would record runs it
    never sent, shown in the admin and read back by the leader at its next full
    reload. Left unreserved, a due entry stays due on a standby until it leads; it
    then adopts the claimed run times from Redis, as ``LeaderScheduler`` does.
    """
    from django_celery_beat.schedulers import DatabaseScheduler  # noqa: PLC0415 (optional)

    class DatabaseLeaderScheduler(LeaderMixin, DatabaseScheduler):
        """django-celery-beat's database scheduler, dispatching only while leader."""

        def reserve(self, entry: Any) -> Any:
            if not self._still_leading():
                return entry
            return super().reserve(entry)

    DatabaseLeaderScheduler.__module__ = __name__
    DatabaseLeaderScheduler.__qualname__ = "DatabaseLeaderScheduler"
    return DatabaseLeaderScheduler


def __getattr__(name: str) -> Any:
    """``DatabaseLeaderScheduler``, made on first use (django-celery-beat is optional)."""
    if name == "DatabaseLeaderScheduler":
        scheduler = _database_leader_scheduler()
        globals()[name] = scheduler
        return scheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The schedule state lasts at least this many leader leases from each claim.
STATE_LEASES = 10


def _state_lifetime(entry: Any, lease_ttl: float) -> float:
    """Seconds the schedule state must last after claiming a run of ``entry``.

    Twice the time to the entry's next run (a standby taking over before that run must
    still find this one), and at least :data:`STATE_LEASES` leases: the state of a beat
    that stopped for good expires by itself, like every key of the package.
    """
    try:
        next_in = float(entry.is_due()[1])
    except Exception:  # a schedule that cannot say: the lease bound alone
        next_in = 0.0
    return max(STATE_LEASES * lease_ttl, 2 * next_in)


def _timestamp(value: datetime) -> float:
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


def _datetime(value: float) -> datetime:
    return datetime.fromtimestamp(value, tz=timezone.utc)
