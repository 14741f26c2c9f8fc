"""What the front end sends a child in one turn of its event loop leaves in one write,
which the child reads as those messages, in order; nothing queued for a closed channel
reaches the child started after it."""

from __future__ import annotations

import asyncio

from infinity.shared import protocol
from infinity.shared.channel import ChannelToChild, ChannelToFront
from infinity.client.supervisor import Child


def _child(path: str) -> Child:
    return Child(protocol.WorkerArgs("inference-test", path, [], None, 1, "", 1, "info"), "unused")


def _open(child: Child) -> ChannelToFront:
    """Give `child` a fresh channel, as its start does, and connect the child's end."""
    child.channel = ChannelToChild(child.args.channel, lambda message: None)
    return ChannelToFront(child.args.channel)


def test_one_turns_messages_leave_in_one_write_and_are_read_in_order(tmp_path, monkeypatch):
    writes = []
    send = ChannelToChild.send
    monkeypatch.setattr(ChannelToChild, "send", lambda self, messages: (writes.append(len(messages)),
                                                                         send(self, messages)))
    child = _child(str(tmp_path / "child"))

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
    child = _child(str(tmp_path / "child"))

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
