"""Tokenizer process: turns `Tokenize` messages into `Tokenized` (or `Failed`, with the kind
of error): texts into tokens, and a two-tower model's media (images, audio) into its
tower's input (workers/preprocess/media.py)."""

from __future__ import annotations

import logging
import os

from infinity.shared import protocol
from infinity.shared.channel import ChannelClosed, ChannelToFront
from infinity.shared.media import PROCESSOR_TEXT_KINDS
from workers.preprocess.media import media_module
from workers.process import run_child
from workers.preprocess import reply
from workers.preprocess.text import model_tokenizer

log = logging.getLogger(__name__)


def main(args: protocol.WorkerArgs) -> None:
    run_child(args, serve)


def _media_preprocessors(args: protocol.WorkerArgs) -> dict:
    """The media preprocessor of each two-tower model."""
    modules = {spec.name: (spec, media_module(spec.kind)) for spec in args.models}
    return {name: module.Preprocessor(spec, args) for name, (spec, module) in modules.items() if module is not None}


def serve(args: protocol.WorkerArgs, channel: ChannelToFront) -> None:
    """Load every model's tokenizer, report `Ready` (or `StartupFailed`), then answer
    `Tokenize` messages until the front end closes the channel."""
    try:
        tokenizers = {spec.name: model_tokenizer(spec) for spec in args.models if spec.kind not in PROCESSOR_TEXT_KINDS}
        media = _media_preprocessors(args)
    except Exception as exc:
        log.exception("cannot load tokenizers")
        channel.send(protocol.StartupFailed(args.name, f"{type(exc).__name__}: {exc}"))
        return
    channel.send(protocol.Ready(args.name, os.getpid()))
    try:
        while True:
            request = channel.receive()
            assert isinstance(request, protocol.Tokenize)
            preprocessor = media.get(request.model)
            if preprocessor is not None and (request.media is not None or preprocessor.takes_text):
                prepare = preprocessor.prepare
            else:
                prepare = tokenizers[request.model].tokenize
            channel.send(reply(prepare, request))
    except ChannelClosed:
        return  # the front end let go of this process: it is stopping, or replacing it
