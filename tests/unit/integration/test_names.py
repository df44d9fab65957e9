"""Lock names from task arguments: canonical, hashed, bounded, and clear when impossible."""

from __future__ import annotations

import datetime
import decimal
import json
import uuid

import pytest

from celery_redlock import ConfigurationError, LockKeyError
from celery_redlock.engine.keys import MAX_NAME_LENGTH, lock_keys
from celery_redlock.integration.names import check_lock_args, task_lock_name


def run(account_id, full=False, *extra, **options):
    """A task body's signature."""


def name(*args, **kwargs):
    lock_args = kwargs.pop("lock_args", None)
    lock_key = kwargs.pop("lock_key", None)
    return task_lock_name("proj.sync", run, args, kwargs, lock_args=lock_args, lock_key=lock_key)


def test_defaults_and_keywords_give_the_same_key():
    """sync(1) and sync(account_id=1, full=False) lock the same thing."""
    assert name(1) == name(account_id=1) == name(1, False) == name(account_id=1, full=False)
    assert name(1) != name(2)
    assert name(1) != name(1, True)


def test_json_round_trip_does_not_change_the_key():
    """A tuple becomes a list and int keys become strings in a JSON message: same key."""
    value = {"ids": (1, 2), 3: "x", "when": None}
    assert name(value) == name(json.loads(json.dumps(value)))


def test_lock_args_selects_the_arguments_and_empty_means_task_only():
    """lock_args picks the key's arguments; () locks the task name alone."""
    assert name(1, lock_args=("account_id",)) == name(1, True, lock_args=("account_id",))
    assert name(1, lock_args=()) == name(2, lock_args=()) == "proj.sync"


def test_lock_key_names_a_resource_shared_across_tasks():
    """A format string or a callable's string is the resource's own name, whatever the
    task: the name ``Redlock("account:42")`` locks in a web process."""
    by_format = name(42, lock_key="account:{account_id}")
    by_callable = task_lock_name(
        "other.task", run, (42,), {}, lock_key=lambda args, kwargs: f"account:{args[0]}"
    )
    assert by_format == by_callable == "account:42"
    assert name(42, lock_key=("account:{account_id}", "ledger")) == ("account:42", "ledger")


def test_a_lock_key_value_that_is_not_a_string_is_digested():
    """A callable returning a number, a tuple's items or a mapping: hashed, task-independent."""
    by_number = task_lock_name("a.task", run, (42,), {}, lock_key=lambda args, kwargs: args[0])
    assert by_number.startswith("key:") and "42" not in by_number
    assert by_number == task_lock_name("b.task", run, (42,), {}, lock_key=lambda a, k: 42)


@pytest.mark.parametrize(
    ("lock_key", "reason"),
    [
        ("{account_id}", "named no resource (an empty string)"),
        ("x{account_id}", "the limit is 512"),
    ],
)
def test_a_resource_name_redis_cannot_take_names_the_task_and_lock_key(lock_key, reason):
    """An empty or unbounded resource name is refused before anything reaches Redis."""
    value = "" if lock_key == "{account_id}" else "y" * 600
    with pytest.raises(LockKeyError) as info:
        name(value, lock_key=lock_key)
    assert "task proj.sync: argument 'lock_key'" in str(info.value)
    assert reason in str(info.value)


def test_argument_values_never_appear_and_length_is_bounded():
    """Huge or secret arguments hash to a short name."""
    secret = "password=hunter2" + "x" * 100_000
    lock_name = name(secret)
    assert "hunter2" not in lock_name
    assert len(lock_name) == len("proj.sync:") + 32
    assert len(lock_keys(lock_name).lock) < MAX_NAME_LENGTH


def test_common_value_types_are_keyed():
    """Dates, UUIDs, Decimals, bytes and sets have stable keys; set order does not matter."""
    when = datetime.datetime(2026, 1, 2, 3, 4, 5)
    ident = uuid.UUID(int=7)
    assert name({"a": {1, 2, 3}}) == name({"a": {3, 2, 1}})
    assert name(when) != name(when.date())
    for value in (when, ident, decimal.Decimal("1.10"), b"\x00\xff", float("nan")):
        assert name(value) == name(value)


def test_unkeyable_argument_names_task_and_argument():
    """An object with no stable representation is refused, naming where it is."""
    with pytest.raises(LockKeyError) as info:
        name(1, options={"callback": object()})
    assert info.value.args[0] == "proj.sync"
    assert "options['options']['callback']" in info.value.args[1]
    assert "lock_args" in str(info.value)
    assert isinstance(info.value, TypeError)


def test_deep_nesting_is_refused():
    """Arbitrarily deep structures are refused rather than recursed into."""
    value: list = []
    for _ in range(100):
        value = [value]
    with pytest.raises(LockKeyError, match="nested deeper"):
        name(value)


def test_arguments_that_do_not_fit_the_signature():
    """A call the body could not accept is a clear key error too."""
    with pytest.raises(LockKeyError, match="do not match"):
        name()


def test_bad_format_key_names_the_problem():
    """A format string over a missing argument is reported."""
    with pytest.raises(LockKeyError, match="lock_key"):
        name(1, lock_key="{nope}")


def test_lock_args_are_checked_against_the_signature():
    """Unknown names, or a bare string instead of a tuple, are configuration errors."""
    check_lock_args("proj.sync", run, ("account_id", "full"))
    with pytest.raises(ConfigurationError, match="'acount_id'"):
        check_lock_args("proj.sync", run, ("acount_id",))
    with pytest.raises(ConfigurationError, match="did you mean"):
        check_lock_args("proj.sync", run, "account_id")


def doc_key(doc, template="doc:{doc}"):
    return task_lock_name("proj.t", lambda doc: None, (doc,), {}, lock_key=template)


def test_lock_key_fields_format_containers_canonically():
    """Equal dicts in another key order, sets in any order, tuples or lists: one key."""
    assert doc_key({"a": 1, "b": [1, 2]}) == doc_key({"b": [1, 2], "a": 1})
    assert doc_key({"a": (1, 2)}) == doc_key(json.loads(json.dumps({"a": (1, 2)})))
    assert doc_key(("x", "y")) == doc_key(["x", "y"])
    assert doc_key({3, 1, 2}) == doc_key({2, 3, 1})
    assert doc_key({"a": 1}) != doc_key({"a": 2})


def test_lock_key_fields_of_scalars_and_indexing_keep_their_text():
    """Strings and numbers format as before; {doc[id]} and conversions still work."""
    assert doc_key("a1") == doc_key(None, "doc:a1")
    assert doc_key(7) == doc_key(None, "doc:7")
    assert doc_key({"id": 5, "x": 1}, "doc:{doc[id]}") == doc_key(None, "doc:5")
    assert doc_key({"b": 1, "a": {"d": 2, "c": 3}}, "doc:{doc[a]!r}") == doc_key(
        {"a": {"c": 3, "d": 2}}, "doc:{doc[a]!s}"
    )


def test_lock_key_field_without_a_stable_text_is_refused():
    """An object formatted as <... at 0x...> would differ per process: LockKeyError."""
    with pytest.raises(LockKeyError) as info:
        doc_key(object())
    assert info.value.args[:2] == ("proj.t", "lock_key")
