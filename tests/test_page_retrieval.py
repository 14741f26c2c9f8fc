"""Page-retrieval (ColPali) models: a tiny ColPali built at test time and served, against
transformers on the same folder: a text query is the processor's `process_queries`
through the model, a page image its `process_images` (token types included), each
giving a vector per attended token (`embeddings[mask]`); rerank scores pages against a
query by MaxSim, as the processor's `score_retrieval` does; a colpali-engine folder is
refused at start with what to do."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from tests.conftest import assert_error
from tests.tiny_models import save_tiny_colpali

pytestmark = pytest.mark.timeout(300)

COLPALI = "tiny-colpali"
QUERIES = ["the quick fox", "seven wizards judge boxing matches of jumbo sized quartz", "dog"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_colpali(tmp_path_factory.mktemp("page-retrieval") / "colpali", seed=5)


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    from tests.conftest import start_server_process

    config = f'[[models]]\nname = "{COLPALI}"\nsource = "{folder}"\n'
    proc = start_server_process(config=config, log_dir=tmp_path_factory.mktemp("page-retrieval-server"))
    try:
        yield proc
    finally:
        proc.cleanup()


def _page(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (*size[::-1], 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


PAGES = [_page(0, (40, 56)), _page(1, (32, 32)), _page(2, (90, 60)), _page(3, (17, 23))]


def _uri(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def reference(folder, queries: list[str] | None = None, pages: list[bytes] | None = None) -> list[np.ndarray]:
    """transformers' vectors of each query or page, alone: every key of the processor's
    output but `labels`, the rows of attended tokens."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor, ColPaliForRetrieval

    model, processor = ColPaliForRetrieval.from_pretrained(str(folder)).eval(), AutoProcessor.from_pretrained(str(folder))
    out = []
    for item in (queries or pages):
        encoded = (processor.process_queries([item]) if queries else
                   processor.process_images([Image.open(io.BytesIO(item)).convert("RGB")]))
        with torch.inference_mode():
            vectors = model(**{k: v for k, v in encoded.items() if k != "labels"}).embeddings[0]
        out.append(vectors[encoded["attention_mask"][0].bool()].numpy())
    return out


def _matrices(server, inputs: list[str], modality: str = "text") -> list[np.ndarray]:
    answer = server.post("/v1/embeddings", json={"model": COLPALI, "input": inputs, "modality": modality})
    assert answer.status_code == 200, answer.text
    data = answer.json()["data"]
    assert all(item["shape"] == [len(item["embedding"]), 16] for item in data)
    return [np.array(item["embedding"], dtype=np.float32) for item in data]


def test_the_model_is_served_as_image_multivector(server):
    (card,) = server.get("/v1/models").json()["data"]
    assert (card["kind"], card["dimensions"], card["backend"], card["capabilities"]) == (
        "image_multivector", 16, "torch", ["embed", "image_embed", "rerank"])


def test_queries_match_transformers_alone_and_in_a_batch(server, folder):
    expected = reference(folder, queries=QUERIES)
    for served in (_matrices(server, QUERIES), [_matrices(server, [q])[0] for q in QUERIES]):
        for got, want in zip(served, expected):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, atol=1e-5)


def test_pages_match_transformers_alone_and_in_a_batch(server, folder):
    expected = reference(folder, pages=PAGES)
    uris = [_uri(page) for page in PAGES]
    for served in (_matrices(server, uris, "image"), [_matrices(server, [u], "image")[0] for u in uris]):
        for got, want in zip(served, expected):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, atol=1e-5)


def _maxsim(query: np.ndarray, page: np.ndarray) -> float:
    return float((query @ page.T).max(axis=1).sum())


def test_rerank_scores_pages_by_maxsim_as_the_processor_does(server, folder):
    import torch
    from transformers import AutoProcessor

    query_rows = reference(folder, queries=QUERIES[:1])[0]
    page_rows = reference(folder, pages=PAGES)
    processor = AutoProcessor.from_pretrained(str(folder))
    expected = processor.score_retrieval([torch.from_numpy(query_rows)], [torch.from_numpy(p) for p in page_rows])[0]
    np.testing.assert_allclose(expected.numpy(), [_maxsim(query_rows, p) for p in page_rows], rtol=1e-5)
    documents = [_uri(PAGES[0]), {"content": [{"type": "image_url", "image_url": {"url": _uri(PAGES[1])}}]},
                 _uri(PAGES[2]), _uri(PAGES[3])]
    answer = server.post("/v1/rerank", json={"model": COLPALI, "query": QUERIES[0], "documents": documents,
                                             "return_documents": True, "top_n": 3})
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    order = np.argsort(-expected.numpy(), kind="stable")[:3]
    assert [r["index"] for r in results] == order.tolist()
    np.testing.assert_allclose([r["relevance_score"] for r in results], expected.numpy()[order], rtol=1e-4)
    urls = [_uri(page) for page in PAGES]
    assert [r["document"]["text"] for r in results] == [urls[r["index"]] for r in results]


def test_the_cohere_client_reranks_pages(server, folder):
    import cohere

    query_rows = reference(folder, queries=QUERIES[1:2])[0]
    expected = [_maxsim(query_rows, p) for p in reference(folder, pages=PAGES)]
    client = cohere.ClientV2(base_url=server.url(""), api_key="unused")
    result = client.rerank(model=COLPALI, query=QUERIES[1], documents=[_uri(p) for p in PAGES])
    assert [r.index for r in result.results] == np.argsort(-np.array(expected), kind="stable").tolist()
    np.testing.assert_allclose([r.relevance_score for r in result.results], sorted(expected, reverse=True),
                               rtol=1e-4)


def test_bad_pages_and_token_ids_are_refused_and_the_server_serves_on(server, folder):
    bad = server.post("/v1/rerank", json={"model": COLPALI, "query": "fox",
                                          "documents": [_uri(PAGES[0]), "data:image/png;base64,AAAA"]})
    assert "input[1] is not an image" in assert_error(bad, 422)["message"]
    assert assert_error(server.post("/v1/rerank", json={"model": COLPALI, "query": "fox", "documents": [{"x": 1}]}),
                        422)["param"] == "documents"
    assert assert_error(server.post("/v1/embeddings", json={"model": COLPALI, "input": [[1, 2, 3]]}), 422)
    np.testing.assert_allclose(_matrices(server, QUERIES[:1])[0], reference(folder, queries=QUERIES[:1])[0], atol=1e-5)


def test_a_colpali_engine_folder_is_refused_with_how_to_convert(folder, tmp_path):
    from infinity.config import ConfigError, ModelConfig
    from infinity.models import resolve_model

    engine = tmp_path / "colpali-engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"model_type": "paligemma", "architectures": ["ColPali"]}))
    (engine / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "vidore/colpaligemma-3b"}))
    with pytest.raises(ConfigError, match="colpali-engine checkpoint.*-hf"):
        resolve_model(ModelConfig(name="m", source=str(engine)))
    for engine_name in ("onnx", "ctranslate2"):
        with pytest.raises(ConfigError, match="page-retrieval"):
            resolve_model(ModelConfig(name="m", source=str(folder), engine=engine_name))
