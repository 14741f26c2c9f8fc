"""GPU checks (marker `gpu`, skipped without CUDA; run by bench/gpu_check.sh on a lent GPU
machine): every engine that can run on CUDA against the sentence-transformers reference
computed on the CPU, the flash-attn variable-length path when flash-attn is installed,
torch.compile, and the server end to end on `device = "cuda"` in half precision."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from tests.support.answers import decode_embedding
from tests.support.reference import cosine
from workers.heads import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

# Minimum cosine to the float32 CPU reference, by dtype.
MIN_COSINE = {"float32": 0.9999, "float16": 0.999, "bfloat16": 0.995, "int8_float16": 0.98}


def _model_vectors(model, texts: list[str], tokenizer) -> np.ndarray:
    encoded = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="np")
    ids = encoded["input_ids"].astype(np.int64)
    return model.forward(ids, encoded["attention_mask"].astype(np.int64), np.zeros_like(ids))


def _assert_matches(vectors: np.ndarray, reference: np.ndarray, dtype: str) -> None:
    worst = min(cosine(v, r) for v, r in zip(vectors, reference))
    assert worst >= MIN_COSINE[dtype], f"{dtype}: worst cosine {worst:.5f}"


@pytest.fixture(scope="module")
def tokenizer(model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_folder))


@pytest.mark.parametrize(("dtype", "compiled"), [("float32", False), ("float16", False), ("bfloat16", False),
                                                 ("float16", True)])
def test_torch_engine_on_cuda(sentences, reference_vectors, tokenizer, dtype, compiled):
    spec = resolve_model(ModelConfig(name="m", device="cuda", engine="torch", dtype=dtype, compile=compiled))
    model = load_model(spec, 1)
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # its per-shape plans (workers/engines/torch_engine.py)
    _assert_matches(_model_vectors(model, sentences[:64], tokenizer), reference_vectors[:64], dtype)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")
def test_flash_attn_varlen_path(sentences, reference_vectors, tokenizer):
    model = load_model(resolve_model(ModelConfig(name="m", device="cuda", engine="torch", dtype="float16")), 1)
    assert model.engine._packed is not None and model.engine._packed.varlen is not None
    _assert_matches(_model_vectors(model, sentences[:64], tokenizer), reference_vectors[:64], "float16")


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8_float16"])
def test_ctranslate2_on_cuda(sentences, reference_vectors, tokenizer, tmp_path, monkeypatch, dtype):
    ctranslate2 = pytest.importorskip("ctranslate2")
    if ctranslate2.get_cuda_device_count() == 0:
        pytest.skip("this ctranslate2 build sees no CUDA device")
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path))
    model = load_model(resolve_model(ModelConfig(name="m", device="cuda", engine="ctranslate2", dtype=dtype)), 1)
    _assert_matches(_model_vectors(model, sentences[:64], tokenizer), reference_vectors[:64], dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_onnx_on_cuda(sentences, reference_vectors, tokenizer, tmp_path, monkeypatch, dtype):
    onnxruntime = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has no CUDA execution provider")
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path))
    model = load_model(resolve_model(ModelConfig(name="m", device="cuda", engine="onnx", dtype=dtype)), 1)
    _assert_matches(_model_vectors(model, sentences[:64], tokenizer), reference_vectors[:64], dtype)


def test_server_on_cuda_float16(start_server, sentences, reference_vectors):
    server = start_server(config='[[models]]\ndevice = "cuda"\ndtype = "float16"\n')
    models = server.get("/v1/models").json()["data"]
    assert models[0]["devices"] == ["cuda:0"]
    response = server.post("/v1/embeddings", {"input": sentences, "encoding_format": "base64"})
    assert response.status_code == 200, response.text
    vectors = np.stack([decode_embedding(item["embedding"]) for item in response.json()["data"]])
    _assert_matches(vectors, reference_vectors, "float16")
