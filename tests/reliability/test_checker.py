"""The history checker itself: hand-made histories that must fail, and ones that must pass.

A checker that never fails proves nothing, so each kind of violation is shown to be
caught here before the scenarios rely on it.
"""

from __future__ import annotations

import pytest

from tests.harness.history import History, Section, Write, check, jain, service


def section(
    start, end, *, fence=1, key="k", valid_until=None, lost_at=None, inc=1, pid=1, asked=None
):
    return Section(
        key=key,
        fence=fence,
        start=start,
        end=end,
        process=pid,
        valid_until=end + 10 if valid_until is None else valid_until,
        lost_at=lost_at,
        increments=inc,
        id=f"{pid}.{fence}",
        asked=asked,
    )


def kinds(violations):
    return [v.kind for v in violations]


def test_sections_one_after_another_pass():
    sections = [section(0, 1, fence=1), section(1, 2, fence=2, pid=2), section(3, 4, fence=3)]
    assert check(sections, counters={"k": 3}) == []


def test_overlapping_valid_sections_fail():
    sections = [section(0, 2, fence=1), section(1, 3, fence=2, pid=2)]
    (violation,) = check(sections, counters={"k": 2})
    assert violation.kind == "overlap"
    assert (
        "2.2" in violation.detail and "1.1" in violation.detail and "1.000000s" in violation.detail
    )


def test_an_overlap_hidden_behind_a_long_earlier_section_is_found():
    """A short section between them does not mask the first one, still valid."""
    sections = [section(0, 10, fence=1), section(1, 2, fence=2, pid=2), section(3, 4, fence=3)]
    assert kinds(check(sections, counters={"k": 3})) == ["overlap", "overlap"]


def test_sections_of_different_keys_may_overlap():
    sections = [section(0, 2, key="a"), section(1, 3, key="b")]
    assert check(sections, counters={"a": 1, "b": 1}) == []


@pytest.mark.parametrize(
    "cut",
    [{"valid_until": 0.9}, {"lost_at": 0.9}],
    ids=["lease-deadline-passed", "loss-learned"],
)
def test_a_section_stops_counting_when_its_lease_ends_or_is_known_lost(cut):
    """A holder paused past its lease runs on, but is no longer a valid holder."""
    sections = [section(0, 5, fence=1, **cut), section(1, 2, fence=2, pid=2)]
    assert check(sections, counters={"k": 2}) == []


def test_stale_write_fails():
    writes = [Write("k", 2, "b", True), Write("k", 1, "a", True)]
    (violation,) = check([], writes)
    assert violation.kind == "stale-write" and "fence 1" in violation.detail


def test_equal_fence_from_another_section_is_stale():
    """Two sections granted the same fence (a double grant) cannot both write."""
    writes = [Write("k", 3, "a", True), Write("k", 3, "b", True)]
    assert kinds(check([], writes)) == ["stale-write"]


def test_refused_and_repeated_writes_pass():
    writes = [
        Write("k", 1, "a", True),
        Write("k", 1, "a", True),
        Write("k", 2, "b", True),
        Write("k", 1, "a", False),
        Write("other", 1, "c", True),
    ]
    assert check([], writes) == []


def test_lost_update_fails():
    sections = [section(0, 1, fence=1), section(1, 2, fence=2)]
    (violation,) = check(sections, counters={"k": 1})
    assert violation.kind == "lost-update"
    assert "counter is 1, 2 increments" in violation.detail


def turns(*pids, waiter=None):
    """Back-to-back sections of one key by ``pids`` in order; ``waiter`` = (pid, asked)
    adds a last section of that pid which asked at ``asked``."""
    sections = [section(i, i + 1, fence=i + 1, pid=pid, inc=0) for i, pid in enumerate(pids)]
    if waiter is not None:
        pid, asked = waiter
        n = len(pids)
        sections.append(section(n, n + 1, fence=n + 1, pid=pid, asked=asked, inc=0))
    return sections


def test_more_sections_of_one_process_in_a_row_than_the_bound_while_another_waits_is_starved():
    """Pid 2 asked, then pid 1 ran 5 sections in a row before it got in: bound 4."""
    sections = turns(1, 1, 1, 1, 1, waiter=(2, -1))
    (violation,) = check(sections, max_run=4)
    assert violation.kind == "starved"
    assert "pid 1 ran 5 sections in a row (bound 4)" in violation.detail
    assert check(sections, max_run=5) == []
    assert check(sections) == [], "only checked when asked for"


def test_only_runs_during_the_wait_count():
    """Sections that started before the waiter asked were not run while it waited."""
    assert check(turns(1, 1, 1, 1, 1, waiter=(2, 2.5)), max_run=2) == []


def test_runs_of_the_waiters_own_process_or_broken_by_another_process_are_service():
    """A process serving its own threads in turn is the handoff working; a section of
    any other process ends a run."""
    assert check(turns(2, 2, 2, 2, 2, waiter=(2, -1)), max_run=1) == []
    assert check(turns(1, 1, 3, 1, 1, 3, waiter=(2, -1)), max_run=2) == []
    (violation,) = check(turns(1, 1, 3, 1, 1, 1, waiter=(2, -1)), max_run=2)
    assert "pid 1 ran 3 sections" in violation.detail


def test_one_process_alone_cannot_starve_anybody():
    sections = [section(i, i + 1, fence=i + 1, asked=0, inc=0) for i in range(10)]
    assert check(sections, max_run=1) == []


def test_service_counts_sections_per_process_and_jain_measures_their_spread():
    sections = [*turns(1, 2, 1, 2), section(0, 1, key="other", pid=3, inc=0)]
    assert service(sections) == {"k": {1: 2, 2: 2}, "other": {3: 1}}
    # Both wanted the lock from pid 2's first start (1) to its last (3).
    assert service(turns(1, 2, 1, 2, 1, 1, 1), contended=True) == {"k": {1: 1, 2: 2}}
    # Pid 2 asked first and was served only after pid 1 had run all of its sections.
    assert service(turns(1, 1, 1, waiter=(2, -1)), contended=True) == {"k": {1: 3, 2: 0}}
    assert jain([5, 5]) == 1.0
    assert jain([10, 0]) == 0.5
    assert jain([]) == 1.0


def test_register_refuses_stale_fences_and_logs_every_attempt(redis_node):
    """The Lua register on a real server, read back through the checker."""
    history = History(redis_node.url, run="unit")
    assert history.write("k", 5, "a")
    assert history.write("k", 5, "a"), "the same section may write again"
    assert not history.write("k", 5, "b"), "an equal fence from another section is stale"
    assert not history.write("k", 4, "c")
    assert history.write("k", 6, "d")
    assert [(w.fence, w.writer, w.accepted) for w in history.writes()] == [
        (5, "a", True),
        (5, "a", True),
        (5, "b", False),
        (4, "c", False),
        (6, "d", True),
    ]
    assert history.check() == []


def test_register_and_history_keep_every_digit_of_a_clock_fence(redis_node):
    """Fences seeded from a node's clock are microseconds (16 digits): Lua would print
    them as 1.7956892548114e+15, so the register stores and logs them as given, and
    fences one microsecond apart stay apart through the log and the sections."""
    history = History(redis_node.url, run="unit")
    fence = 1_795_689_254_811_401
    assert history.write("k", fence, "a")
    assert history.write("k", fence + 1, "b")
    assert not history.write("k", fence, "c"), "one microsecond below the largest"
    assert not history.write("k", fence + 1, "d"), "equal, from another section"
    assert history.client.hget("history:unit:register:k", "fence") == str(fence + 1)
    assert [(w.fence, w.writer, w.accepted) for w in history.writes()] == [
        (fence, "a", True),
        (fence + 1, "b", True),
        (fence, "c", False),
        (fence + 1, "d", False),
    ]
    history.record(section(0, 1, fence=fence, inc=0))
    history.record(section(1, 2, fence=fence + 1, pid=2, inc=0))
    assert [s.fence for s in history.sections()] == [fence, fence + 1]
    assert history.check() == []


def test_history_round_trip_and_non_atomic_counter(redis_node):
    """Sections and counters come back as recorded; interleaved increments lose one."""
    history = History(redis_node.url, run="unit")
    first, second = history.read_counter("k"), history.read_counter("k")
    history.set_counter("k", first + 1)
    history.set_counter("k", second + 1)  # the interleaving an overlap causes
    history.record(section(0, 1, fence=1))
    history.record(section(1, 2, fence=2, pid=2))
    assert history.sections()[1].process == 2
    assert kinds(history.check()) == ["lost-update"]


def test_malformed_fence_is_an_error(redis_node):
    history = History(redis_node.url, run="unit")
    with pytest.raises(Exception, match="fence must be a non-negative integer"):
        history.write("k", "soon", "a")
