"""Two-tower (image-text) models, their text tower: tiny CLIP and SigLIP folders built at
test time and served, against transformers' `get_text_features` on the same folders
(and sentence-transformers for CLIP): L2-normalised vectors, SigLIP's texts padded to
its full length whatever the batch, padding not billed; a CLIP whose tokenizer never
emits the token it pools at is refused at start; inputs of another modality are refused
rather than embedded as text. Each model is served twice: on the engine `auto` picks
(ONNX Runtime here, both towers exported) and on torch."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tests.support.answers import assert_error
from tests.support.media_site import files_site
from tests.support.server import models_toml, running_server
from tests.support.tiny_models import save_tiny_clip, save_tiny_siglip, scoring_text

pytestmark = pytest.mark.timeout(300)

CLIP, SIGLIP = "tiny-clip", "tiny-siglip"  # engine "auto": ONNX Runtime
CLIP_TORCH, SIGLIP_TORCH = "tiny-clip-torch", "tiny-siglip-torch"
CLIP_INT8 = "tiny-clip-int8"  # ONNX Runtime, both towers' weights quantised
ALL_MODELS = [CLIP, SIGLIP, CLIP_TORCH, SIGLIP_TORCH]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("image-text")
    return {CLIP: save_tiny_clip(root / "clip", seed=1), SIGLIP: save_tiny_siglip(root / "siglip", seed=2)}


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    config = models_toml(folders)
    config += "".join(f'[[models]]\nname = "{name}-torch"\nsource = "{folder}"\nengine = "torch"\n'
                      for name, folder in folders.items())
    config += f'[[models]]\nname = "{CLIP_INT8}"\nsource = "{folders[CLIP]}"\nengine = "onnx"\ndtype = "int8"\n'
    config += "[media]\nallow_private_networks = true\n"  # the tests' image server is on loopback
    with running_server(config=config, log_dir=tmp_path_factory.mktemp("image-text-server")) as proc:
        yield proc


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
    assert {name: (card["kind"], card["dimensions"], card["backend"], card["capabilities"])
            for name, card in cards.items()} == {
        CLIP: ("image_text", 16, "onnx", ["embed", "image_embed"]),
        SIGLIP: ("image_text", 32, "onnx", ["embed", "image_embed"]),
        CLIP_TORCH: ("image_text", 16, "torch", ["embed", "image_embed"]),
        SIGLIP_TORCH: ("image_text", 32, "torch", ["embed", "image_embed"]),
        CLIP_INT8: ("image_text", 16, "onnx", ["embed", "image_embed"])}


@pytest.mark.parametrize("model", ALL_MODELS)
def test_text_vectors_are_the_text_towers_normalised(server, folders, model):
    texts = _texts(1, 9)
    folder = folders[model.removesuffix("-torch")]
    np.testing.assert_allclose(_embed(server, model, texts), reference(folder, texts), atol=1e-5)


def test_clip_text_matches_sentence_transformers_by_cosine(server, folders):
    from sentence_transformers import SentenceTransformer

    texts = _texts(2, 6)
    expected = SentenceTransformer(str(folders[CLIP]), device="cpu").encode(texts)  # not normalised
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    assert (np.sum(_embed(server, CLIP, texts) * expected, axis=1) >= 0.99999).all()


@pytest.mark.parametrize("model", ALL_MODELS)
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


def test_inputs_of_a_modality_the_model_lacks_are_refused_not_read_as_text(server):
    answer = server.post("/v1/embeddings", json={"model": CLIP, "input": ["data:audio/wav;base64,UklGRg=="],
                                                 "modality": "audio"})
    assert assert_error(answer, 422)["param"] == "modality"


def test_a_clip_whose_tokenizer_never_gives_its_pooling_token_is_refused(folders, tmp_path):
    import shutil

    from infinity.config import ConfigError, ModelConfig
    from infinity.folders.resolve import resolve_model

    broken = tmp_path / "clip"
    shutil.copytree(folders[CLIP], broken)
    config = json.loads((broken / "config.json").read_text())
    config["text_config"]["eos_token_id"] = 7  # an ordinary word's id: never at the end of every text
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="pools at token id 7"):
        resolve_model(ModelConfig(name="broken", source=str(broken)))


# --- images -------------------------------------------------------------------------------


def _png(seed: int, size: tuple[int, int], mode: str = "RGB", fmt: str = "PNG") -> bytes:
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    if mode == "I;16":  # 16-bit grey; values up to 1023, so Pillow's cut to 8 bits keeps some detail
        image = Image.fromarray(rng.integers(0, 1024, (size[1], size[0]), dtype=np.uint16))
    else:
        image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_reference(folder, files: list[bytes]) -> np.ndarray:
    """transformers' image vectors, normalised, of images loaded as its `load_image` loads them."""
    import io

    import torch
    from PIL import Image, ImageOps
    from transformers import AutoModel, AutoProcessor

    model, processor = AutoModel.from_pretrained(str(folder)).eval(), AutoProcessor.from_pretrained(str(folder))
    images = [ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB") for data in files]
    with torch.inference_mode():
        vectors = model.get_image_features(**processor(images=images, return_tensors="pt")).pooler_output
    return torch.nn.functional.normalize(vectors, dim=-1).numpy()


IMAGES = [_png(1, (40, 50)), _png(2, (64, 33), "L"), _png(3, (33, 70), "RGBA"), _png(4, (48, 48), "P", "GIF"),
          _png(5, (50, 40), "RGB", "JPEG"), _png(6, (45, 45), "RGB", "WEBP"), _png(7, (36, 52), "CMYK", "JPEG"),
          _png(8, (41, 39), "LA"), _png(9, (39, 41), "I;16")]
MIMES = ["image/png", "image/png", "image/png", "image/gif", "image/jpeg", "image/webp", "image/jpeg", "image/png",
         "image/png"]


def _bomb() -> bytes:
    """A 12000x12000 1-bit PNG: a few KB declaring 144 megapixels."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("1", (12000, 12000)).save(buffer, "PNG", optimize=True)
    return buffer.getvalue()


@pytest.mark.parametrize("model", ALL_MODELS)
def test_image_vectors_are_the_vision_towers_normalised(server, folders, model):
    uris = [_data_uri(data, mime) for data, mime in zip(IMAGES, MIMES)]
    answer = server.post("/v1/embeddings", json={"model": model, "input": uris, "modality": "image"})
    assert answer.status_code == 200, answer.text
    served = np.array([item["embedding"] for item in answer.json()["data"]], dtype=np.float32)
    np.testing.assert_allclose(served, image_reference(folders[model.removesuffix("-torch")], IMAGES), atol=1e-5)
    patches = (32 // 8) ** 2
    assert answer.json()["usage"]["prompt_tokens"] == patches * len(IMAGES)


@pytest.mark.parametrize("model", [CLIP, CLIP_TORCH])
def test_an_image_alone_and_inside_a_batch_agree(server, model):
    uris = [_data_uri(data, mime) for data, mime in zip(IMAGES, MIMES)]
    batch = server.post("/v1/embeddings", json={"model": model, "input": uris, "modality": "image"}).json()["data"]
    for uri, item in zip(uris, batch):
        (alone,) = server.post("/v1/embeddings", json={"model": model, "input": uri, "modality": "image"}).json()["data"]
        np.testing.assert_allclose(alone["embedding"], item["embedding"], atol=1e-5)


@pytest.mark.parametrize(("item", "reason"), [
    (_data_uri(_png(1, (1, 1))), "too small"),
    (_data_uri(_png(1, (60, 60))[:300]), "could not be decoded"),
    (_data_uri(b"no image at all"), "not an image"),
    (_data_uri(_png(1, (40, 40)), "text/plain"), "not image/"),
    ("data:image/png;base64,not*base64", "base64"),
    ("ftp://example.com/a.png", "neither a data: URI nor an http(s) URL"),
    (_data_uri(_bomb()), "pixels"),
    (_data_uri(b"\x89PNG" + bytes(11 * 1024 * 1024)), "more than 10485760 bytes"),
])
def test_a_bad_image_fails_its_own_request_and_the_next_is_served(server, item, reason):
    answer = server.post("/v1/embeddings", json={"model": CLIP, "input": [_data_uri(IMAGES[0]), item],
                                                 "modality": "image"})
    error = assert_error(answer, 422)
    assert reason in error["message"] and ("input[1]" in error["message"] or "input" == error["param"])
    good = server.post("/v1/embeddings", json={"model": CLIP, "input": [_data_uri(IMAGES[0])], "modality": "image"})
    assert good.status_code == 200, good.text


@pytest.fixture(scope="module")
def image_site():
    """A plain HTTP server on loopback serving the test images, and a 404."""
    with files_site(IMAGES, ".img") as url:
        yield url


def test_images_by_url_and_by_data_uri_agree(server, folders, image_site):
    urls = [f"{image_site}/{i}.img" for i in range(len(IMAGES))]
    answer = server.post("/v1/embeddings", json={"model": CLIP, "input": urls, "modality": "image"})
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose([item["embedding"] for item in answer.json()["data"]],
                               image_reference(folders[CLIP], IMAGES), atol=1e-5)
    missing = server.post("/v1/embeddings", json={"model": CLIP, "input": [f"{image_site}/99.img"],
                                                  "modality": "image"})
    assert "answered HTTP 404" in assert_error(missing, 422)["message"]


def test_infinitys_image_route_and_the_openai_client(server, folders):
    from openai import OpenAI

    uris = [_data_uri(data, mime) for data, mime in zip(IMAGES[:3], MIMES[:3])]
    expected = image_reference(folders[CLIP], IMAGES[:3])
    answer = server.post("/embeddings_image", json={"model": CLIP, "input": uris})
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose([item["embedding"] for item in answer.json()["data"]], expected, atol=1e-5)
    client = OpenAI(base_url=server.url("/v1"), api_key="unused")
    for options in ({"encoding_format": "float"}, {}):  # the client's default asks for base64
        data = client.embeddings.create(model=CLIP, input=uris, extra_body={"modality": "image"}, **options).data
        np.testing.assert_allclose([item.embedding for item in data], expected, atol=1e-5)


def test_many_clients_sending_images_and_texts_at_once_get_their_own_vectors(server, folders):
    from concurrent.futures import ThreadPoolExecutor

    texts = _texts(9, len(IMAGES))
    text_vectors, image_vectors = reference(folders[CLIP], texts), image_reference(folders[CLIP], IMAGES)

    def call(i: int) -> tuple[int, bool, list[float]]:
        k, as_image = i % len(IMAGES), i % 2 == 0
        body = ({"input": [_data_uri(IMAGES[k], MIMES[k])], "modality": "image"} if as_image
                else {"input": [texts[k]]})
        answer = server.post("/v1/embeddings", json={"model": CLIP, **body})
        assert answer.status_code == 200, answer.text
        return k, as_image, answer.json()["data"][0]["embedding"]

    with ThreadPoolExecutor(8) as pool:
        for k, as_image, vector in pool.map(call, range(48)):
            np.testing.assert_allclose(vector, (image_vectors if as_image else text_vectors)[k], atol=1e-5)


def test_vllms_messages_form(server, folders):
    text = [{"role": "user", "content": [{"type": "text", "text": "quick fox"}]}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_uri(IMAGES[0])}}]}]
    for messages, expected in ((text, reference(folders[CLIP], ["quick fox"])),
                               (image, image_reference(folders[CLIP], IMAGES[:1]))):
        answer = server.post("/v1/embeddings", json={"model": CLIP, "messages": messages})
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose([answer.json()["data"][0]["embedding"]], expected, atol=1e-5)
    both = [{"role": "user", "content": text[0]["content"] + image[0]["content"]}]
    error = assert_error(server.post("/v1/embeddings", json={"model": CLIP, "messages": both}), 422)
    assert error["param"] == "messages" and "2 parts" in error["message"]
    assert assert_error(server.post("/v1/embeddings", json={"model": CLIP, "messages": text, "input": "a"}),
                        422)["param"] == "messages"


def test_cohere_v2_embeds_images_and_describes_them(server, folders):
    import cohere

    expected = image_reference(folders[CLIP], IMAGES[:2])
    answer = server.post("/v2/embed", json={"model": CLIP, "images": [_data_uri(IMAGES[0]), _data_uri(IMAGES[1])],
                                            "input_type": "image", "embedding_types": ["float"]})
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(answer.json()["embeddings"]["float"], expected, atol=1e-5)
    assert answer.json()["images"] == [{"width": 40, "height": 50, "format": "png", "bit_depth": 24},
                                       {"width": 64, "height": 33, "format": "png", "bit_depth": 8}]
    client = cohere.ClientV2(base_url=server.url(""), api_key="unused")
    inputs = [{"content": [{"type": "image_url", "image_url": {"url": _data_uri(data)}}]} for data in IMAGES[:2]]
    response = client.embed(model=CLIP, inputs=inputs, input_type="image", embedding_types=["float"])
    np.testing.assert_allclose(response.embeddings.float_, expected, atol=1e-5)
    mixed = [inputs[0], {"content": [{"type": "text", "text": "quick fox"}]}]
    assert assert_error(server.post("/v2/embed", json={"model": CLIP, "inputs": mixed, "input_type": "image"}),
                        422)["param"] == "inputs"


def test_a_large_image_is_read_whole_on_every_route(server, folders):
    """Long texts are read only as far as a model reads them; a data: URI is read whole."""
    large = _png(8, (400, 300))
    assert len(large) > 300_000
    expected = image_reference(folders[CLIP], [large])
    uri = _data_uri(large)
    for path, body in (("/v1/embeddings", {"input": [uri], "modality": "image"}), ("/embeddings_image", {"input": uri}),
                       ("/v2/embed", {"images": [uri], "input_type": "image", "embedding_types": ["float"]})):
        answer = server.post(path, json={"model": CLIP, **body})
        assert answer.status_code == 200, (path, answer.text)
        vectors = answer.json()["embeddings"]["float"] if path == "/v2/embed" else [
            item["embedding"] for item in answer.json()["data"]]
        np.testing.assert_allclose(vectors, expected, atol=1e-5)


def test_the_api_document_lists_the_image_text_models(server):
    document = server.get("/openapi.json").json()
    model = document["components"]["schemas"]["EmbeddingRequest"]["properties"]["model"]
    assert set(model["anyOf"][0]["enum"]) == {*ALL_MODELS, CLIP_INT8}
    assert "/embeddings_image" in document["paths"]


def test_int8_towers_stay_close_to_float32(server, folders):
    texts = _texts(4, 16)
    uris = [_data_uri(data, mime) for data, mime in zip(IMAGES, MIMES)]
    images = server.post("/v1/embeddings", json={"model": CLIP_INT8, "input": uris, "modality": "image"})
    assert images.status_code == 200, images.text
    for served, expected in ((_embed(server, CLIP_INT8, texts), reference(folders[CLIP], texts)),
                             ([item["embedding"] for item in images.json()["data"]],
                              image_reference(folders[CLIP], IMAGES))):
        cosines = np.sum(np.array(served) * expected, axis=1)  # both normalised
        assert cosines.min() >= 0.97 and cosines.mean() >= 0.99


def test_image_batches_are_counted_under_their_model(server):
    from prometheus_client.parser import text_string_to_metric_families

    def patches_counted() -> float:
        exposition = server.get("/metrics").text
        return sum(sample.value for family in text_string_to_metric_families(exposition) for sample in family.samples
                   if sample.name == "infinity_batch_tokens_sum" and sample.labels["model"] == CLIP_TORCH)

    before = patches_counted()
    uris = [_data_uri(data, mime) for data, mime in zip(IMAGES[:2], MIMES[:2])]
    assert server.post("/v1/embeddings", json={"model": CLIP_TORCH, "input": uris, "modality": "image"}).status_code == 200
    assert patches_counted() - before == 2 * (32 // 8) ** 2
