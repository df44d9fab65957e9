"""Every lock option in one table: the ``redlock_*`` settings and the tasks' ``lock_*``.

One row (:class:`Option`) per option. A row with a ``doc`` is a setting,
``redlock_<name>`` in Celery's configuration, with its default; a row with a
``task_doc`` is a task option, ``lock_<name>`` on a task (``@app.task(lock_ttl=60)``)
or ``<name>`` in its ``redlock_tasks`` entry. Most rows are both: a task that does not
set the option takes the setting's value, and one parser checks the value either way.

Everything reads the table: :func:`from_conf` reads the settings (worker, beat, CLI),
:func:`resolve_task_options` resolves one task's options (the worker through
:func:`celery_redlock.integration.task.lock_options`, configuration-only enablement and
``celery redlock doctor``, so doctor refuses exactly what a worker would), and
:func:`reference` generates the settings reference of the docs. A value that cannot be
used raises :class:`~celery_redlock.exceptions.ConfigurationError` naming the setting
or the task option and what it accepts; nothing is silently replaced by a default.

About 700 lines, kept whole: the table, the parsers of its values and its two readers
change together.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engine.keys import DEFAULT_PREFIX, validate_prefix
from ..engine.rate import Budget, parse_rate
from ..engine.timing import (
    DEFAULT_NODE_TIMEOUT,
    MIN_NODE_TIMEOUT,
    MIN_RENEW_INTERVAL,
    Timing,
    check_kind,
    fraction,
    lease_seconds,
    seconds,
)
from ..exceptions import ConfigurationError
from .names import check_key_template, check_lock_args

__all__ = [
    "ON_BUSY",
    "ON_DUPLICATE",
    "ON_LOST",
    "OPTIONS",
    "SETTING_OPTIONS",
    "TASK_OPTIONS",
    "UNIQUE",
    "Option",
    "Settings",
    "TaskLockOptions",
    "choice",
    "from_conf",
    "parse_entry",
    "rate",
    "reference",
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


def _renew_interval(name: str, value: Any) -> float | None:
    return None if value is None else seconds(name, value, minimum=MIN_RENEW_INTERVAL)


def _node_timeout(name: str, value: Any) -> float | None:
    return None if value is None else seconds(name, value, minimum=MIN_NODE_TIMEOUT)


def _non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _optional(parse: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    """``parse``, letting None through (the option is off)."""

    def parse_optional(name: str, value: Any) -> Any:
        return None if value is None else parse(name, value)

    return parse_optional


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


def _url(name: str, value: Any) -> str | None:
    if value is None:
        return None
    schemes = (
        "redis://",
        "rediss://",
        "unix://",
        "redis+sentinel://",
        "redis+cluster://",
        "rediss+cluster://",
    )
    if not isinstance(value, str) or not value.startswith(schemes):
        raise ConfigurationError(
            f"{name} must be a redis://, rediss://, unix:// or Sentinel URL "
            "(redis+sentinel://[:password@]host[:port][,host[:port]...]/service_name[/db]), "
            "or a Redis Cluster URL (redis+cluster://[:password@]host:port[,host:port...]), "
            f"got {value!r}"
        )
    return value


def _urls(name: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigurationError(
            f"{name} must be a list of redis:// URLs (3, 5 or 7 independent masters), got {value!r}"
        )
    urls = tuple(_url(f"{name}[{i}]", url) for i, url in enumerate(value))
    if len(set(urls)) != len(urls):
        raise ConfigurationError(f"{name} must not list a node twice, got {list(value)!r}")
    return urls  # type: ignore[return-value]


def _prefix(name: str, value: Any) -> str:
    try:
        return validate_prefix(value)
    except ConfigurationError as exc:
        raise ConfigurationError(str(exc).replace("redlock_key_prefix", name)) from None


def _optional_port(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ConfigurationError(f"{name} must be a TCP port (1-65535), got {value!r}")
    return value


def _optional_name(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or any(c in value for c in "{} \n"):
        raise ConfigurationError(
            f"{name} must be a non-empty string without braces or spaces, got {value!r}"
        )
    return value


def _tasks(name: str, value: Any) -> dict[str, dict[str, Any]]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Mapping) for k, v in value.items()
    ):
        raise ConfigurationError(
            f"{name} must map task names or glob patterns to option dicts, "
            f"e.g. {{'proj.tasks.sync_*': {{'ttl': 60}}}}, got {value!r}"
        )
    return {k: dict(v) for k, v in value.items()}


@dataclass(frozen=True)
class Option:
    """One lock option: the setting ``redlock_<name>``, the task option ``lock_<name>``, or both.

    ``doc`` is the setting's line in the reference (None: no setting, so a task that
    does not set the option has none); ``task_doc`` says what it does for one task
    (None: a setting only). ``default`` is the setting's. ``parse`` checks a value
    given for either, under the name it was given by (``redlock_ttl``, ``task
    proj.sync: lock_ttl``); None: checked with the task's other options by
    :func:`resolve_task_options`.
    """

    name: str
    default: Any = None
    parse: Callable[[str, Any], Any] | None = None
    doc: str | None = None
    task_doc: str | None = None

    @property
    def setting(self) -> str:
        """The name of the Celery setting."""
        return f"redlock_{self.name}"

    @property
    def attribute(self) -> str:
        """The task attribute (and ``@app.task`` keyword) that sets it for one task."""
        return f"lock_{self.name}"


_ROWS = (
    Option(
        "url",
        None,
        _url,
        doc="Redis URL of the single lock node. Defaults to broker_url when that is a "
        "redis:// or rediss:// URL.",
    ),
    Option(
        "nodes",
        (),
        _urls,
        doc="URLs of independent Redis masters. With 2 or more, locks use Redlock "
        "(a majority must agree); use an odd number.",
    ),
    Option(
        "ttl",
        30.0,
        lease_seconds,
        doc="Lease length in seconds (0.01 to 30 days); the watchdog renews it.",
        task_doc="lease in seconds, renewed while the body runs",
    ),
    Option(
        "renew_interval",
        None,
        _renew_interval,
        doc="Seconds between renewals (at least 0.002, shorter than the ttl); default "
        "ttl/3, so one failed renewal is survived.",
        task_doc="seconds between renewals",
    ),
    Option("args", task_doc="argument names the key uses; None all, () none"),
    Option(
        "key",
        task_doc="(args, kwargs) -> str, or a format string over argument names (a list "
        "of either: several resources)",
    ),
    Option("key_prefix", DEFAULT_PREFIX, _prefix, doc="Prefix of every Redis key and channel."),
    Option(
        "on_busy",
        "skip",
        choice(ON_BUSY),
        doc="What a task does when its lock is held: skip, retry, raise, wait or requeue "
        "(back on the queue until the key is free; not a retry).",
        task_doc="skip, retry, raise, wait or requeue",
    ),
    Option(
        "on_lost",
        "abort",
        choice(ON_LOST),
        doc="What happens to a running task whose lock is lost: abort, revoke or ignore.",
        task_doc="abort, revoke or ignore",
    ),
    Option(
        "retry_countdown",
        5.0,
        seconds,
        doc="Seconds before a retry, with on_busy='retry' (up to 30 days).",
        task_doc="seconds before a retry",
    ),
    Option(
        "wait_timeout",
        60.0,
        seconds,
        doc="Longest wait, with on_busy='wait' (up to 30 days).",
        task_doc="longest wait for a busy lock",
    ),
    Option("mode", task_doc="exclusive (default) or shared"),
    Option("limit", task_doc="at most this many shared holders per key"),
    Option("fair", task_doc="serve waiters in arrival order"),
    Option(
        "unique",
        None,
        _optional(choice(UNIQUE)),
        doc="Send-time deduplication of locked tasks: until_started (at most one queued "
        "copy per key) or until_finished (none while one is queued or running); "
        "None: the execution lock only.",
        task_doc="until_started or until_finished: at most one queued (or running) copy per key",
    ),
    Option(
        "debounce",
        None,
        _optional(seconds),
        doc="Seconds: calls of a locked task with one key within it collapse into one "
        "run, started no sooner than this after the last call, with its arguments.",
        task_doc="seconds: calls within it collapse into one run, after the last call, "
        "with its arguments",
    ),
    Option(
        "throttle",
        None,
        _optional(seconds),
        doc="Seconds: at most one run per key of a locked task starts per window; calls "
        "inside it get that run (lock_on_duplicate).",
        task_doc="seconds: at most one run per key starts per window (the first call's)",
    ),
    Option(
        "rate",
        None,
        _optional(rate),
        doc='A rate "N/s", "N/m" or "N/h": at most N runs per key of a locked task start '
        "in any such sliding window, across all workers; a run that comes early goes "
        "back on the queue for its slot (not a retry).",
        task_doc='"N/s", "N/m" or "N/h": at most N runs per key start in any such sliding '
        "window, across all workers; an early run waits on the queue",
    ),
    Option(
        "on_duplicate",
        "return",
        choice(ON_DUPLICATE),
        doc="With lock_unique, what apply_async() does when a copy of the key is queued "
        "or running: return (its AsyncResult; nothing is sent) or raise (LockBusy).",
        task_doc="with unique: return (the queued copy's result) or raise (LockBusy)",
    ),
    Option(
        "unique_ttl",
        3600.0,
        lease_seconds,
        doc="With lock_unique, the longest a send-time claim lives without its copy "
        "starting (0.01 s to 30 days; a countdown or eta adds its delay).",
        task_doc="with unique: longest a claim waits for its copy to start",
    ),
    Option(
        "drift_factor",
        0.01,
        fraction,
        doc="Share of the lease assumed lost to clock drift (0 to 0.5).",
    ),
    Option(
        "node_timeout",
        None,
        _node_timeout,
        doc=f"Budget of one call to the nodes, in seconds (at least 0.001, shorter than "
        f"the renew interval); default the smallest of {DEFAULT_NODE_TIMEOUT}, ttl/10 and "
        "renew_interval/2.",
    ),
    Option(
        "min_replicas",
        0,
        _non_negative_int,
        doc="Replicas that must confirm an acquisition (WAIT) before it counts.",
    ),
    Option(
        "fail_open",
        False,
        _bool,
        doc="Run task bodies without a lock when Redis cannot be reached.",
    ),
    Option(
        "beat_name",
        None,
        _optional_name,
        doc="Name of the beat leader lock; beats with the same name elect one leader. "
        "Default: the app's main name and a digest of the broker address (without "
        "its password), so projects with different brokers never share a leader; "
        "set it when one project's beats reach the broker by different addresses.",
    ),
    Option(
        "beat_ttl",
        10.0,
        lease_seconds,
        doc="Lease of the beat leader in seconds (0.01 to 30 days): a standby takes over "
        "within it.",
    ),
    Option(
        "metrics",
        False,
        _bool,
        doc="Record Prometheus metrics (needs the 'metrics' extra, prometheus_client).",
    ),
    Option(
        "metrics_port",
        None,
        _optional_port,
        doc="Serve the metrics on this port from the worker's main process.",
    ),
    Option(
        "events",
        True,
        _bool,
        doc="Keep the event log of locked runs on the first lock node (what `celery "
        "redlock why` and `log` read): written off the task's path, in batches.",
    ),
    Option(
        "events_ttl",
        3600.0,
        lease_seconds,
        doc="Seconds a lock's event log is kept after its last event (0.01 s to 30 "
        "days); each keeps its newest 100 events, the feed every lock's newest 10,000.",
    ),
)
#: The per-task options, in the order error messages list them.
TASK_OPTIONS: dict[str, Option] = {o.name: o for o in _ROWS if o.task_doc is not None}
#: Every option, in the order of the settings reference.
OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        *_ROWS,
        Option(
            "tasks",
            None,
            _tasks,
            doc="Task names or glob patterns to lock by configuration alone, each with a "
            f"dict of options ({', '.join(TASK_OPTIONS)}).",
        ),
    )
}
#: The ``redlock_*`` settings: what :func:`from_conf` reads and :func:`reference` lists.
SETTING_OPTIONS: dict[str, Option] = {n: o for n, o in OPTIONS.items() if o.doc is not None}


@dataclass(frozen=True)
class Settings:
    """Validated ``redlock_*`` settings of one Celery app."""

    url: str | None = None
    nodes: tuple[str, ...] = ()
    ttl: float = 30.0
    renew_interval: float | None = None
    key_prefix: str = DEFAULT_PREFIX
    on_busy: str = "skip"
    on_lost: str = "abort"
    retry_countdown: float = 5.0
    wait_timeout: float = 60.0
    unique: str | None = None
    debounce: float | None = None
    throttle: float | None = None
    rate: str | None = None
    on_duplicate: str = "return"
    unique_ttl: float = 3600.0
    drift_factor: float = 0.01
    node_timeout: float | None = None
    min_replicas: int = 0
    fail_open: bool = False
    metrics: bool = False
    metrics_port: int | None = None
    events: bool = True
    events_ttl: float = 3600.0
    beat_name: str | None = None
    beat_ttl: float = 10.0
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The default lease timing (``redlock_ttl``, ``redlock_renew_interval``, ...),
    #: validated; computed from the fields above when not given.
    timing: Timing = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.timing is None:
            object.__setattr__(
                self,
                "timing",
                Timing.of(self.ttl, self.renew_interval, self.node_timeout, self.drift_factor),
            )

    def beat_timing(self) -> Timing:
        """The beat leader lock's timing (``redlock_beat_ttl``), validated.

        Raises:
            ConfigurationError: naming ``redlock_beat_ttl`` (or the setting at fault).
        """
        return Timing.of(
            self.beat_ttl,
            None,
            self.node_timeout,
            self.drift_factor,
            ttl_name="redlock_beat_ttl",
        )

    def node_urls(self) -> tuple[str, ...]:
        """The lock nodes: ``nodes`` when given, else the single ``url``."""
        if self.nodes:
            return self.nodes
        if self.url:
            return (self.url,)
        raise ConfigurationError(
            "no Redis for locks: set redlock_url (or redlock_nodes), or use a redis:// broker_url"
        )


_settings: weakref.WeakKeyDictionary[Any, Settings] = weakref.WeakKeyDictionary()


def app_settings(app: Any) -> Settings:
    """The validated ``redlock_*`` settings of the Celery ``app`` (read once per app)."""
    settings = _settings.get(app)
    if settings is None:
        settings = _settings[app] = from_conf(app.conf)
    return settings


def forget_app_settings(app: Any) -> None:
    """Read ``app``'s settings again at their next use (:func:`app_settings`)."""
    _settings.pop(app, None)


def from_conf(conf: Mapping[str, Any]) -> Settings:
    """Read and validate every ``redlock_*`` setting from a Celery configuration."""
    values: dict[str, Any] = {}
    for option in SETTING_OPTIONS.values():
        raw = conf.get(option.setting, option.default)
        parse = option.parse
        values[option.name] = (
            option.default if raw is None or parse is None else parse(option.setting, raw)
        )
    if values["url"] is None and not values["nodes"]:
        broker = conf.get("broker_url") or ""
        if isinstance(broker, str) and broker.startswith(("redis://", "rediss://")):
            values["url"] = broker.split(";")[0]
    values["timing"] = Timing.of(
        values["ttl"], values["renew_interval"], values["node_timeout"], values["drift_factor"]
    )
    return Settings(**values)


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


def resolve_task_options(
    settings: Settings,
    task_name: str,
    run: Callable[..., Any],
    entry: Mapping[str, Any] | None = None,
    attribute: Callable[[str], Any] | None = None,
    *,
    source: str | None = None,
) -> TaskLockOptions:
    """Resolve and validate one task's lock options: what the worker runs it with.

    The one place that knows how: the worker
    (:func:`celery_redlock.integration.task.lock_options`), configuration-only enablement
    and ``celery redlock doctor`` all call it, so doctor reports exactly what a worker
    would refuse.

    Arguments:
        settings: the app's settings; each option not given takes the value of the
            setting of its row, when the row is a setting too.
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
    settings: Settings, task_name: str, run: Callable[..., Any], option: Callable[[str], Any]
) -> TaskLockOptions:
    where = f"task {task_name}: lock_"
    values = {name: option(name) for name in TASK_OPTIONS}
    lock_args = values["args"]
    if lock_args is not None:
        check_lock_args(task_name, run, lock_args)
    resolved = {
        name: getattr(settings, name) if values[name] is None else values[name]
        for name, row in TASK_OPTIONS.items()
        if row.doc is not None
    }
    timing = Timing.of(
        resolved["ttl"],
        resolved["renew_interval"],
        settings.node_timeout,
        settings.drift_factor,
        source=where,
    )
    # ttl and renew_interval were checked together just above (each against the
    # other); every other value given is checked by its row's parser.
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


def reference() -> str:
    """The settings reference as a Markdown table, generated from :data:`SETTING_OPTIONS`."""

    def shown(value: Any) -> str:
        if value in (None, (), {}):
            return "—"
        return f"`{value!r}`"

    rows = ["| setting | default | what it does |", "|---|---|---|"]
    rows += [f"| `{o.setting}` | {shown(o.default)} | {o.doc} |" for o in SETTING_OPTIONS.values()]
    return "\n".join(rows) + "\n"
