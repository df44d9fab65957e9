r"""Redis key names: the only module that builds them.

A lock named ``NAME`` under the prefix ``redlock:`` uses::

    redlock:{NAME}            hash: token, fence, task_id, task_name, host, pid,
                              acquired_at, ttl
    redlock:{NAME}:fence      fence counter (an integer that only grows; no TTL)
    redlock:{NAME}:released   pub/sub channel: one message per release
    redlock:{NAME}:state      hash of per-entry last run times (beat leader locks only)
    redlock:{NAME}:shared     sorted set: shared holders (read locks, ``limit`` slots),
                              token -> lease deadline in ms on the node's clock; the
                              member :data:`WRITER_MARK` marks a writer waiting for them
    redlock:{NAME}:holders    hash: shared holder token -> JSON object with fence,
                              task_id, host, pid, acquired_at, task_name, ttl
    redlock:{NAME}:queue      sorted set: fair waiters, token -> arrival order
    redlock:{NAME}:waiting    sorted set: fair waiters, token -> deadline in ms

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

Task locks are named from the task and a SHA-256 digest of its canonical bound
arguments (:func:`task_lock_name`): argument values never appear in Redis, and the
name has a bounded length whatever the arguments are.
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
from typing import Any, NamedTuple, cast

from ..exceptions import ConfigurationError, LockKeyError

__all__ = [
    "DEFAULT_PREFIX",
    "MAX_NAME_LENGTH",
    "SUFFIXES",
    "WRITER_MARK",
    "LockKeys",
    "check_key_template",
    "check_lock_args",
    "is_lock_key",
    "keys_of",
    "lock_keys",
    "lock_name_of",
    "parse_key",
    "release_keys",
    "task_lock_name",
    "validate_prefix",
]

DEFAULT_PREFIX = "redlock:"

#: Longest lock name accepted, in characters. Task locks hash their arguments, so
#: their names stay short whatever the arguments are; this only guards hand-made
#: names from growing keys without bound.
MAX_NAME_LENGTH = 512


#: The member of a lock's shared set that marks a writer waiting for the shared
#: holders to leave (never a token: tokens are hex). The scripts get it as the Lua
#: constant ``WRITER_MARK`` (see :mod:`celery_redlock.scripts`).
WRITER_MARK = "!writer"


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

    @property
    def resource(self) -> tuple[str, str, str, str]:
        """The keys every acquisition checks: lock, fence, shared holders, their info."""
        return (self.lock, self.fence, self.shared, self.holders)

    @property
    def fair(self) -> tuple[str, str]:
        """The fair waiting queue and its waiters' deadlines."""
        return (self.queue, self.waiting)

    @property
    def release_shared(self) -> tuple[str, str, str]:
        """KEYS of ``release_shared.lua``: the channel, the shared set and its details."""
        return (self.channel, self.shared, self.holders)

    @property
    def fair_leave(self) -> tuple[str, str, str, str]:
        """KEYS of ``fair_leave.lua``: the lock, the queue, its deadlines, the channel."""
        return (self.lock, self.queue, self.waiting, self.channel)

    @property
    def release_if(self) -> tuple[str, str, str, str]:
        """KEYS of ``release_if.lua``: the lock and channel, then the shares."""
        return (self.lock, self.channel, self.shared, self.holders)

    @property
    def fence_sync(self) -> tuple[str, str, str]:
        """KEYS of ``fence_sync.lua``: the lock, its fence counter, the shares' details."""
        return (self.lock, self.fence, self.holders)

    @property
    def inspect(self) -> tuple[str, str]:
        """KEYS of ``inspect.lua``: the lock and its fence counter."""
        return (self.lock, self.fence)


#: What follows the lock key in each of its keys (``""`` for the lock key itself).
SUFFIXES: dict[str, str] = {
    field: "" if field == "lock" else f":{'released' if field == 'channel' else field}"
    for field in LockKeys._fields
}


def release_keys(resources: Sequence[LockKeys], *, fair: bool = False) -> tuple[str, ...]:
    """KEYS of ``release.lua``: each lock with its channel (then the fair queue's keys)."""
    keys = tuple(key for resource in resources for key in (resource.lock, resource.channel))
    return keys + resources[0].fair if fair else keys


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


def parse_key(key: str, prefix: str = DEFAULT_PREFIX) -> tuple[LockKeys, str] | None:
    """The lock ``key`` belongs to, and which of its keys it is (a :class:`LockKeys` field).

    None when ``key`` is none of a lock's keys under ``prefix``. A lock key always
    ends with ``}``, so no other key of a lock can be read as one.
    """
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


# -- task locks ------------------------------------------------------------------

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

    * ``lock_key`` callable ``(args, kwargs) -> value`` or format string over the
      argument names: ``key:<digest of the value>``. Tasks that compute the same
      key share the lock, whatever their names. A callable returning a list or
      tuple, or a list or tuple of format strings, names several resources, locked
      together (a tuple of names is returned).
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
            return f"key:{_digest(task_name, 'lock_key', value)}"
        if not value:
            raise LockKeyError(task_name, "lock_key", "named no resource (an empty list)")
        # Each resource is digested alone, so a task locking ("acct:1", "acct:2") and
        # one locking "acct:1" share the lock of account 1.
        return tuple(
            f"key:{_digest(task_name, f'lock_key[{i}]', item)}" for i, item in enumerate(value)
        )
    if lock_args is not None:
        bound = {name: bound[name] for name in lock_args}
    return f"{task_name}:{_digest(task_name, None, bound)}"


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
    parameters = _signature(run).parameters
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
                f"run{_signature(run)}; name the task's arguments, e.g. "
                f"{{{next(iter(parameters), 'arg')}}}"
            )
        if conversion not in (None, "r", "s", "a"):
            raise ConfigurationError(
                f"task {task_name}: lock_key {template!r}: unknown conversion !{conversion} "
                f"in {{{field}}}"
            )


@functools.lru_cache(maxsize=1024)
def _signature(run: Callable[..., Any]) -> inspect.Signature:
    """``run``'s signature, computed once (it costs ~35 µs, per task execution otherwise)."""
    return inspect.signature(run)


def _bind(
    task_name: str, run: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    try:
        bound = _signature(run).bind(*args, **kwargs)
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
