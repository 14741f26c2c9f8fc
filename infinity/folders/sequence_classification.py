"""Reranker and classifier folders: a transformers `*ForSequenceClassification`, saved by
transformers or by sentence-transformers' CrossEncoder (with one label the model reranks,
a cross-encoder's relevance; with several it classifies); and a causal language model
scored by its token logits as a reranker (`infinity.folders.causal_scores`)."""

from __future__ import annotations

from infinity.config import ConfigError, ModelConfig
from infinity.folders import ModelFolder, causal_scores
from infinity.shared.folders import causal_lm, num_labels


# The sentence-transformers modules its folder may declare (infinity/folders/__init__.py).
MODULES = ("Transformer", "LogitScore")


def detect(folder: ModelFolder) -> str | None:
    if any(a.endswith("ForSequenceClassification") for a in folder.config.get("architectures") or []):
        return "rerank" if num_labels(folder.config) == 1 else "classify"
    return causal_scores.detect(folder)


def settings(model: ModelConfig, folder: ModelFolder, kind: str) -> dict:
    if causal_lm(folder.config):
        if kind != "rerank":
            raise ConfigError(f"model '{model.name}': a causal language model is served as a reranker (kind "
                              f"'rerank'), not as kind '{kind}'")
        return causal_scores.settings(model, folder)
    if folder.count("LogitScore"):
        raise ConfigError(f"model '{model.name}': LogitScore reads a causal language model's logits; "
                          f"{folder.transformer} holds none")
    return {}
