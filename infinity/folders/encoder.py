"""Plain encoder folders (BERT, RoBERTa, MPNet and their kin, with or without
sentence-transformers modules): the reader of every folder no other reader claims. They
embed: pooled token states, as the folder's Pooling and Normalize modules say
(`infinity.folders.resolve`)."""

from __future__ import annotations

from infinity.config import ModelConfig
from infinity.folders import ModelFolder


def detect(folder: ModelFolder) -> str | None:
    return "embed"


def settings(model: ModelConfig, folder: ModelFolder, kind: str) -> dict:
    return {}
