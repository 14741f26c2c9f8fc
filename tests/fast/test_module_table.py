"""The rule of infinity/folders/modules.py: every module class of the pinned
sentence-transformers is served or refused by name, and a folder that declares a module,
a setting or an activation the server cannot run is refused at start naming it, never
served without it."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
from pathlib import Path

import pytest

from infinity.config import ConfigError, ModelConfig
from infinity.folders.modules import ACTIVATIONS, REFUSED, SERVED
from infinity.folders.resolve import packaged_model_folder, resolve_model


def _library_module_classes() -> set[str]:
    """Every class the installed sentence-transformers defines that is a module of a model
    (a subclass of its `Module`), in every subpackage."""
    import sentence_transformers
    from sentence_transformers.base.modules import Module

    names = set()
    for info in pkgutil.walk_packages(sentence_transformers.__path__, "sentence_transformers."):
        if ".modules" not in info.name:
            continue
        for _, value in inspect.getmembers(importlib.import_module(info.name), inspect.isclass):
            if issubclass(value, Module) and value.__module__.startswith("sentence_transformers."):
                names.add(value.__name__)
    return names


def test_every_module_class_of_the_library_is_served_or_refused():
    classes = _library_module_classes()
    assert {"Transformer", "Pooling", "Dense", "Normalize", "Router", "StaticEmbedding", "LogitScore"} <= classes
    assert classes - set(SERVED) - set(REFUSED) == set(), "a module class neither served nor refused"
    assert not set(SERVED) & set(REFUSED)


def test_every_activation_served_is_a_torch_module_without_parameters():
    import torch

    for name in ACTIVATIONS:
        activation = getattr(torch.nn, name)()
        assert isinstance(activation, torch.nn.Module) and not list(activation.parameters()), name


def _copy_of_default(root: Path) -> Path:
    """The packaged model's folder (Transformer, Pooling, Normalize), its module files copied
    so a test can change them."""
    root.mkdir(parents=True)
    for entry in packaged_model_folder().iterdir():
        if entry.is_dir():
            (root / entry.name).mkdir()
            for file in entry.iterdir():
                (root / entry.name / file.name).write_bytes(file.read_bytes())
        else:
            (root / entry.name).symlink_to(entry)
    return root


def _modules(folder: Path) -> list[dict]:
    return json.loads((folder / "modules.json").read_text())


def _write_modules(folder: Path, modules: list[dict]) -> None:
    (folder / "modules.json").unlink()
    (folder / "modules.json").write_text(json.dumps(modules))


def _with_module(folder: Path, type_: str, config: dict, weights: dict | None = None) -> Path:
    """`folder` with one more module before its Normalize."""
    import torch
    from safetensors.torch import save_file

    modules = _modules(folder)
    path = f"{len(modules)}_{type_.rsplit('.', 1)[-1]}"
    (folder / path).mkdir()
    (folder / path / "config.json").write_text(json.dumps(config))
    if weights is not None:
        save_file({key: torch.randn(*shape) for key, shape in weights.items()}, str(folder / path / "model.safetensors"))
    _write_modules(folder, modules[:-1] + [{"idx": len(modules), "name": path, "path": path, "type": type_},
                                           modules[-1]])
    return folder


DENSE = "sentence_transformers.models.Dense"


@pytest.mark.parametrize("change, names", [
    (lambda f: _with_module(f, "sentence_transformers.models.WeightedLayerPooling", {}), "WeightedLayerPooling"),
    (lambda f: _with_module(f, "sentence_transformers.models.Router", {}), "Router"),
    (lambda f: _with_module(f, "my_package.modules.Whitening", {}), "my_package.modules.Whitening"),
    (lambda f: _with_module(f, "sentence_transformers.models.Frobnicate", {}), "Frobnicate"),
    (lambda f: _with_module(f, DENSE, {"in_features": 384, "out_features": 8, "activation_function": "my.Swish"},
                            {"linear.weight": (8, 384), "linear.bias": (8,)}), "my.Swish"),
    (lambda f: _with_module(f, DENSE, {"in_features": 384, "out_features": 8, "activation_function":
                                       "torch.nn.modules.activation.PReLU"}, {"linear.weight": (8, 384)}), "PReLU"),
    (lambda f: _with_module(f, DENSE, {"in_features": 384, "out_features": 8, "whiten": True},
                            {"linear.weight": (8, 384)}), "whiten"),
    (lambda f: _with_module(f, DENSE, {"in_features": 384, "out_features": 8, "module_input_name": "cls_vector"},
                            {"linear.weight": (8, 384)}), "cls_vector"),
    (lambda f: _with_module(f, DENSE, {"in_features": 384, "out_features": 8}), "no weights"),
], ids=["weighted-layer-pooling", "router", "custom-code", "unknown-class", "untrusted-activation",
        "activation-with-parameters", "unknown-dense-key", "unknown-feature", "dense-without-weights"])
def test_a_module_that_cannot_run_fails_the_start_naming_it(tmp_path, change, names):
    folder = change(_copy_of_default(tmp_path / "model"))
    with pytest.raises(ConfigError, match=names):
        resolve_model(ModelConfig(name="m", source=str(folder)))


@pytest.mark.parametrize("config, names", [
    ({"word_embedding_dimension": 384, "pooling_mode": "median"}, "median"),
    ({"embedding_dimension": 384, "pooling_mode": "mean", "whitening": True}, "whitening"),
])
def test_a_pooling_setting_that_cannot_run_fails_the_start_naming_it(tmp_path, config, names):
    folder = _copy_of_default(tmp_path / "model")
    pooling = next(entry["path"] for entry in _modules(folder) if entry["type"].endswith("Pooling"))
    (folder / pooling / "config.json").unlink()
    (folder / pooling / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=names):
        resolve_model(ModelConfig(name="m", source=str(folder)))


@pytest.mark.parametrize("settings, names", [
    ({"max_seq_length": 256, "tokenizer_args": {"add_eos_token": True}}, "add_eos_token"),
    ({"max_seq_length": 256, "config_args": {"use_bidirectional_attention": True}}, "use_bidirectional_attention"),
    ({"max_seq_length": 256, "transformer_task": "text-generation"}, "text-generation"),
    ({"max_seq_length": 256, "frobnicate": 1}, "frobnicate"),
])
def test_a_transformer_setting_that_changes_the_output_fails_the_start(tmp_path, settings, names):
    folder = _copy_of_default(tmp_path / "model")
    (folder / "sentence_bert_config.json").unlink()
    (folder / "sentence_bert_config.json").write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match=names):
        resolve_model(ModelConfig(name="m", source=str(folder)))


def test_pooling_and_normalize_of_models_toml_apply_over_the_folders_chain(tmp_path):
    folder = str(packaged_model_folder())
    spec = resolve_model(ModelConfig(name="m", source=folder, pooling="weightedmean", normalize=False))
    assert [step.label for step in spec.modules] == ["Pooling(weightedmean)"]
    assert (spec.pooling, spec.normalize) == ("weightedmean", False)
    spec = resolve_model(ModelConfig(name="m", source=folder))
    assert [step.label for step in spec.modules] == ["Pooling(mean)", "Normalize"]


def test_a_causal_language_model_without_modules_is_not_taken_for_an_embedder(tmp_path):
    from tests.support.tiny_models import save_tiny_decoder_embedder

    embedder = save_tiny_decoder_embedder(tmp_path / "embedder", "qwen3")
    decoder = next(tmp_path.glob("embedder-*"))
    config = json.loads((decoder / "config.json").read_text())
    (decoder / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(ConfigError, match="Qwen3ForCausalLM without sentence-transformers modules"):
        resolve_model(ModelConfig(name="m", source=str(decoder)))
    assert resolve_model(ModelConfig(name="m", source=str(decoder), pooling="lasttoken")).pooling == "lasttoken"
    assert resolve_model(ModelConfig(name="m", source=str(embedder))).pooling == "lasttoken"  # its modules say so


def test_gemma3_is_refused_in_float16_and_served_in_bfloat16_on_gpus(tmp_path):
    from tests.support.zoo import save_embedding_gemma

    folder = str(save_embedding_gemma(tmp_path / "embeddinggemma"))
    with pytest.raises(ConfigError, match="float16"):
        resolve_model(ModelConfig(name="m", source=folder, dtype="float16"))
    assert resolve_model(ModelConfig(name="m", source=folder, device="cuda")).dtype == "bfloat16"


def test_special_tokens_a_tokenizer_config_asks_are_read_as_transformers_reads_them(tmp_path):
    from transformers import AutoTokenizer

    from tests.support.zoo import save_embedding_gemma
    from workers.preprocess.text import load_tokenizer

    folder = save_embedding_gemma(tmp_path / "embeddinggemma")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "add_bos_token": True,
                                                               "add_eos_token": True}))
    tokenizer = load_tokenizer(resolve_model(ModelConfig(name="m", source=str(folder))))
    text = "the quick brown fox"
    assert tokenizer.encode(text).ids == AutoTokenizer.from_pretrained(folder)(text)["input_ids"]


def test_a_static_embedding_model_is_served_on_the_static_engine_alone(tmp_path, monkeypatch):
    from tests.support.zoo import save_static_embedder

    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    folder = str(save_static_embedder(tmp_path / "potion"))
    spec = resolve_model(ModelConfig(name="m", source=folder, device="cuda"))
    assert (spec.kind, spec.engine, spec.dtype, spec.max_length) == ("embed", "static", "float32", 8192)
    trial = resolve_model(ModelConfig(name="m", source=folder), cpu_bfloat16=True)  # a look-up: no bfloat16 trial
    assert (trial.engine, trial.dtype, trial.float32_engine) == ("static", "float32", None)
    assert json.loads((Path(spec.path) / "tokenizer.json").read_text())["post_processor"] is None
    with pytest.raises(ConfigError, match="static engine"):
        resolve_model(ModelConfig(name="m", source=folder, engine="torch"))
    with pytest.raises(ConfigError, match="static engine"):
        resolve_model(ModelConfig(name="m", engine="static"))


def test_a_cross_encoders_saved_activation_is_read_wherever_its_library_saved_it(tmp_path):
    from tests.support.tiny_models import save_tiny_cross_encoder
    from tests.support.zoo import save_raw_score_cross_encoder

    assert resolve_model(ModelConfig(name="m", source=str(save_tiny_cross_encoder(tmp_path / "plain")))
                         ).score_activation == ""
    assert resolve_model(ModelConfig(name="m", source=str(save_raw_score_cross_encoder(tmp_path / "st6")))
                         ).score_activation == "none"
    legacy = save_tiny_cross_encoder(tmp_path / "legacy")
    config = json.loads((legacy / "config.json").read_text())
    for activation, read in (("torch.nn.modules.linear.Identity", "none"), ("torch.nn.modules.activation.Tanh", None)):
        (legacy / "config.json").write_text(json.dumps({**config, "sbert_ce_default_activation_function": activation}))
        if read is None:
            with pytest.raises(ConfigError, match="Tanh"):
                resolve_model(ModelConfig(name="m", source=str(legacy)))
        else:
            assert resolve_model(ModelConfig(name="m", source=str(legacy))).score_activation == read


def test_a_scoring_kind_forced_on_a_folder_without_its_head_fails_the_start(tmp_path):
    from tests.support.tiny_models import save_tiny_bert

    folder = str(save_tiny_bert(tmp_path / "bert"))
    for kind in ("rerank", "classify"):
        with pytest.raises(ConfigError, match="drawn at random"):
            resolve_model(ModelConfig(name="m", source=folder, kind=kind))


def test_a_cross_encoders_default_prompt_fails_the_start(tmp_path):
    from tests.support.tiny_models import save_tiny_cross_encoder

    folder = save_tiny_cross_encoder(tmp_path / "reranker")
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: "}, "default_prompt_name": "query"}))
    with pytest.raises(ConfigError, match="default prompt"):
        resolve_model(ModelConfig(name="m", source=str(folder)))


def test_an_inference_free_router_is_read_as_a_sparse_model_with_a_static_query_side(tmp_path):
    from tests.support.tiny_models import save_inference_free_sparse, save_tiny_masked_lm

    folder = save_inference_free_sparse(tmp_path / "inference-free", save_tiny_masked_lm(tmp_path / "mlm"))
    spec = resolve_model(ModelConfig(name="m", source=str(folder)))
    assert (spec.kind, Path(spec.query_weights).name) == ("sparse", "query_0_SparseStaticEmbedding")
    assert not spec.tasks["query"].special_tokens and spec.tasks["query"].tokenizer == spec.query_weights
    assert spec.tasks["document"].tokenizer is None and Path(spec.path).name == "document_0_Transformer"
    config = json.loads((folder / "router_config.json").read_text())
    for change, names in (({"default_route": "query"}, "default 'query'"),
                          ({"route_mappings": {"('query', None)": "document"}}, "route_mappings")):
        (folder / "router_config.json").write_text(json.dumps({**config, "parameters": {
            **config["parameters"], **change}}))
        with pytest.raises(ConfigError, match=names):
            resolve_model(ModelConfig(name="m", source=str(folder)))


def test_queries_of_a_static_query_side_skip_the_pass_and_keep_their_place_in_the_batch():
    import numpy as np

    from infinity.shared.protocol import QUERY_ROUTE
    from workers.heads import LoadedModel

    class Engine:
        passed: list[list[int]] = []

        def forward(self, input_ids, attention_mask, token_type_ids, wide=False, express=False):  # noqa: ANN001, ANN201
            import torch

            self.passed.append(input_ids[:, 0].tolist())
            return torch.from_numpy(input_ids.astype(np.float32))[..., None]

    class Head:
        def __call__(self, raw, mask):  # noqa: ANN001, ANN201
            return [np.array([f"passed {int(row[0, 0])}"]) for row in raw]

        def route_queries(self, input_ids, attention_mask):  # noqa: ANN001, ANN201
            return [np.array([f"routed {row[0]}"]) for row in input_ids]

    engine = Engine()
    model = LoadedModel(engine, Head(), "float32")
    ids = np.array([[1, 0], [2, 0], [3, 0], [4, 0]])
    types = [(QUERY_ROUTE,), (), (QUERY_ROUTE,), ()]
    outputs = model.forward(ids, np.ones_like(ids), np.zeros_like(ids), vector_types=types)
    assert [str(output[QUERY_ROUTE][0]) if isinstance(output, dict) else str(output[0]) for output in outputs] == [
        "routed 1", "passed 2", "routed 3", "passed 4"]
    assert engine.passed == [[2, 4]]
    model.forward(ids[[0, 2]], np.ones((2, 2), dtype=np.int64), np.zeros((2, 2), dtype=np.int64),
                  vector_types=[(QUERY_ROUTE,), (QUERY_ROUTE,)])
    assert engine.passed == [[2, 4]]  # a batch of queries alone runs no pass
