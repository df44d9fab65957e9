"""Singleton periodic tasks and LeaderScheduler, with real beat and worker processes."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import time
from pathlib import Path

import pytest

from celery_redlock.integration.beat import parse_beat_holder
from tests.harness import BeatProcess, wait_for

SCHEDULER = "celery_redlock.beat:LeaderScheduler"
BEAT_TTL = 2.0


@pytest.fixture
def stamps(tmp_path):
    return tmp_path / "stamps"


@pytest.fixture
def env(stamps):
    return {"REDLOCK_TEST_STAMPS": str(stamps), "REDLOCK_TEST_BEAT_TTL": str(BEAT_TTL)}


@pytest.fixture
def beats(celery_redis, env, tmp_path):
    started: list[BeatProcess] = []

    def make(n: int, scheduler: str | None = SCHEDULER) -> list[BeatProcess]:
        for _ in range(n):
            beat = BeatProcess(
                "tests.apps.beatapp",
                scheduler=scheduler,
                redis_url=celery_redis.url,
                env=env,
                log_dir=tmp_path / "beats",
            )
            started.append(beat)
            beat.start()
        return started[-n:]

    yield make
    for beat in started:
        if beat.alive() and _stopped(beat.pid):
            os.kill(beat.pid, signal.SIGCONT)
        beat.stop()


@pytest.fixture
def worker(worker_process_factory, env):
    return worker_process_factory(
        "tests.apps.beatapp",
        pool="prefork",
        concurrency=5,
        env=env,
        extra_args=["-I", "tests.apps.beat_worker_tasks"],
    )


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "Tt"
    except (FileNotFoundError, IndexError):
        return False


def dispatches(stamps: Path, label: str) -> list[float]:
    """The runs of ``label`` that reached a worker, by the run time the leader claimed.

    The claimed time, not the arrival time: a worker on a loaded machine may run two
    messages of consecutive runs much less than an interval apart.
    """
    if not stamps.exists():
        return []
    runs = [
        line.split()[2] for line in stamps.read_text().splitlines() if line.startswith(f"{label} ")
    ]
    assert "-" not in runs, "a periodic run arrived without its claimed run time"
    return sorted(float(run) for run in runs)


def leader_key(server, app: str = "beatapp") -> str | None:
    """``app``'s leader lock on ``server`` (``redlock:{beat:<app>@<digest>}``)."""
    keys = [
        k
        for k in server.client().scan_iter(f"redlock:{{beat:{app}@*")
        if not k.endswith((":fence", ":state", ":log"))
    ]
    assert len(keys) <= 1, f"one leader lock per project: {keys}"
    return keys[0] if keys else None


def leader(celery_redis, beats: list[BeatProcess], app: str = "beatapp") -> BeatProcess | None:
    key = leader_key(celery_redis, app)
    holder = parse_beat_holder(celery_redis.client().hget(key, "task_name") if key else None)
    pid = int(holder["pid"]) if holder else None
    return next((b for b in beats if b.pid == pid and b.alive()), None)


def assert_one_dispatch_per_slot(times: list[float], window: float) -> None:
    """Interval 1 s: no run sent twice or twice in one slot, no gap past the window."""
    assert len(set(times)) == len(times), f"a run was sent twice: {times}"
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps, "nothing was dispatched"
    assert min(gaps) > 0.5, f"a run was sent twice: gaps {gaps}"
    assert max(gaps) < window, f"runs lost beyond the failover window: gaps {gaps}"


def test_three_beats_elect_one_leader_and_survive_kill_and_stop(
    celery_redis, beats, worker, stamps
):
    """SIGKILL, then SIGSTOP the leader: a standby takes over; one dispatch per slot."""
    group = beats(3)
    first = wait_for(lambda: leader(celery_redis, group), timeout=10)
    wait_for(lambda: len(dispatches(stamps, "stamp")) >= 3, timeout=20)

    os.kill(first.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: not first.alive(), timeout=5)
    second = wait_for(lambda: leader(celery_redis, group), timeout=BEAT_TTL * 3, interval=0.02)
    assert second is not first
    assert time.monotonic() - killed_at < BEAT_TTL + 1.0, "took over within one lease (+1 s)"
    count = len(dispatches(stamps, "stamp"))
    wait_for(lambda: len(dispatches(stamps, "stamp")) >= count + 3, timeout=20)

    os.kill(second.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    wait_for(
        lambda: leader(celery_redis, group) not in (None, second),
        timeout=BEAT_TTL * 3,
        interval=0.02,
    )
    assert time.monotonic() - stopped_at < BEAT_TTL + 1.0, "took over within one lease (+1 s)"
    count = len(dispatches(stamps, "stamp"))
    wait_for(lambda: len(dispatches(stamps, "stamp")) >= count + 2, timeout=20)
    os.kill(second.pid, signal.SIGCONT)  # the old leader wakes up: it must step down
    second.wait_for_log(
        re.compile(r"stepping down|not the leader any more|lost leadership"), timeout=10
    )
    count = len(dispatches(stamps, "stamp"))
    wait_for(lambda: len(dispatches(stamps, "stamp")) >= count + 3, timeout=20)

    window = BEAT_TTL + 2.0  # lease + standby check + one interval
    for label in ("stamp", "remote"):
        assert_one_dispatch_per_slot(dispatches(stamps, label), window)
    elected = sum(b.log_text().count("elected leader") for b in group)
    assert elected >= 3


@pytest.mark.smoke
def test_two_beats_only_one_sends(celery_redis, beats, worker, stamps):
    """With two healthy beats, the standby never sends."""
    group = beats(2)
    wait_for(lambda: len(dispatches(stamps, "stamp")) >= 5, timeout=20)
    the_leader = leader(celery_redis, group)
    standby = next(b for b in group if b is not the_leader)
    assert "Sending due task" not in standby.log_text()
    # The standby names the leader at INFO: app, host and pid.
    standby.wait_for_log(
        re.compile(rf"standing by; the leader is app beatapp on \S+:{the_leader.pid} "),
        timeout=10,
    )
    assert_one_dispatch_per_slot(dispatches(stamps, "stamp"), window=2.0)


@pytest.mark.parametrize("label", ["slow", "remote-slow", "plain-slow"])
def test_periodic_task_slower_than_its_interval_never_overlaps(
    celery_redis, beats, worker, stamps, label
):
    """A 2.5 s job sent every second never overlaps; extra sends are skipped.

    ``slow`` is sent with apply_async, ``remote-slow`` with send_task (beat does not know
    the task), ``plain-slow`` is locked by configuration alone.
    """
    beats(1)
    wait_for(lambda: stamps.exists() and stamps.read_text().count(f"{label}-end") >= 3, timeout=30)
    lines = [
        line.split() for line in stamps.read_text().splitlines() if line.startswith(f"{label}-")
    ]
    starts = sorted(int(t) for kind, t, _ in lines if kind == f"{label}-start")
    ends = sorted(int(t) for kind, t, _ in lines if kind == f"{label}-end")
    runs = list(zip(starts, ends, strict=False))
    assert all(b[0] >= a[1] for a, b in itertools.pairwise(runs)), "two runs overlapped"
    fences = [int(f) for kind, _, f in lines if kind == f"{label}-start"]
    assert fences == sorted(fences) and len(set(fences)) == len(fences)
    task = {
        "slow": "tests.apps.beatapp.slow",
        "remote-slow": "tests.apps.beat_worker_tasks.remote_slow",
        "plain-slow": "tests.apps.beatapp.plain_slow",
    }[label]
    skipped = len(re.findall(re.escape(task) + r"\[[^\]]+\] skipped", worker.log_text()))
    assert skipped >= 2, "beat kept sending while the previous run went on"


def test_leader_scheduler_refuses_a_bad_setting(celery_redis, env, tmp_path):
    """An invalid redlock setting stops beat at start with a message naming it."""
    beat = BeatProcess(
        "tests.apps.beatapp",
        scheduler=SCHEDULER,
        redis_url=celery_redis.url,
        env={**env, "REDLOCK_TEST_BEAT_TTL": "-1"},
        log_dir=tmp_path / "bad",
    )
    with pytest.raises(RuntimeError):
        beat.start(timeout=30)
    beat.stop()
    assert "redlock_beat_ttl must be > 0" in beat.log_text()


@pytest.mark.parametrize("scheduler", [SCHEDULER, None])
@pytest.mark.parametrize("where", ["task", "redlock_rate", "redlock_tasks"])
def test_beat_refuses_a_bad_rate(celery_redis, tmp_path, where, scheduler):
    """A bad lock_rate stops beat at start, as it stops a worker: on a task in the
    schedule, as the redlock_rate default, or in the task's redlock_tasks entry; with the
    LeaderScheduler (before it opens its schedule) and with Celery's own scheduler (at
    beat_init, before the first tick: it would send tasks no worker runs)."""
    beat = BeatProcess(
        "tests.apps.rated:beat",
        scheduler=scheduler,
        redis_url=celery_redis.url,
        env={"REDLOCK_TEST_RATE_AT": where, "REDLOCK_TEST_RATE": "5/fortnight"},
        log_dir=tmp_path / "bad",
    )
    if scheduler is None:
        # Celery's scheduler logs "beat: Starting..." before beat_init, then exits (the
        # harness may see either first).
        with contextlib.suppress(RuntimeError):
            beat.start(timeout=30)
        wait_for(lambda: not beat.alive(), timeout=30, message="beat exited")
    else:
        with pytest.raises(RuntimeError):
            beat.start(timeout=30)
    beat.stop()
    names = "redlock_rate" if where == "redlock_rate" else "task rated.scheduled: lock_rate"
    form = '"N/s", "N/m" or "N/h"'
    assert f"{names} must be a rate {form}" in beat.log_text(), beat.log_tail()
    if scheduler is not None:
        assert "beat: Starting..." not in beat.log_text()
    assert "Scheduler: Sending due task" not in beat.log_text()


def _project_beats(redis_factory, env, tmp_path, beat_name: str | None = None):
    """Two projects, both ``Celery("beatapp")``, each with its own broker, one lock Redis."""
    locks, broker_a, broker_b = redis_factory(3)
    extra = {"REDLOCK_TEST_LOCK_URL": locks.url}
    if beat_name:
        extra["REDLOCK_TEST_BEAT_NAME"] = beat_name
    beats = [
        BeatProcess(
            "tests.apps.beatapp",
            scheduler=SCHEDULER,
            redis_url=broker.url,
            env={**env, **extra},
            log_dir=tmp_path / "projects",
        )
        for broker in (broker_a, broker_b)
    ]
    return locks, (broker_a, broker_b), beats


def _sent(broker) -> int:
    """Messages waiting in the project's default queue (broker db 1)."""
    return broker.client(db=1).llen("celery")


def test_two_projects_with_one_app_name_and_their_own_brokers_both_dispatch(
    redis_factory, env, tmp_path
):
    """The default leader name tells the projects apart by broker: each has its leader."""
    locks, brokers, beats = _project_beats(redis_factory, env, tmp_path)
    try:
        for beat in beats:
            beat.start()
        for broker in brokers:
            wait_for(lambda broker=broker: _sent(broker) >= 3, timeout=20)
    finally:
        for beat in beats:
            beat.stop()
    leaders = [
        k
        for k in locks.client().scan_iter("redlock:{beat:*")
        if not k.endswith((":fence", ":state", ":log"))
    ]
    assert len(leaders) == 0, "both leaders handed over on a clean stop"
    for beat in beats:
        assert "elected leader" in beat.log_text()


def test_an_explicit_shared_beat_name_elects_one_leader_and_the_standby_warns(
    redis_factory, env, tmp_path
):
    """redlock_beat_name set alike in two projects still means one leader (as before);
    the other project's beat says at WARNING that a beat of another project leads."""
    locks, _brokers, beats = _project_beats(redis_factory, env, tmp_path, beat_name="shared")
    try:
        for beat in beats:
            beat.start()
        holder = wait_for(
            lambda: parse_beat_holder(locks.client().hget("redlock:{beat:shared}", "task_name")),
            timeout=10,
        )
        (lead,) = [b for b in beats if b.pid == int(holder["pid"])]
        (standby,) = [b for b in beats if b is not lead]
        standby.wait_for_log(
            re.compile(rf"held by a beat of another project \(app beatapp on \S+:{lead.pid}, "),
            timeout=10,
        )
        assert "Sending due task" not in standby.log_text()
    finally:
        for beat in beats:
            beat.stop()
