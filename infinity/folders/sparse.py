"""Sparse (SPLADE) model folders: sentence-transformers' SparseEncoder layout (a masked-
language-model Transformer and SpladePooling), or a plain masked-language-model folder
served as SPLADE when `kind = "sparse"` says so (sentence-transformers' defaults: the max
of log(1 + relu) over tokens). Anything the folder asks that is not served is refused, so
no vector differs from the model's own."""

from __future__ import annotations

import json

from infinity.config import ConfigError, ModelConfig
from infinity.folders import ModelFolder


# The sentence-transformers modules its folder may declare (infinity/folders/__init__.py).
MODULES = ("Transformer", "MLMTransformer", "SpladePooling")


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
            "sparse_activation": pooling["activation_function"], "max_active_dims": settings.get("max_active_dims")}
