"""What the front end sends a child in one turn of its event loop leaves as one message,
which the child reads as those messages, in order; each start of a child gets endpoints of
its own, so nothing queued for, or sent to, a closed channel reaches the child started
after it."""

from __future__ import annotations

import asyncio

import pytest

from infinity.shared import protocol
from infinity.shared.channel import ChannelClosed, ChannelToChild, ChannelToFront
from infinity.client.supervisor import Child


def _child(folder: str) -> Child:
    return Child(protocol.WorkerArgs("inference-test", f"ipc://{folder}/inference-test", [], None, 1, "", 1, "info"),
                 "unused")


def _open(child: Child) -> ChannelToFront:
    """Give `child` a fresh channel, as its start does, and connect the child's end."""
    return ChannelToFront(child.open_channel(lambda message: None).channel)


def test_one_turns_messages_leave_in_one_message_and_are_read_in_order(tmp_path, monkeypatch):
    writes = []
    send = ChannelToChild.send
    monkeypatch.setattr(ChannelToChild, "send", lambda self, messages: (writes.append(len(messages)),
                                                                         send(self, messages)))
    child = _child(str(tmp_path))

    async def turn() -> list[protocol.Message]:
        end = _open(child)
        child.send(protocol.Cancel(1))
        child.send(protocol.Cancel(2))
        assert writes == []  # queued until the turn ends
        received = [await asyncio.to_thread(end.receive) for _ in range(2)]
        child.close_channel()
        end.close()
        return received

    assert asyncio.run(turn()) == [protocol.Cancel(1), protocol.Cancel(2)]
    assert writes == [2]


def test_messages_queued_for_a_closed_channel_are_dropped(tmp_path):
    child = _child(str(tmp_path))

    async def send_then_restart() -> protocol.Message:
        first = _open(child)
        child.send(protocol.Cancel(1))
        child.close_channel()  # the child died before the turn ended
        second = _open(child)  # its restart's fresh channel
        await asyncio.sleep(0)
        child.send(protocol.Cancel(2))
        received = await asyncio.to_thread(second.receive)
        child.close_channel()
        for end in (first, second):
            end.close()
        return received

    assert asyncio.run(send_then_restart()) == protocol.Cancel(2)


def test_a_restarted_child_has_endpoints_of_its_own_and_never_hears_what_was_sent_to_its_predecessor(tmp_path):
    child = _child(str(tmp_path))

    async def restart() -> tuple[list[protocol.Message], protocol.Message]:
        first_args = child.open_channel(lambda message: None)
        first = ChannelToFront(first_args.channel)
        child.channel.send([protocol.Cancel(0)])
        assert await asyncio.to_thread(first.receive) == protocol.Cancel(0)  # connected
        child.channel.send([protocol.Cancel(1)])  # sent to the first child, which is slow to read it
        child.close_channel()  # it died
        second_args = child.open_channel(lambda message: None)
        assert second_args.channel != first_args.channel
        assert second_args.name == first_args.name and second_args.models == first_args.models
        with pytest.raises((FileNotFoundError, ConnectionRefusedError)):
            ChannelToFront(first_args.channel)  # nothing can connect to the old endpoints
        second = ChannelToFront(second_args.channel)
        child.send(protocol.Cancel(2))
        to_second = await asyncio.to_thread(second.receive)
        to_first = []
        with pytest.raises(ChannelClosed):
            while True:
                to_first.append(await asyncio.wait_for(asyncio.to_thread(first.receive), 5))
        child.close_channel()
        for end in (first, second):
            end.close()
        return to_first, to_second

    to_first, to_second = asyncio.run(restart())
    assert to_first in ([], [protocol.Cancel(1)])  # the old child's, or no one's
    assert to_second == protocol.Cancel(2)
    assert not any(tmp_path.iterdir())
