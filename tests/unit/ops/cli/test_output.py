"""How the commands print durations and tables (what ``ls``, ``inspect`` and ``release`` show)."""

from __future__ import annotations

import pytest

from celery_redlock.ops.cli.output import duration, table


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (None, "-"),
        (-1.0, "none"),
        (-0.5, "0s"),
        (0.0, "0.0s"),
        (59.94, "59.9s"),
        (60, "1m00s"),
        (3599, "59m59s"),
        (3600, "1h00m"),
        (47 * 3600 + 59 * 60, "47h59m"),
        (48 * 3600, "2d00h"),
        (9 * 86400 + 5 * 3600, "9d05h"),
    ],
)
def test_duration_is_short_and_says_none_for_a_key_without_ttl(seconds, shown):
    """Seconds with a tenth under a minute, then two units; -1 (no TTL) is "none"."""
    assert duration(seconds) == shown


def test_table_pads_columns_and_strips_trailing_spaces():
    """Columns are as wide as their widest cell, two spaces apart; no line ends in spaces."""
    assert table([["KEY", "TTL"], ["redlock:{a}", "1.0s"], ["b", "-"]]) == (
        "KEY          TTL\nredlock:{a}  1.0s\nb            -"
    )
