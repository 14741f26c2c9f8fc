"""Tokenizer process: turns `Tokenize` messages into `Tokenized` (or `Failed`, with the kind
of error): texts into tokens, and media (images, audio, pages) into what the model's
media pass takes, by the preprocessor its kind names (workers/preprocess/media.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from infinity.shared import protocol
from infinity.shared.channel import ChannelClosed, ChannelToFront
from infinity.shared.kinds import KINDS
from workers.preprocess import InputError, reply
from workers.preprocess.media import media_module
from workers.preprocess.text import model_tokenizer
from workers.process import run_child

log = logging.getLogger(__name__)

Prepare = Callable[[protocol.Tokenize], protocol.Tokenized]


def main(args: protocol.WorkerArgs) -> None:
    run_child(args, serve)


def _preparers(args: protocol.WorkerArgs) -> tuple[dict[str, Prepare], dict[str, Prepare]]:
    """(how each model's texts are prepared, how its media are) by model name: a text
    model's tokenizer; for a kind that takes a medium, its preprocessor (`KindSpec.
    preprocessor`), which prepares its texts too where the kind says so."""
    texts, media = {}, {}
    for spec in args.models:
        kind, module = KINDS[spec.kind], media_module(spec.kind)
        preprocessor = module.Preprocessor(spec, args) if module is not None else None
        if preprocessor is not None:
            media[spec.name] = preprocessor.prepare
        texts[spec.name] = preprocessor.prepare if kind.text_by_processor else model_tokenizer(spec).tokenize
    return texts, media


def serve(args: protocol.WorkerArgs, channel: ChannelToFront) -> None:
    """Load every model's tokenizer and preprocessor, report `Ready` (or `StartupFailed`),
    then answer `Tokenize` messages until the front end closes the channel."""
    try:
        texts, media = _preparers(args)
    except Exception as exc:
        log.exception("cannot load tokenizers")
        channel.send(protocol.StartupFailed(args.name, f"{type(exc).__name__}: {exc}"))
        return
    channel.send(protocol.Ready(args.name, os.getpid()))
    try:
        while True:
            request = channel.receive()
            assert isinstance(request, protocol.Tokenize)
            prepare = (media if request.media is not None else texts).get(request.model, _no_media)
            channel.send(reply(prepare, request))
    except ChannelClosed:
        return  # the front end let go of this process: it is stopping, or replacing it


def _no_media(request: protocol.Tokenize) -> protocol.Tokenized:
    raise InputError(f"model '{request.model}' takes no media, only texts")
