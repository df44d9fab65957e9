"""The Lua scripts, one ``.lua`` file each, loaded once per process.

Every check-and-act on a lock is one of these scripts, so it is atomic on each node.
Each file starts with a header giving ``KEYS``, ``ARGV`` and the return values.

Each script's signature, the names of its ``KEYS`` and ``ARGV`` in order, is declared
once, with its :class:`Script` constant below; the header lists the same names (a test
holds them equal) and the code reads each argument into a local of its name. Calls are
built only by keyword from the declaration (:attr:`Script.call`, :attr:`Script.on`), so
no caller counts positions. No script takes a mode string that picks between
algorithms: the variants of one file (``acquire``, ``acquire_wake``, ``acquire_fair``)
are scripts of their own, told apart by a constant put in their prelude when loaded.
Calls go out as EVALSHA; a node that answers NOSCRIPT (restarted, flushed, or a
promoted replica) gets ``SCRIPT LOAD`` once, pipelined with the retried calls
(see :mod:`celery_redlock.nodes`), so a batch of 10 renewal calls does not ship the
source 10 times.

The scripts build no key names: each gets every key it touches in ``KEYS``, named as
the fields of :class:`~celery_redlock.engine.keys.LockKeys` that hold them. The constants they share
with Python, :data:`~celery_redlock.keys.WRITER_MARK` and
:data:`~celery_redlock.keys.YIELD_MARK`, are put in front of each script's code
(after its header) as Lua locals of the same names (:data:`PRELUDE`).

Each script's return codes are an :class:`enum.IntEnum` here, beside its loader,
for every module that reads them.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import keyword
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from typing import Any

from ...nodes.calls import Call, bulk
from ..keys import FENCE_HORIZON_LEASES, FENCE_HORIZON_MIN, WRITER_MARK, YIELD_MARK, LockKeys

__all__ = [
    "ABANDON",
    "ACQUIRE",
    "ACQUIRE_FAIR",
    "ACQUIRE_SHARED",
    "ACQUIRE_WAKE",
    "BEAT_CLAIM",
    "BUDGET_READ",
    "CLAIM",
    "CLAIM_START",
    "FAIR_LEAVE",
    "FENCE_SYNC",
    "FENCE_SYNC_SHARED",
    "INSPECT",
    "LOG",
    "NOTE_QUEUED",
    "NOTE_STARTED",
    "PARK",
    "RATE",
    "RATE_OWNED",
    "RATE_PEEK",
    "RATE_RETURN",
    "RELEASE",
    "RELEASE_FAIR",
    "RELEASE_IF",
    "RELEASE_SHARED",
    "RELEASE_WAKE",
    "RENEW_MANY",
    "SCRIPTS",
    "TAKE_DUE",
    "THROTTLE",
    "UNCLAIM",
    "UNPARK",
    "WAKE_LEAVE",
    "AcquireStatus",
    "BeatClaimStatus",
    "ClaimStatus",
    "FairLeaveStatus",
    "FenceSyncStatus",
    "RateStatus",
    "ReleaseIfStatus",
    "ReleaseSharedStatus",
    "ReleaseStatus",
    "RenewStatus",
    "Script",
    "UnclaimStatus",
    "UnparkStatus",
]


# -- return codes, one enum per script (see each script's header) --------------------


class AcquireStatus(enum.IntEnum):
    """First element of an ``acquire.lua`` / ``acquire_shared.lua`` reply."""

    BUSY = 0  #: kept out by another holder (or, fair, by the queue)
    ACQUIRED = 1
    REENTERED = 2  #: this token held it already; lease refreshed
    ABANDONED = 3  #: refused: the token's acquisition was abandoned (``abandon.lua``)


class ReleaseStatus(enum.IntEnum):
    """Reply of ``release.lua``."""

    TAKEN = -1  #: a lock is held by another token: left alone
    GONE = 0  #: expired or released already, wholly or in part
    RELEASED = 1


class ReleaseIfStatus(enum.IntEnum):
    """Reply of ``release_if.lua``."""

    TAKEN = -1  #: held by another task or process: left alone
    GONE = 0
    RELEASED = 1


class ReleaseSharedStatus(enum.IntEnum):
    """Reply of ``release_shared.lua``."""

    GONE = 0  #: expired, or dropped after expiring
    RELEASED = 1


class FairLeaveStatus(enum.IntEnum):
    """Reply of ``fair_leave.lua``."""

    ABSENT = 0  #: was not in the queue
    LEFT = 1


class FenceSyncStatus(enum.IntEnum):
    """Reply of ``fence_sync.lua``."""

    NOT_HELD = 0  #: the counter is >= F but the token no longer holds the lock
    SYNCED = 1


class RenewStatus(enum.IntEnum):
    """One code per key of a ``renew_many.lua`` reply."""

    TAKEN = -1  #: held by another token: the lease is lost
    GONE = 0  #: expired or released: the lease is lost
    RENEWED = 1


class BeatClaimStatus(enum.IntEnum):
    """First element of a ``beat_claim.lua`` reply."""

    NOT_LEADER = -1
    TAKEN = 0  #: a later run was already claimed; the reply's second element is it
    CLAIMED = 1


class ClaimStatus(enum.IntEnum):
    """First element of a ``claim.lua`` reply."""

    BUSY = 0  #: held by another task id; the reply's next elements are it and its PTTL
    CLAIMED = 1
    OURS = 2  #: this task id held it already (a retry); TTL refreshed


class RateStatus(enum.IntEnum):
    """First element of a ``rate.lua`` reply (then the starts in the window, and a wait)."""

    REFUSED = 0  #: no slot now; the reply's third element: ms until the run's slot
    ADMITTED = 1  #: logged; the third element: ms from now to the start (0: now)
    PEEKED = 2  #: counted only (``peek``); the third element: ms until a start fits (0: now)


class UnclaimStatus(enum.IntEnum):
    """Reply of ``unclaim.lua``."""

    TAKEN = -1  #: held by another task id: left alone
    GONE = 0
    FREED = 1


class UnparkStatus(enum.IntEnum):
    """Reply of ``unpark.lua``."""

    DUPLICATE = 0  #: another copy of the run started, or the run is parked: do not start
    START = 1  #: this copy is the run's; it left the parked runs
    UNKNOWN = 2  #: no record of the run (expired, or the node lost it): start


def _lua_string(text: str) -> str:
    if any(c in text for c in "'\\\n"):
        raise ValueError(f"not a plain Lua string: {text!r}")
    return f"'{text}'"


#: Lua put between every script's header and its code: the constants shared with
#: Python. One line, so error line numbers past the header are one more than in the file.
PRELUDE = (
    f"local WRITER_MARK = {_lua_string(WRITER_MARK)} local YIELD_MARK = {_lua_string(YIELD_MARK)}"
    f" local FENCE_HORIZON_LEASES = {FENCE_HORIZON_LEASES}"
    f" local FENCE_HORIZON_MIN_MS = {round(FENCE_HORIZON_MIN * 1000)}\n"
)


def _library(name: str) -> str:
    """The code of the Lua library ``<name>.lua``: its text without its header."""
    text = resources.files(__package__).joinpath(f"{name}.lua").read_text("utf-8")
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("--"))


class Script:
    """A Lua script shipped with the package, addressed by its SHA1, and its signature.

    The signature is the names of the script's ``KEYS`` and ``ARGV``, in order, given
    once here; its ``.lua`` header lists the same names (a test holds them equal),
    and every call is built from it by keyword, so no caller counts positions. A name
    ending in ``*`` is a group: its keyword takes a sequence of any length (possibly
    empty), spread in place, e.g. the four keys of each resource of a lock.

    Builders, compiled once per script so that a call costs what building its
    tuples by hand did (acquire and release run tens of thousands of times a second):

    * :attr:`call` ``(**keys_and_argv)``: the :class:`~celery_redlock.nodes.Call`;
    * :attr:`on` ``(lock_keys, **argv)``: the same, each key read from one lock's
      :class:`~celery_redlock.engine.keys.LockKeys` under its declared name (only for
      a script whose keys are all single fields of it);
    * :attr:`build_keys` ``(**keys)`` and :attr:`build_argv` ``(**argv)``: the
      tuples alone, for callers that encode a call once (:meth:`Kind.encoded`).

    A missing or unknown name raises :class:`TypeError` naming the script and the
    argument, e.g. ``acquire.call() missing 1 required keyword-only argument: 'token'``.

    Several scripts may share one file (``file``), each with its own ``constants``
    put in the prelude as Lua locals: a variant of an algorithm picked when loaded,
    never by an argument of the call (a mode string in ``ARGV`` would let one call
    switch between algorithms that the reader must then tell apart at run time).
    """

    __slots__ = (
        "_heads",
        "arg_names",
        "build_argv",
        "build_keys",
        "call",
        "constants",
        "file",
        "key_names",
        "libraries",
        "name",
        "on",
        "per_key_args",
        "sha",
        "source",
        "status",
    )

    def __init__(
        self,
        name: str,
        *,
        keys: Sequence[str],
        argv: Sequence[str],
        file: str | None = None,
        constants: Mapping[str, str | bool] | None = None,
        status: type[enum.IntEnum] | None = None,
        per_key_args: int | None = None,
        libraries: Sequence[str] = (),
    ) -> None:
        self.name = name
        #: The ``.lua`` file (without its suffix) whose code this script runs.
        self.file = file or name
        #: The names of its KEYS and of its ARGV, in order (``*``: a group).
        self.key_names = tuple(keys)
        self.arg_names = tuple(argv)
        #: Lua locals put in the prelude: what tells the variants of one file apart.
        self.constants = dict(constants or {})
        #: Lua libraries (``<name>.lua`` files of functions) put after the prelude.
        self.libraries = tuple(libraries)
        #: The script's return codes (None: it returns data, not a status).
        self.status = status
        #: For a script whose keys are independent of each other (each key with this
        #: many ARGV entries of its own, and one reply entry per key), so that a call
        #: may be split by key, e.g. per Redis Cluster master. None: keys go together.
        self.per_key_args = per_key_args
        text = resources.files(__package__).joinpath(f"{self.file}.lua").read_text("utf-8")
        lines = text.splitlines(keepends=True)
        header = next((i for i, line in enumerate(lines) if not line.startswith("--")), 0)
        prelude = PRELUDE.rstrip("\n") + "".join(
            f" local {constant} = {_lua_value(value)}" for constant, value in self.constants.items()
        )
        code = [prelude + "\n", *(_library(library) for library in self.libraries)]
        self.source = "".join([*lines[:header], *code, *lines[header:]])
        self.sha = hashlib.sha1(self.source.encode("utf-8")).hexdigest()
        self.call, self.on, self.build_keys, self.build_argv = _builders(self)
        self._heads: dict[tuple[int, int], bytes] = {}

    def evalsha(self, keys: Sequence[str], args: Sequence[object]) -> tuple[object, ...]:
        """The EVALSHA command that runs this script."""
        return ("EVALSHA", self.sha, len(keys), *keys, *args)

    def evalsha_resp(self, keys: int, args: int) -> bytes:
        """The start of :meth:`evalsha` in RESP, up to its keys, for a :attr:`Call.resp`.

        Built once per shape: every lock of a Celery task is a new object, whose
        first call would otherwise build it again.
        """
        head = self._heads.get((keys, args))
        if head is None:
            head = b"*%d\r\n" % (3 + keys + args) + bulk("EVALSHA", self.sha, keys)
            self._heads[keys, args] = head
        return head

    def __repr__(self) -> str:
        return f"<Script {self.name} {self.sha[:8]}>"


def _lua_value(value: str | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return _lua_string(value)


#: A keyword builder of calls, and one of a tuple of keys or of arguments.
_CallBuilder = Callable[..., Call]
_TupleBuilder = Callable[..., tuple[Any, ...]]


def _builders(script: Script) -> tuple[_CallBuilder, _CallBuilder, _TupleBuilder, _TupleBuilder]:
    """The keyword builders of ``script``, compiled from its signature.

    Each is a plain function with keyword-only parameters, so Python's own argument
    binding checks the names (in C, with no dict to sort or inspect per call) and the
    tuples come out in the declared order.
    """
    keys, argv = script.key_names, script.arg_names
    params = [name.rstrip("*") for name in (*keys, *argv)]
    for param in params:
        if not param.isidentifier() or keyword.iskeyword(param) or param == "_keys":
            raise ValueError(f"script {script.name}: {param!r} cannot name an argument")
    if len(set(params)) != len(params):
        raise ValueError(f"script {script.name}: a name is declared twice in {params}")

    def spread(names: Sequence[str], prefix: str = "") -> str:
        items = [f"*{name[:-1]}" if name.endswith("*") else f"{prefix}{name}" for name in names]
        return "(" + "".join(f"{item}, " for item in items) + ")"

    def signature(names: Sequence[str]) -> str:
        return ", ".join(name.rstrip("*") for name in names)

    star = "*, " if params else ""
    argv_star = "*, " if argv else ""
    lock_keys = all(name in LockKeys._fields for name in keys)
    on_body = (
        f"    return Call(script, {spread(keys, '_keys.')}, {spread(argv)})"
        if lock_keys
        else f"    raise TypeError('{script.name}.on(): its keys are not fields of LockKeys')"
    )
    source = (
        f"def call({star}{signature(params)}):\n"
        f"    return Call(script, {spread(keys)}, {spread(argv)})\n"
        f"def on(_keys, {argv_star}{signature(argv)}):\n{on_body}\n"
        f"def build_keys({'*, ' if keys else ''}{signature(keys)}):\n    return {spread(keys)}\n"
        f"def build_argv({argv_star}{signature(argv)}):\n    return {spread(argv)}\n"
    )
    namespace: dict[str, Any] = {"Call": Call, "script": script}
    exec(compile(source, f"<signature of {script.name}.lua>", "exec"), namespace)
    built = tuple(namespace[name] for name in ("call", "on", "build_keys", "build_argv"))
    for function in built:
        function.__qualname__ = f"{script.name}.{function.__name__}"
    return built


# -- the scripts, each with its signature (its header lists the same names) ----------

#: The keys of one resource of an exclusive acquisition (``LockKeys.resource``).
_RESOURCES = "resources*"
#: The record of blocked waiters (``LockKeys.record``), with the variants that keep one.
_RECORD = "record*"
#: Who holds: a :class:`~celery_redlock.engine.kinds.Holder`, as the acquire scripts record it.
_HOLDER = ("task_id", "host", "pid", "acquired_at", "task_name")

_acquire = functools.partial(
    Script,
    file="acquire",
    keys=(_RESOURCES, _RECORD, "abandoned"),
    argv=("token", "ttl_ms", *_HOLDER, "blocking", "waiter_ms", "arrival", "channel", "attempt",
          "grant_ms", "handoff*"),
    status=AcquireStatus,
    libraries=("fence", "wake"),
)  # fmt: skip
#: Exclusive on any number of resources, keeping no record of waiters.
ACQUIRE = _acquire("acquire", constants={"NAMING": ""})
#: Exclusive on one resource; a release grants the lock to the oldest recorded waiter.
ACQUIRE_WAKE = _acquire("acquire_wake", constants={"NAMING": "wake"})
#: Exclusive on one resource; only the head of the recorded waiters may take a free lock.
ACQUIRE_FAIR = _acquire("acquire_fair", constants={"NAMING": "fair"})
ABANDON = Script("abandon", keys=("abandoned",), argv=("token", "ttl_ms"))
FENCE_SYNC = Script(
    "fence_sync",
    keys=("lock", "fence"),
    argv=("token", "granted"),
    status=FenceSyncStatus,
    libraries=("fence",),
)
FENCE_SYNC_SHARED = Script(
    "fence_sync_shared",
    keys=("fence", "holders"),
    argv=("token", "granted"),
    status=FenceSyncStatus,
    libraries=("fence",),
)
#: Appends events to capped lists with the node's time (the event log).
LOG = Script("log", keys=("logs*",), argv=("entries*",), per_key_args=4)
RENEW_MANY = Script(
    "renew_many", keys=("holds*",), argv=("leases*",), status=RenewStatus, per_key_args=3
)
_release = functools.partial(
    Script,
    file="release",
    keys=("locks*", _RECORD, "fence*"),
    argv=("token", "reserve_ms", "channel", "attempt"),
    status=ReleaseStatus,
    libraries=("fence", "wake"),
)
#: Releases what :data:`ACQUIRE` took: a release wakes one waiter per process.
RELEASE = _release("release", constants={"NAMING": ""})
#: Releases what :data:`ACQUIRE_WAKE` took, granting it to the oldest recorded waiter.
RELEASE_WAKE = _release("release_wake", constants={"NAMING": "wake"})
#: Releases what :data:`ACQUIRE_FAIR` took, naming the head of the queue.
RELEASE_FAIR = _release("release_fair", constants={"NAMING": "fair"})
ACQUIRE_SHARED = Script(
    "acquire_shared",
    keys=("lock", "fence", "shared", "holders", "abandoned"),
    argv=("token", "ttl_ms", "limit", *_HOLDER, "attempt"),
    status=AcquireStatus,
    libraries=("fence",),
)
RELEASE_SHARED = Script(
    "release_shared",
    keys=("channel", "shared", "holders"),
    argv=("token", "attempt"),
    status=ReleaseSharedStatus,
)
_leave = functools.partial(
    Script,
    file="fair_leave",
    keys=("lock", "queue", "waiting", "wake", "channel", "fence"),
    argv=("token", "reserve_ms"),
    status=FairLeaveStatus,
    libraries=("fence", "wake"),
)
#: A waiter of :data:`ACQUIRE_WAKE` leaves the record.
WAKE_LEAVE = _leave("wake_leave", constants={"NAMING": "wake"})
#: A waiter of :data:`ACQUIRE_FAIR` leaves the queue.
FAIR_LEAVE = _leave("fair_leave", constants={"NAMING": "fair"})
RELEASE_IF = Script(
    "release_if",
    keys=("lock", "channel", "shared", "holders", "queue", "waiting", "wake", "fence"),
    argv=("task_id", "pid", "reserve_ms"),
    status=ReleaseIfStatus,
    libraries=("fence", "wake"),
)
INSPECT = Script("inspect", keys=("lock", "fence"), argv=())
BEAT_CLAIM = Script(
    "beat_claim",
    keys=("lock", "state"),
    argv=("token", "entry", "known", "run_at", "keep_ms"),
    status=BeatClaimStatus,
)
CLAIM = Script(
    "claim",
    keys=("claim", "lock"),
    argv=("task_id", "ttl_ms", "task_name", "claimed_at", "replace", "debounce_ms", "args",
          "running"),
    status=ClaimStatus,
)  # fmt: skip
UNCLAIM = Script("unclaim", keys=("claim",), argv=("task_id",), status=UnclaimStatus)
CLAIM_START = Script("claim_start", keys=("claim",), argv=("task_id", "args"))
THROTTLE = Script("throttle", keys=("throttle",), argv=("task_id", "window_ms"))
_rate = functools.partial(
    Script,
    file="rate",
    keys=("rate", "budget", "queued"),
    argv=("limit", "window_ms", "member", "task_id", "jitter_ms", "grace_ms", "at_ms", "ahead_ms"),
    status=RateStatus,
    libraries=("window", "queued"),
)
#: Admits one start under a budget (or refuses it, putting its run in line).
RATE = _rate("rate", constants={"PEEK": False, "OWNED": False})
#: Counts the starts in the window and the wait for the next, writing nothing.
RATE_PEEK = _rate("rate_peek", constants={"PEEK": True, "OWNED": False})
#: Admits a start logged earlier for this run (a parked run's copy) at this moment.
RATE_OWNED = _rate("rate_owned", constants={"PEEK": False, "OWNED": True})
RATE_RETURN = Script("rate_return", keys=("rate",), argv=("member",))
NOTE_QUEUED = Script(
    "note_queued",
    keys=("queued*",),
    argv=("task_id", "delay_ms", "grace_ms"),
    libraries=("queued",),
)
NOTE_STARTED = Script("note_started", keys=("queued*",), argv=("task_id",))
BUDGET_READ = Script(
    "budget_read",
    keys=("rate", "budget", "queued"),
    argv=("grace_ms", "most"),
    libraries=("window",),
)
#: Parks a run that must wait (or puts a taken one back), on one node.
PARK = Script(
    "park",
    keys=("due", "runs", "taken", "lines", "line*"),
    argv=("task_id", "run", "delay_ms", "lifetime_ms"),
)
#: Takes the parked runs that are due, each under a lease, to publish.
TAKE_DUE = Script(
    "take_due",
    keys=("due", "runs", "taken", "lines"),
    argv=("most", "lease_ms", "recheck_ms", "handoff_ms", "ahead_ms", "longest_ms"),
)
#: Whether a parked run's copy may start; it then leaves the parked runs.
UNPARK = Script(
    "unpark",
    keys=("due", "runs", "taken", "started", "lines", "line*"),
    argv=("task_id", "token", "horizon_ms", "member"),
    status=UnparkStatus,
)

#: Every script the package runs.
SCRIPTS: tuple[Script, ...] = tuple(
    value for value in list(globals().values()) if isinstance(value, Script)
)
