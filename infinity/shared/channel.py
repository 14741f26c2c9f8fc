"""The channel between the front end and one child process: a Unix stream socket that the
front end listens on and the child connects to, carrying protocol messages both ways,
each framed by its length.

A message costs its sender one write, and the kernel wakes the receiving thread itself;
the ZeroMQ sockets this replaced also woke an I/O thread on each side for every message
(bench/results/serving-path.md#a-unix-socket-per-child). One connection per child
start: a restarted child gets a fresh channel, so nothing meant for its predecessor
reaches it.

`ChannelToChild` is the front end's end, driven by its event loop; `ChannelToFront` is
the child's, with blocking calls (one thread receives; any thread may send).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable

from infinity.shared import protocol

_LENGTH = struct.Struct("<I")
_READ_SIZE = 1 << 18


class ChannelClosed(ConnectionError):
    """The other end closed the channel (its process stopped, or the front end let go)."""


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _framed(messages: tuple[protocol.Message, ...] | list[protocol.Message]) -> bytes:
    parts = []
    for message in messages:
        data = protocol.encode(message)
        parts += (_LENGTH.pack(len(data)), data)
    return b"".join(parts)


class _Frames:
    """Cuts a byte stream into messages; keeps a message that is still arriving."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._wanted = _LENGTH.size  # buffered bytes that let the next message be read

    def feed(self, data: bytes) -> list[protocol.Message]:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered < self._wanted:
            return []  # a large message arrives in many reads: joined once, when whole
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        view = memoryview(data)
        messages, offset, end = [], 0, len(data)
        self._wanted = _LENGTH.size
        while end - offset >= _LENGTH.size:
            size = _LENGTH.unpack_from(view, offset)[0]
            if end - offset - _LENGTH.size < size:
                self._wanted = _LENGTH.size + size
                break
            offset += _LENGTH.size
            messages.append(protocol.decode(view[offset:offset + size]))
            offset += size
        self._chunks = [data[offset:]] if offset < end else []
        self._buffered = end - offset
        return messages


class ChannelToChild:
    """The front end's end of one child's channel, on the running event loop: listens at
    `path` until the child connects, holds what is sent until then, and hands each
    message the child sends to `on_message`. The child's death is noticed by its
    process sentinel, not here: a closed connection only stops reading."""

    def __init__(self, path: str, on_message: Callable[[protocol.Message], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._path = path
        self._on_message = on_message
        self._frames = _Frames()
        self._unsent = bytearray()  # waits for the child to connect, or for room in the socket
        self._connection: socket.socket | None = None
        _unlink(path)  # a previous start's
        self._listener: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(1)
        self._listener.setblocking(False)
        self._loop.add_reader(self._listener, self._accept)

    def send(self, messages: list[protocol.Message]) -> None:
        """Send `messages` with one write (what the socket cannot take now follows when it can)."""
        data = _framed(messages)
        if self._unsent or self._connection is None:
            self._unsent += data
            return
        try:
            written = self._connection.send(data)
        except BlockingIOError:
            written = 0
        except OSError:  # the child is gone; its sentinel reports it
            return
        if written < len(data):
            self._unsent += data[written:]
            self._loop.add_writer(self._connection, self._write_unsent)

    def close(self) -> None:
        """Stop listening and reading; drop what was not sent."""
        self._unsent.clear()
        if self._listener is not None:
            self._loop.remove_reader(self._listener)
            self._listener.close()
            self._listener = None
            _unlink(self._path)
        self._drop_connection()

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            connection, _ = self._listener.accept()
        except BlockingIOError:
            return
        # One child per channel: no one else may connect.
        self._loop.remove_reader(self._listener)
        self._listener.close()
        self._listener = None
        _unlink(self._path)
        connection.setblocking(False)
        self._connection = connection
        self._loop.add_reader(connection, self._read)
        if self._unsent:
            self._write_unsent()

    def _read(self) -> None:
        assert self._connection is not None
        try:
            data = self._connection.recv(_READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop_connection()
            return
        for message in self._frames.feed(data):
            self._on_message(message)

    def _write_unsent(self) -> None:
        assert self._connection is not None
        try:
            written = self._connection.send(self._unsent)
        except BlockingIOError:
            written = 0
        except OSError:
            self._unsent.clear()
            written = 0
        del self._unsent[:written]
        if self._unsent:
            self._loop.add_writer(self._connection, self._write_unsent)
        else:
            self._loop.remove_writer(self._connection)

    def _drop_connection(self) -> None:
        if self._connection is not None:
            self._loop.remove_reader(self._connection)
            self._loop.remove_writer(self._connection)
            self._connection.close()
            self._connection = None


class ChannelToFront:
    """A child's end of its channel: connects to `path` (where the front end listens
    before it starts the child). `receive` blocks for the next message and is called from
    one thread; `send` may be called from any."""

    def __init__(self, path: str) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.connect(path)
        self._frames = _Frames()
        self._received: deque[protocol.Message] = deque()
        self._sending = threading.Lock()

    def receive(self) -> protocol.Message:
        """The next message; `ChannelClosed` once the front end has closed the channel."""
        while not self._received:
            try:
                data = self._socket.recv(_READ_SIZE)
            except OSError as exc:
                raise ChannelClosed(str(exc)) from exc
            if not data:
                raise ChannelClosed("the front end closed the channel")
            self._received.extend(self._frames.feed(data))
        return self._received.popleft()

    def send(self, *messages: protocol.Message) -> None:
        """Send `messages` together, in order; `ChannelClosed` if the front end is gone."""
        data = _framed(messages)
        with self._sending:
            try:
                self._socket.sendall(data)
            except OSError as exc:
                raise ChannelClosed(str(exc)) from exc

    def close(self) -> None:
        """Close this end; what was sent is still delivered."""
        self._socket.close()
