"""What the front end sends a child in one turn of its event loop leaves as one message,
which the child reads as those messages, in order; each start of a child gets endpoints of
its own, so nothing queued for, or sent to, a closed channel reaches the child started
after it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import uvloop

from infinity.shared import protocol
from infinity.shared.channel import ChannelClosed, ChannelToChild, ChannelToFront
from infinity.client.supervisor import Child


def _child(folder: str) -> Child:
    return Child(protocol.WorkerArgs("inference-test", f"ipc://{folder}/inference-test", [], None, 1, "", 1, "info"),
                 "unused")


def _open(child: Child) -> ChannelToFront:
    """Give `child` a fresh channel, as its start does, and connect the child's end."""
    return ChannelToFront(child.open_channel(lambda message: None).channel)


def _recorded_writes(monkeypatch) -> list[list[protocol.Message]]:  # noqa: ANN001 (pytest's fixture)
    """Each channel send from now on, as the messages it carried."""
    writes: list[list[protocol.Message]] = []
    send = ChannelToChild.send
    monkeypatch.setattr(ChannelToChild, "send", lambda self, messages: (writes.append(list(messages)),
                                                                         send(self, messages)))
    return writes


def test_one_turns_messages_leave_in_one_message_and_are_read_in_order(tmp_path, monkeypatch):
    writes = _recorded_writes(monkeypatch)
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
    assert [len(messages) for messages in writes] == [2]


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


# The server's loop (uvloop) and asyncio's own: their timer handles differ.
LOOPS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])


@contextlib.asynccontextmanager
async def _connected(child: Child) -> AsyncIterator[ChannelToFront]:
    """`child`'s fresh channel and the child's end of it, both closed on leaving."""
    end = _open(child)
    try:
        yield end
    finally:
        child.close_channel()
        end.close()


@LOOPS
def test_a_held_message_waits_its_hold_for_the_next_ones_and_leaves_with_them(tmp_path, monkeypatch, run):
    writes = _recorded_writes(monkeypatch)
    child = _child(str(tmp_path))

    async def held() -> None:
        async with _connected(child) as end:
            child.send(protocol.Cancel(1), hold_s=0.2)
            await asyncio.sleep(0.01)
            assert writes == []  # a turn has ended: still held
            child.send(protocol.Cancel(2), hold_s=0.2)  # joins it, and does not push its send back
            await asyncio.sleep(0.3)
            assert writes == [[protocol.Cancel(1), protocol.Cancel(2)]]
            child.send(protocol.Cancel(3), hold_s=0.05)  # alone: leaves when its own hold is up
            await asyncio.sleep(0.2)
            assert writes[1:] == [[protocol.Cancel(3)]]
            assert [await asyncio.to_thread(end.receive) for _ in range(3)] == [protocol.Cancel(i) for i in (1, 2, 3)]

    run(held())


@LOOPS
def test_a_message_sent_without_a_hold_takes_the_held_ones_along_at_the_end_of_its_turn(tmp_path, monkeypatch, run):
    writes = _recorded_writes(monkeypatch)
    child = _child(str(tmp_path))

    async def urgent() -> None:
        async with _connected(child):
            child.send(protocol.Cancel(1), hold_s=10.0)
            child.send(protocol.Cancel(2))
            await asyncio.sleep(0)
            assert writes == [[protocol.Cancel(1), protocol.Cancel(2)]]
            await asyncio.sleep(0.05)
            assert len(writes) == 1  # the hold's timer went with its send

    run(urgent())


@LOOPS
def test_closing_the_channel_drops_what_was_held(tmp_path, monkeypatch, run):
    writes = _recorded_writes(monkeypatch)
    child = _child(str(tmp_path))

    async def closed() -> None:
        async with _connected(child):
            child.send(protocol.Cancel(1), hold_s=0.02)
            child.close_channel()
            await asyncio.sleep(0.05)

    run(closed())
    assert writes == []
