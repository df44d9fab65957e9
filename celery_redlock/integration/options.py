"""Every per-task lock option in one table, and the one function that resolves them.

A task's lock options are its ``lock_<name>`` attributes (``@app.task(lock_ttl=60)``)
or the ``<name>`` keys of its ``redlock_tasks`` entry; each one not given falls back
to the ``redlock_*`` setting its :data:`TASK_OPTIONS` row names. The worker
(:func:`celery_redlock.integration.task.lock_options`), configuration-only enablement
(:func:`celery_redlock.integration.config_only.lockify`) and ``celery redlock doctor`` all go
through :func:`resolve_task_options`, so doctor refuses exactly what a worker would.

The settings table (:mod:`celery_redlock.integration.settings`) builds on this module: its
``redlock_on_busy`` and ``redlock_on_lost`` accept :data:`ON_BUSY` and
:data:`ON_LOST`, and ``redlock_tasks``' documentation lists :data:`TASK_OPTIONS`.
This module reads :class:`~celery_redlock.integration.settings.Settings` only as the type of the
defaults it resolves against (a type-only import: there is no import cycle).

:class:`TaskOption` and :class:`~celery_redlock.integration.settings.Option` look alike but are
kept apart: a setting has a default of its own and its ``setting`` is its Celery name
(``redlock_ttl``); a task option has no default but the setting's value, and its
``setting`` names the settings row it falls back to (``ttl``), or None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..engine.rate import Budget, parse_rate
from ..engine.timing import Timing, check_kind, lease_seconds, seconds
from ..exceptions import ConfigurationError
from .names import check_key_template, check_lock_args

__all__ = [
    "ON_BUSY",
    "ON_DUPLICATE",
    "ON_LOST",
    "TASK_OPTIONS",
    "UNIQUE",
    "Defaults",
    "TaskLockOptions",
    "TaskOption",
    "choice",
    "parse_entry",
    "rate",
    "resolve_task_options",
]

#: What a task does when its lock is held (``lock_on_busy``, ``redlock_on_busy``).
ON_BUSY = ("skip", "retry", "raise", "wait", "requeue")
#: What happens to a running task whose lock is lost (``lock_on_lost``, ``redlock_on_lost``).
ON_LOST = ("abort", "revoke", "ignore")
#: How long a send-time claim keeps other copies out (``lock_unique``; None: no claim).
UNIQUE = ("until_started", "until_finished")
#: What ``apply_async()`` does when a copy is queued already (``lock_on_duplicate``).
ON_DUPLICATE = ("return", "raise")


def rate(name: str, value: Any) -> str:
    """A rate ``"N/s"``, ``"N/m"`` or ``"N/h"``, checked (``lock_rate``, ``redlock_rate``)."""
    parse_rate(name, value)
    checked: str = value
    return checked


def choice(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    """A parser that accepts one of ``choices`` and names them all when refusing."""

    def parse(name: str, value: Any) -> str:
        if value not in choices:
            allowed = ", ".join(repr(c) for c in choices)
            raise ConfigurationError(f"{name} must be one of {allowed}, got {value!r}")
        chosen: str = value
        return chosen

    return parse


@dataclass(frozen=True)
class TaskOption:
    """One lock option of a task: ``lock_<name>`` on the task, ``<name>`` in ``redlock_tasks``.

    ``setting`` names the :data:`~celery_redlock.integration.settings.OPTIONS` entry it defaults
    from (None: no default setting); ``parse`` validates a value given for one task
    (None: checked with the other options by :func:`resolve_task_options`).
    """

    name: str
    setting: str | None
    parse: Callable[[str, Any], Any] | None
    doc: str

    @property
    def attribute(self) -> str:
        """The task attribute (and ``@app.task`` keyword) that sets it."""
        return f"lock_{self.name}"


#: Every per-task option, in the order error messages list them.
TASK_OPTIONS: dict[str, TaskOption] = {
    o.name: o
    for o in (
        TaskOption("ttl", "ttl", None, "lease in seconds, renewed while the body runs"),
        TaskOption("args", None, None, "argument names the key uses; None all, () none"),
        TaskOption(
            "key",
            None,
            None,
            "(args, kwargs) -> str, or a format string over argument names (a list of "
            "either: several resources)",
        ),
        TaskOption("on_busy", "on_busy", choice(ON_BUSY), "skip, retry, raise, wait or requeue"),
        TaskOption("on_lost", "on_lost", choice(ON_LOST), "abort, revoke or ignore"),
        TaskOption("retry_countdown", "retry_countdown", seconds, "seconds before a retry"),
        TaskOption("wait_timeout", "wait_timeout", seconds, "longest wait for a busy lock"),
        TaskOption("renew_interval", "renew_interval", None, "seconds between renewals"),
        TaskOption("mode", None, None, "exclusive (default) or shared"),
        TaskOption("limit", None, None, "at most this many shared holders per key"),
        TaskOption("fair", None, None, "serve waiters in arrival order"),
        TaskOption(
            "unique",
            "unique",
            choice(UNIQUE),
            "until_started or until_finished: at most one queued (or running) copy per key",
        ),
        TaskOption(
            "debounce",
            "debounce",
            seconds,
            "seconds: calls within it collapse into one run, after the last call, with "
            "its arguments",
        ),
        TaskOption(
            "throttle",
            "throttle",
            seconds,
            "seconds: at most one run per key starts per window (the first call's)",
        ),
        TaskOption(
            "rate",
            "rate",
            rate,
            '"N/s", "N/m" or "N/h": at most N runs per key start in any such sliding window, '
            "across all workers; an early run waits on the queue",
        ),
        TaskOption(
            "on_duplicate",
            "on_duplicate",
            choice(ON_DUPLICATE),
            "with unique: return (the queued copy's result) or raise (LockBusy)",
        ),
        TaskOption(
            "unique_ttl",
            "unique_ttl",
            lease_seconds,
            "with unique: longest a claim waits for its copy to start",
        ),
    )
}


@dataclass(frozen=True)
class TaskLockOptions:
    """One task's lock options, resolved against the app settings and validated."""

    timing: Timing
    args: tuple[str, ...] | None
    key: Any
    on_busy: str
    on_lost: str
    retry_countdown: float
    wait_timeout: float
    mode: str = "exclusive"
    limit: int | None = None
    fair: bool = False
    unique: str | None = None
    debounce: float | None = None
    throttle: float | None = None
    on_duplicate: str = "return"
    unique_ttl: float = 3600.0
    rate: Budget | None = None


def parse_entry(task_name: str, entry: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A ``redlock_tasks`` entry's options, checked for names and ``args``' shape.

    ``args`` becomes a tuple of names; a string is refused, not split into letters.

    Raises:
        ConfigurationError: an unknown option, or ``args`` that is not a list of
            argument names; naming ``source`` (the setting's entry) and the task.
    """
    unknown = set(entry) - set(TASK_OPTIONS)
    if unknown:
        raise ConfigurationError(
            f"{source}: unknown option(s) {', '.join(sorted(map(repr, unknown)))}; "
            f"allowed: {', '.join(TASK_OPTIONS)}"
        )
    parsed = dict(entry)
    names = parsed.get("args")
    if names is not None:
        if not (isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)):
            hint = f" (did you mean [{names!r}]?)" if isinstance(names, str) else ""
            raise ConfigurationError(
                f"{source}: task {task_name}: 'args' must be a list of argument names, "
                f"got {names!r}{hint}"
            )
        parsed["args"] = tuple(names)
    return parsed


class Defaults(Protocol):
    """What the resolution reads of :class:`~celery_redlock.integration.settings.Settings`.

    Declared here, not imported: the settings module imports this one. The option
    defaults are read by name (each :data:`TASK_OPTIONS` row's ``setting``).
    """

    @property
    def node_timeout(self) -> float | None:
        """``redlock_node_timeout`` (None: derived from the lease)."""

    @property
    def drift_factor(self) -> float:
        """``redlock_drift_factor``."""


def resolve_task_options(
    settings: Defaults,
    task_name: str,
    run: Callable[..., Any],
    entry: Mapping[str, Any] | None = None,
    attribute: Callable[[str], Any] | None = None,
    *,
    source: str | None = None,
) -> TaskLockOptions:
    """Resolve and validate one task's lock options: what the worker runs it with.

    The one place that knows how: the worker (:func:`celery_redlock.integration.task.lock_options`),
    configuration-only enablement and ``celery redlock doctor`` all call it, so doctor
    reports exactly what a worker would refuse.

    Arguments:
        settings: the app's settings; each option not given defaults to the setting
            its :data:`TASK_OPTIONS` row names.
        task_name: for error messages.
        run: the task body, whose parameters ``args`` and ``key`` must name.
        entry: the ``redlock_tasks`` entry that locks the task, if any (first).
        attribute: reads an option from the task (``lock_<name>``), if it has ours.
        source: where ``entry`` comes from (``redlock_tasks['proj.*']``), appended to
            every error.

    Raises:
        ConfigurationError: naming the task, the option and the accepted values (and
            ``source``).
    """
    given = {} if entry is None else parse_entry(task_name, entry, source or "options")

    def option(name: str) -> Any:
        if name in given:
            return given[name]
        return None if attribute is None else attribute(name)

    try:
        return _resolve(settings, task_name, run, option)
    except ConfigurationError as exc:
        if source is None:
            raise
        raise ConfigurationError(f"{exc} (options from {source})") from None


def _resolve(
    settings: Defaults, task_name: str, run: Callable[..., Any], option: Callable[[str], Any]
) -> TaskLockOptions:
    where = f"task {task_name}: lock_"
    values = {name: option(name) for name in TASK_OPTIONS}
    lock_args = values["args"]
    if lock_args is not None:
        check_lock_args(task_name, run, lock_args)
    resolved = {
        name: getattr(settings, row.setting) if values[name] is None else values[name]
        for name, row in TASK_OPTIONS.items()
        if row.setting is not None
    }
    timing = Timing.of(
        resolved["ttl"],
        resolved["renew_interval"],
        settings.node_timeout,
        settings.drift_factor,
        source=where,
    )
    for name, row in TASK_OPTIONS.items():
        if row.parse is not None and values[name] is not None:
            row.parse(f"{where}{name}", values[name])
    key = values["key"]
    if key is not None and not (
        callable(key)
        or isinstance(key, str)
        or (isinstance(key, (list, tuple)) and key and all(isinstance(k, str) for k in key))
    ):
        raise ConfigurationError(
            f"{where}key must be a callable (args, kwargs) -> str (or a list of them, for "
            "several resources), a format string over the argument names, or a list of "
            f"format strings, got {key!r}"
        )
    templates = [key] if isinstance(key, str) else key if isinstance(key, (list, tuple)) else []
    for template in templates:
        check_key_template(task_name, run, template)
    resources = len(key) if isinstance(key, (list, tuple)) else 1
    unique, debounce, throttle = (resolved[n] for n in ("unique", "debounce", "throttle"))
    if debounce is not None and throttle is not None:
        raise ConfigurationError(f"{where}debounce and lock_throttle: choose one")
    if resources > 1:
        for name in ("unique", "debounce", "throttle"):
            if values[name] is not None:
                raise ConfigurationError(
                    f"{where}{name}: a send-time claim is for one resource; lock_key "
                    f"names {resources}"
                )
        unique = debounce = throttle = None  # the redlock_* defaults are for tasks they fit
        if values["rate"] is not None:
            raise ConfigurationError(
                f"{where}rate: a rate budget is for one resource; lock_key names {resources}"
            )
    if unique is not None and (debounce is not None or throttle is not None):
        if values["unique"] is not None:
            raise ConfigurationError(
                f"{where}unique: lock_debounce and lock_throttle decide how long the "
                "send-time claim lives; leave lock_unique unset with them"
            )
        unique = None
    try:
        mode, limit, fair = check_kind(
            resources, values["mode"], values["limit"], bool(values["fair"])
        )
    except ConfigurationError as exc:
        raise ConfigurationError(
            f"task {task_name}: lock_mode / lock_limit / lock_fair / lock_key: {exc}"
        ) from None
    return TaskLockOptions(
        timing=timing,
        args=None if lock_args is None else tuple(lock_args),
        key=key,
        on_busy=resolved["on_busy"],
        on_lost=resolved["on_lost"],
        retry_countdown=resolved["retry_countdown"],
        wait_timeout=resolved["wait_timeout"],
        mode=mode,
        limit=limit,
        fair=fair,
        unique=unique,
        debounce=debounce,
        throttle=throttle,
        on_duplicate=resolved["on_duplicate"],
        unique_ttl=resolved["unique_ttl"],
        rate=None
        if resolved["rate"] is None or resources > 1
        else parse_rate(f"{where}rate", resolved["rate"]),
    )
