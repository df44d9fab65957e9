"""The redlock_* settings table: defaults, broker fallback, and errors naming the setting."""

from __future__ import annotations

import pytest

from celery_redlock import ConfigurationError
from celery_redlock.engine.timing import (
    MAX_SECONDS,
    MIN_NODE_TIMEOUT,
    MIN_RENEW_INTERVAL,
    MIN_TTL,
    Timing,
)
from celery_redlock.integration.settings import SETTING_OPTIONS, from_conf


def test_defaults():
    """With nothing set, the documented defaults apply and a redis broker is reused."""
    settings = from_conf({"broker_url": "redis://broker:6379/3"})
    assert settings.url == "redis://broker:6379/3"
    assert settings.node_urls() == ("redis://broker:6379/3",)
    assert (settings.ttl, settings.on_busy, settings.on_lost) == (30.0, "skip", "abort")
    assert settings.fail_open is False and settings.key_prefix == "redlock:"


def test_non_redis_broker_is_not_used():
    """An AMQP broker cannot hold locks: without redlock_url the error says what to set."""
    settings = from_conf({"broker_url": "amqp://guest@rabbit//"})
    with pytest.raises(ConfigurationError, match="redlock_url"):
        settings.node_urls()


def test_nodes_win_over_url():
    """redlock_nodes selects Redlock over the listed masters."""
    nodes = ["redis://a:6379", "redis://b:6379", "redis://c:6379"]
    settings = from_conf({"redlock_url": "redis://x", "redlock_nodes": nodes})
    assert settings.node_urls() == tuple(nodes)


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        (
            {"redlock_on_busy": "block"},
            "redlock_on_busy must be one of 'skip', 'retry', 'raise', 'wait'",
        ),
        (
            {"redlock_on_lost": "panic"},
            "redlock_on_lost must be one of 'abort', 'revoke', 'ignore'",
        ),
        ({"redlock_ttl": 0}, "redlock_ttl must be > 0"),
        ({"redlock_ttl": "30"}, "redlock_ttl must be a number"),
        (
            {"redlock_ttl": 10, "redlock_renew_interval": 20},
            "redlock_renew_interval must be shorter",
        ),
        ({"redlock_drift_factor": 1}, "redlock_drift_factor must be >= 0.0 and <= 0.5"),
        ({"redlock_url": "http://x"}, "redlock_url must be a redis://"),
        ({"redlock_nodes": "redis://a"}, "redlock_nodes must be a list"),
        ({"redlock_nodes": ["redis://a", "redis://a"]}, "must not list a node twice"),
        ({"redlock_key_prefix": "{x}"}, "redlock_key_prefix must be a string without"),
        ({"redlock_min_replicas": -1}, "redlock_min_replicas must be an integer >= 0"),
        ({"redlock_fail_open": "yes"}, "redlock_fail_open must be True or False"),
        ({"redlock_tasks": ["proj.*"]}, "redlock_tasks must map task names"),
    ],
)
def test_invalid_values_name_the_setting_and_allowed_values(conf, message):
    """Every bad value raises ConfigurationError (an ImproperlyConfigured) naming it."""
    with pytest.raises(ConfigurationError) as info:
        from_conf(conf)
    assert message in str(info.value)


def test_every_option_is_documented():
    """The table that generates the reference has a doc line for every setting."""
    for option in SETTING_OPTIONS.values():
        assert option.setting.startswith("redlock_") and option.doc.endswith(".")


def test_settings_reference_page_is_current():
    """docs/reference/settings.md holds the reference generated from the table."""
    from pathlib import Path

    from celery_redlock.integration.settings import reference

    root = Path(__file__).resolve().parents[3]
    page = (root / "docs" / "reference" / "settings.md").read_text()
    assert reference() in page, (
        "regenerate: python -c 'from celery_redlock.integration.settings import reference; "
        "print(reference())'"
    )


# -- ranges ----------------------------------------------------------------------------

RANGE = "2592000 seconds (30 days)"


@pytest.mark.parametrize(
    ("setting", "value", "allowed"),
    [
        ("redlock_ttl", 5e-324, f"from 0.01 to {RANGE}"),
        ("redlock_ttl", 0.009, f"from 0.01 to {RANGE}"),
        ("redlock_ttl", float("inf"), f"from 0.01 to {RANGE}"),
        ("redlock_ttl", 1e15, f"from 0.01 to {RANGE}"),
        ("redlock_ttl", MAX_SECONDS + 1, f"from 0.01 to {RANGE}"),
        ("redlock_beat_ttl", 1e15, f"from 0.01 to {RANGE}"),
        ("redlock_beat_ttl", 5e-324, f"from 0.01 to {RANGE}"),
        ("redlock_renew_interval", 5e-324, f"from 0.002 to {RANGE}"),
        ("redlock_renew_interval", float("inf"), f"from 0.002 to {RANGE}"),
        ("redlock_node_timeout", 1e-4, f"from 0.001 to {RANGE}"),
        ("redlock_node_timeout", 1e15, f"from 0.001 to {RANGE}"),
        ("redlock_retry_countdown", 1e15, f"at most {RANGE}"),
        ("redlock_retry_countdown", float("inf"), f"at most {RANGE}"),
        ("redlock_wait_timeout", 1e15, f"at most {RANGE}"),
        ("redlock_wait_timeout", float("-inf"), f"at most {RANGE}"),
    ],
)
def test_durations_out_of_range_name_the_setting_set_and_the_range(setting, value, allowed):
    """5e-324, inf and 1e15 used to fail naming a setting nobody set, or to be accepted
    and then fail every acquisition with Redis' 'value is not an integer or out of range'."""
    with pytest.raises(ConfigurationError) as info:
        from_conf({setting: value})
    message = str(info.value)
    assert message.startswith(f"{setting} must be "), message
    assert allowed in message and f"got {value!r}" in message, message
    others = {o.setting for o in SETTING_OPTIONS.values()} - {setting}
    assert not [o for o in others if o in message], message


@pytest.mark.parametrize(
    "conf",
    [
        {"redlock_ttl": MIN_TTL},
        {"redlock_ttl": MAX_SECONDS},
        {"redlock_ttl": MIN_TTL, "redlock_drift_factor": 0.5},
        {"redlock_ttl": 1, "redlock_renew_interval": MIN_RENEW_INTERVAL},
        {"redlock_renew_interval": 0.1},
        {"redlock_ttl": 1, "redlock_renew_interval": 0.5, "redlock_node_timeout": MIN_NODE_TIMEOUT},
        {"redlock_beat_ttl": MIN_TTL, "redlock_retry_countdown": MAX_SECONDS},
        {"redlock_wait_timeout": MAX_SECONDS},
    ],
)
def test_every_value_inside_the_ranges_is_accepted(conf):
    """The bounds themselves are valid, and a short renew interval alone needs nothing
    else set (the node timeout's default shrinks to fit it)."""
    settings = from_conf(conf)
    t = settings.timing
    assert t == Timing.of(
        settings.ttl, settings.renew_interval, settings.node_timeout, settings.drift_factor
    )
    assert t.node_timeout < t.renew_interval < t.ttl
    assert t.drift + t.margin < t.ttl
