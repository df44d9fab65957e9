"""Waiting until file descriptors are readable, whatever their numbers.

``select.select`` refuses a descriptor numbered 1024 or more (``ValueError:
filedescriptor out of range in select()``): in a process with many files or sockets
open (a web server, a worker with many connections) every lock call would fail. The
library waits with ``poll(2)`` instead, which takes any descriptor, and falls back to
``select`` only where ``poll`` does not exist (Windows).

This module imports nothing from the package, so every layer may use it.
"""

from __future__ import annotations

import math
import select
from collections.abc import Iterable
from typing import Any

__all__ = ["buffered", "readable"]

#: A descriptor is "readable" as select() says it: data, end of stream, or an error.
_READABLE = (
    select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP
    if hasattr(select, "poll")
    else 0
)


def readable(objects: Iterable[Any], timeout: float | None) -> list[Any]:
    """Those of ``objects`` readable within ``timeout`` seconds (None: no limit).

    ``objects`` are descriptors or objects with ``fileno()``; the result is what
    ``select.select(objects, [], [], timeout)[0]`` returns, for any descriptor number.

    Raises:
        OSError, ValueError: as ``select`` does for a closed object.
    """
    objects = list(objects)
    if not hasattr(select, "poll"):
        return list(select.select(objects, [], [], timeout)[0])
    poller = select.poll()
    by_fd: dict[int, Any] = {}
    for obj in objects:
        fd = obj if isinstance(obj, int) else obj.fileno()
        if fd < 0:
            raise ValueError("file descriptor cannot be a negative integer")
        by_fd[fd] = obj
        poller.register(fd, _READABLE)
    ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return [by_fd[fd] for fd, _ in poller.poll(ms)]


def buffered(conn: Any) -> bool | None:
    """Whether a redis-py connection holds a reply it has read but not parsed yet.

    ``poll`` sees only the socket: a read takes what the socket has, so a second
    reply can wait in the parser's buffer (or a TLS socket's) while the socket says
    nothing. ``conn.can_read(0)`` answers that too, but with a read of the socket and
    two changes of its mode: three system calls, on every reply, to learn "no".
    This looks at the buffers only; None where it cannot tell (a parser it does not
    know), and the caller asks ``can_read(0)``.
    """
    sock = getattr(conn, "_sock", None)
    pending = getattr(sock, "pending", None)  # ssl.SSLSocket: decrypted, not read yet
    if pending is not None and pending():
        return True
    parser = getattr(conn, "_parser", None)
    unread = getattr(getattr(parser, "_buffer", None), "unread_bytes", None)
    if unread is not None:  # redis-py's own parser
        return bool(unread())
    return None
