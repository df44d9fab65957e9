"""Running the package's Lua scripts directly, with calls built from their signatures."""

from __future__ import annotations

from typing import Any

from celery_redlock.engine.keys import LockKeys
from celery_redlock.engine.scripts import Script


def run(client: Any, script: Script, keys: LockKeys | None = None, **names: Any) -> Any:
    """EVAL ``script`` with its KEYS and ARGV built by keyword (from ``keys`` by name).

    EVAL with the source rather than EVALSHA, so that a test needs no SCRIPT LOAD.
    """
    call = script.call(**names) if keys is None else script.on(keys, **names)
    return client.eval(script.source, len(call.keys), *call.keys, *call.args)
