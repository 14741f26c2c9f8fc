"""The channel between the front end and one child process: two ZeroMQ sockets over
`ipc://` endpoints, one each way, carrying protocol messages.

The front end binds a PUSH socket at `<base>.in`, which the child's PULL connects to, and
a PULL socket at `<base>.out`, which the child's PUSH connects to. One socket per way
because a ZeroMQ socket is used by one thread at a time, and a child receives in one
thread while its lanes send from others. What one side sends together (the front end's
messages of one event-loop turn, a lane's batch report and its answers) leaves as one
ZeroMQ message, one frame holding them all (`protocol.encode`): one wake-up of the other
side, and ZeroMQ's costs paid once, where a frame per message pays them per message.

Each child start gets endpoints of its own (the supervisor numbers `base` per start), so
nothing meant for a predecessor reaches the new process; each endpoint's file is removed
as soon as the child is known to be connected to it, so no second process can connect,
and at the latest when the channel closes. ZeroMQ tells a PULL socket nothing of a peer
that went away, so each end says goodbye with an empty frame: the front end's closes the
channel (the child's `receive` raises `ChannelClosed` on it); a child's asks the front end
to close it once it has read what came before, so that a child process which ends is
heard out before its exit is seen. Sockets never block on a full queue (no high-water
mark: admission control lives in the front end), and a child's sending socket does not
reconnect, so a send after its connection dropped fails at once.

`ChannelToChild` is the front end's end, driven by its event loop through the sockets'
file descriptors; `ChannelToFront` is the child's, with blocking calls (one thread
receives; any thread may send). One ZeroMQ context, with one I/O thread, serves every
channel of a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
from collections import deque
from collections.abc import Callable

import zmq

from infinity.shared import protocol

# How long a closed socket may take to send what it still holds (ZeroMQ drops it after),
# and how long a child's end that closes waits for the front end's goodbye.
LAST_MESSAGE_LINGER_MS = 2000
# The frame that closes a channel: messages never encode to nothing.
_GOODBYE = b""
_IPC = "ipc://"


class ChannelClosed(ConnectionError):
    """The other end closed the channel (its process stopped, or the front end let go)."""


def _context() -> zmq.Context:
    """This process's ZeroMQ context, made on first use."""
    return zmq.Context.instance()


def _socket(kind: int) -> zmq.Socket:
    socket = _context().socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    return socket


def _endpoints(base: str) -> tuple[str, str]:
    """(to the child, to the front end)."""
    return f"{base}.in", f"{base}.out"


def _unlink(endpoint: str) -> None:
    """Remove an ipc endpoint's socket file (ZeroMQ leaves it), whoever removed it first."""
    if endpoint.startswith(_IPC):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(endpoint[len(_IPC):])


class ChannelToChild:
    """The front end's end of one child's channel, on the running event loop: binds the
    endpoints of `endpoint_base`, holds what is sent until the child connects, and hands
    each message the child sends to `on_message`. The child's death is noticed by its
    process sentinel, not here: a child that is gone only stops being heard."""

    def __init__(self, endpoint_base: str, on_message: Callable[[protocol.Message], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_message = on_message
        self._to_child, self._to_front = _endpoints(endpoint_base)
        self._unsent: deque[bytes] = deque()  # what waits for the child to connect
        self._push: zmq.Socket | None = _socket(zmq.PUSH)
        self._pull: zmq.Socket | None = _socket(zmq.PULL)
        self._push.bind(self._to_child)
        self._pull.bind(self._to_front)
        self._push_fd = self._push.getsockopt(zmq.FD)
        self._pull_fd = self._pull.getsockopt(zmq.FD)
        self._child_reads = False  # connected to `_to_child`
        self._child_writes = False  # connected to `_to_front`
        # A ZeroMQ socket's descriptor turns readable when the socket's state may have
        # changed, and only then (edge-triggered): the PULL's is drained each time; the
        # PUSH's is watched until the child connects, and again when a send finds no child.
        self._loop.add_reader(self._pull_fd, self._read)
        self._loop.add_reader(self._push_fd, self._writable)

    def send(self, messages: list[protocol.Message]) -> None:
        """Send `messages` as one ZeroMQ message; held while the child is not connected."""
        if self._push is None:
            return
        data = protocol.encode(messages)
        if not self._unsent:
            try:
                self._push.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:  # no child connected (yet, or any more: its sentinel tells)
                self._loop.add_reader(self._push_fd, self._writable)
        self._unsent.append(data)

    def close(self) -> None:
        """Tell the child the channel is closed, stop reading, remove the endpoints' files;
        drop what was not sent."""
        self._unsent.clear()
        if self._push is None or self._pull is None:
            return
        self._loop.remove_reader(self._push_fd)
        self._loop.remove_reader(self._pull_fd)
        with contextlib.suppress(zmq.Again):  # no child connected: none to tell
            self._push.send(_GOODBYE, zmq.NOBLOCK)
        self._push.close(linger=LAST_MESSAGE_LINGER_MS)
        self._pull.close(linger=0)
        self._push = self._pull = None
        _unlink(self._to_child)
        _unlink(self._to_front)

    def _writable(self) -> None:
        """The PUSH socket's state may have changed: once the child is connected, remove
        the endpoint's file and send what waited."""
        push = self._push
        if push is None:
            return
        while push.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
            if not self._child_reads:
                self._child_reads = True
                _unlink(self._to_child)  # one child per channel
            if not self._unsent:
                self._loop.remove_reader(self._push_fd)
                return
            try:
                push.send(self._unsent[0], zmq.NOBLOCK)
            except zmq.Again:
                continue
            self._unsent.popleft()

    def _read(self) -> None:
        """Hand every message waiting on the PULL socket to `on_message`, in order."""
        pull = self._pull
        while pull is not None:
            try:
                frame = pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:  # woken by a change of state, not a message
                return
            if not self._child_writes:
                self._child_writes = True
                _unlink(self._to_front)  # one child per channel
            if not len(frame):  # the child closes its end, and waits for the goodbye
                self.close()
                return
            for message in protocol.decode(frame.buffer):
                self._on_message(message)
            # Asking the socket whether more waits costs less than the error of a receive
            # that finds none, and usually a wake-up brings one message.
            if pull is not self._pull or not pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return  # closed by `on_message`, or drained


class ChannelToFront:
    """A child's end of its channel: connects to the endpoints of `endpoint_base` (which
    the front end binds before it starts the child). `receive` blocks for the next message
    and is called from one thread; `send` may be called from any."""

    def __init__(self, endpoint_base: str) -> None:
        to_child, to_front = _endpoints(endpoint_base)
        for endpoint in (to_child, to_front):
            # ZeroMQ connects in the background and would wait forever for a channel that
            # is closed, or taken by another child: fail now, as a socket's connect does.
            if endpoint.startswith(_IPC) and not os.path.exists(endpoint[len(_IPC):]):
                raise FileNotFoundError(errno.ENOENT, "no channel is open at this endpoint", endpoint)
        self._push: zmq.Socket | None = _socket(zmq.PUSH)
        self._pull: zmq.Socket | None = _socket(zmq.PULL)
        # A dropped connection to the front end stays dropped, and its queue goes with it:
        # a send fails rather than waiting for a front end that is gone. Not so for the
        # receiving socket, which would then drop what it had not read yet, the goodbye
        # among it.
        self._push.setsockopt(zmq.RECONNECT_IVL, -1)
        self._push.connect(to_front)
        self._pull.connect(to_child)
        self._received: deque[protocol.Message] = deque()
        self._receiving = threading.Lock()  # held while a thread uses the PULL socket
        self._sending = threading.Lock()
        self._closed = False  # this end closed, or the front end did
        self._goodbye = threading.Event()  # the front end closed the channel

    def receive(self) -> protocol.Message:
        """The next message; `ChannelClosed` once the front end has closed the channel (or
        this end has)."""
        with self._receiving:
            while not self._received:
                if self._pull is None:
                    raise ChannelClosed("the channel is closed")
                frame = self._pull.recv(copy=False)
                if not len(frame):
                    self._said_goodbye()
                    raise ChannelClosed("the front end closed the channel")
                self._received.extend(protocol.decode(frame.buffer))
            return self._received.popleft()

    def pending(self) -> bool:
        """Whether a message waits to be received (from the receiving thread, between its
        calls of `receive`)."""
        return bool(self._received) or (self._pull is not None and bool(self._pull.poll(0)))

    def send(self, *messages: protocol.Message) -> None:
        """Send `messages` together, as one ZeroMQ message; `ChannelClosed` if the front
        end is gone or closed the channel."""
        data = protocol.encode(messages)
        with self._sending:
            if self._closed or self._push is None:
                raise ChannelClosed("the channel is closed")
            try:
                self._push.send(data, zmq.NOBLOCK)
            except zmq.Again as exc:  # the connection dropped, and its queue with it
                self._closed = True
                raise ChannelClosed("the front end is gone") from exc

    def close(self) -> None:
        """Close this end once the front end has read all that was sent on it: tell it, and
        wait for its goodbye (at most `LAST_MESSAGE_LINGER_MS`). A child process that
        ends after this is heard (its `StartupFailed`, say) before its exit is seen; with
        ZeroMQ's I/O thread between the two, its messages would otherwise often come
        after the exit, and be lost."""
        with self._sending:
            if self._push is None:
                return
            told = False
            if not self._closed:
                with contextlib.suppress(zmq.Again):  # the front end is gone
                    self._push.send(_GOODBYE, zmq.NOBLOCK)
                    told = True
            self._closed = True
            self._push.close(linger=LAST_MESSAGE_LINGER_MS)
            self._push = None
        if self._receiving.acquire(blocking=False):
            try:
                if told:
                    self._await_goodbye()
                self._close_pull()
            finally:
                self._receiving.release()
        elif told:  # a thread waits in `receive`: the goodbye wakes it, and it closes the socket
            self._goodbye.wait(LAST_MESSAGE_LINGER_MS / 1000)

    def _await_goodbye(self) -> None:
        """Read, and drop, what comes until the front end's goodbye, or the time is up."""
        assert self._pull is not None
        while self._pull.poll(LAST_MESSAGE_LINGER_MS):
            if not len(self._pull.recv(copy=False)):
                self._said_goodbye()
                return

    def _said_goodbye(self) -> None:
        self._closed = True
        self._goodbye.set()
        self._close_pull()

    def _close_pull(self) -> None:
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None
