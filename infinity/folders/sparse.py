"""Sparse (SPLADE) model folders: sentence-transformers' SparseEncoder layout (a masked-
language-model Transformer and SpladePooling), or a plain masked-language-model folder
served as SPLADE when `kind = "sparse"` says so (sentence-transformers' defaults: the max
of log(1 + relu) over tokens); or an inference-free one, a Router of SPLADE for documents
and SparseStaticEmbedding for queries. Anything the folder asks that is not served is
refused, so no vector differs from the model's own."""

from __future__ import annotations

import json
from pathlib import Path

from infinity.config import ConfigError, ModelConfig
from infinity.folders import ModelFolder
from infinity.shared.protocol import TaskEncoding


# The sentence-transformers modules its folder may declare (infinity/folders/__init__.py).
MODULES = ("Transformer", "MLMTransformer", "SpladePooling", "SparseStaticEmbedding")


def detect(folder: ModelFolder) -> str | None:
    return "sparse" if "SpladePooling" in folder.modules else None


def settings(model: ModelConfig, folder: ModelFolder, kind: str) -> dict:
    """The fields of a sparse model's spec: its pooling and activation, unnormalised
    vectors, and its own cap on nonzero entries (max_active_dims)."""
    architectures = folder.config.get("architectures") or []
    if not any(a.endswith("ForMaskedLM") for a in architectures):
        raise ConfigError(f"model '{model.name}': a sparse model needs a masked-language-model head (a *ForMaskedLM "
                          f"in config.json's architectures); {folder.transformer} has {architectures or 'none'}")
    if model.pooling is not None or model.normalize:
        raise ConfigError(f"model '{model.name}': pooling and normalize do not apply to a sparse model "
                          "(its SpladePooling module says how it pools; its vectors are not normalised)")
    settings = folder.settings()
    if settings.get("transformer_task", "fill-mask") != "fill-mask":
        raise ConfigError(f"model '{model.name}': SpladePooling over a {settings['transformer_task']} transformer "
                          "is not served (it pools masked-language-model logits)")
    pooling = {"pooling_strategy": "max", "activation_function": "relu"}
    if "SpladePooling" in folder.modules:
        pooling.update(json.loads((folder.root / folder.modules["SpladePooling"] / "config.json").read_text()))
    if (pooling["pooling_strategy"] not in ("max", "sum")
            or pooling["activation_function"] not in ("relu", "log1p_relu")):
        raise ConfigError(f"model '{model.name}': SpladePooling {pooling} is not served (pooling_strategy max or sum, "
                          "activation_function relu or log1p_relu)")
    return {"pooling": pooling["pooling_strategy"], "normalize": False,
            "sparse_activation": pooling["activation_function"], "max_active_dims": settings.get("max_active_dims"),
            **_query_route(model, folder)}


def _query_route(model: ModelConfig, folder: ModelFolder) -> dict:
    """An inference-free model's query side (a Router's query route, SparseStaticEmbedding:
    each token the query holds weighs its weight, no pass of the model): its weights, and
    its queries tokenized as sentence-transformers tokenizes them there (by that module's
    tokenizer, without special tokens, cut at its tokenizer's length); documents take the
    SPLADE route, the default. None for a model of one route."""
    if not any(module.route for module in folder.declared):
        return {}
    query = [module for module in folder.declared if module.route == "query"]
    if [module.name for module in query] != ["SparseStaticEmbedding"] or folder.count("SparseStaticEmbedding") != 1:
        raise ConfigError(f"model '{model.name}': a Router's query route is served as one SparseStaticEmbedding; "
                          f"this one has {', '.join(module.name for module in query)}")
    if "SpladePooling" not in {module.name for module in folder.declared if module.route == "document"}:
        raise ConfigError(f"model '{model.name}': a Router's document route is served as SPLADE (an MLMTransformer "
                          "and SpladePooling)")
    path = query[0].path
    longest = _json(path / "tokenizer_config.json").get("model_max_length")
    length = min(longest, folder.max_length) if isinstance(longest, int) else folder.max_length
    return {"query_weights": str(path),
            "tasks": {"query": TaskEncoding(max_length=length, tokenizer=str(path), special_tokens=False),
                      "document": TaskEncoding()}}


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
