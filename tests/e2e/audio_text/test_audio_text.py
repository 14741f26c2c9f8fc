"""Audio-text (CLAP) models: tiny CLAP folders built at test time (an unfused one and a
fused one) and served on torch, against transformers on the same folders: texts through
`get_text_features`, audio clips through transformers' own loading (`load_audio`, its
soundfile backend: float32, channels averaged, soxr) and the folder's feature extractor
into `get_audio_features`. Clips come in every container the server reads, at other
rates and in stereo; a clip longer than the model's window is cut to its first window,
so the same request always gives the same vector; bad audio fails its own request only.
"""

from __future__ import annotations

import base64
import io
import math
import struct
import wave

import numpy as np
import pytest

from tests.support.answers import assert_error
from tests.support.media_site import files_site
from tests.support.server import models_toml, running_server
from tests.support.tiny_models import CLAP_SAMPLING_RATE, save_tiny_clap

pytestmark = pytest.mark.timeout(300)

CLAP, CLAP_FUSED = "tiny-clap", "tiny-clap-fused"
MAX_SECONDS = 5  # the server's max_audio_seconds in these tests
WINDOW = CLAP_SAMPLING_RATE  # the tiny models' window: 1 s


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio-text")
    return {CLAP: save_tiny_clap(root / "clap", seed=3), CLAP_FUSED: save_tiny_clap(root / "clap-fused", seed=4,
                                                                                     fusion=True)}


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    config = models_toml(folders)
    config += f"[media]\nallow_private_networks = true\nmax_audio_seconds = {MAX_SECONDS}\n"
    with running_server(config=config, log_dir=tmp_path_factory.mktemp("audio-text-server")) as proc:
        yield proc


# --- the clips ---------------------------------------------------------------------------------

def _tone(seconds: float, rate: int, seed: int, channels: int = 1) -> np.ndarray:
    """(frames, channels) float32 in [-0.5, 0.5]: a chirp and noise, different per seed."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    base = 0.3 * np.sin(2 * np.pi * (200 + 300 * seed) * t * (1 + t)) + 0.1 * rng.standard_normal(len(t))
    return np.stack([base * (0.5 + 0.5 * c) for c in range(channels)], axis=1).astype(np.float32)


def _pcm16_wav(samples: np.ndarray, rate: int) -> bytes:
    """A PCM16 WAV written by the standard library alone."""
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(samples.shape[1])
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(b"".join(struct.pack("<h", int(v * 32767)) for v in samples.reshape(-1)))
    return out.getvalue()


def _encoded(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=fmt, subtype=subtype)
    return out.getvalue()


# (name, bytes, mime): the containers and encodings the server reads; rates other than the
# model's and stereo go through the downmix and the resampler.
CLIPS = [
    ("pcm16 wav", _pcm16_wav(_tone(0.75, CLAP_SAMPLING_RATE, 0), CLAP_SAMPLING_RATE), "audio/wav"),
    ("float wav", _encoded(_tone(0.5, CLAP_SAMPLING_RATE, 1), CLAP_SAMPLING_RATE, "WAV", "FLOAT"), "audio/wav"),
    ("24-bit wav", _encoded(_tone(0.6, 16000, 2), 16000, "WAV", "PCM_24"), "audio/wav"),
    ("stereo 44.1 kHz wav", _pcm16_wav(_tone(0.8, 44100, 3, channels=2), 44100), "audio/x-wav"),
    ("flac", _encoded(_tone(0.9, 22050, 4), 22050, "FLAC"), "audio/flac"),
    ("ogg vorbis", _encoded(_tone(1.0, CLAP_SAMPLING_RATE, 5), CLAP_SAMPLING_RATE, "OGG", "VORBIS"), "audio/ogg"),
    ("mp3", _encoded(_tone(0.7, 16000, 6), 16000, "MP3"), "audio/mpeg"),
    ("longer than the window", _pcm16_wav(_tone(3.2, CLAP_SAMPLING_RATE, 7), CLAP_SAMPLING_RATE), "audio/wav"),
]


def _data_uri(data: bytes, mime: str = "audio/wav") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def audio_reference(folder, uris: list[str]) -> np.ndarray:
    """transformers' audio vectors: each clip loaded by `load_audio` (soundfile, soxr) at
    the feature extractor's rate, its first window (a longer clip is cut there, not
    cropped at random), spectrograms by the folder's feature extractor, no clip marked
    longer (a fused model's random mark is not used)."""
    import torch
    from transformers import AutoFeatureExtractor, AutoModel
    from transformers.audio_utils import load_audio

    model, extractor = AutoModel.from_pretrained(str(folder)).eval(), AutoFeatureExtractor.from_pretrained(str(folder))
    waves = [load_audio(uri, sampling_rate=extractor.sampling_rate, backend="soundfile")[:extractor.nb_max_samples]
             for uri in uris]
    features = extractor(waves, sampling_rate=extractor.sampling_rate, return_tensors="pt")["input_features"]
    with torch.inference_mode():
        vectors = model.get_audio_features(input_features=features,
                                           is_longer=torch.zeros((len(waves), 1), dtype=torch.bool)).pooler_output
    return vectors.numpy()


def text_reference(folder, texts: list[str]) -> np.ndarray:
    import torch
    from transformers import AutoModel, AutoTokenizer

    model, tokenizer = AutoModel.from_pretrained(str(folder)).eval(), AutoTokenizer.from_pretrained(str(folder))
    with torch.inference_mode():
        return model.get_text_features(**tokenizer(texts, padding=True, truncation=True,
                                                   return_tensors="pt")).pooler_output.numpy()


def _embed(server, model: str, inputs: list[str], modality: str = "audio", path: str = "/v1/embeddings"):
    answer = server.post(path, json={"model": model, "input": inputs, "modality": modality})
    assert answer.status_code == 200, answer.text
    return np.array([item["embedding"] for item in answer.json()["data"]], dtype=np.float32), answer.json()


# --- tests -------------------------------------------------------------------------------------

def test_libsndfile_is_loaded_not_a_pure_python_soundfile():
    import soundfile

    assert soundfile.__libsndfile_version__.startswith("1."), soundfile.__libsndfile_version__
    assert {"WAV", "FLAC", "OGG", "MP3"} <= set(soundfile.available_formats())


def test_the_models_are_served_as_audio_text(server):
    cards = {card["id"]: card for card in server.get("/v1/models").json()["data"]}
    assert {name: (card["kind"], card["dimensions"], card["backend"], card["capabilities"])
            for name, card in cards.items()} == {
        CLAP: ("audio_text", 16, "torch", ["embed", "audio_embed"]),
        CLAP_FUSED: ("audio_text", 16, "torch", ["embed", "audio_embed"])}


@pytest.mark.parametrize("model", [CLAP, CLAP_FUSED])
def test_text_vectors_are_the_text_towers(server, folders, model):
    texts = ["a dog barks", "rain on a tin roof while seven wizards judge", "quartz"]
    served, _ = _embed(server, model, texts, "text")
    np.testing.assert_allclose(served, text_reference(folders[model], texts), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("model", [CLAP, CLAP_FUSED])
def test_clips_of_every_container_rate_and_layout_match_transformers(server, folders, model):
    uris = [_data_uri(data, mime) for _, data, mime in CLIPS]
    served, answer = _embed(server, model, uris)
    expected = audio_reference(folders[model], uris)
    for (name, _, _), got, want in zip(CLIPS, served, expected):
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=name)
    # Every clip is padded to the window: each counts the window's spectrogram frames.
    frames = WINDOW // 160 + 1
    assert answer["usage"]["prompt_tokens"] == frames * len(CLIPS)


@pytest.mark.parametrize("model", [CLAP, CLAP_FUSED])
def test_the_same_long_clip_gives_the_same_vector_every_time(server, model):
    """The feature extractor would crop a long clip at random (and, fused, mark a random
    clip as long): the server cuts it first, so repeated requests agree exactly."""
    uri = _data_uri(CLIPS[-1][1])
    first = [_embed(server, model, [uri])[0][0] for _ in range(3)]
    batched = _embed(server, model, [_data_uri(CLIPS[0][1]), uri, uri])[0]
    for vector in first[1:] + list(batched[1:]):
        np.testing.assert_allclose(vector, first[0], atol=1e-6)


@pytest.mark.parametrize("model", [CLAP, CLAP_FUSED])
def test_a_clip_alone_and_inside_a_batch_agree(server, model):
    uris = [_data_uri(data, mime) for _, data, mime in CLIPS]
    batch, _ = _embed(server, model, uris)
    for uri, vector in zip(uris, batch):
        np.testing.assert_allclose(_embed(server, model, [uri])[0][0], vector, atol=1e-5)


def _riff_garbage() -> bytes:
    return b"RIFF" + struct.pack("<I", 36) + b"WAVEfmt " + b"\xff" * 40


BAD_CLIPS = [
    (_data_uri(_riff_garbage()), "could not be decoded as audio"),
    (_data_uri(b"not audio at all, just text"), "could not be decoded as audio"),
    (_data_uri(_pcm16_wav(np.zeros((0, 1), dtype=np.float32), 8000)), "holds no samples"),
    (_data_uri(_encoded(np.zeros((8000 * (MAX_SECONDS + 1), 1), dtype=np.float32), 8000, "FLAC"), "audio/flac"),
     f"more than the {MAX_SECONDS} s"),
    (_data_uri(_pcm16_wav(_tone(0.5, 8000, 0), 8000), "image/png"), "not audio/*"),
    ("data:audio/wav;base64,not*base64", "base64 is not valid"),
    ("ftp://example.com/a.wav", "neither a data: URI nor an http(s) URL"),
    ("data:audio/wav,plain-not-base64", "not a base64 data: URI"),
]


@pytest.mark.parametrize("item, reason", BAD_CLIPS, ids=[reason for _, reason in BAD_CLIPS])
def test_bad_audio_fails_its_own_request_and_the_next_is_served(server, folders, item, reason):
    error = assert_error(server.post("/v1/embeddings", json={"model": CLAP, "input": [_data_uri(CLIPS[0][1]), item],
                                                             "modality": "audio"}), 422)
    assert reason in error["message"] and "input[1]" in error["message"], error
    good, _ = _embed(server, CLAP, [_data_uri(CLIPS[0][1])])
    np.testing.assert_allclose(good, audio_reference(folders[CLAP], [_data_uri(CLIPS[0][1])]), atol=1e-5)


def test_other_media_and_text_as_audio_are_refused(server):
    image = server.post("/v1/embeddings", json={"model": CLAP, "input": ["data:image/png;base64,iVBORw0KGgo="],
                                                "modality": "image"})
    assert assert_error(image, 422)["param"] == "modality"
    assert assert_error(server.post("/v1/rerank", json={"model": CLAP, "query": "a", "documents": ["b"]}), 400)


@pytest.fixture(scope="module")
def audio_site():
    """A plain HTTP server on loopback serving the test clips."""
    with files_site([data for _, data, _ in CLIPS], ".audio") as url:
        yield url


def test_clips_by_url_match_their_data_uris(server, folders, audio_site):
    served, _ = _embed(server, CLAP, [f"{audio_site}/{i}.audio" for i in range(3)])
    np.testing.assert_allclose(served, audio_reference(folders[CLAP], [_data_uri(d, m) for _, d, m in CLIPS[:3]]),
                               atol=1e-5)


def test_vllms_audio_parts_infinitys_route_and_the_openai_client(server, folders):
    from openai import OpenAI

    data, mime = CLIPS[4][1], CLIPS[4][2]
    expected = audio_reference(folders[CLAP], [_data_uri(data, mime)])
    for part in ({"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "flac"}},
                 {"type": "audio_url", "audio_url": {"url": _data_uri(data, mime)}}):
        answer = server.post("/v1/embeddings", json={"model": CLAP, "messages": [{"role": "user", "content": [part]}]})
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose([answer.json()["data"][0]["embedding"]], expected, atol=1e-5)
    np.testing.assert_allclose(_embed(server, CLAP, [_data_uri(data, mime)], path="/embeddings_audio")[0], expected,
                               atol=1e-5)
    client = OpenAI(base_url=server.url("/v1"), api_key="unused")
    for options in ({"encoding_format": "float"}, {}):  # the client's default asks for base64
        result = client.embeddings.create(model=CLAP, input=[_data_uri(data, mime)], extra_body={"modality": "audio"},
                                          **options).data
        np.testing.assert_allclose([item.embedding for item in result], expected, atol=1e-5)


def test_many_clients_sending_clips_and_texts_at_once_get_their_own_vectors(server, folders):
    from concurrent.futures import ThreadPoolExecutor

    uris = [_data_uri(data, mime) for _, data, mime in CLIPS]
    texts = [f"sound number {i}" for i in range(len(CLIPS))]
    clip_vectors, text_vectors = audio_reference(folders[CLAP], uris), text_reference(folders[CLAP], texts)

    def call(i: int) -> tuple[int, bool, list[float]]:
        k, as_audio = i % len(CLIPS), i % 2 == 0
        body = {"input": [uris[k]], "modality": "audio"} if as_audio else {"input": [texts[k]]}
        answer = server.post("/v1/embeddings", json={"model": CLAP, **body})
        assert answer.status_code == 200, answer.text
        return k, as_audio, answer.json()["data"][0]["embedding"]

    with ThreadPoolExecutor(8) as pool:
        for k, as_audio, vector in pool.map(call, range(40)):
            np.testing.assert_allclose(vector, (clip_vectors if as_audio else text_vectors)[k], atol=1e-5)


def test_a_clap_folder_refuses_the_engines_without_an_audio_tower(folders):
    from infinity.config import ConfigError, ModelConfig
    from infinity.folders.resolve import resolve_model

    for engine in ("onnx", "ctranslate2"):
        with pytest.raises(ConfigError, match="audio tower"):
            resolve_model(ModelConfig(name="m", source=str(folders[CLAP]), engine=engine))
    assert resolve_model(ModelConfig(name="m", source=str(folders[CLAP]))).engine == "torch"
    assert math.isclose(resolve_model(ModelConfig(name="m", source=str(folders[CLAP]))).max_length, 38)


def test_clap_matches_sentence_transformers_by_cosine(server, folders):
    """sentence-transformers loads a CLAP folder as it is (text through
    `get_text_features`, audio arrays through `get_audio_features`)."""
    from sentence_transformers import SentenceTransformer
    from transformers.audio_utils import load_audio

    model = SentenceTransformer(str(folders[CLAP]), device="cpu")
    uris = [_data_uri(data, mime) for _, data, mime in CLIPS[:4]]
    waves = [{"array": load_audio(uri, sampling_rate=CLAP_SAMPLING_RATE, backend="soundfile"),
              "sampling_rate": CLAP_SAMPLING_RATE} for uri in uris]
    texts = ["a dog barks", "rain on a tin roof"]
    for served, expected in ((_embed(server, CLAP, uris)[0], model.encode(waves, normalize_embeddings=True)),
                             (_embed(server, CLAP, texts, "text")[0], model.encode(texts, normalize_embeddings=True))):
        assert (np.sum(served * expected, axis=1) >= 0.99999).all()


def test_the_tokenizer_processes_run_numpys_blas_on_one_thread(server):
    """A spectrogram's mel filter bank is a matrix product: numpy's OpenBLAS would run it
    on a thread per core, spinning beside the inference threads for no gain."""
    from pathlib import Path

    for pid in server.worker_pids()["tokenizer-0"][-1:]:
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"OPENBLAS_NUM_THREADS=1" in environment
