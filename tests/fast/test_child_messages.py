"""What the front end sends a child in one turn of its event loop leaves as one ZeroMQ
message of several frames, which the child reads one message per frame, in order;
nothing queued for a closed socket reaches the child started after it."""

from __future__ import annotations

import asyncio

import zmq

from infinity.shared import protocol
from infinity.supervisor import Child


def _child_and_inbox(context: zmq.Context, endpoint: str) -> tuple[Child, zmq.Socket]:
    inbox = context.socket(zmq.PULL)
    inbox.bind(endpoint)
    child = Child(protocol.WorkerArgs("inference-test", "", endpoint, [], None, 1, "", 1, "info"), "unused")
    child.socket = context.socket(zmq.PUSH)
    child.socket.connect(endpoint)
    return child, inbox


def test_one_turns_messages_leave_together_and_are_read_one_by_one():
    context = zmq.Context()
    child, inbox = _child_and_inbox(context, "inproc://one-turn")

    async def turn() -> bool:
        child.send(protocol.Cancel(1))
        child.send(protocol.Cancel(2))
        sent_at_once = inbox.poll(0) != 0
        await asyncio.sleep(0)
        return sent_at_once

    try:
        assert not asyncio.run(turn())  # queued until the turn ends
        assert inbox.poll(1000)
        first = protocol.decode(inbox.recv())
        assert inbox.getsockopt(zmq.RCVMORE)  # one message of two frames
        assert [first, protocol.decode(inbox.recv())] == [protocol.Cancel(1), protocol.Cancel(2)]
        child.send(protocol.Cancel(3))  # no loop running: at once
        assert protocol.decode(inbox.recv()) == protocol.Cancel(3)
    finally:
        child.close_socket()
        context.destroy(linger=0)


def test_messages_queued_for_a_closed_socket_are_dropped():
    context = zmq.Context()
    child, inbox = _child_and_inbox(context, "inproc://closed")

    async def send_then_close() -> None:
        child.send(protocol.Cancel(1))
        child.close_socket()
        child.socket = context.socket(zmq.PUSH)  # as a restart's fresh socket
        child.socket.connect("inproc://closed")
        await asyncio.sleep(0)
        child.send(protocol.Cancel(2))
        await asyncio.sleep(0)

    try:
        asyncio.run(send_then_close())
        assert inbox.poll(1000)
        assert protocol.decode(inbox.recv()) == protocol.Cancel(2)
        assert not inbox.poll(50)
    finally:
        child.close_socket()
        context.destroy(linger=0)
