"""The public path of the beat schedulers, as users name them in ``beat_scheduler``.

``celery -A proj beat -S celery_redlock.beat:LeaderScheduler``; the code is
:mod:`celery_redlock.integration.beat`.
"""

from typing import Any

from .integration import beat as _beat
from .integration.beat import LeaderMixin, LeaderScheduler, parse_beat_holder

__all__ = ["LeaderMixin", "LeaderScheduler", "parse_beat_holder"]


def __getattr__(name: str) -> Any:
    """``DatabaseLeaderScheduler``, made when first named (django-celery-beat is optional)."""
    return getattr(_beat, name)
