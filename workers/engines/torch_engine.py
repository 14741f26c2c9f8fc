"""PyTorch engine: a transformers encoder run eagerly with SDPA attention, padding-free
(`packed_bert`) for BERT encoders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from workers.engines import packed_bert
from workers.engines.packed_bert import PackedBert
from workers.models import ModelSpec
from workers.pooling import pool

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TorchEngine:
    def __init__(self, spec: ModelSpec, threads: int) -> None:
        from transformers import AutoModel
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()

        torch.set_num_threads(threads)
        self._spec = spec
        self._device = torch.device(spec.device)
        self._model = AutoModel.from_pretrained(
            spec.path, dtype=_DTYPES[spec.dtype], attn_implementation="sdpa"
        ).to(self._device).eval()
        config = json.loads((Path(spec.path) / "config.json").read_text())
        self.dim = int(config["hidden_size"])
        self.vocab_size = int(config["vocab_size"])
        self.pad_id = int(config.get("pad_token_id") or 0)
        self._uses_token_types = config.get("type_vocab_size", 0) > 0
        self._packed = PackedBert(self._model) if packed_bert.supports(self._model) else None

    @torch.inference_mode()
    def embed(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(input_ids).to(self._device)
        mask = torch.from_numpy(attention_mask).to(self._device)
        hidden = self._packed(ids, mask) if self._packed is not None else self._padded(ids, mask)
        vectors = pool(self._spec.pooling, hidden, mask).float()
        if self._spec.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        return vectors.cpu().numpy()

    def _padded(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids": ids, "attention_mask": mask}
        if self._uses_token_types:
            inputs["token_type_ids"] = torch.zeros_like(ids)
        return self._model(**inputs).last_hidden_state
