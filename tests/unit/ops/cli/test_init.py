"""The ``redlock`` group: registered as Celery's own sub-command, with its commands."""

from __future__ import annotations

import pytest
from celery.bin.celery import celery as celery_cli

from celery_redlock.ops.cli import redlock


@pytest.mark.smoke
def test_redlock_is_a_celery_subcommand_through_the_entry_point():
    """`pip install` registered celery.commands: redlock is Celery's own sub-command."""
    assert celery_cli.commands.get("redlock") is redlock, (
        "celery_redlock.ops.cli:redlock is not registered; run `pip install -e .`"
    )
    assert set(redlock.commands) == {"ls", "inspect", "release", "doctor", "why", "log", "web"}
