"""Inputs longer than the model: what a request asks for them (its `long_inputs` and
`chunk_overlap`, Cohere's `truncate`, rerank's `max_chunks_per_doc`), checked against the
model before anything runs, and the chunks' outputs made into one answer per input.

Chunking itself is the tokenizer's (`workers.preprocess.text`): it alone knows how many
tokens an input makes. An input to embed becomes chunks of the model's length, each embedded
as an input of its own; its vector is the token-weighted mean of theirs,

    v = (sum_k n_k * v_k) / (sum_k n_k),   then v / |v| if the model normalises,

where v_k is chunk k's vector and n_k its tokens (as billed: special tokens and the prompt
included). A document too long to rerank becomes chunks, each paired with the query (a
cross-encoder) or embedded (a multi-vector model, scored by MaxSim); it scores as its best.
"""

from __future__ import annotations

import msgspec
import numpy as np

from infinity.api.errors import APIError
from infinity.client.engine_client import ModelInputs, Result, chunk_starts
from infinity.client.topology import ServedModel

# Cohere's `truncate` in our terms.
COHERE_TRUNCATE = {"END": "truncate", "NONE": "error"}


def with_long_inputs(model: ServedModel, inputs: ModelInputs, long_inputs: str | None,
                     chunk_overlap: int | None, max_chunks: int | None = None) -> ModelInputs:
    """`inputs` taking long inputs as the request asks (None: as the model is set): chunks
    only where the model can combine them (`KindSpec.chunks_long_inputs`; documents to
    rerank, `max_chunks` of each: `KindSpec.chunks_documents`), overlapping by less than half
    the model's length, at most the model's `max_chunks_per_input` of one input."""
    if long_inputs is None and chunk_overlap is None and max_chunks is None:  # as the model is set
        return inputs
    spec = model.spec
    chunks = (long_inputs or spec.long_inputs) == "chunk"
    combinable = model.kind.chunks_documents if max_chunks is not None else model.kind.chunks_long_inputs
    if long_inputs == "chunk" and not combinable:
        raise APIError(422, f"long inputs of the {spec.kind} model '{spec.name}' cannot be chunked (chunks are "
                            "combined for models of one dense vector per text, and rerankers); use truncate or error",
                       param="long_inputs")
    if chunk_overlap is not None and not chunks:
        raise APIError(422, "chunk_overlap applies when long inputs are chunked (long_inputs \"chunk\")",
                       param="chunk_overlap")
    if chunk_overlap is not None and chunk_overlap >= spec.max_length // 2:
        raise APIError(422, f"chunk_overlap must be less than half of model '{spec.name}''s {spec.max_length} tokens",
                       param="chunk_overlap")
    if max_chunks is not None and max_chunks > spec.max_chunks_per_input:
        raise APIError(422, f"model '{spec.name}' takes at most {spec.max_chunks_per_input} chunks of one input",
                       param="max_chunks_per_doc")
    return msgspec.structs.replace(inputs, long_inputs=long_inputs, chunk_overlap=chunk_overlap, max_chunks=max_chunks)


def long_inputs_of_cohere(truncate: str | None, long_inputs: str | None) -> str | None:
    """What a Cohere embed body asks of long inputs: its `long_inputs`, or its `truncate`."""
    if truncate is not None and long_inputs is not None:
        raise APIError(422, "give truncate (Cohere's) or long_inputs, not both", param="long_inputs")
    return long_inputs or COHERE_TRUNCATE.get(truncate or "")


def chunk_means(result: Result, normalize: bool) -> np.ndarray:
    """Each input's vector, (n, dim) float32: the token-weighted mean of its chunks' vectors
    (the module's formula), re-normalised where the model normalises; the vector itself for
    an input that was not chunked."""
    rows = result.stacked()
    if result.chunks is None:
        return rows
    starts, weights = chunk_starts(result.chunks), np.asarray(result.costs, dtype=np.float64)[:, None]
    means = np.add.reduceat(rows * weights, starts) / np.add.reduceat(weights, starts)
    if normalize:
        means /= np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)
    return means.astype(np.float32)


def best_chunks(scores: np.ndarray, chunks: list[int] | None) -> tuple[np.ndarray, np.ndarray]:
    """(each document's score: its best chunk's, the index of that chunk among its own)
    from each chunk's `scores`, `chunks` (`Result.chunks`) a document; chunk 0 for a
    document that was not chunked."""
    if chunks is None:
        return scores, np.zeros(len(scores), dtype=np.int64)
    starts = chunk_starts(chunks)
    best = np.array([int(np.argmax(scores[start:start + count])) for start, count in zip(starts, chunks)])
    return scores[starts + best], best
