"""The redlock_* settings table: defaults, broker fallback, and errors naming the setting."""

from __future__ import annotations

import pytest

from celery_redlock import ConfigurationError
from celery_redlock.settings import OPTIONS, from_conf


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
    for option in OPTIONS.values():
        assert option.setting.startswith("redlock_") and option.doc.endswith(".")


def test_readme_settings_table_is_current():
    """The README's settings reference is the one generated from the table."""
    from pathlib import Path

    from celery_redlock.settings import reference

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert reference() in readme, (
        "regenerate: python -c 'from celery_redlock.settings import reference; print(reference())'"
    )
