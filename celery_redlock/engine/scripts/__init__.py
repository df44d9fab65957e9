"""The Lua scripts, one ``.lua`` file each, loaded once per process.

Every check-and-act on a lock is one of these scripts, so it is atomic on each node.
Each file starts with a header giving ``KEYS``, ``ARGV`` and the return values.
Calls go out as EVALSHA; a node that answers NOSCRIPT (restarted, flushed, or a
promoted replica) gets ``SCRIPT LOAD`` once, pipelined with the retried calls
(see :mod:`celery_redlock.nodes`), so a batch of 10 renewal calls does not ship the
source 10 times.

The scripts build no key names: each gets every key it touches in ``KEYS``
(:mod:`celery_redlock.keys` lists them per script). The constants they share
with Python, :data:`~celery_redlock.keys.WRITER_MARK` and
:data:`~celery_redlock.keys.YIELD_MARK`, are put in front of each script's code
(after its header) as Lua locals of the same names (:data:`PRELUDE`).

Each script's return codes are an :class:`enum.IntEnum` here, beside its loader,
for every module that reads them.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from importlib import resources

from ...nodes.calls import bulk
from ..keys import FENCE_HORIZON_LEASES, FENCE_HORIZON_MIN, WRITER_MARK, YIELD_MARK

__all__ = [
    "ABANDON",
    "ACQUIRE",
    "ACQUIRE_SHARED",
    "BEAT_CLAIM",
    "BUDGET_READ",
    "CLAIM",
    "CLAIM_START",
    "FAIR_LEAVE",
    "FENCE_SYNC",
    "INSPECT",
    "NOTE_QUEUED",
    "PARK",
    "RATE",
    "RATE_RETURN",
    "RELEASE",
    "RELEASE_IF",
    "RELEASE_SHARED",
    "RENEW_MANY",
    "TAKE_DUE",
    "THROTTLE",
    "UNCLAIM",
    "UNPARK",
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

    REFUSED = 0  #: N starts in the last window; the reply's third element: ms until one leaves
    ADMITTED = 1
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
    """A Lua script shipped with the package, addressed by its SHA1."""

    __slots__ = ("libraries", "name", "per_key_args", "sha", "source", "status")

    def __init__(
        self,
        name: str,
        *,
        status: type[enum.IntEnum] | None = None,
        per_key_args: int | None = None,
        libraries: Sequence[str] = (),
    ) -> None:
        self.name = name
        #: Lua libraries (``<name>.lua`` files of functions) put after the prelude.
        self.libraries = tuple(libraries)
        #: The script's return codes (None: it returns data, not a status).
        self.status = status
        #: For a script whose keys are independent of each other (each key with this
        #: many ARGV entries of its own, and one reply entry per key), so that a call
        #: may be split by key, e.g. per Redis Cluster master. None: keys go together.
        self.per_key_args = per_key_args
        text = resources.files(__package__).joinpath(f"{name}.lua").read_text("utf-8")
        lines = text.splitlines(keepends=True)
        header = next((i for i, line in enumerate(lines) if not line.startswith("--")), 0)
        code = [PRELUDE, *(_library(library) for library in self.libraries)]
        self.source = "".join([*lines[:header], *code, *lines[header:]])
        self.sha = hashlib.sha1(self.source.encode("utf-8")).hexdigest()

    def evalsha(self, keys: Sequence[str], args: Sequence[object]) -> tuple[object, ...]:
        """The EVALSHA command that runs this script."""
        return ("EVALSHA", self.sha, len(keys), *keys, *args)

    def evalsha_resp(self, keys: int, args: int) -> bytes:
        """The start of :meth:`evalsha` in RESP, up to its keys, for a :attr:`Call.resp`."""
        return b"*%d\r\n" % (3 + keys + args) + bulk("EVALSHA", self.sha, keys)

    def __repr__(self) -> str:
        return f"<Script {self.name} {self.sha[:8]}>"


ACQUIRE = Script("acquire", status=AcquireStatus, libraries=("fence", "wake"))
ABANDON = Script("abandon")
FENCE_SYNC = Script("fence_sync", status=FenceSyncStatus, libraries=("fence",))
RENEW_MANY = Script("renew_many", status=RenewStatus, per_key_args=3)
RELEASE = Script("release", status=ReleaseStatus, libraries=("fence", "wake"))
ACQUIRE_SHARED = Script("acquire_shared", status=AcquireStatus, libraries=("fence",))
RELEASE_SHARED = Script("release_shared", status=ReleaseSharedStatus)
FAIR_LEAVE = Script("fair_leave", status=FairLeaveStatus, libraries=("fence", "wake"))
RELEASE_IF = Script("release_if", status=ReleaseIfStatus, libraries=("fence", "wake"))
INSPECT = Script("inspect")
BEAT_CLAIM = Script("beat_claim", status=BeatClaimStatus)
CLAIM = Script("claim", status=ClaimStatus)
UNCLAIM = Script("unclaim", status=UnclaimStatus)
CLAIM_START = Script("claim_start")
THROTTLE = Script("throttle")
RATE = Script("rate", status=RateStatus, libraries=("queued",))
RATE_RETURN = Script("rate_return")
NOTE_QUEUED = Script("note_queued", libraries=("queued",))
BUDGET_READ = Script("budget_read")
PARK = Script("park")
TAKE_DUE = Script("take_due")
UNPARK = Script("unpark", status=UnparkStatus)
