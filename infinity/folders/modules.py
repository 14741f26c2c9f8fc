"""sentence-transformers modules: which of the pinned library's module classes the server
runs and how (`SERVED`), which it refuses and what would serve such a model (`REFUSED`),
a folder's `modules.json` read in order (`declared_modules`), and an embedder's modules
after its encoder read into the steps its head runs (`embedding_chain`).

Every class the library defines is in one of the two tables (tests/fast/test_module_table.py
walks them), so a folder naming a module is served with the module's meaning or refused at
start naming it; never served without it. A module's config keys are read the same way:
those that change the output are honoured, any other key is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from infinity.config import ConfigError, ModelConfig
from infinity.shared.protocol import (SENTENCE_FEATURE, TOKEN_FEATURE, ChainStep, DenseStep, LayerNormStep,
                                      NormalizeStep, PoolStep)

# How each module class the server runs is served, by class name.
SERVED: dict[str, str] = {
    "Transformer": "the encoder, on the model's engine",
    "StaticEmbedding": "a token table's rows averaged (model2vec), on the static engine",
    "MLMTransformer": "a sparse model's encoder with its masked-language-model head",
    "Pooling": "token states pooled after the pass (every mode and their concatenation, include_prompt)",
    "Dense": "a linear layer and its torch activation after pooling, any number in order (or on token states)",
    "LayerNorm": "a layer norm of the pooled vector",
    "Normalize": "L2 normalisation",
    "Dropout": "nothing: dropout is the identity at inference",
    "SpladePooling": "a sparse model's pooling of its logits (kind sparse)",
    "MultiVectorMask": "a multi-vector model's skipped tokens (kind multivector)",
    "LogitScore": "a causal language model's logit of its true token less its false one's at the last token, as a "
                  "reranker's relevance (kind rerank)",
    "Router": "an inference-free sparse model's routes: its queries weighed by their tokens alone "
              "(SparseStaticEmbedding), its documents by its SPLADE encoder",
    "SparseStaticEmbedding": "an inference-free sparse model's query side, under a Router",
}

# Why each module class the server does not run is refused, by class name.
REFUSED: dict[str, str] = {
    "Module": "the library's abstract base class, not a module of a saved model",
    "InputModule": "the library's abstract base class, not a module of a saved model",
    "Asym": "sentence-transformers' earlier layout of separate modules for queries and documents; save the model "
            "again with sentence-transformers 5 or later (a Router)",
    "SparseAutoEncoder": "a sparse auto-encoder over dense embeddings (CSR); sparse models are served as SPLADE",
    "CSRSparsity": "a sparse auto-encoder over dense embeddings (CSR); sparse models are served as SPLADE",
    "WeightedLayerPooling": "pooling over every layer's states; only the last layer's are computed here",
    "CLIPModel": "sentence-transformers' CLIP wrapper; serve the CLIP folder it holds as kind image_text",
    "BoW": "a bag-of-words model without a transformer",
    "CNN": "a word-embedding CNN without a transformer",
    "LSTM": "a word-embedding LSTM without a transformer",
    "WordEmbeddings": "word vectors without a transformer (GloVe-style)",
    "WordWeights": "per-word weights over word vectors, without a transformer",
    "BaseTokenPooling": "pooling of a multi-vector model's token vectors into fewer vectors",
    "HierarchicalTokenPooling": "pooling of a multi-vector model's token vectors into fewer vectors",
    "LambdaTokenPooling": "pooling of a multi-vector model's token vectors into fewer vectors",
}

# Modules of other packages, by their type in modules.json: the class they are served as.
FOREIGN = {"pylate.models.Dense.Dense": "Dense"}  # PyLate's, before sentence-transformers took ColBERT in

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# The legacy boolean keys of a Pooling config, in the order sentence-transformers concatenates them.
_LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                        "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# The activations a Dense may name: torch.nn's element-wise ones without parameters (what
# sentence-transformers builds with no arguments from a `torch.` path).
ACTIVATIONS = ("Identity", "Tanh", "ReLU", "ReLU6", "GELU", "Sigmoid", "SiLU", "Mish", "ELU", "SELU", "CELU",
               "LeakyReLU", "Softplus", "Softsign", "Hardtanh", "Hardswish", "Hardsigmoid", "LogSigmoid",
               "Tanhshrink")
_FEATURES = (SENTENCE_FEATURE, TOKEN_FEATURE)
# Each run module's config keys the server reads; any other key is refused.
_CONFIG_KEYS = {
    "Pooling": {"embedding_dimension", "word_embedding_dimension", "pooling_mode", "include_prompt",
                *_LEGACY_POOLING_KEYS},
    "Dense": {"in_features", "out_features", "bias", "activation_function", "module_input_name",
              "module_output_name", "use_residual"},
    "LayerNorm": {"dimension"},
    "Normalize": {"module_input_name", "module_output_name"},
    "Dropout": {"dropout"},
    "SpladePooling": {"pooling_strategy", "activation_function", "embedding_dimension", "word_embedding_dimension"},
    "MultiVectorMask": {"skiplist_words", "skiplist_tasks", "keep_only_token_ids"},
    "SparseStaticEmbedding": {"frozen"},
    "LogitScore": {"true_token_id", "false_token_id", "module_input_name"},
}
# The Transformer's own settings (its sentence_bert_config.json) the server reads, of
# sentence-transformers 6 and of the releases before it.
TRANSFORMER_KEYS = {"max_seq_length", "do_lower_case", "transformer_task", "modality_config", "module_output_name",
                    "processing_kwargs", "unpad_inputs", "query_length", "document_length", "query_expansion",
                    "model_args", "tokenizer_args", "config_args", "cache_dir", "backend"}
# Of its loading arguments, those that leave the model's output as it is.
_NEUTRAL_ARGS = {"model_args": {"torch_dtype", "dtype", "attn_implementation", "low_cpu_mem_usage"},
                 "tokenizer_args": {"model_max_length", "use_fast"}, "config_args": set()}
# What an encoder's modality_config says when it is the plain forward pass read here.
PLAIN_TEXT_MODALITY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}


@dataclass(frozen=True)
class DeclaredModule:
    """One entry of a folder's modules.json."""

    name: str  # its class (the last dotted part of its type; sentence-transformers 5's MLMTransformer kept)
    type: str  # as modules.json writes it
    path: Path  # its folder
    route: str | None = None  # the route of a Router it runs on ("query", "document"); None: every input's

    def config(self) -> dict:
        """Its config.json (none: empty)."""
        path = self.path / "config.json"
        return json.loads(path.read_text()) if path.is_file() else {}


def declared_modules(folder: Path) -> tuple[DeclaredModule, ...]:
    """The modules of `folder`'s modules.json in order (none: empty), a Router's by route
    (`routed_modules`); a module of another package than sentence-transformers (custom
    code) or one `REFUSED` fails the start."""
    path = folder / "modules.json"
    if not path.is_file():
        return ()
    entries = json.loads(path.read_text())
    if any(entry["type"].rsplit(".", 1)[-1] == "Router" for entry in entries):
        if len(entries) != 1:
            raise ConfigError(f"{folder}: modules beside a Router are not served")
        return routed_modules(folder / entries[0].get("path", ""))
    return _read_entries(folder, entries)


# The Routers served: queries and documents each their own route, documents by default
# (`Router.for_query_document`), as a request's task picks them.
_ROUTES = ("query", "document")


def routed_modules(folder: Path) -> tuple[DeclaredModule, ...]:
    """A Router's modules (its router_config.json), each marked with its route; only a
    Router of a query route and a document route, documents by default, is served."""
    config = json.loads((folder / "router_config.json").read_text())
    structure, parameters = config.get("structure") or {}, config.get("parameters") or {}
    mappings = parameters.get("route_mappings") or {}
    if sorted(structure) != sorted(_ROUTES) or parameters.get("default_route") != "document" or mappings:
        raise ConfigError(f"{folder}: a Router is served with a query route and a document route, documents by "
                          f"default, picked by task; this one has routes {sorted(structure)}, default "
                          f"{parameters.get('default_route')!r}, route_mappings {mappings}")
    declared: list[DeclaredModule] = []
    for route in _ROUTES:
        entries = [{"type": config["types"][name], "path": name} for name in structure[route]]
        declared += [DeclaredModule(module.name, module.type, module.path, route)
                     for module in _read_entries(folder, entries)]
    return tuple(declared)


def _read_entries(folder: Path, entries: list[dict]) -> tuple[DeclaredModule, ...]:
    declared = []
    for entry in entries:
        kind = entry["type"]
        name = FOREIGN.get(kind) or kind.rsplit(".", 1)[-1]
        if not kind.startswith("sentence_transformers.") and kind not in FOREIGN:
            raise ConfigError(f"{folder}: modules.json names {kind}, a module of the folder's own code; only "
                              "sentence-transformers' modules are served")
        if name in REFUSED:
            raise ConfigError(f"{folder}: sentence-transformers module {name} is not served: {REFUSED[name]}")
        if name not in SERVED:
            raise ConfigError(f"{folder}: sentence-transformers module {kind} is unknown to this server "
                              f"(served: {', '.join(SERVED)})")
        module = DeclaredModule(name, kind, folder / entry.get("path", ""))
        settings = set(module.config())
        unknown = sorted(settings - _CONFIG_KEYS.get(name, settings))
        if unknown:
            raise ConfigError(f"{folder}: {name} module setting {', '.join(unknown)} is not served "
                              f"(read: {', '.join(sorted(_CONFIG_KEYS[name]))})")
        declared.append(module)
    return tuple(declared)


def transformer_refusal(settings: dict, task: str) -> str | None:
    """Why the server cannot run a Transformer module whose sentence_bert_config.json is
    `settings` as an encoder of `task` (sentence-transformers' transformer_task), or None."""
    unknown = sorted(set(settings) - TRANSFORMER_KEYS)
    if unknown:
        return f"Transformer setting {', '.join(unknown)} is not served"
    if settings.get("transformer_task", task) != task:
        return f"a {settings['transformer_task']} Transformer is not served here (this kind reads {task})"
    for key, neutral in _NEUTRAL_ARGS.items():
        changing = sorted(set(settings.get(key) or {}) - neutral)
        if changing:
            return f"Transformer {key} {', '.join(changing)} is not served (they change what the model computes)"
    processing = settings.get("processing_kwargs") or {}
    # A causal reranker's chat template may take arguments (`chat_template_settings` reads them).
    if set(processing) - ({"chat_template"} if task == "text-generation" else set()):
        return f"Transformer processing_kwargs {processing} are not served"
    modality = settings.get("modality_config")
    if task == "feature-extraction" and modality not in (None, PLAIN_TEXT_MODALITY):
        return f"Transformer modality_config {modality} is not served (only {PLAIN_TEXT_MODALITY})"
    return None


def pooling_modes(config: dict, where: object) -> tuple[str, ...]:
    """The modes of a Pooling module's config, as sentence-transformers reads them (its
    `pooling_mode`, else its legacy boolean keys, else mean)."""
    mode = config.get("pooling_mode")
    if mode is None:
        modes = tuple(m for key, m in _LEGACY_POOLING_KEYS.items() if config.get(key)) or ("mean",)
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown or not modes:
        raise ConfigError(f"{where}: pooling mode {', '.join(map(str, unknown)) or 'none'} is not served "
                          f"(modes: {', '.join(POOLING_MODES)})")
    return modes


def embedding_chain(model: ModelConfig, root: Path, declared: tuple[DeclaredModule, ...]) -> tuple[ChainStep, ...]:
    """An embedder's steps after its encoder: its folder's modules in order (none: mean
    pooling and Normalize, as sentence-transformers builds a plain transformers folder),
    with `pooling` and `normalize` of models.toml applied over them."""
    steps: list[ChainStep] = []
    for module in declared:
        if module.name in ("Transformer", "MLMTransformer", "Dropout"):
            continue
        config = module.config()
        if module.name == "StaticEmbedding":  # its mean of rows
            steps.append(PoolStep(("mean",)))
        elif module.name == "Pooling":
            steps.append(PoolStep(pooling_modes(config, module.path)))
        elif module.name == "Dense":
            steps.append(_dense(module, config))
        elif module.name == "LayerNorm":
            steps.append(LayerNormStep(str(module.path), int(config["dimension"])))
        elif module.name == "Normalize":
            steps.append(NormalizeStep(*_features(module, config)))
        else:
            raise ConfigError(f"model '{model.name}': module {module.name} does not belong to an embedder "
                              f"({module.type})")
    if not declared:
        steps = [PoolStep(("mean",)), NormalizeStep()]
    pools = [i for i, step in enumerate(steps) if isinstance(step, PoolStep)]
    if len(pools) > 1:
        raise ConfigError(f"model '{model.name}': its modules pool twice")
    if model.pooling is not None:
        if pools:
            steps[pools[0]] = PoolStep((model.pooling,))
        else:
            steps.insert(0, PoolStep((model.pooling,)))
    elif not pools:
        raise ConfigError(f"model '{model.name}': its modules.json has no Pooling module; set pooling in its "
                          f"models.toml entry ({', '.join(POOLING_MODES)})")
    if model.normalize is not None:
        while steps and steps[-1] == NormalizeStep():
            steps.pop()
        if model.normalize:
            steps.append(NormalizeStep())
    return tuple(steps)


def _features(module: DeclaredModule, config: dict) -> tuple[str, str]:
    """The feature a module reads and the one it writes (sentence-transformers' names)."""
    source = config.get("module_input_name") or SENTENCE_FEATURE
    target = config.get("module_output_name") or source
    for feature in (source, target):
        if feature not in _FEATURES:
            raise ConfigError(f"{module.path}: {module.name} on feature {feature!r} is not served "
                              f"({' or '.join(_FEATURES)})")
    return source, target


def _dense(module: DeclaredModule, config: dict) -> DenseStep:
    activation = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
    name = activation.rsplit(".", 1)[-1]
    if not activation.startswith("torch.nn.") or name not in ACTIVATIONS:
        raise ConfigError(f"{module.path}: Dense activation {activation} is not served (torch.nn's "
                          f"{', '.join(ACTIVATIONS)})")
    if not any((module.path / f).is_file() for f in ("model.safetensors", "pytorch_model.bin")):
        raise ConfigError(f"{module.path}: the Dense module has no weights (model.safetensors or pytorch_model.bin)")
    return DenseStep(str(module.path), int(config["in_features"]), int(config["out_features"]),
                     bool(config.get("bias", True)), name, bool(config.get("use_residual", False)),
                     *_features(module, config))
