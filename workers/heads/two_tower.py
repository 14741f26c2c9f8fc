"""The head of two-tower models (`kind = "image_text"`: CLIP, SigLIP; `"audio_text"`:
CLAP): the tower's own projected vector, L2-normalised unless the model's entry says
`normalize = false` (as CLIP's `text_embeds` and infinity normalise; sentence-transformers
leaves them as they are; CLAP's towers normalise their own)."""

from __future__ import annotations

import numpy as np
import torch

from infinity.shared.protocol import ModelSpec


def shared_dim(config: dict) -> int:
    """The size of the vectors both towers give: CLIP's projection; SigLIP's text head's
    (by default its text tower's width)."""
    if "projection_dim" in config:
        return int(config["projection_dim"])
    text = config["text_config"]
    return int(text.get("projection_size") or text["hidden_size"])


class TowerEmbedding:
    activation = "none"

    def __init__(self, spec: ModelSpec, config: dict) -> None:
        self.dim = shared_dim(config)
        self.labels: list[str] = []
        self._normalize = spec.normalize

    def __call__(self, raw: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
        vectors = raw.float()
        if self._normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        return vectors.cpu().numpy()
