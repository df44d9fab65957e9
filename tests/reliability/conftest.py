"""Fixtures of the reliability scenarios."""

from __future__ import annotations

import pytest

from tests.reliability.workload import Lab


@pytest.fixture
def lab(tmp_path):
    """Servers, proxies and the history's storage server of one test, closed at its end."""
    lab = Lab(tmp_path)
    yield lab
    lab.close()
