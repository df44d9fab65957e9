"""The lock engine: ``Redlock`` and what it is made of, with no knowledge of Celery.

``lock`` ties the parts together: ``kinds`` (exclusive, shared/limit, fair: the script
calls of each and how to read their answers), ``vote`` (one attempt's fan-out and
tally), ``holds`` (a hold per thread, and the collector's release), ``lease`` (a lease,
its deadline clock, how a renewal answer is judged) and ``renewal`` (one watchdog
thread per process). ``waiting`` delivers release notifications, ``keys`` builds and
parses the key layout, ``rate`` keeps rate budgets (``RateLimit``), ``timing``
validates durations, ``threads`` starts the library's threads, and ``scripts`` holds
the Lua, one file per script. It talks to Redis only through
:mod:`celery_redlock.nodes`; the Celery layer (:mod:`celery_redlock.integration`)
builds on it.
"""
