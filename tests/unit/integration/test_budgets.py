"""How long a run put back for its rate budget may wait in a worker (no Redis needed)."""

from __future__ import annotations

import celery
import pytest

from celery_redlock.integration.budgets import MAX_HOLD, broker_visibility, longest_hold


@pytest.mark.parametrize(
    ("broker", "options", "expected"),
    [
        ("redis://127.0.0.1:1/1", None, ("the redis broker's default visibility_timeout", 3600)),
        (
            "rediss://127.0.0.1:1/1",
            {"visibility_timeout": 120},
            ("broker_transport_options['visibility_timeout']", 120),
        ),
        ("sqs://", None, ("the sqs broker's default visibility_timeout", 1800)),
        ("amqp://127.0.0.1:1//", {"visibility_timeout": 120}, None),
        ("memory://", None, None),
    ],
)
def test_the_broker_visibility_timeout_is_that_of_redis_and_sqs_only(broker, options, expected):
    """A broker without one (AMQP, memory) lets a worker hold a message as long as it
    is connected (RabbitMQ up to its consumer_timeout): MAX_HOLD bounds the countdown."""
    app = celery.Celery("budgets-broker", set_as_current=False, broker=broker)
    if options is not None:
        app.conf.broker_transport_options = options
    assert broker_visibility(app) == expected
    assert longest_hold(app) == (MAX_HOLD if expected is None else expected[1] / 2)
    app.close()
