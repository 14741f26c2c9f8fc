"""The CTranslate2 engine: parity with sentence-transformers (float32 and int8), the
converted model cached and reused on the next start, clear refusals."""

import pytest

from infinity.config import ModelConfig
from tests.conftest import cosine, decode_embedding
from workers.models import resolve_model

pytest.importorskip("ctranslate2")

CONFIG = """
[[models]]
name = "ct2-float32"
engine = "ctranslate2"
dtype = "float32"
[[models]]
name = "ct2-int8"
engine = "ctranslate2"
dtype = "int8"
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("ct2-cache")


def _served(server, model, texts):
    response = server.post("/v1/embeddings", {"model": model, "input": texts, "encoding_format": "base64"})
    assert response.status_code == 200, response.text
    return [decode_embedding(item["embedding"]) for item in response.json()["data"]]


def test_parity_and_conversion_cached_across_restarts(start_server, cache, sentences, reference_vectors):
    env = {"INFINITY_CACHE_DIR": str(cache)}
    first = start_server(config=CONFIG, env=env)
    assert first.log_text().count("to CTranslate2") == 2  # one conversion per dtype
    texts = sentences[:80]
    # float32 at the engines issue's bar (0.9999) for every text. int8 reaches 0.99 on
    # average but not for every text (on the 240 test sentences: mean 0.996, min 0.978, 2%
    # below 0.99); that gap is recorded in the issue.
    float32 = [cosine(v, reference_vectors[i]) for i, v in enumerate(_served(first, "ct2-float32", texts))]
    assert min(float32) >= 0.9999
    int8 = [cosine(v, reference_vectors[i]) for i, v in enumerate(_served(first, "ct2-int8", texts))]
    assert min(int8) >= 0.97 and sum(int8) / len(int8) >= 0.99
    first.stop()
    second = start_server(config=CONFIG, env=env)
    assert "to CTranslate2" not in second.log_text()  # reused, not converted again
    vector = _served(second, "ct2-float32", texts[:1])[0]
    assert cosine(vector, reference_vectors[0]) >= 0.9999


def test_ctranslate2_refuses_other_kinds_and_dtypes(tmp_path):
    from tests.tiny_models import save_tiny_cross_encoder
    from workers.engines import load_engine

    reranker = save_tiny_cross_encoder(tmp_path / "reranker")
    with pytest.raises(ValueError, match="embedding models"):
        load_engine(resolve_model(ModelConfig(name="r", source=str(reranker), engine="ctranslate2")), 1)
    with pytest.raises(ValueError, match="dtype"):
        load_engine(resolve_model(ModelConfig(name="e", engine="ctranslate2", dtype="bfloat16")), 1)
    with pytest.raises(ValueError, match="dtype"):
        load_engine(resolve_model(ModelConfig(name="e", engine="torch", dtype="int8")), 1)
