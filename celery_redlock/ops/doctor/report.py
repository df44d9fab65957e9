"""What ``doctor`` tells: findings, their levels, the exit status and the JSON form.

The checks (:mod:`.checks`) produce :class:`Finding` objects; :func:`exit_code` turns
them into the command's exit status; :class:`Report` carries them with the node facts
they came from and renders both as JSON (``--json``). The text form is the CLI's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from celery.platforms import EX_UNAVAILABLE

from .facts import NodeFacts

__all__ = ["ERROR", "LEVELS", "OK", "WARN", "Finding", "Report", "exit_code"]

OK, WARN, ERROR = "ok", "warn", "error"
LEVELS = (OK, WARN, ERROR)


@dataclass(frozen=True)
class Finding:
    """One result of a check.

    Arguments:
        level: ``ok``, ``warn`` or ``error``.
        code: stable identifier of the check (``evicting-policy``...).
        message: the problem, its consequence and the fix (or what is fine).
        node: the node it is about (sanitized URL), or ``None`` for the setup.
    """

    level: str
    code: str
    message: str
    node: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form with stable keys: level, code, node, message."""
        return {"level": self.level, "code": self.code, "node": self.node, "message": self.message}


def exit_code(findings: Iterable[Finding]) -> int:
    """0 without errors; ``EX_UNAVAILABLE`` if a node was unreachable; else 1."""
    findings = list(findings)
    if any(f.code == "node-unreachable" and f.level == ERROR for f in findings):
        return int(EX_UNAVAILABLE)
    if any(f.level == ERROR for f in findings):
        return 1
    return 0


@dataclass
class Report:
    """What :func:`~celery_redlock.ops.doctor.diagnose` found.

    The findings, the node facts they came from, and the exit code.
    """

    findings: list[Finding]
    facts: list[NodeFacts]

    @property
    def exit_code(self) -> int:
        """The command's exit status (see :func:`exit_code`)."""
        return exit_code(self.findings)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form: ok, exit_code, counts, findings, nodes."""
        counts = {level: sum(f.level == level for f in self.findings) for level in LEVELS}
        return {
            "ok": self.exit_code == 0,
            "exit_code": self.exit_code,
            "counts": counts,
            "findings": [f.as_dict() for f in self.findings],
            "nodes": [n.as_dict() for n in self.facts],
        }
