"""PyTorch engine: a transformers encoder with SDPA attention (where the architecture has
it), padding-free (`packed_bert`) for BERT-shaped encoders (BERT, RoBERTa, XLM-RoBERTa),
with its sequence-classification or masked-language-model head where logits are asked;
optionally through `torch.compile` (`compile = true`). In bfloat16 / float16 on a CPU its
linear layers are prepacked for oneDNN (`workers.engines.onednn`)."""

from __future__ import annotations

import inspect

import numpy as np
import torch

from infinity.shared import devices
from infinity.shared.protocol import ModelSpec
from workers.engines import onednn, packed_bert
from workers.engines.base import RawOutput, auto_class, model_output, pad_id
from workers.engines.packed_bert import PackedBert

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# What follows the BERT body's token states in the transformers heads whose body runs
# padding-free: the classifier on the pooler output, the masked-language-model head on
# every token (zero states at padding give logits there that heads mask out).
_BERT_HEADS = {
    "BertForSequenceClassification": lambda model, hidden: model.classifier(model.bert.pooler(hidden)),
    "BertForMaskedLM": lambda model, hidden: model.cls(hidden),
}


class TorchEngine:
    name = "torch"
    lanes = 1  # one pass at a time, on all its threads
    widens = False  # every pass is wide
    express = False  # a second pass at once would share the threads of the first

    def __init__(self, spec: ModelSpec, threads: int, output: RawOutput) -> None:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        if spec.dtype not in _DTYPES:
            raise ValueError(f"the torch engine takes dtype {', '.join(_DTYPES)}; got {spec.dtype}")
        torch.set_num_threads(threads)
        self._output = output
        self._device = torch.device(devices.torch_device(spec.device))
        self.on_caller_threads = self._device.type == "cpu"
        # transformers picks SDPA attention where the architecture has it (MPNet has not).
        self._model = auto_class(output, spec).from_pretrained(spec.path, dtype=_DTYPES[spec.dtype]).to(self._device).eval()
        # A retrieval model hands its keyword arguments to its vision-language model, whose
        # attention may depend on the token types (PaliGemma's prefix).
        self._takes_token_types = "token_type_ids" in inspect.signature(
            getattr(self._model, "vlm", self._model).forward).parameters
        self.pad_id = pad_id(spec)
        self._head = _BERT_HEADS.get(type(self._model).__name__)
        body = self._model if output is RawOutput.TOKEN_STATES else self._model.bert if self._head else None
        # The padding-free forward computes attended tokens only.
        packs = body is not None and packed_bert.supports(body) and not spec.reads_unattended_states
        self._packed = PackedBert(body) if packs else None
        if not spec.compile and onednn.uses_onednn(next(self._model.parameters())):
            onednn.prepack_all(self._model)
        if spec.compile:
            # The module's own padded forward compiles whole; the padding-free one is cut into
            # pieces by its data-dependent token selection, so it is not used.
            self._model = torch.compile(self._model, dynamic=True)
            self._packed = None

    @torch.inference_mode()
    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                token_type_ids: np.ndarray, wide: bool = False, express: bool = False) -> torch.Tensor:
        ids, mask, types = (torch.from_numpy(a).to(self._device) for a in (input_ids, attention_mask, token_type_ids))
        if self._packed is None:
            return self._padded(ids, mask, types)
        hidden = self._packed(ids, mask, types)
        return hidden if self._output is RawOutput.TOKEN_STATES else self._head(self._model, hidden)

    @torch.inference_mode()
    def forward_media(self, features: np.ndarray, input_ids: np.ndarray | None = None,
                      attention_mask: np.ndarray | None = None,
                      token_type_ids: np.ndarray | None = None, grid: np.ndarray | None = None) -> torch.Tensor:
        """A two-tower model's media tower: (n, ...) float32 images' pixels or clips'
        spectrograms -> (n, dim), its projected pooled output; a retrieval model's pages:
        their pixels (and patch grids) with their prompts' ids -> its output for every token."""
        values = torch.from_numpy(features).to(self._device, dtype=next(self._model.parameters()).dtype)
        if input_ids is not None:
            ids, mask, types = (torch.from_numpy(a).to(self._device) for a in (input_ids, attention_mask, token_type_ids))
            inputs = {"input_ids": ids, "attention_mask": mask, "pixel_values": values}
            if self._takes_token_types:
                inputs["token_type_ids"] = types
            if grid is not None:
                inputs["image_grid_thw"] = torch.from_numpy(grid).to(self._device)
            return model_output(self._model, inputs, self._output)
        if hasattr(self._model, "get_audio_features"):
            # Clips are cut to the window in preprocessing: none is longer, nothing to fuse.
            longer = torch.zeros((len(values), 1), dtype=torch.bool, device=self._device)
            return self._model.get_audio_features(input_features=values, is_longer=longer).pooler_output
        return self._model.get_image_features(pixel_values=values).pooler_output

    def _padded(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        """The transformers module's own forward: token states, or a head's logits."""
        inputs = {"input_ids": ids, "attention_mask": mask}
        if self._takes_token_types:
            inputs["token_type_ids"] = types
        return model_output(self._model, inputs, self._output)

