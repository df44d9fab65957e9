"""The built wheel carries everything the package loads at run time."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_lua_scripts_and_py_typed(tmp_path):
    """Build the wheel, install it apart from the source tree, and load every script."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("celery_redlock-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    lua = sorted(Path(n).name for n in names if n.endswith(".lua"))
    shipped = sorted(p.name for p in (ROOT / "celery_redlock" / "scripts").glob("*.lua"))
    assert lua == shipped
    assert "celery_redlock/py.typed" in names
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
    )
    probe = (
        "import celery_redlock, celery_redlock.scripts as s; "
        f"assert celery_redlock.__file__.startswith({str(target)!r}), celery_redlock.__file__; "
        "print(len([s.ACQUIRE, s.RENEW_MANY, s.RELEASE, s.RELEASE_IF, s.FENCE_SYNC, "
        "s.INSPECT]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == "6"
