"""How the package talks to Redis: connections to 1..N masters, and concurrent fan-out.

The lock engine says *what* to ask each node (a list of :class:`Call`); this layer
gets every node's :class:`Reply` back within one time budget, and knows nothing of
locks. Two properties matter more here than convenience:

* **Bounded time.** Every connection has explicit connect and socket timeouts and no
  retries (redis-py's ready-made client retries a failing command, 8.7 s against a
  blackholed node with a 0.5 s socket timeout); a call that cannot finish within
  its budget fails, and the caller decides what that means (for a lock: that node
  did not vote).
* **Concurrency without threads.** :func:`fan_out` writes every node's request
  first, then reads whichever reply is ready, in the calling thread, and returns as
  soon as the caller's ``decided`` predicate says the outcome is known.

Where each piece lives, from the bottom:

* :mod:`.calls`: what travels (:class:`Call`, :class:`Reply`, ``Leg``, the
  ``Script`` a call runs) and the two protocols the rest of the package types
  against: :class:`LockNode` (one Redlock vote, plain master or whole cluster) and
  :class:`Server` (one server's connection pool, where a leg is sent).
* :mod:`.urls`: URL forms, connection settings, :func:`safe_url`, and
  ``make_node``, which turns a URL into a node through a registry of node kinds, so
  it never imports the modules that implement them.
* :mod:`.sentinel`: the ``redis+sentinel://`` URL and its pool, which asks the
  sentinels for the master.
* :mod:`.node`: :class:`Node`, one master's per-process connection pool (checkout,
  checkin, draining replies left in flight, sentinel master rechecks).
* :mod:`.fanout`: :func:`fan_out`, the select loop, script loading, redirections.
* :mod:`.nodeset`: :class:`NodeSet`, the masters of a lock, shared per process.
* :mod:`.cluster`: ``redis+cluster://``, a whole Redis Cluster as one lock node
  (slot routing, MOVED and ASK). It registers its URL kind when imported, which
  :mod:`celery_redlock.engine.lock` does (and so the package itself, before any of
  its modules runs); nothing else imports it.
"""

from .calls import Call, LockNode, Reply, Server
from .fanout import ALIVE_GRACE, fan_out
from .node import Node
from .nodeset import NodeSet
from .urls import safe_url

__all__ = [
    "ALIVE_GRACE",
    "Call",
    "LockNode",
    "Node",
    "NodeSet",
    "Reply",
    "Server",
    "fan_out",
    "safe_url",
]
