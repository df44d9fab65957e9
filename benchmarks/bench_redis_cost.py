"""Redis-side cost per acquire, renew and release: commands and bytes, against the peers.

Run from the repository root: ``python -m benchmarks.bench_redis_cost [--ops N]
[--batch B]``. Starts its own redis-server (through the test harness) and writes
``benchmarks/results/redis_cost.json``.

Every lock takes ``--ops`` distinct keys through acquire (non-blocking, uncontended),
renew and release, on the same server. What the server saw is counted twice, in two
passes over fresh keys, because watching costs bytes:

* pass 1, no observer: ``INFO commandstats`` deltas (every command the server ran,
  including those a Lua script runs with ``redis.call``) and ``INFO stats``
  ``total_net_input_bytes`` / ``total_net_output_bytes`` deltas, less the bytes of the
  ``INFO`` calls themselves (measured around an empty phase);
* pass 2, ``MONITOR``: which of those commands came over the network (MONITOR tags
  script calls ``[lua]``); its stream is output bytes, hence the separate pass.

Everything is divided per operation. Our renewal is batched, so it is reported per lock
renewed with one lock per renewer tick and with ``--batch`` (1,000) locks per tick.
celery_redlock runs with ``auto_renew=False`` so no background tick adds commands.

Peers: redis-py ``Lock`` (``reacquire()`` renews), python-redis-lock (``extend()``),
pottery ``Redlock`` on one node (``extend()``), and the WATCH/MULTI/EXEC lock of
``bench_latency``. No target was set for this item; the figures are reported as measured.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version as dist_version
from typing import Any

import redis
import redis_lock
from pottery import Redlock as PotteryRedlock

from benchmarks.bench_latency import WatchLock
from benchmarks.common import environment, server_label, write_report
from celery_redlock import Redlock
from celery_redlock.engine.renewal import Renewer
from tests.harness import RedisServer

#: Commands of the observer connection, never of a lock.
OBSERVER_COMMANDS = {"info", "echo", "config", "monitor", "hello", "client"}


@dataclass
class Contender:
    """How one lock implementation does each operation on one lock object."""

    make: Callable[[str], Any]
    acquire: Callable[[Any], object]
    renew: Callable[[list[Any]], None]
    release: Callable[[Any], object]
    #: Whether one renew call covers many locks (measured at 1 and ``--batch`` per tick).
    batched: bool = False


def must(ok: object, what: str) -> None:
    if ok is False or ok is None:
        raise RuntimeError(f"{what} failed on an uncontended key")


def contenders(url: str) -> dict[str, Contender]:
    client = redis.Redis.from_url(url)
    renewer = Renewer()

    def ours_acquire(lock: Redlock) -> None:
        must(lock.acquire(blocking=False), "celery_redlock acquire")

    def each(renew_one: Callable[[Any], object]) -> Callable[[list[Any]], None]:
        def renew(locks: list[Any]) -> None:
            for lock in locks:
                must(renew_one(lock), "renew")

        return renew

    def pottery_extend(lock: PotteryRedlock) -> bool:
        lock.extend()  # raises when it cannot extend
        return True

    return {
        "celery_redlock": Contender(
            make=lambda name: Redlock(name, nodes=[url], ttl=30, auto_renew=False),
            acquire=ours_acquire,
            renew=lambda locks: renewer.renew([lock.lease for lock in locks]),
            release=Redlock.release,
            batched=True,
        ),
        "redis-py Lock": Contender(
            make=lambda name: client.lock(name, timeout=30),
            acquire=lambda lock: must(lock.acquire(blocking=False), "redis-py acquire"),
            renew=each(lambda lock: lock.reacquire()),
            release=lambda lock: lock.release(),
        ),
        "python-redis-lock": Contender(
            make=lambda name: redis_lock.Lock(client, name, expire=30),
            acquire=lambda lock: must(lock.acquire(blocking=False), "python-redis-lock acquire"),
            renew=each(lambda lock: lock.extend(expire=30) or True),
            release=lambda lock: lock.release(),
        ),
        "pottery Redlock (1 node)": Contender(
            make=lambda name: PotteryRedlock(key=name, masters={client}, auto_release_time=30),
            acquire=lambda lock: must(lock.acquire(blocking=False), "pottery acquire"),
            renew=each(pottery_extend),
            release=lambda lock: lock.release(),
        ),
        "WATCH/MULTI baseline": Contender(
            make=lambda name: WatchLock(client, name, ttl=30),
            acquire=lambda lock: must(lock.acquire(), "WATCH acquire"),
            renew=each(WatchLock.extend),
            release=WatchLock.release,
        ),
    }


class ServerMeter:
    """Pass 1: commandstats and network byte deltas over a phase, on one observer link."""

    def __init__(self, url: str) -> None:
        self.observer = redis.Redis.from_url(url)
        self.info_bytes = (0, 0)
        self.info_bytes = self._bytes_delta(lambda: None)  # the INFO calls' own bytes

    def _net(self) -> tuple[int, int]:
        stats = self.observer.info("stats")
        return stats["total_net_input_bytes"], stats["total_net_output_bytes"]

    def _commands(self) -> Counter[str]:
        raw = self.observer.info("commandstats")
        return Counter({key[len("cmdstat_") :]: int(value["calls"]) for key, value in raw.items()})

    def _bytes_delta(self, run: Callable[[], object]) -> tuple[int, int]:
        in0, out0 = self._net()
        run()
        in1, out1 = self._net()
        return in1 - in0 - self.info_bytes[0], out1 - out0 - self.info_bytes[1]

    def __call__(self, run: Callable[[], object], per: int) -> dict[str, Any]:
        before = self._commands()
        bytes_in, bytes_out = self._bytes_delta(run)
        calls = self._commands() - before
        for name in OBSERVER_COMMANDS:
            calls.pop(name, None)
        return {
            "server_commands": round(sum(calls.values()) / per, 3),
            "server_commands_by_name": {k: round(v / per, 3) for k, v in sorted(calls.items())},
            "bytes_in": round(bytes_in / per, 1),
            "bytes_out": round(bytes_out / per, 1),
        }


class NetworkMeter:
    """Pass 2: the commands that came over the network, told apart from scripts' by MONITOR."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.observer = redis.Redis.from_url(url)

    def __call__(self, run: Callable[[], object], per: int) -> dict[str, Any]:
        begin, end = f"bench-begin-{uuid.uuid4().hex}", f"bench-end-{uuid.uuid4().hex}"
        network: Counter[str] = Counter()
        scripted = 0
        with redis.Redis.from_url(self.url).monitor() as monitor:
            self.observer.echo(begin)
            run()
            self.observer.echo(end)
            started = False
            while True:
                entry = monitor.next_command()
                command = entry["command"]
                if not started:
                    started = begin in command
                    continue
                if end in command:
                    break
                name = command.split(" ", 1)[0].lower()
                if entry["client_type"] == "lua":
                    scripted += 1
                elif name not in OBSERVER_COMMANDS:
                    network[name] += 1
        return {
            "network_commands": round(sum(network.values()) / per, 3),
            "network_commands_by_name": {k: round(v / per, 3) for k, v in sorted(network.items())},
            "script_commands": round(scripted / per, 3),
        }


def one_pass(
    contender: Contender, prefix: str, ops: int, batch: int, meter: Callable[..., dict]
) -> dict[str, dict]:
    """Acquire, renew and release ``ops`` fresh locks, measuring each phase with ``meter``."""
    locks = [contender.make(f"{prefix}:{i}") for i in range(ops)]
    phases = {
        "acquire": meter(lambda: [contender.acquire(lock) for lock in locks], ops),
        "renew": meter(lambda: [contender.renew([lock]) for lock in locks], ops),
    }
    if contender.batched:
        phases[f"renew ({batch} locks per tick)"] = meter(
            lambda: contender.renew(locks[:batch]), batch
        )
    phases["release"] = meter(lambda: [contender.release(lock) for lock in locks], ops)
    return phases


def measure(url: str, ops: int, batch: int) -> dict[str, dict[str, dict]]:
    locks = contenders(url)
    for name, contender in locks.items():  # warm connections and script caches
        one_pass(contender, f"warm:{name}", 5, 5, lambda run, per: run())
    server, network = ServerMeter(url), NetworkMeter(url)
    results: dict[str, dict[str, dict]] = {}
    for name, contender in locks.items():
        costs = one_pass(contender, f"p1:{name}", ops, batch, server)
        seen = one_pass(contender, f"p2:{name}", ops, batch, network)
        results[name] = {phase: {**seen[phase], **costs[phase]} for phase in costs}
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1000, help="locks per contender and pass")
    parser.add_argument("--batch", type=int, default=1000, help="locks per batched renew tick")
    args = parser.parse_args(argv)
    if args.batch > args.ops:
        parser.error("--batch cannot exceed --ops (the batch renews locks held by the pass)")
    started = time.monotonic()
    with RedisServer() as server:
        results = measure(server.url, args.ops, args.batch)
        version = server.version
    report = {
        "benchmark": "Redis-side cost per acquire / renew / release, one node",
        **environment(),
        "redis_server": server_label(version),
        "python_redis_lock": dist_version("python-redis-lock"),
        "pottery": dist_version("pottery"),
        "ops": args.ops,
        "batch": args.batch,
        "wall_s": round(time.monotonic() - started, 1),
        "notes": [
            "per operation (per lock renewed for renew): network_commands = commands "
            "clients sent (MONITOR, pass 2); script_commands = redis.call inside Lua "
            "(MONITOR); server_commands = INFO commandstats calls (pass 1), which count "
            "both; bytes_in/bytes_out = INFO stats total_net_*_bytes (pass 1)",
            "celery_redlock with auto_renew=False; renew = Renewer().renew(leases) "
            "with 1 lock per tick and with `batch` locks per tick",
            "no target was set for this item",
        ],
        "results": results,
    }
    write_report("redis_cost", report)
    print(
        f"{'lock':<26} {'phase':<27} {'net cmds':>8} {'server cmds':>11} "
        f"{'bytes in':>9} {'bytes out':>9}"
    )
    for name, phases in results.items():
        for phase, row in phases.items():
            print(
                f"{name:<26} {phase:<27} {row['network_commands']:>8} "
                f"{row['server_commands']:>11} {row['bytes_in']:>9} {row['bytes_out']:>9}"
            )
    return report


if __name__ == "__main__":
    main()
