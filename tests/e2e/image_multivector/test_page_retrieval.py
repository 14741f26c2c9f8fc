"""Page-retrieval models: a tiny ColPali and a tiny ColQwen2 built at test time and served,
against transformers on the same folders: a text query is the processor's
`process_queries` through the model, a page image its `process_images` (ColPali's token
types, ColQwen2's patch grids: its pages' token counts vary with their size), each
giving a vector per attended token (`embeddings[mask]`), alone and in batches; rerank
scores pages against a query by MaxSim, as the processor's `score_retrieval` does; a
colpali-engine folder is refused at start with what to do."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from tests.support.answers import assert_error
from tests.support.server import models_toml, running_server
from tests.support.tiny_models import save_tiny_colpali, save_tiny_colqwen2

pytestmark = pytest.mark.timeout(300)

COLPALI, COLQWEN2 = "tiny-colpali", "tiny-colqwen2"
MODELS = [COLPALI, COLQWEN2]
QUERIES = ["the quick fox", "seven wizards judge boxing matches of jumbo sized quartz", "dog"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("page-retrieval")
    return {COLPALI: save_tiny_colpali(root / "colpali", seed=5), COLQWEN2: save_tiny_colqwen2(root / "colqwen2", seed=6)}


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    config = models_toml(folders)
    with running_server(config=config, log_dir=tmp_path_factory.mktemp("page-retrieval-server")) as proc:
        yield proc


def _page(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (*size[::-1], 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


# Of different sizes: ColQwen2 gives them different token counts.
PAGES = [_page(0, (40, 56)), _page(1, (32, 32)), _page(2, (150, 100)), _page(3, (17, 23))]


def _uri(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def reference(folder, queries: list[str] | None = None, pages: list[bytes] | None = None) -> list[np.ndarray]:
    """transformers' vectors of each query or page, alone: every key of the processor's
    output but `labels`, the rows of attended tokens."""
    import torch
    import transformers
    from PIL import Image

    architecture = getattr(transformers, json.loads((folder / "config.json").read_text())["architectures"][0])
    model, processor = architecture.from_pretrained(str(folder)).eval(), transformers.AutoProcessor.from_pretrained(str(folder))
    out = []
    for item in (queries or pages):
        encoded = (processor.process_queries([item]) if queries else
                   processor.process_images([Image.open(io.BytesIO(item)).convert("RGB")]))
        with torch.inference_mode():
            vectors = model(**{k: v for k, v in encoded.items() if k != "labels"}).embeddings[0]
        out.append(vectors[encoded["attention_mask"][0].bool()].numpy())
    return out


def _matrices(server, model: str, inputs: list[str], modality: str = "text") -> list[np.ndarray]:
    answer = server.post("/v1/embeddings", json={"model": model, "input": inputs, "modality": modality})
    assert answer.status_code == 200, answer.text
    data = answer.json()["data"]
    assert all(item["shape"] == [len(item["embedding"]), 16] for item in data)
    return [np.array(item["embedding"], dtype=np.float32) for item in data]


def test_the_models_are_served_as_image_multivector(server):
    cards = server.get("/v1/models").json()["data"]
    assert {card["id"]: (card["kind"], card["dimensions"], card["backend"], card["capabilities"]) for card in cards} == {
        name: ("image_multivector", 16, "torch", ["embed", "image_embed", "rerank"]) for name in MODELS}


@pytest.mark.parametrize("model", MODELS)
def test_queries_match_transformers_alone_and_in_a_batch(server, folders, model):
    expected = reference(folders[model], queries=QUERIES)
    for served in (_matrices(server, model, QUERIES), [_matrices(server, model, [q])[0] for q in QUERIES]):
        for got, want in zip(served, expected):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_pages_match_transformers_alone_and_in_a_batch(server, folders, model):
    expected = reference(folders[model], pages=PAGES)
    uris = [_uri(page) for page in PAGES]
    if model == COLQWEN2:
        assert len({len(rows) for rows in expected}) > 1, "pages of different sizes, different token counts"
    for served in (_matrices(server, model, uris, "image"), [_matrices(server, model, [u], "image")[0] for u in uris]):
        for got, want in zip(served, expected):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, atol=1e-5)


def _maxsim(query: np.ndarray, page: np.ndarray) -> float:
    return float((query @ page.T).max(axis=1).sum())


@pytest.mark.parametrize("model", MODELS)
def test_rerank_scores_pages_by_maxsim_as_the_processor_does(server, folders, model):
    import torch
    from transformers import AutoProcessor

    folder = folders[model]
    query_rows = reference(folder, queries=QUERIES[:1])[0]
    page_rows = reference(folder, pages=PAGES)
    processor = AutoProcessor.from_pretrained(str(folder))
    expected = processor.score_retrieval([torch.from_numpy(query_rows)], [torch.from_numpy(p) for p in page_rows])[0]
    np.testing.assert_allclose(expected.numpy(), [_maxsim(query_rows, p) for p in page_rows], rtol=1e-5)
    documents = [_uri(PAGES[0]), {"content": [{"type": "image_url", "image_url": {"url": _uri(PAGES[1])}}]},
                 _uri(PAGES[2]), _uri(PAGES[3])]
    answer = server.post("/v1/rerank", json={"model": model, "query": QUERIES[0], "documents": documents,
                                             "return_documents": True, "top_n": 3})
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    order = np.argsort(-expected.numpy(), kind="stable")[:3]
    assert [r["index"] for r in results] == order.tolist()
    np.testing.assert_allclose([r["relevance_score"] for r in results], expected.numpy()[order], rtol=1e-4)
    urls = [_uri(page) for page in PAGES]
    assert [r["document"]["text"] for r in results] == [urls[r["index"]] for r in results]


def test_the_cohere_client_reranks_pages(server, folders):
    import cohere

    folder = folders[COLPALI]
    query_rows = reference(folder, queries=QUERIES[1:2])[0]
    expected = [_maxsim(query_rows, p) for p in reference(folder, pages=PAGES)]
    client = cohere.ClientV2(base_url=server.url(""), api_key="unused")
    result = client.rerank(model=COLPALI, query=QUERIES[1], documents=[_uri(p) for p in PAGES])
    assert [r.index for r in result.results] == np.argsort(-np.array(expected), kind="stable").tolist()
    np.testing.assert_allclose([r.relevance_score for r in result.results], sorted(expected, reverse=True),
                               rtol=1e-4)


def test_bad_pages_and_token_ids_are_refused_and_the_server_serves_on(server, folders):
    bad = server.post("/v1/rerank", json={"model": COLPALI, "query": "fox",
                                          "documents": [_uri(PAGES[0]), "data:image/png;base64,AAAA"]})
    assert "input[1] is not an image" in assert_error(bad, 422)["message"]
    assert assert_error(server.post("/v1/rerank", json={"model": COLPALI, "query": "fox", "documents": [{"x": 1}]}),
                        422)["param"] == "documents"
    assert assert_error(server.post("/v1/embeddings", json={"model": COLPALI, "input": [[1, 2, 3]]}), 422)
    np.testing.assert_allclose(_matrices(server, COLPALI, QUERIES[:1])[0],
                               reference(folders[COLPALI], queries=QUERIES[:1])[0], atol=1e-5)


def test_a_colpali_engine_folder_is_refused_with_how_to_convert(folders, tmp_path):
    from infinity.config import ConfigError, ModelConfig
    from infinity.folders.resolve import resolve_model

    engine = tmp_path / "colpali-engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"model_type": "paligemma", "architectures": ["ColPali"]}))
    (engine / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "vidore/colpaligemma-3b"}))
    with pytest.raises(ConfigError, match="colpali-engine checkpoint.*-hf"):
        resolve_model(ModelConfig(name="m", source=str(engine)))
    for engine_name in ("onnx", "ctranslate2"):
        with pytest.raises(ConfigError, match="page-retrieval"):
            resolve_model(ModelConfig(name="m", source=str(folders[COLQWEN2]), engine=engine_name))


@pytest.mark.parametrize("model", MODELS)
def test_many_clients_sending_pages_and_queries_at_once_get_their_own_vectors(server, folders, model):
    """Pages of different sizes from different requests share batches (ColQwen2's pixels
    then padded to the batch's largest page): each client still gets its own rows."""
    from concurrent.futures import ThreadPoolExecutor

    pages, queries = reference(folders[model], pages=PAGES), reference(folders[model], queries=QUERIES)

    def call(i: int) -> tuple[np.ndarray, np.ndarray]:
        if i % 3:
            k = i % len(PAGES)
            return _matrices(server, model, [_uri(PAGES[k])], "image")[0], pages[k]
        k = i % len(QUERIES)
        return _matrices(server, model, [QUERIES[k]])[0], queries[k]

    with ThreadPoolExecutor(8) as pool:
        for got, want in pool.map(call, range(36)):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_sentence_transformers_multi_vector_encoder_agrees_row_by_row(server, folders, model):
    """sentence-transformers' MultiVectorEncoder loads both folders (queries through
    `encode_query`, pages through `encode_document`): same rows, cosine 1 per row."""
    from PIL import Image
    from sentence_transformers import MultiVectorEncoder

    encoder = MultiVectorEncoder(str(folders[model]), device="cpu")
    expected = (list(encoder.encode_query(QUERIES)) +
                list(encoder.encode_document([Image.open(io.BytesIO(page)).convert("RGB") for page in PAGES])))
    served = _matrices(server, model, QUERIES) + _matrices(server, model, [_uri(page) for page in PAGES], "image")
    for got, want in zip(served, expected):
        want = np.asarray(want, dtype=np.float32)
        assert got.shape == want.shape
        cosines = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
        assert (cosines >= 0.99999).all()
