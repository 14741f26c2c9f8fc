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
        return {**causal_scores.settings(model, folder), "score_activation": _saved_activation(model, folder)}
    if folder.count("LogitScore"):
        raise ConfigError(f"model '{model.name}': LogitScore reads a causal language model's logits; "
                          f"{folder.transformer} holds none")
    architectures = folder.config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ConfigError(f"model '{model.name}': kind '{kind}' needs a sequence-classification head (a "
                          f"*ForSequenceClassification in config.json's architectures); {folder.transformer} has "
                          f"{architectures or 'none'}, whose head would be drawn at random")
    settings = folder.settings()
    default_prompt = (settings.get("prompts") or {}).get(settings.get("default_prompt_name") or "")
    if default_prompt:
        raise ConfigError(f"model '{model.name}': a cross-encoder's default prompt ({default_prompt!r}) is not served")
    return {"score_activation": _saved_activation(model, folder)}


# The activations a CrossEncoder may have saved, as the front end applies them.
_ACTIVATIONS = {"Identity": "none", "Sigmoid": "sigmoid"}


def _saved_activation(model: ModelConfig, folder: ModelFolder) -> str:
    """The activation sentence-transformers' CrossEncoder applies to the folder's logits,
    where it saved one ("" where not: the head's default): in
    config_sentence_transformers.json (sentence-transformers 6), config.json's
    `sentence_transformers` (4 and 5) or `sbert_ce_default_activation_function` (before)."""
    saved = (folder.settings().get("activation_fn") or (folder.config.get("sentence_transformers") or {}).get(
        "activation_fn") or folder.config.get("sbert_ce_default_activation_function") or "")
    if not saved:
        return ""
    name = saved.rsplit(".", 1)[-1]
    if not saved.startswith("torch.") or name not in _ACTIVATIONS:
        raise ConfigError(f"model '{model.name}': a cross-encoder's activation {saved} is not served "
                          f"({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]
