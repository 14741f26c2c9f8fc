"""The client libraries users of the servers we replace already have, unchanged, pointed at
the shared scoring server (the default embedder, a tiny cross-encoder): LlamaIndex's TEI
embedding and TEI rerank postprocessor, chromadb's `HuggingFaceEmbeddingServer`, and
LiteLLM's `infinity/` and `openai/` providers. Each client's answer is held to our own
routes' answer for the same inputs: vectors to `/v1/embeddings`' within
`SAME_TEXTS_ATOL`, reranks' order and scores to `/v1/rerank`'s.

The clients come from the `clients` extra. Nothing here may leave the machine: LiteLLM
would fetch its model cost map at import and chromadb may send telemetry, so both are
told not to before they are imported, and every test runs with connections to any host
but loopback refused (`loopback_only`), so a client that still tried would fail here."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.support.reference import MODEL_NAME, SAME_SCORES_ATOL, assert_same_vectors
from tests.support.tiny_models import RERANKER_NAME

pytestmark = pytest.mark.timeout(300)

TEXTS = ["The cat sat on the mat.", "Embeddings map texts to vectors.", "A third, unrelated sentence."]
QUERY = "the quick brown fox"
# Words the tiny reranker's tokenizer knows, so that its scores spread.
DOCUMENTS = ["a lazy dog while seven wizards", "the quick brown fox jumps", "boxing matches of jumbo sized",
             "quartz sphinx numbers 0 1 2", "fox jumps over a lazy dog"]


def _is_loopback(host: Any) -> bool:
    if host in (None, "localhost"):
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Refuse name look-ups and connections to anything but loopback for the test's length,
    and fail the test if any was tried: a client may swallow the refusal (LiteLLM falls
    back to its bundled cost map), so the attempt itself is the failure."""
    tried: list[Any] = []
    look_up, connect, connect_ex = socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex

    def refused(what: Any) -> OSError:
        tried.append(what)
        return OSError(f"test_peer_clients: no connection beyond loopback ({what!r})")

    def guarded_look_up(host: Any, *args: Any, **kwargs: Any):
        if not _is_loopback(host.decode() if isinstance(host, bytes) else host):
            raise refused(host)
        return look_up(host, *args, **kwargs)

    def guarded(real):
        def call(sock: socket.socket, address: Any):
            if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
                raise refused(address)
            return real(sock, address)
        return call

    monkeypatch.setattr(socket, "getaddrinfo", guarded_look_up)
    monkeypatch.setattr(socket.socket, "connect", guarded(connect))
    monkeypatch.setattr(socket.socket, "connect_ex", guarded(connect_ex))
    yield
    assert not tried, f"a client tried to reach beyond loopback: {tried}"


@pytest.fixture
def litellm(monkeypatch: pytest.MonkeyPatch):
    """LiteLLM, imported (once, under `loopback_only`) with its bundled model cost map: it
    fetches one from the web at import otherwise."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.delenv("INFINITY_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    import litellm

    monkeypatch.setattr(litellm, "telemetry", False)
    monkeypatch.setattr(litellm, "suppress_debug_info", True)
    return litellm


def _our_vectors(server, texts: list[str]) -> np.ndarray:
    answer = server.post("/v1/embeddings", {"model": MODEL_NAME, "input": texts, "encoding_format": "float"})
    assert answer.status_code == 200, answer.text
    return np.array([item["embedding"] for item in answer.json()["data"]], dtype=np.float32)


def _our_rerank(server, query: str, documents: list[str]) -> list[dict]:
    answer = server.post("/v1/rerank", {"model": RERANKER_NAME, "query": query, "documents": documents})
    assert answer.status_code == 200, answer.text
    return answer.json()["results"]


# --- LlamaIndex --------------------------------------------------------------------------------

def test_llama_index_tei_embedding(scoring_server):
    from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

    # model_name only picks an instruction to prepend, for instructor and BGE names: none here.
    embedder = TextEmbeddingsInference(model_name=MODEL_NAME, base_url=scoring_server.url(""), timeout=60)
    ours = _our_vectors(scoring_server, TEXTS)
    assert_same_vectors(embedder.get_text_embedding_batch(TEXTS), ours, "get_text_embedding_batch")
    assert_same_vectors([embedder.get_query_embedding(TEXTS[0])], ours[:1], "get_query_embedding")

    async_vectors = asyncio.run(embedder.aget_text_embedding_batch(TEXTS))
    assert_same_vectors(async_vectors, ours, "aget_text_embedding_batch")


def test_llama_index_tei_rerank(scoring_server):
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.postprocessor.tei_rerank import TextEmbeddingInference

    reranker = TextEmbeddingInference(base_url=scoring_server.url(""), top_n=len(DOCUMENTS), timeout=60)
    nodes = [NodeWithScore(node=TextNode(text=text, id_=str(i)), score=0.0) for i, text in enumerate(DOCUMENTS)]
    ranked = reranker.postprocess_nodes(nodes, QueryBundle(QUERY))
    ours = _our_rerank(scoring_server, QUERY, DOCUMENTS)
    assert [int(node.node.id_) for node in ranked] == [result["index"] for result in ours]
    np.testing.assert_allclose([node.score for node in ranked], [result["relevance_score"] for result in ours],
                               atol=1e-6, rtol=0)


# --- chromadb ----------------------------------------------------------------------------------

def test_chromadb_huggingface_embedding_server(scoring_server, monkeypatch):
    monkeypatch.setenv("ANONYMIZED_TELEMETRY", "False")
    monkeypatch.delenv("HUGGINGFACE_API_KEY", raising=False)  # it would send it as a bearer token
    from chromadb.utils.embedding_functions import HuggingFaceEmbeddingServer

    embed = HuggingFaceEmbeddingServer(url=scoring_server.url("/embed"))
    ours = _our_vectors(scoring_server, TEXTS)
    assert_same_vectors(np.stack(embed(TEXTS)), ours, "__call__")
    assert_same_vectors(np.stack(embed.embed_query([TEXTS[1]])), ours[1:2], "embed_query")


# --- LiteLLM -----------------------------------------------------------------------------------

def test_litellm_infinity_embedding(scoring_server, litellm):
    response = litellm.embedding(model=f"infinity/{MODEL_NAME}", input=TEXTS, api_base=scoring_server.url(""))
    assert [item["index"] for item in response.data] == list(range(len(TEXTS)))
    assert_same_vectors([item["embedding"] for item in response.data], _our_vectors(scoring_server, TEXTS))
    assert response.usage.prompt_tokens > 0


def test_litellm_infinity_rerank(scoring_server, litellm):
    response = litellm.rerank(model=f"infinity/{RERANKER_NAME}", query=QUERY, documents=DOCUMENTS,
                              api_base=scoring_server.url(""))
    ours = _our_rerank(scoring_server, QUERY, DOCUMENTS)
    assert [result["index"] for result in response.results] == [result["index"] for result in ours]
    np.testing.assert_allclose([result["relevance_score"] for result in response.results],
                               [result["relevance_score"] for result in ours], atol=SAME_SCORES_ATOL, rtol=0)
    # LiteLLM asks for the documents back and reads each as infinity's plain text.
    assert [result["document"]["text"] for result in response.results] == [DOCUMENTS[r["index"]] for r in ours]


def test_litellm_openai_embedding(scoring_server, litellm):
    """LiteLLM's openai provider sends `"encoding_format": null` where the caller named
    none, which OpenAI reads as float; so does the server (tests/fast/test_front_end.py)."""
    response = litellm.embedding(model=f"openai/{MODEL_NAME}", input=TEXTS, api_base=scoring_server.url("/v1"),
                                 api_key="not-checked")
    assert [item["index"] for item in response.data] == list(range(len(TEXTS)))
    assert_same_vectors([item["embedding"] for item in response.data], _our_vectors(scoring_server, TEXTS))
