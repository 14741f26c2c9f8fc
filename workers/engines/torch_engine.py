"""PyTorch engine: a transformers encoder with SDPA attention (where the architecture has
it), padding-free for BERT-shaped encoders (BERT, RoBERTa, XLM-RoBERTa: `packed_bert`),
ModernBERT (`packed_modernbert`) and Qwen2 / Qwen3 decoders (`packed_decoder`), with its
sequence-classification or masked-language-model head where logits are asked (or, for
a causal language model scored as a reranker, its body and the rows of its output layer
its score reads: `ModelSpec.score_tokens`); optionally through `torch.compile`
(`compile = true`). In bfloat16 / float16 on a CPU its linear layers are prepacked for
oneDNN (`workers.engines.onednn`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import numpy as np
import torch

from infinity.shared import devices
from infinity.shared.kinds import TEXT, RawOutput
from infinity.shared.protocol import ModelSpec
from workers.engines import onednn, packed_bert, packed_decoder, packed_modernbert
from workers.engines.base import auto_class, model_output, pad_id
from workers.engines.packed_bert import PackedBert
from workers.engines.packed_decoder import PackedDecoder
from workers.engines.packed_modernbert import PackedModernBert

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# A padding-free forward: (n, L) ids, mask and segments -> (n, L, hidden) token states,
# zero at padding.
PackedForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# The transformers heads whose body runs padding-free, by class: the body's attribute, and
# what follows its token states (given with the mask): the classifier on the pooled
# states, the masked-language-model head on every token (zero states at padding give
# logits there that heads mask out).
_PACKED_HEADS = {
    "BertForSequenceClassification": ("bert", lambda model, hidden, mask: model.classifier(model.bert.pooler(hidden))),
    "BertForMaskedLM": ("bert", lambda model, hidden, mask: model.cls(hidden)),
    "ModernBertForSequenceClassification": ("model", packed_modernbert.classifier_logits),
    "ModernBertForMaskedLM": ("model", lambda model, hidden, mask: model.decoder(model.head(hidden))),
}


def _causal_scorer(spec: ModelSpec, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor]:
    """A causal language model's body, and the rows of its output layer for
    `spec.score_tokens`: only those logits are read, so the projection on the whole
    vocabulary is neither kept nor computed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype, trust_remote_code=spec.trust_remote_code)
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{spec.path}: an output layer with a bias is not served for scoring by token logits")
    return model.get_decoder(), head.weight[list(spec.score_tokens)].detach().clone()


def _token_scores(rows: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(n, 1): at each input's last attended token (inputs are padded on the right), the
    logit of the first scored token, less the second's if there is one."""
    last = hidden[torch.arange(len(hidden), device=hidden.device), mask.sum(dim=1) - 1]
    logits = last @ rows.T
    return logits[:, :1] - logits[:, 1:] if len(rows) == 2 else logits


def _padding_free(body: torch.nn.Module) -> PackedForward | None:
    """The padding-free forward of a model body, for the families that have one."""
    if packed_bert.supports(body):
        return PackedBert(body)
    if packed_modernbert.supports(body):
        return PackedModernBert(body)
    if packed_decoder.supports(body):
        return PackedDecoder(body)
    return None


class TorchEngine:
    name = "torch"
    lanes = 1  # one pass at a time, on all its threads
    widens = False  # every pass is wide
    # No express lane of its own: a second pass at once would share the threads of the
    # first (on a CPU its text lanes have one: workers/inference/calibration.text_lanes).
    express = False

    def __init__(self, spec: ModelSpec, threads: int, outputs: Mapping[str, RawOutput]) -> None:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        if spec.dtype not in _DTYPES:
            raise ValueError(f"the torch engine takes dtype {', '.join(_DTYPES)}; got {spec.dtype}")
        torch.set_num_threads(threads)
        output = self._output = outputs[TEXT]
        self._media_output = next((out for medium, out in outputs.items() if medium != TEXT), None)
        self._device = torch.device(devices.torch_device(spec.device))
        if self._device.type == "cuda":
            # cuDNN's attention (which torch prefers for half precision on Hopper) builds a
            # plan for every new (batch, length) shape, hundreds of milliseconds each; served
            # batches rarely repeat a shape, so that cost lands on most passes
            # (bench/results/gpu.md). The memory-efficient kernel needs no plan.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.on_caller_threads = self._device.type == "cpu"
        # A causal reranker's scores: its body's states, then `_token_scores` (None: the model's own output).
        self._token_scores: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # transformers picks SDPA attention where the architecture has it (MPNet has not).
        if spec.score_tokens and output is RawOutput.SEQUENCE_LOGITS:
            body_model, rows = _causal_scorer(spec, _DTYPES[spec.dtype])
            self._model = body_model.to(self._device).eval()
            rows = rows.to(self._device)
            self._token_scores = lambda hidden, mask: _token_scores(rows, hidden, mask)
        else:
            self._model = auto_class(output, spec).from_pretrained(
                spec.path, dtype=_DTYPES[spec.dtype], trust_remote_code=spec.trust_remote_code).to(self._device).eval()
        # A retrieval model hands its keyword arguments to its vision-language model, whose
        # attention may depend on the token types (PaliGemma's prefix).
        self._takes_token_types = "token_type_ids" in inspect.signature(
            getattr(self._model, "vlm", self._model).forward).parameters
        self.pad_id = pad_id(spec)
        body_name, self._head = _PACKED_HEADS.get(type(self._model).__name__, (None, None))
        body = (self._model if output is RawOutput.TOKEN_STATES or self._token_scores is not None
                else getattr(self._model, body_name) if body_name else None)
        # The padding-free forward computes attended tokens only. It re-implements transformers'
        # own classes, known by name: a folder's own code may reuse those names (jina's
        # flash implementations do) and compute otherwise, so it runs its own forward.
        packs = (body is not None and not spec.reads_unattended_states
                 and type(self._model).__module__.startswith("transformers."))
        self._packed = _padding_free(body) if packs else None
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
        if self._token_scores is not None:
            return self._token_scores(hidden, mask)
        return hidden if self._output is RawOutput.TOKEN_STATES else self._head(self._model, hidden, mask)

    @torch.inference_mode()
    def forward_media(self, arrays: Mapping[str, np.ndarray]) -> torch.Tensor:
        """The model's media pass on its inputs by name (an image's pixels, a clip's
        spectrogram, a page's pixels and prompt): floating arrays in the model's dtype."""
        dtype = next(self._model.parameters()).dtype
        inputs = {name: torch.from_numpy(array).to(self._device,
                                                   dtype=dtype if np.issubdtype(array.dtype, np.floating) else None)
                  for name, array in arrays.items() if name != "token_type_ids" or self._takes_token_types}
        assert self._media_output is not None
        return model_output(self._model, inputs, self._media_output)

    def _padded(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        """The transformers module's own forward: token states, or a head's logits."""
        inputs = {"input_ids": ids, "attention_mask": mask}
        if self._takes_token_types:
            inputs["token_type_ids"] = types
        if self._token_scores is not None:
            return self._token_scores(model_output(self._model, inputs, RawOutput.TOKEN_STATES), mask)
        return model_output(self._model, inputs, self._output)

