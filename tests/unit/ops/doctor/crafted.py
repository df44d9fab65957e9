"""Crafted inputs shared by the doctor's tests: settings, node facts, finding codes."""

from __future__ import annotations

from typing import Any

from celery_redlock.integration.settings import Settings, from_conf
from celery_redlock.ops.doctor.facts import NodeFacts
from celery_redlock.ops.doctor.report import Finding

NODE = "redis://127.0.0.1:6379/0"
DURABLE = {"appendonly": "yes", "appendfsync": "always", "save": ""}


def settings(**conf: Any) -> Settings:
    """Validated settings from ``redlock_*`` keyword arguments (no prefix)."""
    return from_conf({f"redlock_{k}": v for k, v in conf.items()} | {"redlock_url": NODE})


def codes(findings: list[Finding], level: str | None = None) -> set[str]:
    return {f.code for f in findings if level is None or f.level == level}


def healthy(node: str, run_id: str) -> NodeFacts:
    return NodeFacts(
        node,
        config={"maxmemory-policy": "noeviction", "maxmemory": "0", **DURABLE},
        info={
            "uptime_in_seconds": "86400",
            "role": "master",
            "connected_slaves": "0",
            "run_id": run_id,
        },
        clock_skew=0.001,
        clock_uncertainty=0.0005,
        rtt=0.001,
    )
