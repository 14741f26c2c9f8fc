"""Static-embedding engine (sentence-transformers' StaticEmbedding: model2vec, the
static-retrieval models): no transformer, each token's row of a table. Its "token states"
are those rows; the embedding head's mean pooling then gives what the module's mean bag
of rows gives. Weights as sentence-transformers saves them (`embedding.weight`) or as
model2vec does (`embeddings`, with an optional token `mapping` into them and per-token
`weights`), folded into one row per token id as sentence-transformers folds them."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from infinity.shared import devices
from infinity.shared.kinds import RawOutput
from infinity.shared.protocol import ModelSpec


def table(folder: Path) -> torch.Tensor:
    """The (vocabulary, dim) float32 rows of the static model in `folder`."""
    weights = load_file(str(folder / "model.safetensors"))
    if "embedding.weight" in weights:
        return weights["embedding.weight"].float()
    rows = weights["embeddings"]
    if "mapping" in weights:
        rows = rows[weights["mapping"].long()]
    rows = rows.float()
    if "weights" in weights:
        rows = rows * weights["weights"].float()[:, None]
    return rows.contiguous()


class StaticEngine:
    name = "static"
    lanes = 1
    widens = False
    express = False
    on_caller_threads = False  # a look-up: no pass worth spreading over lanes
    pad_id = 0

    def __init__(self, spec: ModelSpec, threads: int, outputs: Mapping[str, RawOutput]) -> None:
        if spec.dtype != "float32":
            raise ValueError(f"the static engine computes float32; got {spec.dtype}")
        self._rows = table(Path(spec.path)).to(devices.torch_device(spec.device))

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray,
                wide: bool = False, express: bool = False) -> torch.Tensor:
        return self._rows[torch.from_numpy(input_ids).to(self._rows.device)]

    def forward_media(self, arrays: Mapping[str, np.ndarray]) -> torch.Tensor:
        raise ValueError("a static embedding model takes texts only")
