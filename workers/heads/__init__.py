"""Heads: what each model kind makes of an engine's raw output (`workers.heads.base.Head`),
and the model an inference process serves, an engine with its kind's head. A new kind
is one module in this package plus one line in `HEADS` (and its name where the
configuration lists kinds); no engine changes."""

from __future__ import annotations

import importlib

import numpy as np
import torch

from infinity.shared.protocol import ModelSpec
from workers.engines import load_engine
from workers.engines.base import Engine, model_config
from workers.heads.base import Head

# Imported lazily, like the engines.
HEADS = {
    "embed": "workers.heads.pooled:PooledEmbedding",
    "rerank": "workers.heads.scores:RelevanceScores",
    "classify": "workers.heads.scores:ClassScores",
    "multivector": "workers.heads.multivector:TokenVectors",
    "sparse": "workers.heads.sparse:SparseWeights",
    "image_text": "workers.heads.two_tower:TowerEmbedding",
    "audio_text": "workers.heads.two_tower:TowerEmbedding",
    "image_multivector": "workers.heads.multivector:RetrievalTokenVectors",
}


def load_head(spec: ModelSpec) -> Head:
    module_name, class_name = HEADS[spec.kind].split(":")
    return getattr(importlib.import_module(module_name), class_name)(spec, model_config(spec))


class LoadedModel:
    """A model as an inference process runs it: its engine's forward pass, then its head;
    `dtype`: what the engine computes in."""

    def __init__(self, engine: Engine, head: Head, dtype: str) -> None:
        self.engine = engine
        self.head = head
        self.dtype = dtype

    @torch.inference_mode()
    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray,
                wide: bool = False, read_mask: np.ndarray | None = None,
                express: bool = False) -> np.ndarray | list[np.ndarray]:
        """(n, longest) int64 ids, mask and token segments -> the head's output;
        `read_mask`: the tokens whose states the head reads, if not the attended ones;
        `wide`, `express`: the engine's pass to run it on."""
        raw = self.engine.forward(input_ids, attention_mask, token_type_ids, wide=wide, express=express)
        return self.head(raw, torch.from_numpy(attention_mask if read_mask is None else read_mask).to(raw.device))

    @torch.inference_mode()
    def forward_media(self, features: np.ndarray, input_ids: np.ndarray | None = None,
                      attention_mask: np.ndarray | None = None,
                      token_type_ids: np.ndarray | None = None,
                      grid: np.ndarray | None = None) -> np.ndarray | list[np.ndarray]:
        """(n, ...) float32 media features (images' pixels, clips' spectrograms), with the
        ids, mask and token types of the prompts they come with for a retrieval model (and
        each image's patch `grid` where images vary in size) -> the head's output (a
        two-tower model's image or audio vectors; a retrieval model's vectors per token)."""
        # Engines whose towers take the medium alone (ONNX Runtime's vision tower) take no prompts.
        raw = (self.engine.forward_media(features) if input_ids is None
               else self.engine.forward_media(features, input_ids, attention_mask, token_type_ids, grid))
        mask = (torch.ones((len(features), 1), dtype=torch.int64) if attention_mask is None
                else torch.from_numpy(attention_mask))
        return self.head(raw, mask.to(raw.device))


def load_model(spec: ModelSpec, threads: int) -> LoadedModel:
    """The spec's head, and the engine that gives it the raw output it needs; where
    `dtype = "auto"` chose bfloat16, in the precision its trial settles (workers/inference/precision.py)."""
    if spec.float32_engine is not None:
        from workers.inference.precision import load_by_trial

        return load_by_trial(spec, threads, load_model)
    head = load_head(spec)
    return LoadedModel(load_engine(spec, threads, head.output), head, spec.dtype)
