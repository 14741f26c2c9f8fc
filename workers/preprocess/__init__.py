"""Preprocessing, in the tokenizer processes (and, for small requests, the front end):
texts into token ids (`text`), media files decoded (`image_decoding`, `audio_decoding`)
and made ready for a model's tower (`image`, `audio`, `page`; `media` holds what they
share). The process itself is `worker`.

What every preprocessor shares is here: the error of a client's input, and the
answer a preprocessing function gives whatever happens (`reply`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from infinity.shared import protocol, tracing

log = logging.getLogger(__name__)


class InputError(ValueError):
    """A client input the model cannot take."""


def reply(prepare: Callable[[protocol.Tokenize], protocol.Tokenized],
          request: protocol.Tokenize) -> protocol.Tokenized | protocol.Failed:
    """The answer to `request` as `prepare` (a tokenizer's, or an image preprocessor's)
    makes it: its inputs ready for the model, an invalid input, or an internal failure if
    `prepare` itself fails (which must not take its process down); in a `tokenize` span
    where the request is traced."""
    if request.trace is None:
        return _answer(prepare, request)
    with tracing.span("tokenize", request.trace) as span:
        answer = _answer(prepare, request)
        if span is not None and isinstance(answer, protocol.Tokenized):
            span.set_attributes({"infinity.model": request.model, "infinity.inputs": len(answer.inputs.costs),
                                 "infinity.tokens": answer.inputs.billed})
    return answer


def _answer(prepare: Callable[[protocol.Tokenize], protocol.Tokenized],
            request: protocol.Tokenize) -> protocol.Tokenized | protocol.Failed:
    try:
        return prepare(request)
    except InputError as exc:
        return protocol.Failed(request.request_id, protocol.ErrorKind.INVALID_INPUT, str(exc), param="input")
    except Exception as exc:
        log.exception("tokenizing request %d failed", request.request_id)
        return protocol.Failed(request.request_id, protocol.ErrorKind.INTERNAL, f"tokenization failed: {exc}")
