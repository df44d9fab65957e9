"""A Sentinel-monitored master for tests: one master, one replica, three sentinels.

Every process is a real ``redis-server`` (sentinels run with ``--sentinel`` and a
config file of their own, which they rewrite). Import it directly::

    from tests.harness.sentinel import SentinelGroup

    with SentinelGroup(tmp_path) as group:
        url = group.url()            # redis+sentinel://127.0.0.1:P1,...:P3/mymaster/0
        group.failover()             # SENTINEL FAILOVER, waits until it is complete
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from .servers import HOST, RedisServer, close_all, make_client, wait_for

__all__ = ["SentinelGroup", "SentinelServer"]


class SentinelServer(RedisServer):
    """A ``redis-server --sentinel`` monitoring one master, with its own config file."""

    def __init__(
        self,
        master_port: int,
        *,
        service: str = "mymaster",
        quorum: int = 2,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        data_dir: str | os.PathLike[str],
    ) -> None:
        super().__init__(data_dir=data_dir)
        self.master_port = master_port
        self.service = service
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    @property
    def config_path(self) -> Path:
        return self.data_dir / "sentinel.conf"

    def command_line(self, port: int | None = None) -> list[str]:
        """``redis-server sentinel.conf --sentinel --port P ...`` (the file comes first)."""
        if not self.config_path.exists():  # a restart keeps what the sentinel rewrote
            self.config_path.write_text(
                f"sentinel monitor {self.service} {HOST} {self.master_port} {self.quorum}\n"
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}\n"
            )
        return [
            self._binary_info().path,
            str(self.config_path),
            "--sentinel",
            "--bind", HOST,
            "--port", str(port if port is not None else self.port),
            "--protected-mode", "no",
            "--dir", str(self.data_dir),
            "--logfile", str(self.log_path),
            "--daemonize", "no",
        ]  # fmt: skip

    def master(self) -> dict[str, Any]:
        """This sentinel's view of the monitored master (SENTINEL MASTER)."""
        with self.client() as conn:
            return conn.sentinel_master(self.service)


class SentinelGroup:
    """A master, a replica of it, and three sentinels (quorum 2); all closed together."""

    SERVICE = "mymaster"

    def __init__(self, base_dir: str | os.PathLike[str], *, sentinels: int = 3) -> None:
        self.base_dir = Path(base_dir)
        self.master = RedisServer(data_dir=self.base_dir / "master")
        self.replica: RedisServer | None = None
        self.sentinels: list[SentinelServer] = []
        self._count = sentinels

    def start(self, timeout: float = 20.0) -> SentinelGroup:
        """Start everything and wait until the sentinels know the replica and each other."""
        try:
            self.master.start()
            self.replica = RedisServer(
                ("--replicaof", HOST, str(self.master.port)), data_dir=self.base_dir / "replica"
            )
            self.replica.start()
            wait_for(
                lambda: self.replica_in_sync(self.master, self.replica),
                timeout=timeout,
                message="the replica to sync with the master",
            )
            for i in range(self._count):
                sentinel = SentinelServer(
                    self.master.port, service=self.SERVICE, data_dir=self.base_dir / f"s{i}"
                )
                self.sentinels.append(sentinel)
                sentinel.start()
            wait_for(self._settled, timeout=timeout, message="the sentinels to settle")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every process (sentinels first, so none starts a failover meanwhile)."""
        close_all([*self.sentinels, self.replica, self.master])

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------- views

    def url(self, db: int = 0, *, password: str | None = None, query: str = "") -> str:
        """``redis+sentinel://[:password@]127.0.0.1:P1,...,127.0.0.1:Pn/mymaster/DB``."""
        hosts = ",".join(f"{HOST}:{s.port}" for s in self.sentinels)
        auth = f":{password}@" if password else ""
        return f"redis+sentinel://{auth}{hosts}/{self.SERVICE}/{db}" + (
            f"?{query}" if query else ""
        )

    @property
    def servers(self) -> Sequence[RedisServer]:
        return [s for s in (self.master, self.replica) if s is not None]

    def running_sentinels(self) -> list[SentinelServer]:
        return [s for s in self.sentinels if s.alive()]

    def reported_master_port(self) -> int | None:
        """The master port every running sentinel agrees on, else None."""
        ports = set()
        for sentinel in self.running_sentinels():
            try:
                state = sentinel.master()
            except redis.RedisError:
                return None
            if not state.get("is_master") or state.get("is_odown") or state.get("is_sdown"):
                return None
            ports.add(int(state["port"]))
        return ports.pop() if len(ports) == 1 else None

    def current_master(self) -> RedisServer:
        """The server the sentinels report as master."""
        port = self.reported_master_port()
        for server in self.servers:
            if server.port == port:
                return server
        raise AssertionError(f"the sentinels report no known master (port {port})")

    @staticmethod
    def role(server: RedisServer) -> str | None:
        try:
            with server.client(socket_timeout=1) as conn:
                return conn.execute_command("ROLE")[0]
        except redis.RedisError:
            return None

    @staticmethod
    def replica_in_sync(master: RedisServer, replica: RedisServer) -> bool:
        """The replica is connected to ``master`` and has its whole replication stream."""
        try:
            with master.client(socket_timeout=1) as conn:
                info = conn.info("replication")
        except redis.RedisError:
            return False
        offset = info.get("master_repl_offset")
        for key, value in info.items():
            if (
                key.startswith("slave")
                and isinstance(value, dict)
                and int(value.get("port", 0)) == replica.port
                and value.get("state") == "online"
            ):
                return int(value.get("offset", -1)) == offset
        return False

    def _settled(self) -> bool:
        for sentinel in self.sentinels:
            try:
                state = sentinel.master()
            except redis.RedisError:
                return False
            if int(state.get("num-slaves", 0)) < 1:
                return False
            if int(state.get("num-other-sentinels", 0)) < self._count - 1:
                return False
            if int(state["port"]) != self.master.port:
                return False
        return True

    # ----------------------------------------------------------------- failover

    def failover(
        self, *, kill: bool = False, wait_demoted: bool = False, timeout: float = 30.0
    ) -> RedisServer:
        """Fail over to the other server and wait until it is the agreed master.

        ``kill=False`` asks a sentinel (SENTINEL FAILOVER; the old master stays up and
        is demoted to a replica a little later, awaited with ``wait_demoted``);
        ``kill=True`` SIGKILLs the master and lets the sentinels detect it. Returns
        the new master.
        """
        old = self.current_master()
        new = next(s for s in self.servers if s is not old)
        if kill:
            old.kill()
        else:
            with make_client(HOST, self.sentinels[0].port) as conn:
                conn.execute_command("SENTINEL", "FAILOVER", self.SERVICE)
        wait_for(
            lambda: self.reported_master_port() == new.port and self.role(new) == "master",
            timeout=timeout,
            interval=0.05,
            message=f"the sentinels to promote {new!r}",
        )
        if wait_demoted and not kill:
            wait_for(
                lambda: self.role(old) == "slave",
                timeout=timeout,
                interval=0.05,
                message=f"{old!r} to be demoted to a replica",
            )
        return new
