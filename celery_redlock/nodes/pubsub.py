"""Reading the messages of a pub/sub connection without redis-py's parser.

A waiting process reads one message per handoff between processes (the grant a
release publishes for its waiter), and the time from the socket turning readable to
the waiter holding the lock is on the path of every such handoff.
redis-py's parser asks the socket again after each reply (``can_read``: a read and
two changes of socket mode) and parses in general-purpose Python; this reads what
the socket has in one ``recv`` and parses the few shapes a subscriber receives
(``subscribe`` and ``unsubscribe`` confirmations, ``message``, an error), as
RESP2 arrays or RESP3 pushes.

The connection is made (and authenticated) by redis-py; once it is handed to a
:class:`PubSubReader`, only the reader reads its socket. Commands (``SUBSCRIBE``)
are still sent through the connection.
"""

from __future__ import annotations

import socket
from typing import Any

from redis.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError

__all__ = ["PubSubReader"]

#: What one ``recv`` takes at most.
READ_SIZE = 65536

_INCOMPLETE = object()


class PubSubReader:
    """The messages arriving on one connected pub/sub connection, parsed.

    Messages are lists as redis-py's parser gives them with ``decode_responses``:
    ``["message", channel, payload]``, ``["subscribe", channel, count]``. An error
    reply is raised as :class:`~redis.exceptions.ResponseError` (a refused
    ``SUBSCRIBE``: the caller starts over, as after a dropped connection).
    """

    __slots__ = ("_buffer", "_encoding", "_sock")

    def __init__(self, conn: AbstractConnection) -> None:
        sock = conn._sock
        if sock is None:
            raise RedisConnectionError("not connected")
        self._sock: socket.socket = sock
        self._encoding: str = conn.encoder.encoding
        self._buffer: bytearray = bytearray()

    def read(self) -> list[Any]:
        """Read what the socket has (one ``recv``) and return the complete messages.

        Call it when the socket is readable: on a blocking socket it waits for data.
        An incomplete message stays buffered until the rest arrives.

        Raises:
            redis.exceptions.ConnectionError: the server closed the connection.
            OSError: the socket failed (or was closed under us).
        """
        data = self._sock.recv(READ_SIZE)
        if not data:
            raise RedisConnectionError("Connection closed by server.")
        self._buffer += data
        pending = getattr(self._sock, "pending", None)  # TLS: decrypted, not read yet
        while pending is not None and pending():
            self._buffer += self._sock.recv(READ_SIZE)
        return self._messages()

    def _messages(self) -> list[Any]:
        messages, pos = [], 0
        buffer = self._buffer
        while pos < len(buffer):
            value, end = self._parse(buffer, pos)
            if value is _INCOMPLETE:
                break
            if isinstance(value, ResponseError):
                del buffer[:end]
                raise value
            messages.append(value)
            pos = end
        del buffer[:pos]
        return messages

    def _parse(self, buffer: bytearray, pos: int) -> tuple[Any, int]:
        """The value starting at ``pos`` and where it ends; ``_INCOMPLETE`` if cut."""
        line_end = buffer.find(b"\r\n", pos)
        if line_end < 0:
            return _INCOMPLETE, pos
        kind, head, after = buffer[pos], bytes(buffer[pos + 1 : line_end]), line_end + 2
        if kind in b"*>":  # an array, or a RESP3 push
            items = []
            for _ in range(int(head)):
                item, after = self._parse(buffer, after)
                if item is _INCOMPLETE:
                    return _INCOMPLETE, pos
                items.append(item)
            return items, after
        if kind == ord("$"):
            size = int(head)
            if size < 0:
                return None, after
            if len(buffer) < after + size + 2:
                return _INCOMPLETE, pos
            return bytes(buffer[after : after + size]).decode(self._encoding), after + size + 2
        if kind == ord(":"):
            return int(head), after
        if kind == ord("+"):
            return head.decode(self._encoding), after
        if kind == ord("-"):
            return ResponseError(head.decode(self._encoding, "replace")), after
        if kind == ord("_"):
            return None, after
        raise InvalidResponse(f"unexpected reply type {chr(kind)!r} on a pub/sub connection")
