"""The channel between the front end and a child: messages both ways, in order, whole; what
is sent together leaves as one ZeroMQ message; sent before the child connects, delivered
once it does; one child per channel, and no endpoint file left; either end learns when the
other lets go; a child that closes its end is heard out before it ends."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
from pathlib import Path

import pytest
import zmq

from infinity.shared import protocol
from infinity.shared.channel import ChannelClosed, ChannelToChild, ChannelToFront
from workers.process import run_child

# Far more than one read of a socket takes, so a message arrives in many pieces.
LARGE = protocol.Infer(7, "m", [0], protocol.TokenInputs(os.urandom(3_000_000), [750_000]))


def _base(folder: Path) -> str:
    return f"ipc://{folder}/child.1"


async def _until(condition, tries: int = 500) -> None:
    for _ in range(tries):
        if condition():
            return
        await asyncio.sleep(0.01)


async def _connected(folder: Path) -> None:
    """Until the front end has seen the child connect to its end (and removed its file)."""
    await _until(lambda: not (folder / "child.1.in").exists())


def test_messages_both_ways_in_order_large_ones_too(tmp_path):
    base = _base(tmp_path)

    async def exchange() -> tuple[list[protocol.Message], list[protocol.Message]]:
        from_child: list[protocol.Message] = []
        front = ChannelToChild(base, from_child.append)
        front.send([protocol.Cancel(1)])  # before the child connects: held until it does
        end = ChannelToFront(base)
        front.send([LARGE, protocol.Cancel(2)])
        to_child = [await asyncio.to_thread(end.receive) for _ in range(3)]
        await asyncio.to_thread(end.send, protocol.Done(1), LARGE)
        await asyncio.to_thread(end.send, protocol.Done(2))
        await _until(lambda: len(from_child) == 3)
        front.close()
        end.close()
        return to_child, from_child

    to_child, from_child = asyncio.run(exchange())
    assert to_child == [protocol.Cancel(1), LARGE, protocol.Cancel(2)]
    assert from_child == [protocol.Done(1), LARGE, protocol.Done(2)]


def test_a_child_sees_whether_a_message_waits(tmp_path):
    """Behind a received message in the same frame, or in the socket, or none."""
    base = _base(tmp_path)

    async def check() -> list[bool]:
        front = ChannelToChild(base, lambda message: None)
        end = ChannelToFront(base)
        seen = [end.pending()]
        front.send([protocol.Cancel(1), protocol.Cancel(2)])
        await asyncio.to_thread(end.receive)
        seen.append(end.pending())  # the frame's second message
        await asyncio.to_thread(end.receive)
        seen.append(end.pending())
        front.send([protocol.Cancel(3)])
        await _until(end.pending)
        seen.append(end.pending())
        front.close()
        end.close()
        return seen

    assert asyncio.run(check()) == [False, True, False, True]


def test_what_is_sent_together_leaves_as_one_zeromq_message_both_ways(tmp_path):
    """Each end's peer here is a bare ZeroMQ socket, which sees the messages as they travel."""
    base = _base(tmp_path)
    context = zmq.Context.instance()

    async def front_end_sends() -> list[bytes]:
        front = ChannelToChild(base, lambda message: None)
        child = context.socket(zmq.PULL)
        child.connect(f"{base}.in")
        front.send([protocol.Cancel(1), LARGE, protocol.Cancel(3)])
        front.send([protocol.Cancel(4)])
        received = [await asyncio.to_thread(child.recv) for _ in range(2)]
        front.close()
        child.close(linger=0)
        return received

    first, second = asyncio.run(front_end_sends())
    assert protocol.decode(first) == [protocol.Cancel(1), LARGE, protocol.Cancel(3)]
    assert protocol.decode(second) == [protocol.Cancel(4)]

    to_child, to_front = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    to_child.bind(f"{base}.in")
    to_front.bind(f"{base}.out")
    end = ChannelToFront(base)
    end.send(protocol.Done(1), LARGE, protocol.Done(2))
    end.send(protocol.Done(3))
    assert protocol.decode(to_front.recv()) == [protocol.Done(1), LARGE, protocol.Done(2)]
    assert protocol.decode(to_front.recv()) == [protocol.Done(3)]
    to_child.send(b"")  # the front end's goodbye, which the closing end waits for
    end.close()
    assert to_front.recv() == b""  # the child's: it is closing
    for socket in (to_child, to_front):
        socket.close(linger=0)


def test_one_child_per_channel_and_no_endpoint_file_left(tmp_path):
    base = _base(tmp_path)

    async def connect_twice() -> list[protocol.Message]:
        received: list[protocol.Message] = []
        front = ChannelToChild(base, received.append)
        end = ChannelToFront(base)
        end.send(protocol.Done(1))  # a child's first message (`Ready`)
        await _until(lambda: received and not any(tmp_path.iterdir()))  # the front end saw it connect
        assert not any(tmp_path.iterdir())
        with pytest.raises((FileNotFoundError, ConnectionRefusedError)):
            ChannelToFront(base)
        front.send([protocol.Cancel(2)])  # still reaches the one child
        received.append(await asyncio.to_thread(end.receive))
        front.close()
        end.close()
        return received

    assert asyncio.run(connect_twice()) == [protocol.Done(1), protocol.Cancel(2)]
    assert not any(tmp_path.iterdir())


def test_a_channel_closed_before_its_child_connected_leaves_no_file_and_takes_no_child(tmp_path):
    base = _base(tmp_path)

    async def close_unused() -> None:
        front = ChannelToChild(base, lambda message: None)
        front.send([protocol.Cancel(1)])
        front.close()

    asyncio.run(close_unused())
    assert not any(tmp_path.iterdir())
    with pytest.raises((FileNotFoundError, ConnectionRefusedError)):
        ChannelToFront(base)


def test_a_child_learns_that_the_front_end_closed_its_channel(tmp_path):
    base = _base(tmp_path)

    async def close_under_the_child() -> None:
        front = ChannelToChild(base, lambda message: None)
        end = ChannelToFront(base)
        await _connected(tmp_path)
        front.close()
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(asyncio.to_thread(end.receive), 5)
        with pytest.raises(ChannelClosed):
            for _ in range(100):
                end.send(protocol.Done(1))
        end.close()

    asyncio.run(close_under_the_child())


def test_a_child_cannot_use_its_end_once_it_closed_it(tmp_path):
    base = _base(tmp_path)

    async def close_then_use() -> None:
        front = ChannelToChild(base, lambda message: None)
        end = ChannelToFront(base)
        await _connected(tmp_path)
        await asyncio.to_thread(end.close)  # the front end, on this loop, answers its goodbye
        with pytest.raises(ChannelClosed):
            end.receive()
        with pytest.raises(ChannelClosed):
            end.send(protocol.Done(1))
        front.close()

    asyncio.run(close_then_use())


def test_the_front_end_stops_reading_a_child_that_went_away(tmp_path):
    base = _base(tmp_path)
    received: list[protocol.Message] = []

    async def child_goes_away() -> None:
        front = ChannelToChild(base, received.append)
        end = ChannelToFront(base)
        end.send(protocol.Done(1))
        await asyncio.to_thread(end.close)
        await asyncio.sleep(0.1)
        front.send([protocol.Cancel(2)])  # to a child that is gone: dropped, no error
        front.close()

    asyncio.run(child_goes_away())
    assert received == [protocol.Done(1)]


def test_a_childs_threads_end_quietly_once_the_front_end_closes_its_channel(tmp_path):
    from workers.inference.scheduler import Scheduler
    from workers.inference.worker import _receive

    base = _base(tmp_path)

    async def close_then_receive() -> None:
        front = ChannelToChild(base, lambda message: None)
        end = ChannelToFront(base)
        await _connected(tmp_path)
        front.close()
        set_in = []  # the thread `set_threads` was called in, before it received
        await asyncio.wait_for(asyncio.to_thread(_receive, end, Scheduler(), {},
                                                 lambda: set_in.append(threading.current_thread())),
                               5)  # returns, raises nothing
        assert len(set_in) == 1 and set_in[0] is not threading.main_thread()
        end.close()

    asyncio.run(close_then_receive())


def _fail_to_start(args: protocol.WorkerArgs, channel: ChannelToFront) -> None:
    """A child's `serve` that reports a failed start, a large one, and returns."""
    channel.send(protocol.StartupFailed(args.name, "x" * 3_000_000))


def _child_that_fails_to_start(args: protocol.WorkerArgs) -> None:
    """A child process's main that ends the moment its `run_child` returns: nothing it
    sent may still be on the way then."""
    run_child(args, _fail_to_start)
    os._exit(0)


def test_a_child_that_closes_its_end_is_heard_out_before_it_ends(tmp_path):
    base = _base(tmp_path)
    args = protocol.WorkerArgs("inference-test", base, [], None, 1, "", 1, "info")
    received: list[protocol.Message] = []

    async def child_fails() -> int | None:
        front = ChannelToChild(base, received.append)
        process = multiprocessing.get_context("spawn").Process(target=_child_that_fails_to_start, args=(args,))
        process.start()
        await asyncio.to_thread(process.join, 60)
        heard = list(received)  # by the time its exit is seen
        front.close()
        assert heard == received
        return process.exitcode

    assert asyncio.run(child_fails()) == 0
    assert received == [protocol.StartupFailed("inference-test", "x" * 3_000_000)]
    assert not any(tmp_path.iterdir())
