"""The heads of sequence classifiers: a reranker's relevance score (`kind = "rerank"`,
one label) and a classifier's label scores (`kind = "classify"`), the logits as they
are. The front end applies the activation sentence-transformers' CrossEncoder (one
label) or transformers' text-classification pipeline (several) would, unless raw scores
are asked."""

from __future__ import annotations

import numpy as np
import torch

from infinity.shared.folders import num_labels
from infinity.shared.protocol import ModelSpec


class ClassScores:

    def __init__(self, spec: ModelSpec, config: dict) -> None:
        # A causal reranker's engine gives one logit, its score tokens' (`ModelSpec.score_tokens`).
        self.dim = 1 if spec.score_tokens else num_labels(config)
        id2label = config.get("id2label") or {}
        self.labels = [str(id2label.get(str(i), f"LABEL_{i}")) for i in range(self.dim)]
        if spec.score_activation:
            self.activation = spec.score_activation
        elif self.dim == 1 or config.get("problem_type") == "multi_label_classification":
            self.activation = "sigmoid"
        else:
            self.activation = "softmax"

    def __call__(self, raw: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
        return raw.float().cpu().numpy()


class RelevanceScores(ClassScores):
    def __init__(self, spec: ModelSpec, config: dict) -> None:
        super().__init__(spec, config)
        if self.dim != 1:
            raise ValueError(f"a reranker needs a head with one output; {spec.path} has {self.dim}")
