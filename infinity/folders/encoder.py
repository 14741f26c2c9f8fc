"""Plain encoder folders (BERT, RoBERTa, MPNet, DistilBERT, T5 encoders, Gemma3, decoder
embedders and their kin, with or without sentence-transformers modules): the reader of
every folder no other reader claims. They embed: token states run through the folder's
modules after the encoder (Pooling, Dense, LayerNorm, Normalize, in order:
`infinity.folders.modules.embedding_chain`).

A folder without modules.json is read as sentence-transformers reads one (mean pooling,
normalised) only where its architecture is an encoder's: a causal or sequence-to-sequence
language model's head, or a token-level head, says the folder was not made to embed,
and it is refused unless models.toml names its pooling."""

from __future__ import annotations

import json

from infinity.config import ConfigError, ModelConfig
from infinity.folders import ModelFolder
from infinity.folders.modules import embedding_chain, transformer_refusal
from infinity.shared.protocol import NormalizeStep, PoolStep

# The sentence-transformers modules its folder may declare (infinity/folders/__init__.py).
MODULES = ("Transformer", "StaticEmbedding", "Pooling", "Dense", "LayerNorm", "Normalize", "Dropout")
# Heads whose folders, without sentence-transformers modules, are not embedders.
NOT_EMBEDDER_HEADS = ("ForCausalLM", "ForConditionalGeneration", "ForTokenClassification", "ForQuestionAnswering",
                      "ForMultipleChoice", "LMHeadModel")
# Families whose activations overflow in float16 (Gemma's): served in bfloat16 or float32.
NO_FLOAT16_FAMILIES = ("gemma", "gemma2", "gemma3", "gemma3_text")


def detect(folder: ModelFolder) -> str | None:
    return "embed"


def settings(model: ModelConfig, folder: ModelFolder, kind: str) -> dict:
    """An embedder's module chain (`ModelSpec.modules`) and what /v1/models shows of it,
    after refusing what its folder asks that is not served."""
    path = folder.transformer / "sentence_bert_config.json"
    refused = transformer_refusal(json.loads(path.read_text()) if path.is_file() else {}, "feature-extraction")
    if refused is not None:
        raise ConfigError(f"model '{model.name}': {refused}")
    architectures = folder.config.get("architectures") or []
    heads = [a for a in architectures if a.endswith(NOT_EMBEDDER_HEADS)]
    if heads and not folder.declared and model.pooling is None:
        raise ConfigError(f"model '{model.name}': {folder.transformer} holds a {heads[0]} without sentence-transformers "
                          "modules, not an embedder; set its pooling in models.toml to embed with it anyway")
    if model.dtype == "float16" and folder.config.get("model_type") in NO_FLOAT16_FAMILIES:
        raise ConfigError(f"model '{model.name}': {folder.config['model_type']} overflows in float16; use dtype "
                          "\"bfloat16\" or \"float32\"")
    chain = embedding_chain(model, folder.root, folder.declared)
    pool = next(step for step in chain if isinstance(step, PoolStep))
    return {"modules": chain, "pooling": "+".join(pool.modes), "normalize": chain[-1] == NormalizeStep()}
