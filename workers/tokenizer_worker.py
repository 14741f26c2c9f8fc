"""Tokenizer process: turns `Tokenize` messages into `Tokenized` (or a 422 `Failed`)."""

from __future__ import annotations

import logging
import os

from infinity import protocol
from workers.process import start_child
from workers.tokenization import InputError, ModelTokenizer

log = logging.getLogger(__name__)


def main(args: protocol.WorkerArgs) -> None:
    context, inbox, to_front = start_child(args)
    try:
        try:
            tokenizers = {spec.name: ModelTokenizer(spec) for spec in args.models}
        except Exception as exc:
            log.exception("cannot load tokenizers")
            to_front.send(protocol.encode(protocol.StartupFailed(args.name, f"{type(exc).__name__}: {exc}")))
            return
        to_front.send(protocol.encode(protocol.Ready(args.name, os.getpid())))
        while True:
            request = protocol.decode(inbox.recv())
            assert isinstance(request, protocol.Tokenize)
            try:
                reply = tokenizers[request.model].tokenize(request)
            except InputError as exc:
                reply = protocol.Failed(request.request_id, 422, str(exc), param="input")
            except Exception as exc:  # a tokenizer bug must not take the process down
                log.exception("tokenizing request %d failed", request.request_id)
                reply = protocol.Failed(request.request_id, 500, f"tokenization failed: {exc}")
            to_front.send(protocol.encode(reply))
    finally:
        context.destroy(linger=0)
