"""Late chunking (`late_chunking: true` on `/v1/embeddings`): one reading of a whole text,
then one vector per span of it, pooled from the token states its characters cover,
instead of one pass per chunk.

Spans are character ranges `[start, end)` into each input as sent (the prompt not counted),
given per input (`spans`) or found by `split: "sentences"` (`sentence_spans`). A span's
tokens are the text's tokens whose characters overlap it (special tokens and a prompt's
tokens are read, giving context, but in no span); its vector is their states' mean,
L2-normalised where the model normalises. Only models of kind "embed" that mean-pool their
token states take it.

Each text is tokenized once, whole, with offsets (a lookup); the model is then given those
token ids (`ModelInputs.token_ids`), never the text again, so a window's tokens are the
whole text's tokens and their offsets map back to its characters. (The pass cannot hand
back offsets itself: `Tokenized` carries ids only, and adding offsets to it would make
every request's tokenizer work cost what only late chunking needs.)

A text that fits the model (`max_length` tokens, special and prompt tokens counted) is one
window: its whole token sequence. A longer one is read in macro-windows (`TextReading`):
each holds the leading special and prompt tokens ("head"), `size = max_length - head -
tail` consecutive tokens of the text, and the trailing special tokens ("tail"); window k
starts `k * (size - overlap)` text tokens in, the last one moved back to end at the text's
last token (so every window is full). `overlap` is the request's `chunk_overlap`, else a
quarter of `size`: with the rule below, each token is read with at least `overlap // 2`
tokens of context on a cut side (an eighth of the window), for about 4/3 of the passes of
disjoint windows. At most the model's `max_chunks_per_input` windows per text (beyond:
422 naming the count); each window is one input to the model (a slot, `usage` counts its
tokens), which answers its token states.

Each text token's state is taken from the window where it is furthest from a cut (the
window centre rule, `state_sources`): its context in window [a, b) is min(tokens of the
window before it, tokens after it), a side that reaches the text's first or last token
counting as unbounded (nothing was cut there); the window of most context wins, the
earlier one on a tie. For two consecutive windows this splits their overlap in its middle,
the first half read from the earlier one. Head and tail tokens are in no span; their
states are the first window's and the last window's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from infinity.api.errors import APIError
from infinity.api.types.embeddings import CohereEmbedRequest, EmbeddingRequest
from infinity.client.engine_client import EngineClient, ModelInputs
from infinity.client.topology import ServedModel
from infinity.shared.protocol import PLAIN_MEANS, TOKEN_STATES, ModelSpec, TextTokens

# Where one sentence ends and the next begins: whitespace after ".", "!" or "?", or a newline.
SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\s*\n\s*")

# A long text's windows share a quarter of their text tokens unless the request says otherwise.
DEFAULT_OVERLAP_SHARE = 4


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
    if spec.kind != "embed" or spec.modules not in PLAIN_MEANS:
        raise APIError(422, f"late chunking pools token states by their mean: model '{spec.name}' (kind '{spec.kind}'"
                            f", modules {', '.join(step.label for step in spec.modules) or 'none'}) is not an embedder "
                            "whose vector is the mean alone", param="late_chunking")
    if (body.spans is None) == (body.split is None):
        raise APIError(422, "late chunking takes spans (character ranges per input) or split, one of them",
                       param="spans")
    for param in ("long_inputs", "outputs", "embedding_types"):
        if getattr(body, param) is not None:
            raise APIError(422, f"late chunking answers one vector per span, reading long texts in windows; leave "
                                f"{param} out",
                           param=param)
    if body.input_usage:
        raise APIError(422, "late chunking bills each text's windows, not one count per input; leave input_usage out",
                       param="input_usage")


def refuse_on_cohere(body: CohereEmbedRequest) -> None:
    """A 422 where a Cohere embed body asks for late chunking: Cohere's API has no such
    field and its answer a vector per text, no spans; Jina's, on `/v1/embeddings`, has."""
    for param in ("late_chunking", "spans", "split"):
        if getattr(body, param) not in (None, False):
            raise APIError(422, f"late chunking (and its {param}) is on /v1/embeddings: Cohere's embed answers a "
                                "vector per text", param=param)


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
                       spans: list[list[tuple[int, int]]], overlap: int | None) -> tuple[list[SpanVectors], int]:
    """Each text's span vectors, read in windows of the model's length sharing `overlap`
    tokens (None: a quarter of a window), and the tokens billed (every window's); the
    module's rules."""
    spec = model.spec
    texts = inputs.texts or []
    longer = next((i for i, text in enumerate(texts) if len(text) > spec.max_input_chars), None)
    if longer is not None:
        raise APIError(422, f"input[{longer}] is longer than the {spec.max_input_chars} characters model "
                            f"'{spec.name}' reads of one input", param="input")
    looked_up = await client.look_up(model, inputs, True)
    prompt_length = len(inputs.prompt_on(spec))
    readings = [TextReading.of(tokens, prompt_length, spec, overlap, i)
                for i, tokens in enumerate(looked_up.tokens or [])]
    windows = [ids for reading in readings for ids in reading.window_ids()]
    result = await client.run(model, ModelInputs(token_ids=windows, vector_types=(TOKEN_STATES,)))
    try:
        window_states = [np.array(rows, dtype=np.float32) for rows in result.rows()]
    finally:
        result.release()
    answers, first = [], 0
    for i, (reading, text_spans) in enumerate(zip(readings, spans, strict=True)):
        states = reading.token_states(window_states[first:first + len(reading.windows)])
        first += len(reading.windows)
        answers.append(_pooled(reading.tokens, states, text_spans, prompt_length, spec.normalize, i))
    return answers, result.prompt_tokens


@dataclass(frozen=True)
class TextReading:
    """How one text's whole tokenization is read (the module's rules): `head` tokens (the
    special and prompt tokens before the text) and `tail` tokens (the special tokens after
    it) in every window, and between them the `windows`, [start, stop) indices into
    `tokens`."""

    tokens: TextTokens
    head: int
    tail: int
    windows: list[tuple[int, int]]

    @classmethod
    def of(cls, tokens: TextTokens, prompt_length: int, spec: ModelSpec, overlap: int | None,
           index: int) -> TextReading:
        """The reading of input `index`, `tokens` (its prompt `prompt_length` characters);
        a 422 where it needs more windows than the model takes, or `overlap` is too large."""
        count = len(tokens.ids)
        head = 0
        while head < count and (tokens.special[head] or tokens.offsets[head][0] < prompt_length):
            head += 1
        tail = 0
        while tail < count - head and tokens.special[count - 1 - tail]:
            tail += 1
        if count <= spec.max_length:
            return cls(tokens, head, tail, [(head, count - tail)])
        size = spec.max_length - head - tail
        if size < 1:
            raise APIError(422, f"the prompt and special tokens of input[{index}] fill the {spec.max_length} tokens "
                                f"of a window of model '{spec.name}'", param="input")
        overlap = size // DEFAULT_OVERLAP_SHARE if overlap is None else overlap
        if 2 * overlap >= size:
            raise APIError(422, f"chunk_overlap must be less than half of the {size} text tokens a window of model "
                                f"'{spec.name}' holds beside its special and prompt tokens", param="chunk_overlap")
        text_tokens = count - head - tail
        needed = 1 - (size - text_tokens) // (size - overlap)  # 1 + ceil((text_tokens - size) / stride)
        if needed > spec.max_chunks_per_input:
            raise APIError(422, f"input[{index}] is {count} tokens: late chunking reads it in {needed} windows of "
                                f"{spec.max_length} tokens, more than the {spec.max_chunks_per_input} "
                                f"(max_chunks_per_input) model '{spec.name}' takes of one input", param="input")
        return cls(tokens, head, tail, [(head + start, head + stop)
                                        for start, stop in macro_windows(text_tokens, size, overlap)])

    def window_ids(self) -> list[list[int]]:
        """Each window's token ids: the head's, its own, the tail's."""
        ids = self.tokens.ids
        head, tail = ids[:self.head], ids[len(ids) - self.tail:]
        return [head + ids[start:stop] + tail for start, stop in self.windows]

    def token_states(self, window_states: list[np.ndarray]) -> np.ndarray:
        """Every token's state, a row per token of `tokens`, from each window's states (a
        row per token of its `window_ids`): a text token's from the window `state_sources`
        picks, the head's from the first window, the tail's from the last."""
        count, head, tail = len(self.tokens.ids), self.head, self.tail
        for (start, stop), states in zip(self.windows, window_states, strict=True):
            if len(states) != head + stop - start + tail:
                raise RuntimeError(f"the pass gave {len(states)} token states of a window of "
                                   f"{head + stop - start + tail} tokens")
        rows = np.empty((count, window_states[0].shape[1]), dtype=np.float32)
        rows[:head] = window_states[0][:head]
        rows[count - tail:] = window_states[-1][len(window_states[-1]) - tail:]
        sources = state_sources(self.windows, head, count - tail)
        for window, ((start, _), states) in enumerate(zip(self.windows, window_states)):
            taken = np.flatnonzero(sources == window) + head
            rows[taken] = states[head + taken - start]
        return rows


def macro_windows(tokens: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """[start, stop) ranges over `tokens` tokens: one if they fit `size`, else windows of
    `size` starting every `size - overlap` tokens, the last moved back to end at the last."""
    windows, start = [], 0
    while True:
        start = max(min(start, tokens - size), 0)
        windows.append((start, min(start + size, tokens)))
        if start + size >= tokens:
            return windows
        start += size - overlap


def state_sources(windows: list[tuple[int, int]], first: int, last: int) -> np.ndarray:
    """For each token of [`first`, `last`), covered by `windows` in order, the index of the
    window its state is taken from: where it has the most context on its nearer cut side
    (the module's window centre rule), the earlier window on a tie."""
    positions = np.arange(first, last)
    sources = np.full(last - first, -1)
    best = np.full(last - first, -1.0)
    for window, (start, stop) in enumerate(windows):
        inside = slice(start - first, stop - first)
        context = np.full(stop - start, np.inf)
        if start > first:
            context = np.minimum(context, positions[inside] - start)
        if stop < last:
            context = np.minimum(context, stop - 1 - positions[inside])
        better = context > best[inside]
        sources[inside][better] = window
        best[inside][better] = context[better]
    return sources


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
