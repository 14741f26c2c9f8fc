"""The channel between the front end and a child: messages both ways, in order, whole
however the stream cuts them; sent before the child connects, delivered once it does;
one child per channel; either end learns when the other lets go."""

from __future__ import annotations

import asyncio
import os

import pytest

from infinity.shared import protocol
from infinity.shared.channel import ChannelClosed, ChannelToChild, ChannelToFront, _Frames, _framed

# Far more than one read takes, so a message arrives in many pieces.
LARGE = protocol.Infer(7, "m", [0], protocol.TokenInputs(os.urandom(3_000_000), [750_000]))


def test_a_stream_cut_anywhere_gives_the_messages_whole_and_in_order():
    messages = [protocol.Cancel(1), protocol.Done(2), protocol.Cancel(3)]
    data = _framed(messages)
    for cut in range(1, len(data)):
        frames = _Frames()
        assert frames.feed(data[:cut]) + frames.feed(data[cut:]) == messages
    frames = _Frames()
    assert [message for byte in range(len(data)) for message in frames.feed(data[byte:byte + 1])] == messages


def test_messages_both_ways_in_order_large_ones_too(tmp_path):
    path = str(tmp_path / "child")

    async def exchange() -> tuple[list[protocol.Message], list[protocol.Message]]:
        from_child: list[protocol.Message] = []
        front = ChannelToChild(path, from_child.append)
        front.send([protocol.Cancel(1)])  # before the child connects: held until it does
        end = ChannelToFront(path)
        front.send([LARGE, protocol.Cancel(2)])
        to_child = [await asyncio.to_thread(end.receive) for _ in range(3)]
        await asyncio.to_thread(end.send, protocol.Done(1), LARGE)
        await asyncio.to_thread(end.send, protocol.Done(2))
        for _ in range(500):
            if len(from_child) == 3:
                break
            await asyncio.sleep(0.01)
        front.close()
        end.close()
        return to_child, from_child

    to_child, from_child = asyncio.run(exchange())
    assert to_child == [protocol.Cancel(1), LARGE, protocol.Cancel(2)]
    assert from_child == [protocol.Done(1), LARGE, protocol.Done(2)]


def test_one_child_per_channel_and_no_socket_file_left(tmp_path):
    path = str(tmp_path / "child")

    async def connect_twice() -> None:
        front = ChannelToChild(path, lambda message: None)
        end = ChannelToFront(path)
        for _ in range(100):  # the front end accepts on its next turns
            if not os.path.exists(path):
                break
            await asyncio.sleep(0.01)
        with pytest.raises((FileNotFoundError, ConnectionRefusedError)):
            ChannelToFront(path)
        front.close()
        end.close()

    asyncio.run(connect_twice())
    assert not os.path.exists(path)


def test_a_child_learns_that_the_front_end_closed_its_channel(tmp_path):
    path = str(tmp_path / "child")

    async def close_under_the_child() -> None:
        front = ChannelToChild(path, lambda message: None)
        end = ChannelToFront(path)
        await asyncio.sleep(0.05)
        front.close()
        with pytest.raises(ChannelClosed):
            await asyncio.to_thread(end.receive)
        with pytest.raises(ChannelClosed):
            for _ in range(100):  # the first writes may still find room in the socket
                end.send(protocol.Done(1))
        end.close()

    asyncio.run(close_under_the_child())


def test_the_front_end_stops_reading_a_child_that_went_away(tmp_path):
    path = str(tmp_path / "child")
    received: list[protocol.Message] = []

    async def child_goes_away() -> None:
        front = ChannelToChild(path, received.append)
        end = ChannelToFront(path)
        end.send(protocol.Done(1))
        end.close()
        await asyncio.sleep(0.1)
        front.send([protocol.Cancel(2)])  # to a child that is gone: dropped, no error
        front.close()

    asyncio.run(child_goes_away())
    assert received == [protocol.Done(1)]


def test_a_childs_threads_end_quietly_once_the_front_end_closes_its_channel(tmp_path):
    from workers.inference.scheduler import Scheduler
    from workers.inference.worker import _receive

    path = str(tmp_path / "child")

    async def close_then_receive() -> None:
        front = ChannelToChild(path, lambda message: None)
        end = ChannelToFront(path)
        await asyncio.sleep(0.05)
        front.close()
        await asyncio.wait_for(asyncio.to_thread(_receive, end, Scheduler()), 5)  # returns, raises nothing
        end.close()

    asyncio.run(close_then_receive())
