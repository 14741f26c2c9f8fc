"""Tokenizer process: turns `Tokenize` messages into `Tokenized` (or `Failed`, with the kind
of error): texts into tokens, and a two-tower model's images into pixels."""

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


def _image_preprocessors(args: protocol.WorkerArgs) -> dict:
    """The image preprocessor of each two-tower model. Pillow (the `images` extra) is
    imported only where such a model is served."""
    specs = [spec for spec in args.models if spec.kind == "image_text"]
    if not specs:
        return {}
    from workers.image_preprocessing import ImagePreprocessor
    from workers.images import ImageLimits

    limits = ImageLimits(args.max_image_bytes, args.max_image_pixels)
    return {spec.name: ImagePreprocessor(spec, limits) for spec in specs}


def serve(args: protocol.WorkerArgs, inbox: zmq.Socket, to_front: zmq.Socket) -> None:
    """Load every model's tokenizer, report `Ready` (or `StartupFailed`), then answer
    `Tokenize` messages until the process ends."""
    try:
        tokenizers = {spec.name: model_tokenizer(spec) for spec in args.models}
        images = _image_preprocessors(args)
    except Exception as exc:
        log.exception("cannot load tokenizers")
        to_front.send(protocol.encode(protocol.StartupFailed(args.name, f"{type(exc).__name__}: {exc}")))
        return
    to_front.send(protocol.encode(protocol.Ready(args.name, os.getpid())))
    while True:
        request = protocol.decode(inbox.recv())
        assert isinstance(request, protocol.Tokenize)
        preprocessor = images.get(request.model) if request.images is not None else None
        prepare = preprocessor.prepare if preprocessor is not None else tokenizers[request.model].tokenize
        to_front.send(protocol.encode(reply(prepare, request)))
