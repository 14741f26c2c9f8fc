"""Tokenizer process: turns `Tokenize` messages into `Tokenized` (or `Failed`, with the kind of error)."""

from __future__ import annotations

import logging
import os

import zmq

from infinity.shared import protocol
from workers.process import LAST_MESSAGE_LINGER_MS, start_child
from workers.tokenization import model_tokenizer, reply

log = logging.getLogger(__name__)


def main(args: protocol.WorkerArgs) -> None:
    context, inbox, to_front = start_child(args)
    try:
        serve(args, inbox, to_front)
    finally:
        context.destroy(linger=LAST_MESSAGE_LINGER_MS)


def serve(args: protocol.WorkerArgs, inbox: zmq.Socket, to_front: zmq.Socket) -> None:
    """Load every model's tokenizer, report `Ready` (or `StartupFailed`), then answer
    `Tokenize` messages until the process ends."""
    try:
        tokenizers = {spec.name: model_tokenizer(spec) for spec in args.models}
    except Exception as exc:
        log.exception("cannot load tokenizers")
        to_front.send(protocol.encode(protocol.StartupFailed(args.name, f"{type(exc).__name__}: {exc}")))
        return
    to_front.send(protocol.encode(protocol.Ready(args.name, os.getpid())))
    while True:
        request = protocol.decode(inbox.recv())
        assert isinstance(request, protocol.Tokenize)
        to_front.send(protocol.encode(reply(tokenizers[request.model], request)))
