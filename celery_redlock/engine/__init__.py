"""The lock engine: ``Redlock`` and what it is made of, with no knowledge of Celery.

``lock`` (quorum, leases, holds per thread), ``keys`` (the key layout, built and
parsed), ``timing`` (validated durations and the drift allowance), ``renewal`` (one
watchdog thread per process), ``waiting`` (release notifications), ``threads`` (how the
library starts its threads) and ``scripts`` (the Lua, one file per script). It talks to
Redis only through :mod:`celery_redlock.nodes`.
"""
