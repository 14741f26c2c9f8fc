"""Two-tower (image-text) models, their text tower: tiny CLIP and SigLIP folders built at
test time and served, against transformers' `get_text_features` on the same folders
(and sentence-transformers for CLIP): L2-normalised vectors, SigLIP's texts padded to
its full length whatever the batch, padding not billed; a CLIP whose tokenizer never
emits the token it pools at is refused at start; inputs of another modality are refused
rather than embedded as text."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tests.conftest import assert_error
from tests.tiny_models import save_tiny_clip, save_tiny_siglip, scoring_text

pytestmark = pytest.mark.timeout(300)

CLIP, SIGLIP = "tiny-clip", "tiny-siglip"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("image-text")
    return {CLIP: save_tiny_clip(root / "clip", seed=1), SIGLIP: save_tiny_siglip(root / "siglip", seed=2)}


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    from tests.conftest import start_server_process

    config = "".join(f'[[models]]\nname = "{name}"\nsource = "{folder}"\n' for name, folder in folders.items())
    proc = start_server_process(config=config, log_dir=tmp_path_factory.mktemp("image-text-server"))
    try:
        yield proc
    finally:
        proc.cleanup()


def reference(folder, texts: list[str]) -> np.ndarray:
    """transformers' text vectors, normalised: CLIP's texts padded to the longest, SigLIP's
    to the tower's full length, as each is trained."""
    import torch
    from transformers import AutoModel, AutoProcessor

    model, processor = AutoModel.from_pretrained(str(folder)).eval(), AutoProcessor.from_pretrained(str(folder))
    padding = "max_length" if model.config.model_type == "siglip" else True
    with torch.inference_mode():
        vectors = model.get_text_features(**processor(text=texts, padding=padding, truncation=True,
                                                      return_tensors="pt")).pooler_output
    return torch.nn.functional.normalize(vectors, dim=-1).numpy()


def _texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [scoring_text(rng, rng.randint(1, 12)) for _ in range(count)]


def _embed(server, model: str, texts: list[str]) -> np.ndarray:
    answer = server.post("/v1/embeddings", json={"model": model, "input": texts})
    assert answer.status_code == 200, answer.text
    return np.array([item["embedding"] for item in answer.json()["data"]], dtype=np.float32)


def test_the_models_are_served_as_image_text(server):
    cards = {card["id"]: card for card in server.get("/v1/models").json()["data"]}
    assert {name: (card["kind"], card["dimensions"], card["backend"]) for name, card in cards.items()} == {
        CLIP: ("image_text", 16, "torch"), SIGLIP: ("image_text", 32, "torch")}


@pytest.mark.parametrize("model", [CLIP, SIGLIP])
def test_text_vectors_are_the_text_towers_normalised(server, folders, model):
    texts = _texts(1, 9)
    np.testing.assert_allclose(_embed(server, model, texts), reference(folders[model], texts), atol=1e-5)


def test_clip_text_matches_sentence_transformers_by_cosine(server, folders):
    from sentence_transformers import SentenceTransformer

    texts = _texts(2, 6)
    expected = SentenceTransformer(str(folders[CLIP]), device="cpu").encode(texts)  # not normalised
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    assert (np.sum(_embed(server, CLIP, texts) * expected, axis=1) >= 0.99999).all()


@pytest.mark.parametrize("model", [CLIP, SIGLIP])
def test_a_text_alone_and_inside_a_batch_of_other_lengths_agree(server, model):
    texts = _texts(3, 7)
    batch = _embed(server, model, texts)
    for text, vector in zip(texts, batch):
        np.testing.assert_allclose(_embed(server, model, [text])[0], vector, atol=1e-5)


def test_padding_to_full_length_is_not_billed(server, folders):
    from tokenizers import Tokenizer

    texts = ["quick fox", "lazy dog jumps"]
    tokenizer = Tokenizer.from_file(str(folders[SIGLIP] / "tokenizer.json"))
    answer = server.post("/v1/embeddings", json={"model": SIGLIP, "input": texts}).json()
    assert answer["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(text).ids) for text in texts)


def test_the_cohere_route_embeds_text_with_an_image_text_model(server, folders):
    answer = server.post("/v2/embed", json={"model": CLIP, "texts": ["quick fox"], "input_type": "search_query",
                                            "embedding_types": ["float"]})
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(answer.json()["embeddings"]["float"], reference(folders[CLIP], ["quick fox"]),
                               atol=1e-5)


@pytest.mark.parametrize("modality", ["image", "audio"])
def test_inputs_of_another_modality_are_refused_not_read_as_text(server, modality):
    answer = server.post("/v1/embeddings", json={"model": CLIP, "input": ["data:image/png;base64,iVBORw0KGgo="],
                                                 "modality": modality})
    assert assert_error(answer, 422)["param"] == "modality"


def test_a_clip_whose_tokenizer_never_gives_its_pooling_token_is_refused(folders, tmp_path):
    import shutil

    from infinity.config import ConfigError, ModelConfig
    from infinity.models import resolve_model

    broken = tmp_path / "clip"
    shutil.copytree(folders[CLIP], broken)
    config = json.loads((broken / "config.json").read_text())
    config["text_config"]["eos_token_id"] = 7  # an ordinary word's id: never at the end of every text
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="pools at token id 7"):
        resolve_model(ModelConfig(name="broken", source=str(broken)))
