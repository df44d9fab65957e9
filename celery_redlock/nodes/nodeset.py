"""The masters a lock lives on (:class:`NodeSet`), shared per process."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..base import forksafe
from ..exceptions import ConfigurationError
from .calls import Call, LockNode, Reply
from .fanout import fan_out
from .node import Node
from .urls import make_node

__all__ = ["LAG_WINDOW", "NodeSet"]

#: How long (seconds) a node counts as lagging after it was last seen lagging
#: (:meth:`NodeSet.lagging`).
LAG_WINDOW = 1.0


class NodeSet:
    """The masters a lock lives on: one node, or N independent nodes for Redlock.

    Instances are shared per process for the same URLs and timeout (:meth:`get`),
    and their nodes per URL whatever the timeout: every lock on the same servers
    shares their connections (else 300 locks with 300 short ttls would open 300 sets
    of connections).
    """

    _registry: dict[tuple[Any, ...], NodeSet] = {}
    _nodes: dict[str, LockNode] = {}
    _registry_lock = threading.Lock()

    def __init__(
        self, urls: Sequence[str], *, timeout: float, nodes: Sequence[LockNode] | None = None
    ) -> None:
        if isinstance(urls, str):
            urls = [urls]
        urls = list(urls)
        if not urls:
            raise ConfigurationError(
                "no Redis nodes given: pass nodes=[url, ...] (one URL, or 3, 5, 7... "
                "independent masters for Redlock), or set redlock_url / redlock_nodes"
            )
        if len(set(urls)) != len(urls):
            raise ConfigurationError(f"Redis node URLs must be distinct, got {urls!r}")
        if not timeout or timeout <= 0:
            raise ConfigurationError(f"node timeout must be > 0 seconds, got {timeout!r}")
        if nodes is None:
            nodes = [make_node(url, timeout=timeout, default=Node) for url in urls]
        self.nodes = tuple(nodes)
        self.timeout = timeout
        self.quorum = len(self.nodes) // 2 + 1

    @classmethod
    def get(cls, urls: Sequence[str], *, timeout: float) -> NodeSet:
        """The process-wide NodeSet for these URLs and timeout."""
        key = (tuple([urls] if isinstance(urls, str) else urls), timeout)
        nodeset = cls._registry.get(key)
        if nodeset is None:
            with cls._registry_lock:
                nodeset = cls._registry.get(key)
                if nodeset is None:
                    if not timeout or timeout <= 0:  # checked before a node is made
                        cls(key[0], timeout=timeout)
                    nodes = [cls._shared_node(url, timeout) for url in key[0]]
                    nodeset = cls._registry[key] = cls(key[0], timeout=timeout, nodes=nodes)
        return nodeset

    @classmethod
    def _shared_node(cls, url: str, timeout: float) -> LockNode:
        """The process's node for ``url`` (call with the registry lock held)."""
        node = cls._nodes.get(url)
        if node is None:
            node = cls._nodes[url] = make_node(url, timeout=timeout, default=Node)
        else:
            node.widen_timeout(timeout)
        return node

    #: A request whose reply a fan-out did not wait for keeps its connection, owing the
    #: reply: the thread's next request to that node goes out behind it.
    queues_behind = True

    def __len__(self) -> int:
        return len(self.nodes)

    def lagging(self) -> frozenset[int]:
        """The nodes (by index) seen lagging within :data:`LAG_WINDOW`; none on one node.

        A node lags when its reply comes far behind the others of a fan-out, or one
        left in flight there (a fan-out decided without it) is still missing when the
        node is next used, or never came (:data:`~celery_redlock.nodes.calls.LAG`).
        What would wait for every node (a release, an undo, an in-process takeover)
        would then go at that node's pace: the caller does not wait for it once a
        quorum decided.
        """
        if len(self.nodes) == 1:
            return frozenset()
        since = time.monotonic() - LAG_WINDOW
        return frozenset(
            i for i, node in enumerate(self.nodes) if getattr(node, "lagged_at", -math.inf) > since
        )

    def answering(self, since: float) -> int:
        """How many nodes answered a request of this process after ``since`` (monotonic).

        A node that answers other requests of this process is up, whatever one request
        to it timed out: a process or machine starved of CPU (hundreds of threads
        starting at once) reads its replies late.
        """
        return sum(1 for node in self.nodes if getattr(node, "answered_at", 0.0) > since)

    def __repr__(self) -> str:
        return f"<NodeSet {[n.safe_url for n in self.nodes]} quorum={self.quorum}>"

    def call(
        self,
        calls: Sequence[Call] | Sequence[Sequence[Call] | None],
        *,
        per_node: bool = False,
        timeout: float | None = None,
        decided: Callable[[list[Reply | None]], bool] | None = None,
        patient: bool = False,
    ) -> list[Reply | None]:
        """Send the same calls to every node (or ``calls[i]`` to node i with ``per_node``)."""
        requests = calls if per_node else [calls] * len(self.nodes)
        return fan_out(
            self.nodes,
            requests,  # type: ignore[arg-type]
            timeout=self.timeout if timeout is None else timeout,
            decided=decided,
            patient=patient,
        )

    @staticmethod
    @forksafe.at_fork_in_child
    def _after_fork_in_child() -> None:
        # A parent thread inside get() at fork would leave the registry locked here.
        NodeSet._registry_lock = threading.Lock()

    def close(self) -> None:
        """Close the connections of nodes this process will not use again.

        For a short-lived owner (a CLI command, doctor) that built this NodeSet alone:
        nodes shared through :meth:`get` are pooled per process, and closing them under
        another user would pull sockets from under it.
        """
        for node in self.nodes:
            node.close()
