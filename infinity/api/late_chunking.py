"""Late chunking (`late_chunking: true` on `/v1/embeddings`): one pass of the model over a
whole text, then one vector per span of it, pooled from the token states its characters
cover, instead of one pass per chunk.

Spans are character ranges `[start, end)` into each input as sent (the prompt not counted),
given per input (`spans`) or found by `split: "sentences"` (`sentence_spans`). A span's
tokens are the text's tokens whose characters overlap it (special tokens and a prompt's
tokens are in the pass, giving context, but in no span); its vector is their states' mean,
L2-normalised where the model normalises. Only models of kind "embed" that mean-pool their
token states take it, and only inputs that fit the model in one pass (longer ones: 422).
"""

from __future__ import annotations

import re

import msgspec
import numpy as np

from infinity.api.errors import APIError
from infinity.api.types.embeddings import EmbeddingRequest
from infinity.client.engine_client import EngineClient, ModelInputs
from infinity.client.topology import ServedModel
from infinity.shared.protocol import TOKEN_STATES, TextTokens

# Where one sentence ends and the next begins: whitespace after ".", "!" or "?", or a newline.
SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\s*\n\s*")


class SpanVectors:
    """One input's spans: each one's characters `[start, end)`, its tokens `[token_start,
    token_end)` among the pass's (special and prompt tokens counted), and its vector."""

    def __init__(self, characters: list[tuple[int, int]], tokens: list[tuple[int, int]], vectors: np.ndarray) -> None:
        self.characters = characters
        self.tokens = tokens
        self.vectors = vectors


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """The sentences of `text` as character ranges: it is cut where `SENTENCE_BREAK`
    matches, each piece stripped of surrounding whitespace, empty pieces dropped."""
    pieces, start = [], 0
    for found in SENTENCE_BREAK.finditer(text):
        pieces.append((start, found.start()))
        start = found.end()
    pieces.append((start, len(text)))
    spans = []
    for start, end in pieces:
        while start < end and text[start].isspace():
            start += 1
        while end > start and text[end - 1].isspace():
            end -= 1
        if start < end:
            spans.append((start, end))
    return spans


def refuse_unless_late_chunkable(model: ServedModel, body: EmbeddingRequest) -> None:
    """A 422 where `body` asks for late chunking `model` cannot honour, or gives spans or
    `split` without asking for it."""
    if not body.late_chunking:
        if body.spans is not None or body.split is not None:
            raise APIError(422, "spans and split apply with late_chunking true", param="late_chunking")
        return
    spec = model.spec
    if spec.kind != "embed" or spec.pooling != "mean":
        raise APIError(422, f"late chunking pools token states by their mean: model '{spec.name}' (kind '{spec.kind}'"
                            f", pooling '{spec.pooling}') is not an embedder that mean-pools", param="late_chunking")
    if (body.spans is None) == (body.split is None):
        raise APIError(422, "late chunking takes spans (character ranges per input) or split, one of them",
                       param="spans")
    for param in ("long_inputs", "chunk_overlap", "outputs", "embedding_types"):
        if getattr(body, param) is not None:
            raise APIError(422, f"late chunking answers one vector per span, in one pass; leave {param} out",
                           param=param)


def character_spans(body: EmbeddingRequest, texts: list[str]) -> list[list[tuple[int, int]]]:
    """Each text's spans: `body.spans` checked against it, or its sentences."""
    if body.spans is None:
        spans = [sentence_spans(text) for text in texts]
        empty = next((i for i, each in enumerate(spans) if not each), None)
        if empty is not None:
            raise APIError(422, f"input[{empty}] holds no sentence (it is blank)", param="input")
        return spans
    if len(body.spans) != len(texts):
        raise APIError(422, f"spans holds {len(body.spans)} lists for {len(texts)} inputs: one list per input",
                       param="spans")
    for i, (each, text) in enumerate(zip(body.spans, texts)):
        for start, end in each:
            if not 0 <= start < end <= len(text):
                raise APIError(422, f"spans[{i}] holds [{start}, {end}]: a span is [start, end) with 0 <= start < end "
                                    f"<= {len(text)}, the characters of input[{i}]", param="spans")
    return [[(start, end) for start, end in each] for each in body.spans]


async def span_vectors(client: EngineClient, model: ServedModel, inputs: ModelInputs,
                       spans: list[list[tuple[int, int]]]) -> tuple[list[SpanVectors], int]:
    """Each text's span vectors from one pass over it (the module's rule), and the tokens
    billed; a text the model cannot read in one pass is a 422."""
    spec = model.spec
    texts = inputs.texts or []
    longer = next((i for i, text in enumerate(texts) if len(text) > spec.max_input_chars), None)
    if longer is not None:
        raise APIError(422, f"input[{longer}] is longer than the {spec.max_input_chars} characters model "
                            f"'{spec.name}' reads of one input", param="input")
    looked_up = await client.look_up(model, inputs, True)
    tokens = looked_up.tokens or []
    for i, each in enumerate(tokens):
        if len(each.ids) > spec.max_length:
            raise APIError(422, f"input[{i}] is {len(each.ids)} tokens, more than the {spec.max_length} of model "
                                f"'{spec.name}': late chunking reads an input in one pass", param="input")
    result = await client.run(model, msgspec.structs.replace(inputs, vector_types=(TOKEN_STATES,)))
    try:
        states = [np.array(rows, dtype=np.float32) for rows in result.rows()]
    finally:
        result.release()
    prompt_length = len(inputs.prompt_on(spec))
    answers = []
    for i, (text_tokens, text_states, text_spans) in enumerate(zip(tokens, states, spans, strict=True)):
        if len(text_states) != len(text_tokens.ids):
            raise RuntimeError(f"the pass gave {len(text_states)} token states of input {i}, its tokenizer "
                               f"{len(text_tokens.ids)} tokens")
        answers.append(_pooled(text_tokens, text_states, text_spans, prompt_length, spec.normalize, i))
    return answers, result.prompt_tokens


def _pooled(tokens: TextTokens, states: np.ndarray, spans: list[tuple[int, int]], prompt_length: int,
            normalize: bool, index: int) -> SpanVectors:
    """One text's span vectors: the mean of the states of the tokens overlapping each span
    (offsets into the prompted text, shifted past the prompt), normalised if asked."""
    offsets = np.array(tokens.offsets, dtype=np.int64).reshape(-1, 2) - prompt_length
    special = np.array(tokens.special, dtype=bool)
    token_ranges, vectors = [], []
    for start, end in spans:
        covered = np.flatnonzero(~special & (offsets[:, 0] < end) & (offsets[:, 1] > start))
        if len(covered) == 0:
            raise APIError(422, f"the span [{start}, {end}] of input[{index}] covers no token (only whitespace)",
                           param="spans")
        token_ranges.append((int(covered[0]), int(covered[-1]) + 1))
        vectors.append(states[covered].mean(axis=0))
    pooled = np.stack(vectors)
    if normalize:
        pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
    return SpanVectors(spans, token_ranges, pooled.astype(np.float32))
