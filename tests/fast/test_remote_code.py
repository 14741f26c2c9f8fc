"""Folders that ship their own modelling code (an `auto_map` in config.json or
tokenizer_config.json), read from their config alone (no weights, no code run): refused
without `trust_remote_code`, naming the model, the classes and the key; with it, served on
torch whatever `engine = "auto"`, the bfloat16 trial or the lone-input runtimes would pick
for the family, and refused on an engine named otherwise; code named in another hub
repository is fetched at start, and a start that cannot fetch it fails naming it."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub.constants
import pytest

from infinity.config import ConfigError, ModelConfig, load_config
from infinity.folders.resolve import resolve_model

# A BERT config, as jina-embeddings-v2 keeps one beside its own code: the family alone
# would be served on CTranslate2 or ONNX Runtime.
BERT_CONFIG = {"model_type": "bert", "architectures": ["JinaBertModel"], "max_position_embeddings": 512,
               "hidden_size": 32, "num_attention_heads": 2, "pad_token_id": 0}
AUTO_MAP = {"AutoConfig": "configuration_bert.JinaBertConfig", "AutoModel": "modeling_bert.JinaBertModel"}


def _folder(root: Path, config: dict, tokenizer_config: dict | None = None) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    if tokenizer_config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(root)


@pytest.fixture
def remote(tmp_path: Path) -> str:
    return _folder(tmp_path / "remote", {**BERT_CONFIG, "auto_map": AUTO_MAP})


def test_a_folder_with_code_is_refused_unless_trusted_naming_model_classes_and_key(remote: str) -> None:
    with pytest.raises(ConfigError) as refused:
        resolve_model(ModelConfig(name="jina", source=remote))
    message = str(refused.value)
    assert "model 'jina'" in message and "ships its own code" in message
    assert "configuration_bert.JinaBertConfig" in message and "modeling_bert.JinaBertModel" in message
    assert "trust_remote_code = true" in message


def test_a_tokenizer_with_code_is_refused_unless_trusted(tmp_path: Path) -> None:
    tokenizer_config = {"auto_map": {"AutoTokenizer": ["tokenization_tiny.TinyTokenizer", None]}}
    folder = _folder(tmp_path / "tok", BERT_CONFIG, tokenizer_config)
    with pytest.raises(ConfigError, match=r"tokenizer_config.json auto_map: tokenization_tiny.TinyTokenizer.*"
                                          r"trust_remote_code = true"):
        resolve_model(ModelConfig(name="tok", source=folder))
    assert resolve_model(ModelConfig(name="tok", source=folder, trust_remote_code=True)).trust_remote_code


def test_trusted_code_is_served_on_torch_where_its_family_would_not_be(tmp_path: Path, remote: str) -> None:
    plain = resolve_model(ModelConfig(name="bert", source=_folder(tmp_path / "plain", BERT_CONFIG)))
    if plain.engine == "torch":
        pytest.skip("neither the ctranslate2 nor the onnx extra is installed: every model runs on torch")
    assert not plain.trust_remote_code
    spec = resolve_model(ModelConfig(name="jina", source=remote, trust_remote_code=True))
    assert (spec.trust_remote_code, spec.engine, spec.fallback_engine, spec.lone_engines) == (True, "torch", None, ())


def test_trusted_code_tries_bfloat16_on_torch_only(tmp_path: Path, remote: str) -> None:
    plain = resolve_model(ModelConfig(name="bert", source=_folder(tmp_path / "plain", BERT_CONFIG)), cpu_bfloat16=True)
    if plain.engine == "torch":
        pytest.skip("the openvino extra is not installed: bfloat16 is tried on torch for every model")
    spec = resolve_model(ModelConfig(name="jina", source=remote, trust_remote_code=True), cpu_bfloat16=True)
    assert (spec.engine, spec.dtype, spec.float32_engine, spec.lone_engines) == ("torch", "bfloat16", "torch", ())


@pytest.mark.parametrize("engine", ["onnx", "ctranslate2", "openvino"])
def test_an_engine_other_than_torch_is_refused_for_code_saying_why(remote: str, engine: str) -> None:
    with pytest.raises(ConfigError) as refused:
        resolve_model(ModelConfig(name="jina", source=remote, trust_remote_code=True, engine=engine))
    message = str(refused.value)
    assert f"model 'jina': the {engine} engine" in message and "only the torch engine runs" in message
    assert message.endswith('use engine = "torch" or "auto"')
    assert resolve_model(ModelConfig(name="jina", source=remote, trust_remote_code=True, engine="torch")).engine \
        == "torch"


def test_a_lone_engine_other_than_torch_is_refused_for_code(remote: str) -> None:
    with pytest.raises(ConfigError, match="lone_engine: the onnx engine .* only the torch engine runs"):
        resolve_model(ModelConfig(name="jina", source=remote, trust_remote_code=True, dtype="float32",
                                  lone_engine="onnx"))


def test_code_of_another_repository_that_cannot_be_fetched_fails_the_start_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As nomic-embed-text-v1.5's config names nomic-ai/nomic-bert-2048's code; offline, with an empty hub cache.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    auto_map = {"AutoConfig": "no-such-org/no-such-code--configuration_hf_nomic_bert.NomicBertConfig",
                "AutoModel": "no-such-org/no-such-code--modeling_hf_nomic_bert.NomicBertModel"}
    folder = _folder(tmp_path / "nomic", {**BERT_CONFIG, "model_type": "nomic_bert", "auto_map": auto_map})
    with pytest.raises(ConfigError) as refused:
        resolve_model(ModelConfig(name="nomic", source=folder, trust_remote_code=True))
    message = str(refused.value)
    assert "model 'nomic'" in message and "hub repository no-such-org/no-such-code" in message
    assert "could not be downloaded" in message
    with pytest.raises(ConfigError, match="trust_remote_code = true"):  # untrusted: nothing is fetched
        resolve_model(ModelConfig(name="nomic", source=folder))


def test_trust_is_a_models_toml_key_and_off_by_default(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text("[[models]]\nname = 'a'\nsource = '/models/a'\n"
                    "[[models]]\nname = 'b'\nsource = '/models/b'\ntrust_remote_code = true\n")
    assert [m.trust_remote_code for m in load_config(path, env={}).models] == [False, True]
    path.write_text("[[models]]\nname = 'a'\nsource = '/models/a'\ntrust_remote_code = 'perhaps'\n")
    with pytest.raises(ConfigError, match="trust_remote_code"):
        load_config(path, env={})
