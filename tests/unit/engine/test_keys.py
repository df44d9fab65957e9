"""Redis keys of a lock: exact key strings, one cluster slot, one-to-one with names."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from redis.crc import key_slot

from celery_redlock import ConfigurationError
from celery_redlock.engine.keys import lock_keys, lock_name_of


def test_keys_of_a_lock_share_one_cluster_slot():
    """Lock hash, fence counter and channel all carry the same hash tag."""
    keys = lock_keys("a}b{c")
    assert keys.lock == "redlock:{a}b{c}"
    assert keys.fence == "redlock:{a}b{c}:fence"
    assert keys.channel == "redlock:{a}b{c}:released"
    assert lock_keys("x", "app:").lock == "app:{x}"


# -- cluster hash tags ----------------------------------------------------------------


def hash_tag(key: str) -> str | None:
    """The hash tag Redis Cluster hashes ``key`` by (its cluster spec), None for none."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    if start < 0 or end < 0 or end == start + 1:
        return None
    return key[start + 1 : end]


# Names heavy in the key syntax itself, and any other text.
brace_names = st.one_of(
    st.text(alphabet="{}\\:x", min_size=1, max_size=12),
    st.text(min_size=1, max_size=40),
)
prefixes = st.one_of(
    st.just("redlock:"), st.text(max_size=10).filter(lambda p: not {"{", "}"} & set(p))
)


@given(name=brace_names, prefix=prefixes)
@example(name="}x", prefix="redlock:")
@example(name="}", prefix="redlock:")
@example(name="{}", prefix="redlock:")
@example(name="}{}", prefix="")
def test_every_key_of_any_lock_has_one_non_empty_hash_tag(name, prefix):
    """Whatever the name holds, all of a lock's keys share a non-empty tag: one slot."""
    keys = lock_keys(name, prefix)
    tags = {hash_tag(key) for key in keys}
    assert len(tags) == 1 and None not in tags and "" not in tags, (keys, tags)
    assert len({key_slot(key.encode()) for key in keys}) == 1, keys
    assert lock_name_of(keys.lock, prefix) == name


@given(first=brace_names, second=brace_names)
@example(first="}x", second="\\}x")
@example(first="\\x", second="x")
@example(first="a}:fence", second="a")
def test_different_names_never_share_a_key(first, second):
    """The layout is one-to-one: no key of one lock is a key of another."""
    if first != second:
        assert not set(lock_keys(first)) & set(lock_keys(second))


def test_a_name_starting_with_a_closing_brace_or_the_escape_is_escaped():
    """``redlock:{}x}`` would hash on the whole key; such names get a backslash in front.

    Every other name keeps the key it always had."""
    assert lock_keys("}x").lock == "redlock:{\\}x}"
    assert lock_keys("}x").fence == "redlock:{\\}x}:fence"
    assert lock_keys("\\x").lock == "redlock:{\\\\x}"
    for plain in ("reports:daily", "a\\b", "{user1}:profile", "x}", "{}", "proj.sync:ab12"):
        assert lock_keys(plain).lock == "redlock:{" + plain + "}"


@pytest.mark.parametrize("prefix", ["{x}", "a{", "}", "{}"])
def test_a_prefix_with_braces_is_refused_by_lock_keys_too(prefix):
    """Redlock(key_prefix=...) reaches lock_keys without the settings' check."""
    with pytest.raises(ConfigurationError, match="key_prefix must be a string without"):
        lock_keys("x", prefix)
