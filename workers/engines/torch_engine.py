"""PyTorch engine: a transformers encoder with SDPA attention (where the architecture has
it), padding-free (`packed_bert`) for BERT encoders, with a sequence-classification head
for rerankers and classifiers; optionally through `torch.compile` (`compile = true`)."""

from __future__ import annotations

import inspect

import numpy as np
import torch

from infinity.shared import devices
from infinity.shared.protocol import ModelSpec
from workers.engines import packed_bert
from workers.engines.base import describe
from workers.engines.packed_bert import PackedBert
from workers.pooling import embedding

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TorchEngine:
    name = "torch"
    lanes = 1  # one pass at a time, on all its threads
    widens = False  # every pass is wide

    def __init__(self, spec: ModelSpec, threads: int) -> None:
        from transformers import AutoModel, AutoModelForSequenceClassification
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        if spec.dtype not in _DTYPES:
            raise ValueError(f"the torch engine takes dtype {', '.join(_DTYPES)}; got {spec.dtype}")
        torch.set_num_threads(threads)
        self._spec = spec
        self._device = torch.device(devices.torch_device(spec.device))
        model_class = AutoModel if spec.kind == "embed" else AutoModelForSequenceClassification
        # transformers picks SDPA attention where the architecture has it (MPNet has not).
        self._model = model_class.from_pretrained(spec.path, dtype=_DTYPES[spec.dtype]).to(self._device).eval()
        self._takes_token_types = "token_type_ids" in inspect.signature(self._model.forward).parameters
        describe(self, spec)
        body = self._model if spec.kind == "embed" else getattr(self._model, "bert", None)
        self._packed = PackedBert(body) if body is not None and packed_bert.supports(body) else None
        if spec.compile:
            # The module's own padded forward compiles whole; the padding-free one is cut into
            # pieces by its data-dependent token selection, so it is not used.
            self._model = torch.compile(self._model, dynamic=True)
            self._packed = None

    @torch.inference_mode()
    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                token_type_ids: np.ndarray, wide: bool = False) -> np.ndarray:
        ids, mask, types = (torch.from_numpy(a).to(self._device) for a in (input_ids, attention_mask, token_type_ids))
        if self._spec.kind == "embed":
            hidden = self._packed(ids, mask, types) if self._packed is not None else self._padded(ids, mask, types)
            out = embedding(self._spec.pooling, self._spec.normalize, hidden, mask)
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

