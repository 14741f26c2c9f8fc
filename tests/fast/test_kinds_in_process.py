"""Every model kind the other in-process tests leave out (embed: test_front_end.py; sparse:
test_sparse.py) through the whole request path in one process (tests/fast/inprocess.py),
route -> head -> encoding, against what the fake engine's functions give for the inputs
as the model's own tokenizer and processors prepare them: a cross-encoder's rerank, a
classifier's labels, a multi-vector model's matrices and MaxSim, a two-tower model's
texts, images and clips, a page-retrieval model's queries and pages. Also: a model named
on a route its kind does not serve is told the routes its kind does; and an array a
preprocessor adds to its features reaches the engine's media pass as it made it, with no
code in between told of it."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import wave
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from infinity.api.routes import ROUTES
from infinity.config import ModelConfig
from infinity.shared import protocol
from infinity.shared.kinds import KINDS, TEXT
from tests.fast.inprocess import (ThreadLauncher, media_features, output_width, pooled_states, serving,
                                  serving_on_its_own_loop, token_states)
from tests.support.bge_m3 import save_tiny_bge_m3
from tests.support.tiny_models import (CLAP_SAMPLING_RATE, CLASSIFIER_LABELS, save_tiny_clap, save_tiny_classifier,
                                       save_tiny_clip, save_tiny_colpali, save_tiny_cross_encoder, save_tiny_masked_lm,
                                       save_tiny_pylate_colbert)
from workers.preprocess import image
from workers.preprocess.media import item_bytes

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny model folder of each kind but embed (the packaged model), by kind; a plain
    masked language model stands for a sparse one. The hybrid one is here for the routes
    only (it is served end to end in tests/e2e/hybrid)."""
    root = tmp_path_factory.mktemp("kinds")
    return {"rerank": save_tiny_cross_encoder(root / "rerank"), "classify": save_tiny_classifier(root / "classify"),
            "multivector": save_tiny_pylate_colbert(root / "multivector"), "sparse": save_tiny_masked_lm(root / "mlm"),
            "image_text": save_tiny_clip(root / "clip"), "audio_text": save_tiny_clap(root / "clap"),
            "image_multivector": save_tiny_colpali(root / "colpali"), "hybrid": save_tiny_bge_m3(root / "bge-m3")}


def _model(folders: dict[str, Path], kind: str, name: str | None = None, **settings: object) -> ModelConfig:
    """The model of `kind`, named as its kind unless `name` says."""
    if kind == "embed":
        return ModelConfig(name=kind, engine="torch")
    return ModelConfig(name=name or kind, source=str(folders[kind]), engine="torch",
                       **({"kind": "sparse"} if kind == "sparse" else {}), **settings)


def _tokenizer(folder: Path) -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    return tokenizer


def _pooled(ids: list[int], width: int) -> np.ndarray:
    """The fake engine's one vector of an input of `ids` (sequence logits, a text tower's features)."""
    return pooled_states(np.array([ids]), np.ones((1, len(ids)), dtype=np.int64), width)[0]


def _width(folder: Path, kind: str) -> int:
    """Floats per vector the fake engine gives a model of `kind` in `folder`."""
    return output_width(KINDS[kind].outputs[TEXT], json.loads((folder / "config.json").read_text()))


def _unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=-1, keepdims=True)


def _floats(answer: dict) -> np.ndarray:
    return np.array([item["embedding"] for item in answer["data"]], dtype=np.float32)


def _data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _image_file(picture: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, fmt, **options)
    return buffer.getvalue()


def _gradient(width: int, height: int) -> Image.Image:
    ramp = np.linspace(0, 255, width * height * 3).reshape(height, width, 3)
    return Image.fromarray(ramp.astype(np.uint8), "RGB")


# Images of clearly different mean values (the fake engine's image vector is a function of
# its pixels' mean), in two formats and three sizes: (file, its Cohere description).
IMAGES = [(_image_file(Image.new("RGB", (40, 24), (200, 40, 30)), "PNG"),
           {"width": 40, "height": 24, "format": "png", "bit_depth": 24}),
          (_image_file(Image.new("L", (30, 50), 60), "JPEG"),
           {"width": 30, "height": 50, "format": "jpeg", "bit_depth": 8}),
          (_image_file(_gradient(36, 36), "PNG"), {"width": 36, "height": 36, "format": "png", "bit_depth": 24})]
IMAGE_URIS = [_data_uri(data, f"image/{info['format']}") for data, info in IMAGES]


def _pictures(files: list[bytes]) -> list[Image.Image]:
    """Image files as transformers' image loading gives them to a processor."""
    return [Image.open(io.BytesIO(data)).convert("RGB") for data in files]


# --- rerank: a cross-encoder ---------------------------------------------------------------------

QUERY = "the quick fox"
DOCUMENTS = ["a lazy dog", "quick brown fox jumps over", "seven wizards judge boxing matches", "7"]


def test_a_cross_encoder_ranks_by_the_sigmoid_of_each_pairs_logit_or_the_raw_logit(folders):
    tokenizer = _tokenizer(folders["rerank"])
    pairs = [tokenizer.encode(QUERY, document).ids for document in DOCUMENTS]
    logits = np.array([_pooled(ids, 1)[0] for ids in pairs], dtype=np.float64)
    relevance = 1 / (1 + np.exp(-logits))
    best_first = np.argsort(-logits, kind="stable").tolist()

    async def test():
        async with serving(model=_model(folders, "rerank")) as client:
            ranked = await (await client.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})).json()
            top = await (await client.post("/v1/rerank", json={
                "query": QUERY, "documents": [{"text": document} for document in DOCUMENTS], "top_n": 2,
                "return_documents": True, "raw_scores": True})).json()
        return ranked, top

    ranked, top = asyncio.run(test())
    assert [result["index"] for result in ranked["results"]] == best_first
    assert all("document" not in result for result in ranked["results"])
    np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], relevance[best_first], rtol=1e-6)
    tokens = sum(len(ids) for ids in pairs)
    assert ranked["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "truncated_inputs": 0}
    assert ranked["meta"]["tokens"] == {"input_tokens": tokens}
    assert [(r["index"], r["document"]["text"]) for r in top["results"]] == [(i, DOCUMENTS[i]) for i in best_first[:2]]
    np.testing.assert_allclose([r["relevance_score"] for r in top["results"]], logits[best_first[:2]], rtol=1e-6)


# --- classify ------------------------------------------------------------------------------------

TEXTS = ["the quick brown fox", "a lazy dog", "seven wizards judge boxing matches of jumbo sized quartz"]


def test_a_classifier_gives_every_labels_softmax_best_first_or_the_raw_logits(folders):
    tokenizer = _tokenizer(folders["classify"])
    inputs = [encoding.ids for encoding in tokenizer.encode_batch(TEXTS)]
    logits = np.stack([_pooled(ids, len(CLASSIFIER_LABELS)) for ids in inputs]).astype(np.float64)
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = exp / exp.sum(axis=1, keepdims=True)

    async def test():
        async with serving(model=_model(folders, "classify")) as client:
            scored = await (await client.post("/v1/classify", json={"input": TEXTS})).json()
            raw = await (await client.post("/v1/classify", json={"input": TEXTS, "raw_scores": True})).json()
        return scored, raw

    scored, raw = asyncio.run(test())
    for answer, expected in ((scored, probabilities), (raw, logits)):
        for labels, row in zip(answer["data"], expected, strict=True):
            order = np.argsort(-row, kind="stable")
            assert [label["label"] for label in labels] == [CLASSIFIER_LABELS[j] for j in order]
            np.testing.assert_allclose([label["score"] for label in labels], row[order], rtol=1e-6)
    tokens = sum(len(ids) for ids in inputs)
    assert scored["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "truncated_inputs": 0}


# --- multivector: a ColBERT (PyLate's layout: [Q] / [D] marker tokens, a 32 -> 16 projection) ---

QUERY_LENGTH = 16  # the tiny ColBERT's queries are filled up to this with [MASK]
SKIPPED = ("the", "a")  # its documents' skiplist


def _colbert(folder: Path, text: str, task: str) -> tuple[list[int], np.ndarray]:
    """(the tokens billed, the vectors) of a text as PyLate encodes it: [CLS], the task's
    marker token, the text's tokens and [SEP]; a query filled up to its length with [MASK],
    whose vectors count; a document without the vectors of its skiplist's words. Each
    vector the token's state projected and normalised."""
    tokenizer = _tokenizer(folder)
    ids = tokenizer.encode(text).ids
    ids = [ids[0], tokenizer.token_to_id("[Q] " if task == "query" else "[D] "), *ids[1:]]
    if task == "query":
        read = ids + [tokenizer.token_to_id("[MASK]")] * (QUERY_LENGTH - len(ids))
    else:
        read = [i for i in ids if i not in {tokenizer.token_to_id(word) for word in SKIPPED}]
    projection = load_file(str(folder / "1_Dense" / "model.safetensors"))["linear.weight"]
    return ids, _unit(token_states(np.array(read), projection.shape[1]) @ projection.T)


def _maxsim(query: np.ndarray, document: np.ndarray) -> float:
    return float((query @ document.T).max(axis=1).sum())


def test_a_multivector_model_answers_a_matrix_per_text_encoded_as_a_query_or_a_document(folders):
    texts = ["the quick fox", "a lazy dog jumps over the brown fox"]
    folder = folders["multivector"]

    async def test():
        async with serving(model=_model(folders, "multivector")) as client:
            answers = {task: await (await client.post("/v1/embeddings", json={"input": texts, "input_type": task}))
                       .json() for task in ("query", "document")}
            plain = await (await client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"}))\
                .json()
        return answers, plain

    answers, plain = asyncio.run(test())
    for task, answer in answers.items():
        expected = [_colbert(folder, text, task) for text in texts]
        for item, (_, rows) in zip(answer["data"], expected, strict=True):
            assert item["shape"] == list(rows.shape)
            np.testing.assert_allclose(item["embedding"], rows, atol=1e-6)
        tokens = sum(len(ids) for ids, _ in expected)  # a query's [MASK] filling is not billed
        assert answer["usage"]["prompt_tokens"] == tokens
    for item, document in zip(plain["data"], answers["document"]["data"], strict=True):  # documents by default
        assert item["shape"] == document["shape"]
        packed = np.frombuffer(base64.b64decode(item["embedding"]), "<f4").reshape(item["shape"])
        np.testing.assert_array_equal(packed, np.array(document["embedding"], dtype=np.float32))


def test_a_multivector_model_reranks_documents_by_maxsim_against_the_query(folders):
    folder = folders["multivector"]
    query_ids, query = _colbert(folder, QUERY, "query")
    documents = [_colbert(folder, document, "document") for document in DOCUMENTS]
    scores = np.array([_maxsim(query, rows) for _, rows in documents])
    best_first = np.argsort(-scores, kind="stable").tolist()

    async def test():
        async with serving(model=_model(folders, "multivector")) as client:
            return await (await client.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})).json()

    ranked = asyncio.run(test())
    assert [result["index"] for result in ranked["results"]] == best_first
    np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], scores[best_first], rtol=1e-5)
    assert ranked["usage"]["prompt_tokens"] == len(query_ids) + sum(len(ids) for ids, _ in documents)


# --- image_text: a CLIP ----------------------------------------------------------------------------

def _clip_pixels(folder: Path, files: list[bytes]) -> np.ndarray:
    """The pixels of image files, through the folder's own image processor."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(folder)(images=_pictures(files), return_tensors="np")["pixel_values"]


def test_a_two_tower_image_model_embeds_texts_and_images_each_by_its_tower(folders):
    folder = folders["image_text"]
    texts = ["a photo of a fox", "two lazy dogs"]
    width = _width(folder, "image_text")
    text_vectors = np.stack([_pooled(encoding.ids, width) for encoding in _tokenizer(folder).encode_batch(texts)])
    image_vectors = media_features(_clip_pixels(folder, [data for data, _ in IMAGES]), width)
    vision = json.loads((folder / "config.json").read_text())["vision_config"]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2  # what an image is billed

    async def test():
        models = [_model(folders, "image_text"), _model(folders, "image_text", name="raw", normalize=False)]
        async with serving(model=models) as client:
            def post(path: str, body: dict):
                return client.post(path, json={"model": "image_text", **body})

            by_text = await (await post("/v1/embeddings", {"input": texts})).json()
            by_image = await (await post("/v1/embeddings", {"input": IMAGE_URIS, "modality": "image"})).json()
            image_route = await (await post("/embeddings_image", {"input": IMAGE_URIS})).json()
            cohere = await (await post("/v1/embed", {"images": IMAGE_URIS})).json()
            raw = await (await client.post("/embeddings_image", json={"model": "raw", "input": IMAGE_URIS})).json()
        return by_text, by_image, image_route, cohere, raw

    by_text, by_image, image_route, cohere, raw = asyncio.run(test())
    np.testing.assert_allclose(_floats(by_text), _unit(text_vectors), atol=1e-6)
    np.testing.assert_allclose(_floats(by_image), _unit(image_vectors), atol=1e-6)
    np.testing.assert_array_equal(_floats(image_route), _floats(by_image))
    assert by_image["usage"]["prompt_tokens"] == patches * len(IMAGES)
    assert cohere["response_type"] == "embeddings_floats"
    np.testing.assert_array_equal(np.array(cohere["embeddings"], dtype=np.float32), _floats(by_image))
    assert cohere["images"] == [info for _, info in IMAGES] and cohere["texts"] == []
    np.testing.assert_allclose(_floats(raw), image_vectors, atol=1e-6)  # normalize = false: the tower's own


# --- audio_text: a CLAP ----------------------------------------------------------------------------

def _wav(frequency: float) -> tuple[bytes, np.ndarray]:
    """Half a second of a tone at the model's rate, as a mono 16-bit WAV, and its samples
    as floats. Higher tones are quieter, so that clips' spectrograms differ in their mean
    (all the fake engine reads of them)."""
    rate = CLAP_SAMPLING_RATE
    times = np.arange(rate // 2) / rate
    pcm = (np.sin(2 * np.pi * frequency * times) * 30000 * 200 / frequency).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return buffer.getvalue(), pcm.astype(np.float32) / 32768


def test_a_two_tower_audio_model_embeds_texts_and_clips_each_by_its_tower(folders):
    from transformers import AutoFeatureExtractor

    folder = folders["audio_text"]
    texts = ["a fox barks", "seven wizards"]
    clips = [_wav(frequency) for frequency in (220, 1000)]
    uris = [_data_uri(data, "audio/wav") for data, _ in clips]
    features = AutoFeatureExtractor.from_pretrained(folder)([samples for _, samples in clips],
                                                            sampling_rate=CLAP_SAMPLING_RATE,
                                                            return_tensors="np")["input_features"]
    width = _width(folder, "audio_text")
    clip_vectors = _unit(media_features(features, width))
    text_vectors = _unit(np.stack([_pooled(e.ids, width) for e in _tokenizer(folder).encode_batch(texts)]))

    async def test():
        async with serving(model=_model(folders, "audio_text")) as client:
            by_text = await (await client.post("/v1/embeddings", json={"input": texts})).json()
            by_clip = await (await client.post("/v1/embeddings", json={"input": uris, "modality": "audio"})).json()
            audio_route = await (await client.post("/embeddings_audio", json={"input": uris})).json()
            message = await (await client.post("/v1/embeddings", json={"messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": uris[1].split(",")[1], "format": "wav"}}]}]})).json()
        return by_text, by_clip, audio_route, message

    by_text, by_clip, audio_route, message = asyncio.run(test())
    np.testing.assert_allclose(_floats(by_text), text_vectors, atol=1e-6)
    np.testing.assert_allclose(_floats(by_clip), clip_vectors, atol=1e-6)
    np.testing.assert_array_equal(_floats(audio_route), _floats(by_clip))
    np.testing.assert_array_equal(_floats(message), _floats(by_clip)[1:])
    assert by_clip["usage"]["prompt_tokens"] == features.shape[2] * len(clips)  # a clip is billed its frames


# --- image_multivector: a ColPali ------------------------------------------------------------------

def _colpali(folder: Path, texts: list[str] | None = None,
             files: list[bytes] | None = None) -> list[tuple[int, np.ndarray]]:
    """(the tokens billed, the vectors) of each query or page, through the folder's own
    processor: a query's vectors its tokens' states, a page's its prompt's and image
    tokens' states plus its pixels' features."""
    from transformers import AutoProcessor

    processor, width = AutoProcessor.from_pretrained(folder), _width(folder, "image_multivector")
    if files is None:
        encoded = {key: value.numpy() for key, value in processor.process_queries(texts).items()}
        features = np.zeros((len(texts), width), dtype=np.float32)
    else:
        encoded = {key: value.numpy() for key, value in processor.process_images(_pictures(files)).items()}
        features = media_features(encoded["pixel_values"], width)
    attended = encoded["attention_mask"].astype(bool)
    return [(int(mask.sum()), token_states(ids[mask], width) + vector)
            for ids, mask, vector in zip(encoded["input_ids"], attended, features, strict=True)]


def test_a_page_retrieval_model_embeds_queries_and_pages_and_reranks_pages_by_maxsim(folders):
    folder = folders["image_multivector"]
    queries = _colpali(folder, texts=[QUERY, "seven wizards"])
    pages = _colpali(folder, files=[data for data, _ in IMAGES])
    query_tokens, query = queries[0]
    scores = np.array([_maxsim(query, rows) for _, rows in pages])
    best_first = np.argsort(-scores, kind="stable").tolist()
    documents = [IMAGE_URIS[0], {"content": [{"type": "image_url", "image_url": {"url": IMAGE_URIS[1]}}]},
                 IMAGE_URIS[2]]

    async def test():
        async with serving(model=_model(folders, "image_multivector")) as client:
            by_text = await (await client.post("/v1/embeddings", json={"input": [QUERY, "seven wizards"]})).json()
            by_page = await (await client.post("/v1/embeddings", json={"input": IMAGE_URIS,
                                                                       "modality": "image"})).json()
            image_route = await (await client.post("/embeddings_image", json={"input": IMAGE_URIS})).json()
            ranked = await (await client.post("/v1/rerank", json={"query": QUERY, "documents": documents})).json()
        return by_text, by_page, image_route, ranked

    by_text, by_page, image_route, ranked = asyncio.run(test())
    for answer, expected in ((by_text, queries), (by_page, pages)):
        for item, (_, rows) in zip(answer["data"], expected, strict=True):
            assert item["shape"] == list(rows.shape)
            np.testing.assert_allclose(item["embedding"], rows, atol=1e-6)
        assert answer["usage"]["prompt_tokens"] == sum(tokens for tokens, _ in expected)
    assert image_route["data"] == by_page["data"]
    assert [result["index"] for result in ranked["results"]] == best_first
    np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], scores[best_first], rtol=1e-5)
    assert ranked["usage"]["prompt_tokens"] == query_tokens + sum(tokens for tokens, _ in pages)


# --- a model on a route its kind does not serve ------------------------------------------------------

# A valid body of each route that runs a model (it is decoded before the model is chosen).
BODIES = {"/v1/embeddings": {"input": ["a text"]}, "/embeddings_image": {"input": IMAGE_URIS[:1]},
          "/embeddings_audio": {"input": ["data:audio/wav;base64,AAAA"]}, "/v1/embed": {"texts": ["a text"]},
          "/v1/embed_sparse": {"inputs": ["a text"]}, "/v1/rerank": {"query": "a", "documents": ["b"]},
          "/v1/classify": {"input": ["a text"]}, "/tokenize": {"prompt": "a text"}, "/detokenize": {"tokens": [5]},
          "/score": {"text_1": "a", "text_2": ["b"]}, "/pooling": {"input": ["a text"]},
          "/embed": {"texts": ["a text"]}, "/rerank": {"query": "a", "documents": ["b"]}}
MODEL_ROUTES = [route.operation for route in ROUTES if route.operation.kinds]


@pytest.fixture(scope="module")
def every_kind(folders):
    """A server of one model of each kind, named as its kind, on an event loop of its own
    for this module's tests to run their requests on: (the loop, the client)."""
    with serving_on_its_own_loop(model=[_model(folders, kind) for kind in KINDS]) as served:
        yield served.loop, served.client


def test_every_model_route_has_a_body_here():
    assert set(BODIES) == {operation.path for operation in MODEL_ROUTES}


@pytest.mark.parametrize("operation", MODEL_ROUTES, ids=lambda operation: operation.path)
def test_a_model_of_another_kind_is_told_the_routes_its_kind_serves(operation, every_kind):
    loop, client = every_kind

    async def ask(kind: str) -> tuple[int, dict]:
        answer = await client.post(operation.path, json={**BODIES[operation.path], "model": kind})
        return answer.status, (await answer.json())["error"]

    others = [kind for kind in KINDS if kind not in operation.kinds]
    assert others
    for kind in others:
        status, error = loop.run_until_complete(ask(kind))
        assert (status, error["code"], error["param"]) == (400, "wrong_model_kind", "model"), (kind, error)
        serves = re.fullmatch(f"model '{kind}' is of kind '{kind}'; it serves (.*), not this route", error["message"])
        assert serves is not None, error["message"]
        routes = [f"{op.method.upper()} {op.path}" for op in MODEL_ROUTES if kind in op.kinds]
        assert serves[1].split(" and ") == routes


def test_a_media_route_without_a_model_name_serves_the_one_model_of_its_kinds(every_kind):
    loop, client = every_kind
    uri = _data_uri(_wav(440)[0], "audio/wav")

    async def ask() -> tuple[dict, dict]:
        unnamed = await client.post("/embeddings_audio", json={"input": [uri]})
        named = await client.post("/v1/embeddings", json={"model": "audio_text", "input": [uri], "modality": "audio"})
        return await unnamed.json(), await named.json()

    unnamed, named = loop.run_until_complete(ask())
    assert unnamed["model"] == "audio_text" and unnamed["data"] == named["data"]


# --- a new input field ----------------------------------------------------------------------------

def _animation(frames: int, shade: int) -> bytes:
    """A GIF of `frames` frames, the first of grey `shade`."""
    pictures = [Image.new("RGB", (32, 32), (shade + 20 * i,) * 3) for i in range(frames)]
    return _image_file(pictures[0], "GIF", save_all=True, append_images=pictures[1:])


def test_an_array_a_preprocessor_adds_reaches_the_engines_media_pass_per_item_collated(folders, monkeypatch):
    """The image preprocessor wrapped to give each image's frame count beside its pixels:
    the engine's media pass gets it, stacked over the batch's items as the pixels are, and
    nothing else changes."""
    prepare = image.Preprocessor.prepare

    def with_frame_count(self: image.Preprocessor, request: protocol.Tokenize) -> protocol.Tokenized:
        answer = prepare(self, request)
        frames = [Image.open(io.BytesIO(item_bytes(item, "input", 1 << 20, "image"))).n_frames
                  for item in request.media or []]
        answer.inputs.arrays.append(protocol.ArrayPart.of("frame_count", np.array(frames, dtype=np.int64)))
        return answer

    monkeypatch.setattr(image.Preprocessor, "prepare", with_frame_count)
    files = [_animation(1, 30), _animation(3, 120), _animation(2, 200)]
    launcher = ThreadLauncher()

    async def test():
        async with serving(launcher, model=_model(folders, "image_text")) as client:
            answer = await client.post("/embeddings_image", json={"input": [_data_uri(f, "image/gif") for f in files]})
            return await answer.json()

    answer = asyncio.run(test())
    seen = launcher.engines["image_text"].media_seen[-1]
    assert set(seen) == {"pixel_values", "frame_count"}
    assert seen["frame_count"].dtype == np.int64 and seen["frame_count"].tolist() == [1, 3, 2]
    pixels = _clip_pixels(folders["image_text"], files)
    np.testing.assert_array_equal(seen["pixel_values"], pixels)
    vectors = media_features(pixels, _width(folders["image_text"], "image_text"))
    np.testing.assert_allclose(_floats(answer), _unit(vectors), atol=1e-6)
