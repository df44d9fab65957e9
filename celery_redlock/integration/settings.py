"""Every ``redlock_*`` setting in one table: default, parser, and documentation.

The table is the single source of truth: :func:`from_conf` reads Celery's
configuration through it, the per-task options fall back to it (their own table is
:mod:`celery_redlock.integration.options`), and the configuration reference in the docs is
generated from it. A value that cannot be used raises
:class:`~celery_redlock.exceptions.ConfigurationError` naming the setting and what
it accepts; nothing is silently replaced by a default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engine.keys import DEFAULT_PREFIX, validate_prefix
from ..engine.timing import DEFAULT_NODE_TIMEOUT, MIN_NODE_TIMEOUT, MIN_RENEW_INTERVAL, Timing
from ..engine.timing import fraction as _fraction
from ..engine.timing import lease_seconds as _lease
from ..engine.timing import seconds as _seconds
from ..exceptions import ConfigurationError
from .options import ON_BUSY, ON_DUPLICATE, ON_LOST, TASK_OPTIONS, UNIQUE, choice, rate

__all__ = ["OPTIONS", "Option", "Settings", "from_conf", "reference"]


def _renew_interval(name: str, value: Any) -> float | None:
    return None if value is None else _seconds(name, value, minimum=MIN_RENEW_INTERVAL)


def _node_timeout(name: str, value: Any) -> float | None:
    return None if value is None else _seconds(name, value, minimum=MIN_NODE_TIMEOUT)


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
    """One setting: ``redlock_<name>`` in Celery's configuration."""

    name: str
    default: Any
    parse: Callable[[str, Any], Any]
    doc: str

    @property
    def setting(self) -> str:
        """The name of the Celery setting."""
        return f"redlock_{self.name}"


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option(
            "url",
            None,
            _url,
            "Redis URL of the single lock node. Defaults to broker_url when that is a "
            "redis:// or rediss:// URL.",
        ),
        Option(
            "nodes",
            (),
            _urls,
            "URLs of independent Redis masters. With 2 or more, locks use Redlock "
            "(a majority must agree); use an odd number.",
        ),
        Option(
            "ttl",
            30.0,
            _lease,
            "Lease length in seconds (0.01 to 30 days); the watchdog renews it.",
        ),
        Option(
            "renew_interval",
            None,
            _renew_interval,
            "Seconds between renewals (at least 0.002, shorter than the ttl); default ttl/3, "
            "so one failed renewal is survived.",
        ),
        Option("key_prefix", DEFAULT_PREFIX, _prefix, "Prefix of every Redis key and channel."),
        Option(
            "on_busy",
            "skip",
            choice(ON_BUSY),
            "What a task does when its lock is held: skip, retry, raise, wait or requeue "
            "(back on the queue until the key is free; not a retry).",
        ),
        Option(
            "on_lost",
            "abort",
            choice(ON_LOST),
            "What happens to a running task whose lock is lost: abort, revoke or ignore.",
        ),
        Option(
            "retry_countdown",
            5.0,
            _seconds,
            "Seconds before a retry, with on_busy='retry' (up to 30 days).",
        ),
        Option(
            "wait_timeout", 60.0, _seconds, "Longest wait, with on_busy='wait' (up to 30 days)."
        ),
        Option(
            "unique",
            None,
            _optional(choice(UNIQUE)),
            "Send-time deduplication of locked tasks: until_started (at most one queued "
            "copy per key) or until_finished (none while one is queued or running); "
            "None: the execution lock only.",
        ),
        Option(
            "debounce",
            None,
            _optional(_seconds),
            "Seconds: calls of a locked task with one key within it collapse into one run, "
            "started no sooner than this after the last call, with its arguments.",
        ),
        Option(
            "throttle",
            None,
            _optional(_seconds),
            "Seconds: at most one run per key of a locked task starts per window; calls "
            "inside it get that run (lock_on_duplicate).",
        ),
        Option(
            "rate",
            None,
            _optional(rate),
            'A rate "N/s", "N/m" or "N/h": at most N runs per key of a locked task start '
            "in any such sliding window, across all workers; a run that comes early goes "
            "back on the queue for its slot (not a retry).",
        ),
        Option(
            "on_duplicate",
            "return",
            choice(ON_DUPLICATE),
            "With lock_unique, what apply_async() does when a copy of the key is queued or "
            "running: return (its AsyncResult; nothing is sent) or raise (LockBusy).",
        ),
        Option(
            "unique_ttl",
            3600.0,
            _lease,
            "With lock_unique, the longest a send-time claim lives without its copy "
            "starting (0.01 s to 30 days; a countdown or eta adds its delay).",
        ),
        Option(
            "drift_factor",
            0.01,
            _fraction,
            "Share of the lease assumed lost to clock drift (0 to 0.5).",
        ),
        Option(
            "node_timeout",
            None,
            _node_timeout,
            f"Budget of one call to the nodes, in seconds (at least 0.001, shorter than the "
            f"renew interval); default the smallest of {DEFAULT_NODE_TIMEOUT}, ttl/10 and "
            "renew_interval/2.",
        ),
        Option(
            "min_replicas",
            0,
            _non_negative_int,
            "Replicas that must confirm an acquisition (WAIT) before it counts.",
        ),
        Option(
            "fail_open",
            False,
            _bool,
            "Run task bodies without a lock when Redis cannot be reached.",
        ),
        Option(
            "beat_name",
            None,
            _optional_name,
            "Name of the beat leader lock; beats with the same name elect one leader. "
            "Default: the app's main name and a digest of the broker address (without "
            "its password), so projects with different brokers never share a leader; "
            "set it when one project's beats reach the broker by different addresses.",
        ),
        Option(
            "beat_ttl",
            10.0,
            _lease,
            "Lease of the beat leader in seconds (0.01 to 30 days): a standby takes over "
            "within it.",
        ),
        Option(
            "metrics",
            False,
            _bool,
            "Record Prometheus metrics (needs the 'metrics' extra, prometheus_client).",
        ),
        Option(
            "metrics_port",
            None,
            _optional_port,
            "Serve the metrics on this port from the worker's main process.",
        ),
        Option(
            "tasks",
            None,
            _tasks,
            "Task names or glob patterns to lock by configuration alone, each with a dict of "
            f"options ({', '.join(TASK_OPTIONS)}).",
        ),
    )
}


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


def from_conf(conf: Mapping[str, Any]) -> Settings:
    """Read and validate every ``redlock_*`` setting from a Celery configuration."""
    values: dict[str, Any] = {}
    for option in OPTIONS.values():
        raw = conf.get(option.setting, option.default)
        values[option.name] = option.default if raw is None else option.parse(option.setting, raw)
    if values["url"] is None and not values["nodes"]:
        broker = conf.get("broker_url") or ""
        if isinstance(broker, str) and broker.startswith(("redis://", "rediss://")):
            values["url"] = broker.split(";")[0]
    values["timing"] = Timing.of(
        values["ttl"], values["renew_interval"], values["node_timeout"], values["drift_factor"]
    )
    return Settings(**values)


def reference() -> str:
    """The settings reference as a Markdown table, generated from :data:`OPTIONS`."""

    def shown(value: Any) -> str:
        if value in (None, (), {}):
            return "—"
        return f"`{value!r}`"

    rows = ["| setting | default | what it does |", "|---|---|---|"]
    rows += [f"| `{o.setting}` | {shown(o.default)} | {o.doc} |" for o in OPTIONS.values()]
    return "\n".join(rows) + "\n"
