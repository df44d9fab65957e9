"""Lock names from task calls: canonical, hashed and bounded, whatever the arguments.

A task lock is named from the task and a SHA-256 digest of its canonical bound
arguments (:func:`task_lock_name`): argument values never appear in Redis, and the
name has a bounded length whatever the arguments are. Canonical means equal for equal
calls, before and after a JSON round trip: ``sync(1)`` and
``sync(account_id=1, full=False)`` get one name, as do a tuple and the list a JSON
message turns it into.

A ``lock_key`` that gives a string names a *resource*, as written:
``lock_key="account:{account_id}"`` takes the lock ``Redlock("account:7")`` takes in a
web process, and ``celery redlock inspect account:7`` finds it. The user chose that
text, so it reaches Redis as is; any other value a ``lock_key`` callable returns is
digested like arguments are.

The name is then turned into Redis keys by :mod:`celery_redlock.engine.keys`, which
knows nothing of tasks. :func:`check_lock_args` and :func:`check_key_template`
refuse, at worker start, ``lock_args`` and ``lock_key`` that could name no call of
the task.
"""

from __future__ import annotations

import datetime
import decimal
import functools
import hashlib
import inspect
import json
import math
import re
import string
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from ..engine.keys import MAX_NAME_LENGTH
from ..exceptions import ConfigurationError, LockKeyError

__all__ = [
    "MAX_DEPTH",
    "call_lock_name",
    "check_key_template",
    "check_lock_args",
    "signature",
    "task_lock_name",
]

#: Deepest nesting of an argument that is keyed; deeper values are refused.
MAX_DEPTH = 32


def task_lock_name(
    task_name: str,
    run: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    lock_args: Sequence[str] | None = None,
    lock_key: str | Sequence[str] | Callable[[Sequence[Any], Mapping[str, Any]], Any] | None = None,
) -> str | tuple[str, ...]:
    """The lock name of one task call (or names, for several resources); no argument values.

    * ``lock_key`` format string over the argument names, or callable
      ``(args, kwargs) -> value``: a string is the resource's name itself (tasks and
      ``Redlock`` objects naming the same resource share the lock); another value
      gives ``key:<digest of the value>``. A callable returning a list or tuple, or a
      list or tuple of format strings, names several resources, locked together (a
      tuple of names is returned).
    * ``lock_args=()``: the task name alone (one run of the task at a time).
    * ``lock_args=None``: ``<task name>:<digest of every bound argument>``.
    * ``lock_args=("a", "b")``: ``<task name>:<digest of a and b>``.

    Arguments are bound to ``run``'s signature with defaults applied, so
    ``sync(1)`` and ``sync(account_id=1, full=False)`` lock the same key.

    Raises:
        LockKeyError: an argument cannot be keyed (naming the task and argument).
    """
    if lock_key is None and lock_args is not None and not lock_args:
        return task_name
    bound = _bind(task_name, run, args, kwargs)
    if lock_key is not None:
        if callable(lock_key):
            value = lock_key(args, kwargs)
        elif isinstance(lock_key, (list, tuple)):
            value = [_format(task_name, template, bound) for template in lock_key]
        else:
            value = _format(task_name, cast(str, lock_key), bound)
        if not isinstance(value, (list, tuple)):
            return _resource(task_name, "lock_key", value)
        if not value:
            raise LockKeyError(task_name, "lock_key", "named no resource (an empty list)")
        # Each resource is named alone, so a task locking ("acct:1", "acct:2") and
        # one locking "acct:1" share the lock of account 1.
        return tuple(_resource(task_name, f"lock_key[{i}]", item) for i, item in enumerate(value))
    if lock_args is not None:
        bound = {name: bound[name] for name in lock_args}
    return f"{task_name}:{_digest(task_name, None, bound)}"


def _resource(task_name: str, argument: str, value: Any) -> str:
    """The lock name of one resource a ``lock_key`` gave: a string as is, else a digest."""
    if not isinstance(value, str):
        return f"key:{_digest(task_name, argument, value)}"
    if not value:
        raise LockKeyError(task_name, argument, "named no resource (an empty string)")
    if len(value) > MAX_NAME_LENGTH:
        raise LockKeyError(
            task_name,
            argument,
            f"the resource name is {len(value)} characters long, the limit is "
            f"{MAX_NAME_LENGTH}: name the resource by a short identifier",
        )
    return value


def _format(task_name: str, template: str, bound: Mapping[str, Any]) -> str:
    """``template`` formatted over the bound arguments, containers in canonical form.

    ``{doc}`` of a dict, list, tuple or set is its canonical JSON (sorted keys, sets
    sorted, tuples as lists: as :func:`_canonical`), so equal values in another
    order, or after a JSON round trip, name the same resource. Scalars format as
    Python formats them; ``{doc[id]}`` and ``{doc.id}`` reach inside first.
    """
    fields = {name: _Field(task_name, name, value) for name, value in bound.items()}
    try:
        return template.format(**fields)
    except (KeyError, IndexError, AttributeError, ValueError, TypeError) as exc:
        raise LockKeyError(task_name, "lock_key", f"{template!r}: {exc!r}") from exc


_DEFAULT_TEXT: tuple[object, ...] = (object.__format__, object.__str__, object.__repr__)


class _Field:
    """A bound argument as a ``lock_key`` format field: formats canonically."""

    __slots__ = ("path", "task", "value")

    def __init__(self, task: str, path: str, value: Any) -> None:
        self.task, self.path, self.value = task, path, value

    def __getitem__(self, item: Any) -> _Field:
        return _Field(self.task, f"{self.path}[{item!r}]", self.value[item])

    def __getattr__(self, name: str) -> _Field:
        return _Field(self.task, f"{self.path}.{name}", getattr(self.value, name))

    def _text(self, text: Callable[[Any], str]) -> str:
        value = self.value
        if isinstance(value, (Mapping, list, tuple, set, frozenset)):
            return json.dumps(
                _canonical(self.task, self.path, value, 0),
                sort_keys=True,
                separators=(",", ":"),
                ensure_ascii=False,
            )
        kind = type(value)
        if (kind.__format__, kind.__str__, kind.__repr__) == _DEFAULT_TEXT:
            # "<Foo object at 0x7f...>": a different resource in every process.
            raise LockKeyError(
                self.task,
                "lock_key",
                f"{{{self.path}}} is a {kind.__qualname__} without a stable text; "
                "format one of its fields, or use a callable lock_key",
            )
        return text(value)

    def __format__(self, spec: str) -> str:
        if isinstance(self.value, (Mapping, list, tuple, set, frozenset)):
            return format(self._text(str), spec)
        return self._text(lambda value: format(value, spec))

    def __str__(self) -> str:
        return self._text(str)

    def __repr__(self) -> str:
        return self._text(repr)


def check_lock_args(task_name: str, run: Callable[..., Any], lock_args: Sequence[str]) -> None:
    """Raise ConfigurationError if ``lock_args`` names something ``run`` does not take."""
    parameters = inspect.signature(run).parameters
    if isinstance(lock_args, str):
        raise ConfigurationError(
            f"task {task_name}: lock_args must be a tuple of argument names, got the "
            f"string {lock_args!r} (did you mean ({lock_args!r},)?)"
        )
    unknown = [name for name in lock_args if name not in parameters]
    if unknown:
        raise ConfigurationError(
            f"task {task_name}: lock_args names {', '.join(map(repr, unknown))}, not "
            f"parameters of run{inspect.signature(run)}"
        )


def check_key_template(task_name: str, run: Any, template: str) -> None:
    """Refuse a ``lock_key`` format string that could not format any call of ``run``.

    Every replacement field must start with a parameter name of ``run`` (``{doc}``,
    ``{doc[id]}``, ``{doc.id}``); positional fields (``{}``, ``{0}``) and unknown
    names would fail every run of the task, so they are refused at worker start.

    Raises:
        ConfigurationError: naming the task, the key and the field.
    """
    parameters = signature(run).parameters
    try:
        fields = [
            (field, conversion)
            for _, field, _, conversion in string.Formatter().parse(template)
            if field is not None
        ]
    except ValueError as exc:
        raise ConfigurationError(
            f"task {task_name}: lock_key {template!r} is not a valid format string: {exc}"
        ) from None
    for field, conversion in fields:
        name = re.split(r"[.\[]", field, maxsplit=1)[0]
        if name not in parameters or name == "":
            raise ConfigurationError(
                f"task {task_name}: lock_key {template!r} uses the field {{{field}}}, but "
                f"{name or 'a positional field'!s} is not a parameter of "
                f"run{signature(run)}; name the task's arguments, e.g. "
                f"{{{next(iter(parameters), 'arg')}}}"
            )
        if conversion not in (None, "r", "s", "a"):
            raise ConfigurationError(
                f"task {task_name}: lock_key {template!r}: unknown conversion !{conversion} "
                f"in {{{field}}}"
            )


def call_lock_name(
    task_name: str,
    run: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    lock_args: Sequence[str] | None = None,
    lock_key: Any = None,
) -> str | tuple[str, ...] | None:
    """:func:`task_lock_name`, or None when the arguments do not bind to ``run`` at all.

    Such a call has nothing to lock: running the body raises Python's own TypeError
    ("missing 1 required positional argument: ..."), before any of it runs.

    Raises:
        LockKeyError: an argument that binds cannot be keyed.
    """
    try:
        return task_lock_name(task_name, run, args, kwargs, lock_args=lock_args, lock_key=lock_key)
    except LockKeyError:
        try:
            signature(run).bind(*args, **kwargs)
        except TypeError:
            return None
        raise


@functools.lru_cache(maxsize=1024)
def signature(run: Callable[..., Any]) -> inspect.Signature:
    """``run``'s signature, computed once (it costs ~35 µs, per task execution otherwise)."""
    return inspect.signature(run)


def _bind(
    task_name: str, run: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    try:
        bound = signature(run).bind(*args, **kwargs)
    except TypeError as exc:
        raise LockKeyError(task_name, "(call)", f"arguments do not match the task: {exc}") from exc
    bound.apply_defaults()
    return dict(bound.arguments)


def _digest(task_name: str, argument: str | None, value: Any) -> str:
    if argument is None:
        canonical = {name: _canonical(task_name, name, v, 0) for name, v in value.items()}
    else:
        canonical = _canonical(task_name, argument, value, 0)
    text = json.dumps(
        canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True
    )
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _canonical(task: str, path: str, value: Any, depth: int) -> Any:
    """A JSON value that is equal for equal arguments, before and after a JSON round trip.

    Tuples become lists and mapping keys strings, as a JSON message would make them;
    sets are sorted; dates, UUIDs and Decimals become tagged strings.
    """
    if depth > MAX_DEPTH:
        raise LockKeyError(task, path, f"nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [_canonical(task, f"{path}[{i}]", v, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise LockKeyError(task, path, f"mapping key of type {type(k).__name__}")
            out[k if isinstance(k, str) else json.dumps(k)] = _canonical(
                task, f"{path}[{k!r}]", v, depth + 1
            )
        return out
    if isinstance(value, (set, frozenset)):
        items = [_canonical(task, f"{path}{{}}", v, depth + 1) for v in value]
        return {"__set__": sorted(items, key=lambda v: json.dumps(v, sort_keys=True))}
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return {"__datetime__": value.isoformat()}
    if isinstance(value, (uuid.UUID, decimal.Decimal)):
        return {f"__{type(value).__name__.lower()}__": str(value)}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"__bytes__": bytes(value).hex()}
    raise LockKeyError(
        task,
        path,
        f"values of type {type(value).__module__}.{type(value).__qualname__} have no stable "
        "key; leave the argument out with lock_args, or name the resource with lock_key",
    )
