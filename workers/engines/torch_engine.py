"""PyTorch engine: a transformers encoder run eagerly with SDPA attention, padding-free
(`packed_bert`) for BERT encoders, with a sequence-classification head for rerankers and
classifiers."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import torch

from workers.engines import packed_bert
from workers.engines.packed_bert import PackedBert
from workers.models import ModelSpec, num_labels
from workers.pooling import pool

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TorchEngine:
    def __init__(self, spec: ModelSpec, threads: int) -> None:
        from transformers import AutoModel, AutoModelForSequenceClassification
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        if spec.dtype not in _DTYPES:
            raise ValueError(f"the torch engine takes dtype {', '.join(_DTYPES)}; got {spec.dtype}")
        torch.set_num_threads(threads)
        self._spec = spec
        self._device = torch.device(spec.device)
        config = json.loads((Path(spec.path) / "config.json").read_text())
        model_class = AutoModel if spec.kind == "embed" else AutoModelForSequenceClassification
        self._model = model_class.from_pretrained(
            spec.path, dtype=_DTYPES[spec.dtype], attn_implementation="sdpa"
        ).to(self._device).eval()
        self.pad_id = int(config.get("pad_token_id") or 0)
        self._takes_token_types = "token_type_ids" in inspect.signature(self._model.forward).parameters
        if spec.kind == "embed":
            self.dim = int(config["hidden_size"])
            self.labels: list[str] = []
            self.activation = "none"
            body = self._model
        else:
            self.dim = num_labels(config)
            if spec.kind == "rerank" and self.dim != 1:
                raise ValueError(f"a reranker needs a head with one output; {spec.path} has {self.dim}")
            id2label = self._model.config.id2label
            self.labels = [str(id2label.get(i, f"LABEL_{i}")) for i in range(self.dim)]
            self.activation = _activation(config, self.dim)
            body = getattr(self._model, "bert", None)
        self._packed = PackedBert(body) if body is not None and packed_bert.supports(body) else None

    @torch.inference_mode()
    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                token_type_ids: np.ndarray) -> np.ndarray:
        ids, mask, types = (torch.from_numpy(a).to(self._device) for a in (input_ids, attention_mask, token_type_ids))
        if self._spec.kind == "embed":
            hidden = self._packed(ids, mask, types) if self._packed is not None else self._padded(ids, mask, types)
            out = pool(self._spec.pooling, hidden, mask).float()
            if self._spec.normalize:
                out = torch.nn.functional.normalize(out, p=2, dim=1)
        elif self._packed is not None:  # BertForSequenceClassification: pooler, then classifier
            hidden = self._packed(ids, mask, types)
            out = self._model.classifier(self._model.bert.pooler(hidden)).float()
        else:
            out = self._padded(ids, mask, types).float()
        return out.cpu().numpy()

    def _padded(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        """The transformers module's own forward: token embeddings, or a head's logits."""
        inputs = {"input_ids": ids, "attention_mask": mask}
        if self._takes_token_types:
            inputs["token_type_ids"] = types
        output = self._model(**inputs)
        return output.last_hidden_state if self._spec.kind == "embed" else output.logits


def _activation(config: dict, labels: int) -> str:
    """What sentence-transformers' CrossEncoder (one label) or transformers' text
    classification pipeline (several) applies to the logits."""
    saved = (config.get("sentence_transformers") or {}).get("activation_fn", "")
    if saved.endswith("Identity"):
        return "none"
    if saved.endswith("Sigmoid") or labels == 1 or config.get("problem_type") == "multi_label_classification":
        return "sigmoid"
    return "softmax"
