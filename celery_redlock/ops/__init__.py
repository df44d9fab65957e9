"""Operations: the ``celery redlock`` command line and ``doctor``.

The top layer: it reads what the lower ones wrote (locks, shares, beat leadership)
and presents it. Nothing below imports it.
"""
