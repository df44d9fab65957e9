"""Operations: what an operator asks of a running system.

The top layer: ``inventory`` and ``shares`` read what the lower layers wrote to Redis
(locks, shares, beat leadership), ``workers`` asks the workers whether a holder still
runs, ``doctor/`` judges a deployment, and ``cli/`` presents all of it as
``celery redlock``. Nothing below imports it.
"""
