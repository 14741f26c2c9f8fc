"""Model sources and folders: the packaged default, plain transformers folders with a
pooling setting, hub ids that cannot be fetched."""

import numpy as np
import pytest
import torch

from infinity.config import ConfigError, ModelConfig
from tokenizers import Tokenizer

from infinity.folders.resolve import resolve_model
from tests.support.tiny_models import save_tiny_bert


def test_packaged_default_model_reads_its_sentence_transformers_modules():
    spec = resolve_model(ModelConfig(name="default"))
    assert (spec.pooling, spec.normalize, spec.max_length, spec.lowercase) == ("mean", True, 256, False)


def test_unreachable_hub_id_fails_with_the_model_name(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="no-such-org/no-such-model"):
        resolve_model(ModelConfig(name="x", source="no-such-org/no-such-model"))


def test_missing_local_folder_is_named(tmp_path):
    with pytest.raises(ConfigError, match="not a model folder"):
        resolve_model(ModelConfig(name="x", source=str(tmp_path / "missing")))


def test_plain_transformers_folder_with_pooling_setting(tmp_path):
    folder = save_tiny_bert(tmp_path / "tiny")
    spec = resolve_model(ModelConfig(name="tiny", source=str(folder), pooling="cls"))
    assert (spec.pooling, spec.normalize, spec.max_length) == ("cls", True, 64)


def _reference(folder, texts, pooling):
    from transformers import BertModel

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))  # training is not deterministic
    model = BertModel.from_pretrained(folder).eval()
    out = []
    for text in texts:
        ids = torch.tensor([tokenizer.encode(text).ids])
        with torch.no_grad():
            hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        vector = hidden[0] if pooling == "cls" else hidden[-1] if pooling == "lasttoken" else hidden.mean(0)
        out.append((vector / vector.norm()).numpy())
    return np.stack(out)


def test_served_plain_folder_matches_transformers(tmp_path, start_server):
    folder = save_tiny_bert(tmp_path / "tiny")
    config = tmp_path / "models.toml"
    config.write_text(
        f'[[models]]\nname = "tiny-cls"\nsource = "{folder}"\npooling = "cls"\n'
        f'[[models]]\nname = "tiny-last"\nsource = "{folder}"\npooling = "lasttoken"\n'
        f'[[models]]\nname = "tiny-mean"\nsource = "{folder}"\npooling = "mean"\nnormalize = false\n'
    )
    texts = ["the quick brown fox", "a lazy dog", "seven wizards quietly judge boxing matches of jumbo quartz"]
    server = start_server("--config", str(config))
    for name, pooling in (("tiny-cls", "cls"), ("tiny-last", "lasttoken")):
        got = np.array([d["embedding"] for d in server.embed(texts, model=name).json()["data"]])
        np.testing.assert_allclose(got, _reference(folder, texts, pooling), atol=1e-5)
    got = np.array([d["embedding"] for d in server.embed(texts, model="tiny-mean").json()["data"]])
    assert not np.allclose(np.linalg.norm(got, axis=1), 1.0)  # normalize = false is honoured
    reference = _reference(folder, texts, "mean")
    cosine = (got * reference).sum(1) / np.linalg.norm(got, axis=1)
    assert (cosine > 0.99999).all()


def test_kind_is_detected_from_the_head_and_can_be_overridden(tmp_path):
    from sentence_transformers import CrossEncoder

    from tests.support.tiny_models import save_tiny_classifier, save_tiny_cross_encoder

    reranker = save_tiny_cross_encoder(tmp_path / "reranker")
    classifier = save_tiny_classifier(tmp_path / "classifier")
    assert resolve_model(ModelConfig(name="r", source=str(reranker))).kind == "rerank"
    assert resolve_model(ModelConfig(name="c", source=str(classifier))).kind == "classify"
    assert resolve_model(ModelConfig(name="e", source=str(save_tiny_bert(tmp_path / "e")))).kind == "embed"
    assert resolve_model(ModelConfig(name="d")).kind == "embed"  # sentence-transformers embedder
    assert resolve_model(ModelConfig(name="r", source=str(reranker), kind="classify")).kind == "classify"
    # sentence-transformers 6 saves a CrossEncoder with a modules.json: still a reranker.
    CrossEncoder(str(reranker)).save(str(tmp_path / "st-cross-encoder"))
    assert (tmp_path / "st-cross-encoder" / "modules.json").is_file()
    assert resolve_model(ModelConfig(name="s", source=str(tmp_path / "st-cross-encoder"))).kind == "rerank"


def test_auto_engine_rule(tmp_path):
    import importlib.util

    from tests.support.tiny_models import save_tiny_cross_encoder, save_tiny_family_model

    installed = {name: importlib.util.find_spec(module) is not None
                 for name, module in (("ctranslate2", "ctranslate2"), ("onnx", "onnxscript"))}
    converted = "onnx" if installed["onnx"] else "torch"  # what CTranslate2 cannot take
    bert_family = "ctranslate2" if installed["ctranslate2"] else converted
    assert resolve_model(ModelConfig(name="d")).engine == bert_family
    assert resolve_model(ModelConfig(name="d", dtype="int8")).engine == bert_family
    assert resolve_model(ModelConfig(name="d", engine="torch")).engine == "torch"
    assert resolve_model(ModelConfig(name="d", dtype="bfloat16")).engine == "torch"
    assert resolve_model(ModelConfig(name="d", compile=True)).engine == "torch"
    reranker = save_tiny_cross_encoder(tmp_path / "reranker")
    assert resolve_model(ModelConfig(name="r", source=str(reranker))).engine == bert_family
    mpnet = save_tiny_family_model(tmp_path / "mpnet", "mpnet")
    assert resolve_model(ModelConfig(name="m", source=str(mpnet))).engine == converted


def test_auto_engine_falls_back_to_torch_when_its_choice_cannot_load(tmp_path):
    import msgspec

    from workers.engines.torch_engine import TorchEngine
    from workers.heads import load_model

    from tests.support.tiny_models import save_tiny_family_model

    folder = save_tiny_family_model(tmp_path / "mpnet", "mpnet")
    spec = resolve_model(ModelConfig(name="mpnet", source=str(folder), engine="torch"))
    forced = msgspec.structs.replace(spec, engine="ctranslate2", fallback_engine="torch")  # it has no MPNet converter
    assert isinstance(load_model(forced, 1).engine, TorchEngine)
    with pytest.raises(Exception):
        load_model(msgspec.structs.replace(forced, fallback_engine=None), 1)


def test_characters_read_per_input_follow_max_length_unless_set(tmp_path):
    folder = save_tiny_bert(tmp_path / "tiny")
    assert resolve_model(ModelConfig(name="t", source=str(folder))).max_input_chars == 64 * 64
    assert resolve_model(ModelConfig(name="t", source=str(folder), max_length=32)).max_input_chars == 64 * 32
    assert resolve_model(ModelConfig(name="t", source=str(folder), max_input_chars=100)).max_input_chars == 100
