"""Sparse (SPLADE) models end to end: tiny sentence-transformers SparseEncoder folders and a
plain BERT masked language model served with `kind = "sparse"`, on the ONNX and torch
engines, against sentence-transformers' own `encode_document` on the same folders (the
same indices, values within 1e-5), alone and inside batches of other lengths; TEI's
`/embed_sparse` and the sparse items of `/v1/embeddings` (through the official `openai`
client too), `top_k` and the model's own max_active_dims, usage in tokens, and the 4xx
answers to what a sparse model cannot give; an inference-free model's queries weighed by
their tokens alone and its documents by SPLADE. One server serves every model."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from infinity.config import ConfigError, ModelConfig
from infinity.folders.resolve import resolve_model
from tests.support.answers import assert_error
from tests.support.reference import SAME_SCORES_ATOL
from tests.support.server import running_server
from tests.support.tiny_models import save_inference_free_sparse, save_tiny_bert, save_tiny_sparse, scoring_text

pytestmark = pytest.mark.timeout(300)

SPLADE = "tiny-splade"  # max of log(1 + relu), engine "auto" (ONNX here)
SUMMED = "tiny-splade-sum"  # sum of log(1 + log(1 + relu)), max_active_dims, MLMTransformer, torch
PLAIN = "tiny-masked-lm"  # a plain BertForMaskedLM folder with kind = "sparse", torch (padding-free BERT)
DENSE = "tiny-dense"
INFERENCE_FREE = "tiny-inference-free"  # a Router: SparseStaticEmbedding for queries, SPLADE for documents
MAX_ACTIVE_DIMS = 12
MAX_LENGTH = 64  # the tiny tokenizer's model_max_length


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("sparse")
    splade = save_tiny_sparse(root / "splade")
    return {
        SPLADE: splade,
        SUMMED: save_tiny_sparse(root / "summed", seed=1, pooling="sum", activation="log1p_relu",
                                 max_active_dims=MAX_ACTIVE_DIMS, legacy_module=True),
        PLAIN: root / "splade-mlm",  # the masked language model under SPLADE's folder
        DENSE: save_tiny_bert(root / "dense"),
        INFERENCE_FREE: save_inference_free_sparse(root / "inference-free", root / "splade-mlm"),
    }



@pytest.fixture(scope="module")
def sparse_server(folders, tmp_path_factory):
    config = (f'[[models]]\nname = "{SPLADE}"\nsource = "{folders[SPLADE]}"\n'
              f'[[models]]\nname = "{SUMMED}"\nsource = "{folders[SUMMED]}"\nengine = "torch"\n'
              f'[[models]]\nname = "{PLAIN}"\nsource = "{folders[PLAIN]}"\nkind = "sparse"\nengine = "torch"\n'
              f'[[models]]\nname = "{DENSE}"\nsource = "{folders[DENSE]}"\nengine = "torch"\n'
              f'[[models]]\nname = "{INFERENCE_FREE}"\nsource = "{folders[INFERENCE_FREE]}"\nengine = "torch"\n')
    log_dir = tmp_path_factory.mktemp("sparse-server")
    with running_server(config=config, log_dir=log_dir, env={"INFINITY_CACHE_DIR": str(log_dir / "cache")}) as proc:
        yield proc


@pytest.fixture(scope="module")
def reference(folders):
    """sentence-transformers' dense vectors of each sparse model's documents."""
    from sentence_transformers import SparseEncoder

    encoders = {name: SparseEncoder(str(folders[name]), device="cpu") for name in (SPLADE, SUMMED, PLAIN)}
    return lambda name, texts: encoders[name].encode_document(texts, convert_to_sparse_tensor=False).numpy()


def _texts(seed: int, count: int) -> list[str]:
    """Texts of 1 to 60 words, some longer than the models' 64 tokens (cut)."""
    rng = random.Random(seed)
    return [scoring_text(rng, rng.randint(1, 60)) for _ in range(count)]


def _embed_sparse(server, model: str, inputs, **fields) -> list[list[dict]]:
    answer = server.post("/embed_sparse", {"model": model, "inputs": inputs, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _assert_same_vector(first: list[dict], second: list[dict]) -> None:
    """Two answers ({index, value} by index) give the same vector within 1e-5 (an entry
    one of them has is as good as zero in the other)."""
    dense = [dict((entry["index"], entry["value"]) for entry in answer) for answer in (first, second)]
    indices = sorted(dense[0].keys() | dense[1].keys())
    np.testing.assert_allclose([dense[0].get(i, 0.0) for i in indices], [dense[1].get(i, 0.0) for i in indices],
                               atol=1e-5)


def _assert_matches(served: list[dict], expected: np.ndarray) -> None:
    """`served` ({index, value} by index) holds exactly the nonzero entries of the dense
    `expected`, each within 1e-5 (and a millionth of it: sums over tokens reach 50, where
    float32 values are 4e-6 apart)."""
    indices = [entry["index"] for entry in served]
    assert indices == np.flatnonzero(expected).tolist()
    np.testing.assert_allclose([entry["value"] for entry in served], expected[indices], atol=1e-5, rtol=1e-6)


def test_the_models_are_served_with_their_kind_and_vocabulary(sparse_server, folders):
    cards = {card["id"]: card for card in sparse_server.get("/v1/models").json()["data"]}
    vocabulary = Tokenizer.from_file(str(folders[SPLADE] / "tokenizer.json")).get_vocab_size()
    for name in (SPLADE, SUMMED, PLAIN):
        assert (cards[name]["kind"], cards[name]["capabilities"], cards[name]["dimensions"]) == (
            "sparse", ["sparse"], vocabulary)
    assert cards[SPLADE]["backend"] == "onnx" and cards[PLAIN]["backend"] == "torch"
    assert cards[DENSE]["kind"] == "embed"


@pytest.mark.parametrize("model", [SPLADE, SUMMED, PLAIN])
def test_embed_sparse_matches_sentence_transformers(sparse_server, reference, model):
    """The model's own max_active_dims (SUMMED's) is applied as sentence-transformers does."""
    texts = _texts(1, 16)
    served = _embed_sparse(sparse_server, model, texts)
    expected = reference(model, texts)
    assert len(served) == len(texts)
    for entries, vector in zip(served, expected, strict=True):
        assert 0 < len(entries) < len(vector)  # some entries, not every one
        _assert_matches(entries, vector)
    if model == SUMMED:
        assert max(len(entries) for entries in served) == MAX_ACTIVE_DIMS


def test_an_input_alone_and_inside_a_batch_of_other_lengths_agree(sparse_server):
    texts = _texts(2, 10)
    for model in (SPLADE, PLAIN):
        batch = _embed_sparse(sparse_server, model, texts)
        for text, entries in zip(texts, batch):
            (alone,) = _embed_sparse(sparse_server, model, text)
            assert [e["index"] for e in alone] == [e["index"] for e in entries]
            np.testing.assert_allclose([e["value"] for e in alone], [e["value"] for e in entries], atol=1e-5)


def test_embeddings_items_hold_the_same_vectors_and_usage_counts_tokens(sparse_server, folders):
    texts = _texts(3, 6) + ["word " * 80]  # some are cut to the model's 64 tokens
    body = sparse_server.post("/v1/embeddings", {"model": SPLADE, "input": texts}).json()
    expected = _embed_sparse(sparse_server, SPLADE, texts)
    assert [item["index"] for item in body["data"]] == list(range(len(texts)))
    for item, entries in zip(body["data"], expected, strict=True):
        assert item["object"] == "embedding"
        assert item["embedding"] == {"indices": [e["index"] for e in entries], "values": [e["value"] for e in entries]}
    lengths = [len(encoding.ids) for encoding in
               Tokenizer.from_file(str(folders[SPLADE] / "tokenizer.json")).encode_batch(texts)]
    tokens = sum(min(length, MAX_LENGTH) for length in lengths)
    truncated = sum(length > MAX_LENGTH for length in lengths)
    assert truncated >= 1
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "truncated_inputs": truncated}
    typed = sparse_server.post("/v1/embeddings", {"model": SPLADE, "input": texts[:2],
                                                  "embedding_types": ["float"]}).json()
    for item, plain in zip(typed["data"], body["data"][:2], strict=True):
        # Two requests: weights SAME_SCORES_ATOL apart, so one that near 0 may be in one only.
        as_typed, as_plain = (dict(zip(vector["indices"], vector["values"]))
                              for vector in (item["embeddings"]["float"], plain["embedding"]))
        for index in as_typed.keys() | as_plain.keys():
            assert abs(as_typed.get(index, 0.0) - as_plain.get(index, 0.0)) <= SAME_SCORES_ATOL, index


def test_top_k_keeps_the_largest_values_sorted_by_index(sparse_server):
    texts = _texts(4, 5)
    whole = _embed_sparse(sparse_server, SPLADE, texts)
    for top_k in (1, 5):
        cut = _embed_sparse(sparse_server, SPLADE, texts, top_k=top_k)
        items = sparse_server.post("/v1/embeddings", {"model": SPLADE, "input": texts, "top_k": top_k}).json()["data"]
        for entries, kept, item in zip(whole, cut, items, strict=True):
            largest = sorted(sorted(entries, key=lambda e: -e["value"])[:top_k], key=lambda e: e["index"])
            assert kept == largest
            assert item["embedding"] == {"indices": [e["index"] for e in kept], "values": [e["value"] for e in kept]}
    # A request's top_k never lifts the model's own max_active_dims.
    summed = _embed_sparse(sparse_server, SUMMED, texts, top_k=1000)
    assert max(len(entries) for entries in summed) == MAX_ACTIVE_DIMS


def test_token_ids_and_truncation_on_embed_sparse(sparse_server, folders):
    tokenizer = Tokenizer.from_file(str(folders[SPLADE] / "tokenizer.json"))
    # A text that fits: the tokenizer's training varies, so a fixed text may not, and ids
    # past the limit are cut at the end (their [SEP] with them), a text before its [SEP].
    text = next(text for text in _texts(5, 20) if len(tokenizer.encode(text).ids) < MAX_LENGTH)
    (by_ids,) = _embed_sparse(sparse_server, SPLADE, [tokenizer.encode(text).ids])
    (by_text,) = _embed_sparse(sparse_server, SPLADE, [text])
    # Within float noise, not equal: a lone input may run on a lane or on the wide pass.
    _assert_same_vector(by_ids, by_text)
    long = "word " * 80
    assert _embed_sparse(sparse_server, SPLADE, [long], truncate=True)
    assert _embed_sparse(sparse_server, SPLADE, ["short"], truncate=False)
    assert assert_error(sparse_server.post("/embed_sparse", {"model": SPLADE, "inputs": [long], "truncate": False}),
                        422)["param"] == "truncate"


@pytest.mark.parametrize("fields, param", [
    ({"dimensions": 16}, "dimensions"),
    ({"encoding_format": "base64"}, "encoding_format"),
    ({"embedding_types": ["float", "int8"]}, "embedding_types"),
    ({"embedding_type": "binary"}, "embedding_type"),
    ({"top_k": 0}, "top_k"),
])
def test_what_a_sparse_vector_cannot_be_is_refused_on_embeddings(sparse_server, fields, param):
    answer = sparse_server.post("/v1/embeddings", {"model": SPLADE, "input": ["a text"], **fields})
    assert assert_error(answer, 422)["param"] == param


@pytest.mark.parametrize("fields, param", [
    ({"prompt_name": "no-such-prompt"}, "prompt_name"),
    ({"truncation_direction": "Left"}, "truncation_direction"),
    ({"top_k": 0}, "top_k"),
    ({"inputs": ""}, "inputs"),
    ({"inputs": []}, "inputs"),
])
def test_bad_embed_sparse_requests_are_refused(sparse_server, fields, param):
    answer = sparse_server.post("/embed_sparse", {"model": SPLADE, "inputs": ["a text"], **fields})
    assert assert_error(answer, 422)["param"] == param


def test_models_of_other_kinds_are_refused_with_the_reason(sparse_server):
    assert assert_error(sparse_server.post("/embed_sparse", {"model": DENSE, "inputs": ["a"]}),
                        400)["code"] == "wrong_model_kind"
    # Three sparse models: one must be named.
    assert assert_error(sparse_server.post("/embed_sparse", {"inputs": ["a"]}), 422)["param"] == "model"
    top_k = sparse_server.post("/v1/embeddings", {"model": DENSE, "input": ["a"], "top_k": 3})
    assert "sparse" in assert_error(top_k, 422)["message"]
    for path, body in (("/v1/rerank", {"query": "q", "documents": ["d"]}), ("/v1/classify", {"input": ["a"]}),
                       ("/v1/embed", {"texts": ["a"]})):
        error = assert_error(sparse_server.post(path, {"model": SPLADE, **body}), 400)
        assert error["code"] == "wrong_model_kind" and "'sparse'" in error["message"]


def test_the_openai_client_parses_sparse_items_in_float_and_is_told_why_base64_is_refused(sparse_server):
    import openai

    texts = _texts(6, 3)
    expected = _embed_sparse(sparse_server, SPLADE, texts)
    with openai.OpenAI(base_url=sparse_server.url("/v1"), api_key="unused", max_retries=0) as client:
        response = client.embeddings.create(model=SPLADE, input=texts, encoding_format="float")
        for item, entries in zip(response.data, expected, strict=True):
            assert item.embedding == {"indices": [e["index"] for e in entries],
                                      "values": [e["value"] for e in entries]}
        assert response.usage.prompt_tokens > 0
        with pytest.raises(openai.UnprocessableEntityError, match="encoding_format"):
            client.embeddings.create(model=SPLADE, input=texts)  # the client asks for base64


def test_the_contract_lists_embed_sparse_and_the_sparse_models(sparse_server):
    from openapi_spec_validator import OpenAPIV31SpecValidator, validate

    document = sparse_server.get("/openapi.json").json()
    validate(document, cls=OpenAPIV31SpecValidator)
    assert {"/embed_sparse", "/v1/embed_sparse"} <= set(document["paths"])
    schemas = document["components"]["schemas"]
    assert schemas["SparseEmbedRequest"]["properties"]["model"]["anyOf"][0]["enum"] == [SPLADE, SUMMED, PLAIN,
                                                                                     INFERENCE_FREE]
    assert set(schemas["EmbeddingRequest"]["properties"]["model"]["anyOf"][0]["enum"]) == {
        SPLADE, SUMMED, PLAIN, DENSE, INFERENCE_FREE}
    answer = document["paths"]["/embed_sparse"]["post"]["responses"]["200"]["content"]["application/json"]
    assert schemas[answer["schema"]["$ref"].rsplit("/", 1)[-1]]["type"] == "array"


def test_the_torch_engine_gives_the_masked_language_model_logits_padding_free(folders):
    """BertForMaskedLM's body takes the padding-free forward, then its MLM head: the
    module's own logits at every real token. CTranslate2 has no MLM head to give."""
    import msgspec
    from transformers import BertForMaskedLM

    from infinity.shared.kinds import TEXT, RawOutput
    from workers.engines.ctranslate2_engine import CTranslate2Engine
    from workers.heads import load_model

    spec = resolve_model(ModelConfig(name="p", source=str(folders[PLAIN]), kind="sparse", engine="torch"))
    engine = load_model(spec, 1).engine
    assert engine._packed is not None
    ids = np.array([[2, 5, 6, 7, 8, 3], [2, 9, 3, 0, 0, 0]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    logits = engine.forward(ids, mask, np.zeros_like(ids))
    with torch.inference_mode():
        expected = BertForMaskedLM.from_pretrained(str(folders[PLAIN])).eval()(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
    keep = torch.from_numpy(mask).bool()
    torch.testing.assert_close(logits[keep], expected[keep], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="masked-language-model"):
        CTranslate2Engine(msgspec.structs.replace(spec, engine="ctranslate2"), 1, {TEXT: RawOutput.TOKEN_LOGITS})


# --- what is refused at start --------------------------------------------------------------------

def test_a_sparse_folder_is_detected_and_its_splade_settings_read(folders):
    spec = resolve_model(ModelConfig(name="s", source=str(folders[SUMMED])))
    assert (spec.kind, spec.pooling, spec.sparse_activation, spec.max_active_dims, spec.normalize) == (
        "sparse", "sum", "log1p_relu", MAX_ACTIVE_DIMS, False)
    assert resolve_model(ModelConfig(name="p", source=str(folders[PLAIN]))).kind == "embed"  # unless told
    assert resolve_model(ModelConfig(name="s", source=str(folders[SPLADE]))).engine != "ctranslate2"


@pytest.mark.parametrize("settings, message", [
    ({"engine": "ctranslate2"}, "ctranslate2"),
    ({"pooling": "mean"}, "pooling"),
    ({"normalize": True}, "normalize"),
])
def test_settings_a_sparse_model_cannot_take_fail_the_start(folders, settings, message):
    with pytest.raises(ConfigError, match=message):
        resolve_model(ModelConfig(name="s", source=str(folders[SPLADE]), **settings))


def test_kind_sparse_needs_a_masked_language_model_head(folders):
    with pytest.raises(ConfigError, match="ForMaskedLM"):
        resolve_model(ModelConfig(name="d", source=str(folders[DENSE]), kind="sparse"))


def test_sparse_encoder_modules_that_are_not_served_fail_the_start(folders, tmp_path):
    """A SparseAutoEncoder over dense embeddings, and a Router whose routes are not an
    inference-free model's (a dense model's), are refused by name."""
    from sentence_transformers import SentenceTransformer, SparseEncoder
    from sentence_transformers.sentence_transformer.modules import Pooling
    from sentence_transformers.sparse_encoder.modules import Router, SparseAutoEncoder, Transformer

    SparseEncoder(modules=[Transformer(str(folders[DENSE])), Pooling(32, "mean"),
                           SparseAutoEncoder(input_dim=32, hidden_dim=64, k=8)]).save(str(tmp_path / "csr"))
    dense = str(folders[DENSE])
    SentenceTransformer(modules=[Router.for_query_document(
        query_modules=[Transformer(dense), Pooling(32, "cls")],
        document_modules=[Transformer(dense), Pooling(32, "mean")])]).save(str(tmp_path / "dense-router"))
    for folder, reason in (("csr", "SparseAutoEncoder"), ("dense-router", "Router is served for inference-free")):
        with pytest.raises(ConfigError, match=reason):
            resolve_model(ModelConfig(name="x", source=str(tmp_path / folder)))


def test_an_inference_free_model_weighs_queries_by_their_tokens_and_documents_by_splade(sparse_server, folders):
    """Queries (`input_type` query) as sentence-transformers' encode_query gives them, with
    no pass of the model; documents (named so, or by default, and on TEI's route) as its
    encode_document; a batch of queries of several lengths alone and together agree."""
    from sentence_transformers import SparseEncoder

    reference = SparseEncoder(str(folders[INFERENCE_FREE]), device="cpu")
    queries, documents = _texts(11, 5) + ["word " * 80], _texts(12, 4)
    expected = {"query": reference.encode_query(queries, convert_to_sparse_tensor=False).numpy(),
                "document": reference.encode_document(documents, convert_to_sparse_tensor=False).numpy()}

    def embedded(texts, **fields):
        answer = sparse_server.post("/v1/embeddings", {"model": INFERENCE_FREE, "input": texts, **fields})
        assert answer.status_code == 200, answer.text
        return [[{"index": i, "value": v} for i, v in zip(item["embedding"]["indices"], item["embedding"]["values"])]
                for item in answer.json()["data"]]

    for served, wanted in zip(embedded(queries, input_type="query"), expected["query"], strict=True):
        _assert_matches(served, wanted)
    alone = embedded(queries[1], input_type="query")[0]
    _assert_matches(alone, expected["query"][1])
    for answer in (embedded(documents, input_type="document"), embedded(documents),
                   _embed_sparse(sparse_server, INFERENCE_FREE, documents)):
        for served, wanted in zip(answer, expected["document"], strict=True):
            _assert_matches(served, wanted)
    usage = sparse_server.post("/v1/embeddings", {"model": INFERENCE_FREE, "input": queries[:1],
                                                  "input_type": "query"}).json()["usage"]
    tokenizer = Tokenizer.from_file(str(next(folders[INFERENCE_FREE].glob("query_*")) / "tokenizer.json"))
    assert usage["prompt_tokens"] == min(len(tokenizer.encode(queries[0], add_special_tokens=False).ids), MAX_LENGTH)


def test_a_binary_answer_is_refused_for_a_sparse_model(sparse_server):
    answer = sparse_server.post("/v1/embeddings", {"model": SPLADE, "input": ["a text"], "encoding_format": "bytes"})
    assert answer.status_code == 422 and answer.json()["error"]["param"] == "encoding_format"
