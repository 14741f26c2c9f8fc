"""An example request and answer of every operation of the API, as a client writes and
reads them (JSON values), keyed by the operation's method and primary path: the OpenAPI
document (`infinity.api.openapi`) carries them, so `/docs` fills its "Try it out" form
with each and shows each answer. tests/fast/test_openapi.py decodes every one into its
operation's msgspec types and validates it against the document's schemas, so that an
example cannot drift from the types.

Vectors are cut to their first values (a model's have hundreds); the model names are those
of a typical configuration, replaced in a served document by a served model of the
operation's kinds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Example:
    """One example of an operation: `name` (its key in the document: the dialect or shape
    it shows), the request body (None for an operation without one) and the 200 answer."""

    name: str
    summary: str
    request: Any
    answer: Any


# The packaged default model: a served document names the server's own.
EMBEDDER = "all-MiniLM-L6-v2"
RERANKER = "reranker"
CLASSIFIER = "classifier"
SPARSE = "splade"
IMAGE_TEXT = "clip"
AUDIO_TEXT = "clap"

# A model of each kind, as a typical configuration names them: the models of the document
# the documentation site shows (docs/hooks/site.py).
MODELS_BY_KIND = {"embed": [EMBEDDER], "rerank": [RERANKER], "classify": [CLASSIFIER], "multivector": ["colbert"],
                  "sparse": [SPARSE], "hybrid": ["bge-m3"], "image_text": [IMAGE_TEXT], "audio_text": [AUDIO_TEXT],
                  "image_multivector": ["colpali"]}

CREATED = 1767225600  # 2026-01-01T00:00:00Z
TEXTS = ["A fox jumps over the lazy dog.", "A lorry on the road."]
VECTORS = [[0.0262, 0.0750, 0.0377, -0.0485], [-0.0190, 0.0431, 0.0822, 0.0107]]
USAGE = {"prompt_tokens": 19, "total_tokens": 19, "truncated_inputs": 0}
QUERY, DOCUMENTS = "what is a fox?", ["a fox is an animal", "a lorry"]
# A 1x1 PNG and 1 ms of silence as WAV: data: URIs that a server without network access reads.
PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
WAV = ("data:audio/wav;base64,UklGRkQAAABXQVZFZm10IBAAAAABAAEAgD4AAAB9AAACABAAZGF0YSAAAAAAAAAAAAAAAAAAAAAAAAAA"
       "AAAAAAAAAAAAAAAAAAAAAAA=")


def _embeddings(model: str, vectors: list[list[float]], usage: dict[str, int]) -> dict[str, Any]:
    """OpenAI's embeddings answer of `vectors`."""
    return {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": vector}
                                       for i, vector in enumerate(vectors)],
            "model": model, "usage": usage, "id": "embd-3f1c0a7e9b2d4c6e8a0b1c2d3e4f5a6b", "created": CREATED}


def _cohere_meta(version: str, tokens: int, billed: dict[str, int]) -> dict[str, Any]:
    return {"api_version": {"version": version}, "billed_units": billed, "tokens": {"input_tokens": tokens}}


_COHERE_EMBED = Example(
    "Cohere", "Cohere's embed: texts", {"model": EMBEDDER, "texts": TEXTS, "input_type": "search_document"},
    {"id": "5c0e4b1a2f3d4e5f6a7b8c9d0e1f2a3b", "embeddings": VECTORS, "texts": TEXTS,
     "meta": _cohere_meta("1", 19, {"input_tokens": 19}), "response_type": "embeddings_floats"})

_RERANKED = [(0, 0.9812), (1, 0.0004)]  # (document index, score), best first


def _rerank_answer(document: Any) -> dict[str, Any]:
    """Cohere's and Jina's rerank answer, each result's document as `document(text)`."""
    return {"id": "9a8b7c6d5e4f4a3b2c1d0e9f8a7b6c5d", "object": "rerank", "created": CREATED,
            "results": [{"index": i, "relevance_score": score, "document": document(DOCUMENTS[i])}
                        for i, score in _RERANKED],
            "model": RERANKER, "usage": {"prompt_tokens": 21, "total_tokens": 21, "truncated_inputs": 0},
            "meta": _cohere_meta("2", 21, {"search_units": 1})}


_RERANK_BODY = {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": True}
_TEI_EMBED = Example("TEI", "TEI's embed: a bare list of vectors", {"inputs": TEXTS}, VECTORS)
_PREDICTIONS = [{"score": 0.9987, "label": "POSITIVE"}, {"score": 0.0013, "label": "NEGATIVE"}]
_TOKENS = [101, 1037, 4419, 102]  # "a fox" in the default model's vocabulary, with [CLS] and [SEP]
_TEI_TOKENS = [{"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None},
               {"id": 1037, "text": "a", "special": False, "start": 0, "stop": 1},
               {"id": 4419, "text": "fox", "special": False, "start": 2, "stop": 5},
               {"id": 102, "text": "[SEP]", "special": True, "start": None, "stop": None}]
_HEALTH = {"status": "ok", "unix": 1767225600.25}
_CARD = {
    "id": EMBEDDER, "object": "model", "owned_by": "infinity", "created": CREATED, "kind": "embed",
    "capabilities": ["embed"], "backend": "torch", "dtype": "float32", "lone_backend": None, "prepared": True,
    "stats": {"queue_fraction": 0.0, "queue_absolute": 0, "results_pending": 0, "batch_size": 64},
    "ready": True, "dimensions": 384, "max_length": 256, "long_inputs": "truncate", "pooling": "mean",
    "normalize": True, "modules": ["Pooling(mean)", "Normalize"], "digest": None, "prompts": {},
    "default_prompt_name": None, "devices": ["cpu"],
    "replicas": [{"device": "cpu", "ready": True, "inputs": 1024, "engine": "torch", "dtype": "float32",
                  "lone_engine": None, "prepared": True}]}
_INFO = {"model_id": EMBEDDER, "model_sha": None, "model_dtype": "float32",
         "model_type": {"embedding": {"pooling": "mean"}}, "served_model_name": EMBEDDER,
         "max_concurrent_requests": 4096, "max_input_length": 256, "max_batch_tokens": 16384,
         "max_batch_requests": 64, "max_client_batch_size": 2048, "auto_truncate": True, "tokenization_workers": 2,
         "version": "0.1.0", "sha": None, "docker_label": None}
_VLLM_LIST = {"id": "score-7e6d5c4b3a2f4e1d9c8b7a6f5e4d3c2b", "object": "list", "created": CREATED}

EXAMPLES: dict[str, tuple[Example, ...]] = {
    "post /v1/embeddings": (
        Example("OpenAI", "Two texts, float vectors", {"model": EMBEDDER, "input": TEXTS},
                _embeddings(EMBEDDER, VECTORS, USAGE)),
    ),
    "post /embeddings_image": (
        Example("infinity", "An image as a data: URI", {"model": IMAGE_TEXT, "input": [PNG]},
                _embeddings(IMAGE_TEXT, VECTORS[:1], {"prompt_tokens": 0, "total_tokens": 0,
                                                      "truncated_inputs": 0})),
    ),
    "post /embeddings_audio": (
        Example("infinity", "An audio clip as a data: URI", {"model": AUDIO_TEXT, "input": [WAV]},
                _embeddings(AUDIO_TEXT, VECTORS[:1], {"prompt_tokens": 0, "total_tokens": 0,
                                                      "truncated_inputs": 0})),
    ),
    "post /v1/embed": (_COHERE_EMBED,),
    "post /v1/embed_sparse": (
        Example("TEI", "One text's nonzero values, by index", {"model": SPARSE, "inputs": ["a fox"], "top_k": 3},
                [[{"index": 1037, "value": 0.8125}, {"index": 4419, "value": 2.4375},
                  {"index": 6071, "value": 1.1875}]]),
    ),
    "post /v1/rerank": (
        Example("Cohere", "Cohere's and Jina's rerank: documents returned as objects", _RERANK_BODY,
                _rerank_answer(lambda text: {"text": text})),
    ),
    "post /v1/classify": (
        Example("infinity", "Every label's score, best first", {"model": CLASSIFIER, "input": ["I love this film"]},
                {"id": "c1a2b3c4d5e64f7a8b9c0d1e2f3a4b5c", "object": "classify", "created": CREATED,
                 "data": [[{"label": p["label"], "score": p["score"]} for p in _PREDICTIONS]], "model": CLASSIFIER,
                 "usage": {"prompt_tokens": 6, "total_tokens": 6, "truncated_inputs": 0}}),
    ),
    "post /score": (
        Example("vLLM", "One text against two", {"model": RERANKER, "text_1": QUERY, "text_2": DOCUMENTS},
                {**_VLLM_LIST, "model": RERANKER, "usage": {"prompt_tokens": 21, "total_tokens": 21,
                                                            "truncated_inputs": 0},
                 "data": [{"index": i, "score": score, "object": "score"} for i, score in _RERANKED]}),
    ),
    "post /pooling": (
        Example("vLLM", "An embedder's vector", {"model": EMBEDDER, "input": ["a fox"]},
                {**_VLLM_LIST, "id": "pool-1b2c3d4e5f6a4b7c8d9e0f1a2b3c4d5e", "model": EMBEDDER,
                 "usage": {"prompt_tokens": 4, "total_tokens": 4, "truncated_inputs": 0},
                 "data": [{"index": 0, "data": VECTORS[0], "object": "pooling"}]}),
    ),
    "post /ping": (Example("SageMaker", "Ready", None, _HEALTH),),
    "post /tokenize": (
        Example("vLLM", "vLLM's body and answer", {"model": EMBEDDER, "prompt": "a fox"},
                {"count": 4, "max_model_len": 256, "tokens": _TOKENS, "token_strs": None}),
        Example("TEI", "TEI's body and answer", {"model": EMBEDDER, "inputs": "a fox"}, [_TEI_TOKENS]),
    ),
    "post /detokenize": (
        Example("vLLM", "vLLM's body and answer", {"model": EMBEDDER, "tokens": _TOKENS},
                {"prompt": "[CLS] a fox [SEP]"}),
        Example("TEI", "TEI's body and answer", {"model": EMBEDDER, "ids": [[1037, 4419]]}, ["a fox"]),
    ),
    "get /v1/models": (Example("OpenAI", "One embedder on the CPU", None, {"object": "list", "data": [_CARD]}),),
    "get /health": (Example("infinity", "Ready", None, _HEALTH),),
    "get /live": (Example("infinity", "Answering", None, _HEALTH),),
    "post /embed": (_TEI_EMBED, _COHERE_EMBED),
    "post /embed_all": (
        Example("TEI", "A vector per token", {"inputs": "a fox"},
                [[[0.1008, 0.2006, 0.2984], [0.0421, -0.1177, 0.3310], [0.2045, 0.0562, -0.0931],
                  [0.0874, 0.1593, 0.2211]]]),
    ),
    "post /rerank": (
        Example("TEI", "TEI's rerank: a bare list, best first",
                {"query": QUERY, "texts": DOCUMENTS, "return_text": True},
                [{"index": i, "score": score, "text": DOCUMENTS[i]} for i, score in _RERANKED]),
        Example("infinity", "infinity's rerank: documents returned as texts", _RERANK_BODY,
                _rerank_answer(lambda text: text)),
    ),
    "post /predict": (Example("TEI", "A text's labels, best first", {"inputs": "I love this film"}, _PREDICTIONS),),
    "post /similarity": (
        Example("TEI", "A sentence against two",
                {"inputs": {"source_sentence": "a fox", "sentences": ["a red fox", "a lorry"]}}, [0.9253, 0.2101]),
    ),
    "post /decode": (Example("TEI", "Token ids back to text", {"ids": [[1037, 4419]]}, ["a fox"]),),
    "get /info": (Example("TEI", "The default model", None, _INFO),),
    "post /": (Example("TEI", "An embedder's vectors", {"inputs": TEXTS}, VECTORS),),
    "post /invocations": (
        Example("vLLM", "vLLM's embeddings body", {"model": EMBEDDER, "input": TEXTS},
                _embeddings(EMBEDDER, VECTORS, USAGE)),
        Example("vLLM-classify", "A classifier's body, answered in vLLM's shape",
                {"model": CLASSIFIER, "input": ["I love this film"]},
                {**_VLLM_LIST, "id": "classify-5d4c3b2a1f0e4d9c8b7a6f5e4d3c2b1a", "model": CLASSIFIER,
                 "usage": {"prompt_tokens": 6, "total_tokens": 6, "truncated_inputs": 0},
                 "data": [{"index": 0, "label": _PREDICTIONS[0]["label"],
                           "probs": [p["score"] for p in _PREDICTIONS], "num_classes": len(_PREDICTIONS)}]}),
        Example("TEI", "TEI's body, as POST /", {"inputs": TEXTS}, VECTORS),
    ),
}
