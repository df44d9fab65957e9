"""A headless Chromium for the web dashboard's tests and screenshot: Debian's, via Selenium.

One place for how it is found and started: ``tests/unit/ops/web/conftest.py`` (the
``browser`` fixture) and ``scripts/screenshot_web.py`` both use :func:`start_chromium`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["CHROMEDRIVER", "CHROMIUM", "MISSING_HINT", "WINDOW", "missing", "start_chromium"]

#: Where Debian's packages put them (``apt-get install chromium chromium-driver``).
CHROMIUM = os.environ.get("CHROMIUM_BIN") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = (
    os.environ.get("CHROMEDRIVER_BIN") or shutil.which("chromedriver") or "/usr/bin/chromedriver"
)
MISSING_HINT = (
    "install Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
)

#: The browser's viewport: a laptop screen's.
WINDOW = (1280, 800)

#: Headless, and nothing reaching out of the machine (no sync, no component updates,
#: no QUIC): the flags every Chromium of the tests and the screenshot scripts gets.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def missing() -> str | None:
    """Why a headless Chromium cannot be started here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is missing (pip install -e '.[test]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (Path(path).is_file() and os.access(path, os.X_OK)):
            return f"{path} not found: {MISSING_HINT}"
    return None


def start_chromium(profile: Path, log: Path | None = None) -> Any:
    """A headless Chromium (Selenium WebDriver) with the fresh profile ``profile``.

    Its viewport is :data:`WINDOW`; nothing it does reaches out of the machine (no
    sync, no component updates, no QUIC), which has no network anyway.
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        *FLAGS,
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
    ):
        options.add_argument(flag)
    service = Service(executable_path=CHROMEDRIVER, log_output=None if log is None else str(log))
    driver = webdriver.Chrome(options=options, service=service)
    # The viewport itself, whatever the window's frame takes in this Chromium version.
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": WINDOW[0], "height": WINDOW[1], "deviceScaleFactor": 1, "mobile": False},
    )
    return driver
