"""Turning request inputs into token ids: fast tokenizers, truncation, real token counts.

Padding is never applied here (a model's tokenizer.json may pad every input to a fixed
length, which makes the model several times slower on short inputs): the inference
process pads each batch to its own longest input.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

from infinity import protocol
from workers.models import ModelSpec

log = logging.getLogger(__name__)


class InputError(ValueError):
    """A client input the model cannot take; answered with 422."""


def reply(tokenizer: "ModelTokenizer", request: protocol.Tokenize) -> protocol.Tokenized | protocol.Failed:
    """The answer to `request`: its tokens, a 422 for an input the model cannot take, or a
    500 if the tokenizer itself fails (which must not take its process down)."""
    try:
        return tokenizer.tokenize(request)
    except InputError as exc:
        return protocol.Failed(request.request_id, 422, str(exc), param="input")
    except Exception as exc:
        log.exception("tokenizing request %d failed", request.request_id)
        return protocol.Failed(request.request_id, 500, f"tokenization failed: {exc}")


def load_tokenizer(spec: ModelSpec) -> Tokenizer:
    path = Path(spec.path) / "tokenizer.json"
    if path.is_file():
        tokenizer = Tokenizer.from_file(str(path))
    else:  # e.g. sentencepiece-only folders: let transformers build the fast tokenizer
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec.path, use_fast=True).backend_tokenizer
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def _feeds_token_types(spec: ModelSpec) -> bool:
    """Whether the model's transformers tokenizer hands segment ids to the model (BERT's
    does; a generic fast tokenizer does not), so pairs are encoded as its authors trained."""
    try:
        from transformers import AutoTokenizer

        return "token_type_ids" in AutoTokenizer.from_pretrained(spec.path).model_input_names
    except Exception:  # no transformers tokenizer files: the tokenizer.json's segments stand
        return True


class ModelTokenizer:
    """Tokenizes the inputs of one model."""

    def __init__(self, spec: ModelSpec) -> None:
        self._spec = spec
        self._tokenizer = load_tokenizer(spec)
        config = json.loads((Path(spec.path) / "config.json").read_text())
        self._vocab_size = int(config["vocab_size"])
        # Pairs keep the query whole and cut the document, unless the query alone is too
        # long; then both sides are cut (longest first), as for single texts.
        self._pair_tokenizer = Tokenizer.from_str(self._tokenizer.to_str())
        self._pair_segments = spec.kind == "rerank" and _feeds_token_types(spec)
        if spec.truncate:
            self._tokenizer.enable_truncation(spec.max_length)
            self._pair_tokenizer.enable_truncation(spec.max_length, strategy="only_second")

    def tokenize(self, request: protocol.Tokenize) -> protocol.Tokenized:
        type_ids = None
        if request.query is not None:
            encodings = self._encode_pairs(request.query, request.texts or [])
            sequences = [e.ids for e in encodings]
            if self._pair_segments:
                type_ids = np.fromiter((t for e in encodings for t in e.type_ids), dtype=np.int8).tobytes()
            truncated = self._count_truncated(encodings)
        elif request.texts is not None:
            encodings = self._tokenizer.encode_batch(self._cased(request.texts))
            sequences = [e.ids for e in encodings]
            truncated = self._count_truncated(encodings)
        else:
            sequences, truncated = self._check_token_ids(request.token_ids or [])
        lengths = [len(s) for s in sequences]
        ids = np.fromiter((t for s in sequences for t in s), dtype="<i4", count=sum(lengths))
        return protocol.Tokenized(request.request_id, ids.tobytes(), lengths, truncated, type_ids)

    def _cased(self, texts: list[str]) -> list[str]:
        return [t.lower() for t in texts] if self._spec.lowercase else texts

    def _encode_pairs(self, query: str, documents: list[str]) -> list[Encoding]:
        pairs = list(zip(self._cased([query]) * len(documents), self._cased(documents)))
        try:
            return self._pair_tokenizer.encode_batch(pairs)
        except Exception:  # the query alone does not fit: cut both sides
            return self._tokenizer.encode_batch(pairs)

    def _count_truncated(self, encodings: list[Encoding]) -> int:
        """Inputs cut to max_length; with truncation off, an input too long is an error."""
        if self._spec.truncate:
            return sum(1 for e in encodings if e.overflowing)
        for i, encoding in enumerate(encodings):
            if len(encoding.ids) > self._spec.max_length:
                self._too_long(i, len(encoding.ids))
        return 0

    def _check_token_ids(self, sequences: list[list[int]]) -> tuple[list[list[int]], int]:
        truncated = 0
        out = []
        for i, ids in enumerate(sequences):
            if any(t < 0 or t >= self._vocab_size for t in ids):
                raise InputError(f"input[{i}] holds a token id outside the model's vocabulary "
                                 f"(0 to {self._vocab_size - 1})")
            if len(ids) > self._spec.max_length:
                if not self._spec.truncate:
                    self._too_long(i, len(ids))
                ids = ids[:self._spec.max_length]
                truncated += 1
            out.append(ids)
        return out, truncated

    def _too_long(self, index: int, length: int) -> None:
        raise InputError(
            f"input[{index}] has {length} tokens, more than the maximum of "
            f"{self._spec.max_length} for model '{self._spec.name}' (truncation is off for this model)"
        )
