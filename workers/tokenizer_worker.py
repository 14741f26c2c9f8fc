"""Tokenizer process: turns `Tokenize` messages into `Tokenized` (or `Failed`, with the kind
of error): texts into tokens, and a two-tower model's media (images, audio) into its
tower's input (workers/media_towers.py)."""

from __future__ import annotations

import logging
import os

import zmq

from infinity.shared import protocol
from infinity.shared.media import PROCESSOR_TEXT_KINDS
from workers.media_towers import media_module
from workers.process import LAST_MESSAGE_LINGER_MS, start_child
from workers.tokenization import model_tokenizer, reply

log = logging.getLogger(__name__)


def main(args: protocol.WorkerArgs) -> None:
    context, inbox, to_front = start_child(args)
    try:
        serve(args, inbox, to_front)
    finally:
        context.destroy(linger=LAST_MESSAGE_LINGER_MS)


def _media_preprocessors(args: protocol.WorkerArgs) -> dict:
    """The media preprocessor of each two-tower model."""
    modules = {spec.name: (spec, media_module(spec.kind)) for spec in args.models}
    return {name: module.Preprocessor(spec, args) for name, (spec, module) in modules.items() if module is not None}


def serve(args: protocol.WorkerArgs, inbox: zmq.Socket, to_front: zmq.Socket) -> None:
    """Load every model's tokenizer, report `Ready` (or `StartupFailed`), then answer
    `Tokenize` messages until the process ends."""
    try:
        tokenizers = {spec.name: model_tokenizer(spec) for spec in args.models if spec.kind not in PROCESSOR_TEXT_KINDS}
        media = _media_preprocessors(args)
    except Exception as exc:
        log.exception("cannot load tokenizers")
        to_front.send(protocol.encode(protocol.StartupFailed(args.name, f"{type(exc).__name__}: {exc}")))
        return
    to_front.send(protocol.encode(protocol.Ready(args.name, os.getpid())))
    while True:
        request = protocol.decode(inbox.recv())
        assert isinstance(request, protocol.Tokenize)
        preprocessor = media.get(request.model)
        if preprocessor is not None and (request.media is not None or preprocessor.takes_text):
            prepare = preprocessor.prepare
        else:
            prepare = tokenizers[request.model].tokenize
        to_front.send(protocol.encode(reply(prepare, request)))
