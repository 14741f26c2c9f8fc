"""Which engine serves a model, from its folder's config.json alone (no weights loaded):
ModernBERT, which CTranslate2 has no converter for and whose export ONNX Runtime's
optimiser cannot fuse, is served by torch (padding-free) under `engine = "auto"`, and tries
bfloat16 there as other encoders do; the decoder embedders (Qwen3, Qwen2) are served by
torch (padding-free) at float32 though ONNX Runtime could serve them, and try bfloat16 on
OpenVINO where installed, as other encoders do."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from infinity.config import ConfigError, ModelConfig
from infinity.folders.resolve import resolve_model

MODERNBERT_CONFIG = {"model_type": "modernbert", "architectures": ["ModernBertModel"], "max_position_embeddings": 8192,
                     "pad_token_id": 50283}


@pytest.fixture
def modernbert(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(MODERNBERT_CONFIG))
    return str(tmp_path)


def test_auto_serves_modernbert_on_torch(modernbert: str) -> None:
    spec = resolve_model(ModelConfig(name="m", source=modernbert))
    assert (spec.kind, spec.engine, spec.fallback_engine, spec.max_length) == ("embed", "torch", None, 8192)


def test_modernbert_tries_bfloat16_against_float32_on_torch(modernbert: str) -> None:
    spec = resolve_model(ModelConfig(name="m", source=modernbert), cpu_bfloat16=True)
    # Its bfloat16 on OpenVINO where installed (which runs its plain export), else on torch.
    bfloat16_engine = "openvino" if importlib.util.find_spec("openvino") else "torch"
    assert (spec.engine, spec.dtype, spec.float32_engine) == (bfloat16_engine, "bfloat16", "torch")


@pytest.mark.parametrize("engine, why", [("onnx", "transformer optimiser, which fails on modernbert"),
                                         ("ctranslate2", "this model is modernbert")])
def test_engines_that_cannot_run_modernbert_refuse_it_naming_the_others(modernbert: str, engine: str,
                                                                         why: str) -> None:
    with pytest.raises(ConfigError, match=why) as refused:
        resolve_model(ModelConfig(name="m", source=modernbert, engine=engine))
    assert 'use engine = "torch" or' in str(refused.value) and '"openvino"' in str(refused.value)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_auto_serves_decoders_on_torch_and_tries_bfloat16_as_encoders_do(tmp_path: Path, family: str) -> None:
    config = {"model_type": family, "architectures": [f"{family.title()}Model"], "max_position_embeddings": 32768}
    (tmp_path / "config.json").write_text(json.dumps(config))
    float32 = resolve_model(ModelConfig(name="m", source=str(tmp_path)))
    assert (float32.engine, float32.dtype, float32.fallback_engine) == ("torch", "float32", None)
    bfloat16 = resolve_model(ModelConfig(name="m", source=str(tmp_path)), cpu_bfloat16=True)
    bfloat16_engine = "openvino" if importlib.util.find_spec("openvino") else "torch"
    assert (bfloat16.engine, bfloat16.dtype, bfloat16.float32_engine) == (bfloat16_engine, "bfloat16", "torch")
    assert resolve_model(ModelConfig(name="m", source=str(tmp_path), engine="onnx")).engine == "onnx"
