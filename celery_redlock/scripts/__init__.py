"""The Lua scripts, one ``.lua`` file each, loaded once per process.

Every check-and-act on a lock is one of these scripts, so it is atomic on each node.
Each file starts with a header giving ``KEYS``, ``ARGV`` and the return values.
Calls go out as EVALSHA; a node that answers NOSCRIPT (restarted, flushed, or a
promoted replica) gets ``SCRIPT LOAD`` once, pipelined with the retried calls
(see :mod:`celery_redlock.nodes`), so a batch of 10 renewal calls does not ship the
source 10 times.
"""

from __future__ import annotations

import hashlib
from importlib import resources

__all__ = [
    "ACQUIRE",
    "ACQUIRE_SHARED",
    "BEAT_CLAIM",
    "FAIR_LEAVE",
    "FENCE_SYNC",
    "INSPECT",
    "RELEASE",
    "RELEASE_IF",
    "RELEASE_SHARED",
    "RENEW_MANY",
    "Script",
]


class Script:
    """A Lua script shipped with the package, addressed by its SHA1."""

    __slots__ = ("name", "per_key_args", "sha", "source")

    def __init__(self, name: str, *, per_key_args: int | None = None) -> None:
        self.name = name
        #: For a script whose keys are independent of each other (each key with this
        #: many ARGV entries of its own, and one reply entry per key), so that a call
        #: may be split by key, e.g. per Redis Cluster master. None: keys go together.
        self.per_key_args = per_key_args
        self.source = resources.files(__package__).joinpath(f"{name}.lua").read_text("utf-8")
        self.sha = hashlib.sha1(self.source.encode("utf-8")).hexdigest()

    def evalsha(self, keys: tuple | list, args: tuple | list) -> tuple:
        """The EVALSHA command that runs this script."""
        return ("EVALSHA", self.sha, len(keys), *keys, *args)

    def __repr__(self) -> str:
        return f"<Script {self.name} {self.sha[:8]}>"


ACQUIRE = Script("acquire")
FENCE_SYNC = Script("fence_sync")
RENEW_MANY = Script("renew_many", per_key_args=3)
RELEASE = Script("release")
ACQUIRE_SHARED = Script("acquire_shared")
RELEASE_SHARED = Script("release_shared")
FAIR_LEAVE = Script("fair_leave")
RELEASE_IF = Script("release_if")
INSPECT = Script("inspect")
BEAT_CLAIM = Script("beat_claim")
