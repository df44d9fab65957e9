"""A redis-server in a network namespace of its own, so a test can cut the network.

The fault proxy (:mod:`tests.harness.faultproxy`) blackholes one TCP path; a namespace
cuts the *link*: the server's side of a veth pair goes down, packets to it are
dropped (connects time out, sends get no answer), and coming back up heals it with
the server process untouched, as a switch or cable failure would. It needs root
(``CAP_NET_ADMIN``) and iproute2; :func:`available` says whether this machine has both.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from typing import Any

from .servers import RedisServer

__all__ = ["NetnsRedisServer", "available"]

_ids = itertools.count()


def _ip(*args: str, namespace: str | None = None) -> None:
    prefix = [] if namespace is None else ["ip", "netns", "exec", namespace]
    subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, timeout=10)


def available() -> str | None:
    """None if namespaces can be made here, else why not (a skip reason)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "network namespaces need root (CAP_NET_ADMIN) and iproute2's ip"
    probe = f"rlprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot create a network namespace here: {exc}"
    _ip("netns", "del", probe)
    return None


class NetnsRedisServer(RedisServer):
    """A :class:`RedisServer` alone in a namespace, reached over a veth pair.

    :meth:`partition` takes the server's end of the link down; :meth:`heal` brings it
    back. The namespace and link are made on :meth:`start` and removed on :meth:`close`.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        n = next(_ids)
        tag = f"{os.getpid() % 100000}{n}"
        self.namespace = f"rl{tag}"
        self._outer, self._inner = f"rlo{tag}", f"rli{tag}"
        subnet = f"10.{200 + os.getpid() % 50}.{n % 250}"
        self._outer_address, self._host = f"{subnet}.1", f"{subnet}.2"
        self._net = False

    def _make_network(self) -> None:
        if self._net:
            return
        _ip("netns", "add", self.namespace)
        self._net = True
        _ip("link", "add", self._outer, "type", "veth", "peer", "name", self._inner,
            "netns", self.namespace)  # fmt: skip
        _ip("addr", "add", f"{self._outer_address}/30", "dev", self._outer)
        _ip("link", "set", self._outer, "up")
        _ip("addr", "add", f"{self._host}/30", "dev", self._inner, namespace=self.namespace)
        _ip("link", "set", self._inner, "up", namespace=self.namespace)
        _ip("link", "set", "lo", "up", namespace=self.namespace)

    def start(self) -> NetnsRedisServer:
        self._make_network()
        super().start()
        return self

    def command_line(self, port: int | None = None) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *super().command_line(port)]

    def partition(self) -> None:
        """Cut the link: the server is running but unreachable."""
        _ip("link", "set", self._inner, "down", namespace=self.namespace)

    def heal(self) -> None:
        """Restore the link."""
        _ip("link", "set", self._inner, "up", namespace=self.namespace)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._net:
                self._net = False
                subprocess.run(["ip", "netns", "del", self.namespace], check=False, timeout=10)
                subprocess.run(
                    ["ip", "link", "del", self._outer], check=False, capture_output=True, timeout=10
                )
