"""Turning request inputs into token ids: fast tokenizers, truncation, real token counts.

Padding is never applied here (a model's tokenizer.json may pad every input to a fixed
length, which makes the model several times slower on short inputs): the inference
process pads each batch to its own longest input.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from infinity import protocol
from workers.models import ModelSpec


class InputError(ValueError):
    """A client input the model cannot take; answered with 422."""


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


class ModelTokenizer:
    """Tokenizes the inputs of one model."""

    def __init__(self, spec: ModelSpec) -> None:
        self._spec = spec
        self._tokenizer = load_tokenizer(spec)
        config = json.loads((Path(spec.path) / "config.json").read_text())
        self._vocab_size = int(config["vocab_size"])
        if spec.truncate:
            self._tokenizer.enable_truncation(spec.max_length)

    def tokenize(self, request: protocol.Tokenize) -> protocol.Tokenized:
        if request.texts is not None:
            sequences, truncated = self._encode_texts(request.texts)
        else:
            sequences, truncated = self._check_token_ids(request.token_ids or [])
        lengths = [len(s) for s in sequences]
        ids = np.fromiter((t for s in sequences for t in s), dtype="<i4", count=sum(lengths))
        return protocol.Tokenized(request.request_id, ids.tobytes(), lengths, truncated)

    def _encode_texts(self, texts: list[str]) -> tuple[list[list[int]], int]:
        if self._spec.lowercase:
            texts = [t.lower() for t in texts]
        encodings = self._tokenizer.encode_batch(texts)
        sequences = [e.ids for e in encodings]
        if self._spec.truncate:
            return sequences, sum(1 for e in encodings if e.overflowing)
        for i, ids in enumerate(sequences):
            if len(ids) > self._spec.max_length:
                self._too_long(i, len(ids))
        return sequences, 0

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
