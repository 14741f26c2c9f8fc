"""CTranslate2 engine for encoders of the BERT and RoBERTa families: the transformers
model is converted once into CTranslate2's format, cached under the cache directory
keyed by the model's files, the requested quantisation and the library versions, and
reused on later starts. Where logits are asked, the model's sequence-classification head
runs in torch on the encoder's output."""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path

import numpy as np
import torch

from infinity.shared import devices
from infinity.shared.folders import engine_refusal
from infinity.shared.kinds import TEXT, RawOutput
from infinity.shared.protocol import ModelSpec
from workers.engines.artifacts import cached_build, versions
from workers.engines.base import pad_id
from workers.engines.lanes import built_at_lane_niceness, settle_wide_copy, wants_copy

log = logging.getLogger(__name__)

# dtype in models.toml -> CTranslate2 compute type (and the quantisation stored on disk).
COMPUTE_TYPES = {"float32": "float32", "float16": "float16", "int8": "int8", "int8_float16": "int8_float16"}


def converted_model(spec: ModelSpec) -> tuple[Path, bool]:
    """The CTranslate2 folder of `spec`, converting it if no cached one matches; returns
    (folder, whether it was converted now)."""
    def convert(staging: Path) -> None:
        from ctranslate2.converters import TransformersConverter

        with _converter_view(Path(spec.path)) as source:
            converter = TransformersConverter(str(source), trust_remote_code=spec.trust_remote_code)
            converter.convert(str(staging), quantization=COMPUTE_TYPES[spec.dtype], force=True)
        log.info("converted %s to CTranslate2 (%s)", spec.name, spec.dtype)

    return cached_build("ctranslate2", Path(spec.path), {
        "quantization": COMPUTE_TYPES[spec.dtype], **versions("ctranslate2", "transformers")}, convert)


@contextlib.contextmanager
def _converter_view(source: Path) -> Iterator[Path]:
    """`source` as CTranslate2's converter can read it. Its BERT and RoBERTa loaders assert
    `config.position_embedding_type == "absolute"`, a key transformers 5 no longer writes
    (its BERT-family models only have absolute positions); for such a folder, a temporary
    view with the key added to config.json and every other file linked."""
    config = json.loads((source / "config.json").read_text())
    if "position_embedding_type" in config:
        yield source
        return
    with tempfile.TemporaryDirectory(prefix="infinity-ct2-source-") as view:
        for path in source.iterdir():
            if path.name != "config.json":
                (Path(view) / path.name).symlink_to(path.resolve())
        (Path(view) / "config.json").write_text(json.dumps({**config, "position_embedding_type": "absolute"}))
        yield Path(view)


class CTranslate2Engine:
    name = "ctranslate2"
    on_caller_threads = False  # its threads are its own

    def __init__(self, spec: ModelSpec, threads: int, outputs: Mapping[str, RawOutput]) -> None:
        import ctranslate2

        config = json.loads((Path(spec.path) / "config.json").read_text())
        refusal = engine_refusal(self.name, outputs, config, spec.reads_unattended_states)
        if refusal is not None:
            raise ValueError(f"'{spec.name}': {refusal}")
        if spec.dtype not in COMPUTE_TYPES:
            raise ValueError(f"the ctranslate2 engine takes dtype {', '.join(COMPUTE_TYPES)}; got {spec.dtype}")
        output = outputs[TEXT]
        self._head = _classification_head(spec, config["model_type"]) if output is RawOutput.SEQUENCE_LOGITS else None
        folder, _ = converted_model(spec)
        device, index = devices.ctranslate2_device(spec.device)
        # On the CPU, one single-threaded replica per core (sharing the weights), a lane
        # each: more sentences/s than one replica on every thread
        # (bench/results/code-choices.md#figures-behind-the-code-choices).
        self.lanes = threads if device == "cpu" else 1
        copies = wants_copy(folder, self.lanes)
        build = partial(ctranslate2.Encoder, str(folder), device=device, device_index=index,
                        compute_type=COMPUTE_TYPES[spec.dtype], intra_threads=1 if device == "cpu" else threads,
                        inter_threads=self.lanes)
        # Its workers compute the lanes' passes; where the copies give an express lane, at the lanes' nice value.
        self._encoder = built_at_lane_niceness(build) if copies else build()
        self._wide = ctranslate2.Encoder(str(folder), device=device, compute_type=COMPUTE_TYPES[spec.dtype],
                                         intra_threads=threads) if copies else None
        # The express lane's own copy: one more replica of `_encoder` instead would take
        # turns with the lanes' two, and cost them (bench/results/express-lane.md#the-express-lane).
        self._express = ctranslate2.Encoder(str(folder), device=device, compute_type=COMPUTE_TYPES[spec.dtype],
                                            intra_threads=1) if copies else None
        self.express = self._express is not None
        self.pad_id = pad_id(spec)
        settle_wide_copy(self, spec, threads)

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                token_type_ids: np.ndarray, wide: bool = False, express: bool = False) -> torch.Tensor:
        import ctranslate2

        lengths = attention_mask.sum(axis=1).astype(np.int32)
        # Segment ids matter for the second text of a pair; plain texts are all segment 0.
        types = token_type_ids.tolist() if token_type_ids.any() else None
        encoder = self._wide if wide and self._wide is not None else self._express if express else self._encoder
        output = encoder.forward_batch(ctranslate2.StorageView.from_array(input_ids.astype(np.int32)),
                                             ctranslate2.StorageView.from_array(lengths), types)
        if self._head is not None:
            return self._head(output)
        return torch.from_numpy(np.asarray(output.last_hidden_state))

    def forward_media(self, arrays: Mapping[str, np.ndarray]) -> torch.Tensor:
        raise NotImplementedError("the ctranslate2 engine runs no media tower (infinity.shared.kinds.ENGINE_OUTPUTS)")


def _classification_head(spec: ModelSpec, model_type: str) -> Callable[[object], torch.Tensor]:
    """The sequence-classification head, run in torch on CTranslate2's encoder output: for
    BERT a linear layer on the pooler output (which CTranslate2 computes), for the RoBERTa
    family dense + tanh + projection on the first token's hidden state."""
    from transformers import AutoModelForSequenceClassification

    head = AutoModelForSequenceClassification.from_pretrained(
        spec.path, dtype=torch.float32, trust_remote_code=spec.trust_remote_code).eval().classifier
    output_field = "pooler_output" if model_type == "bert" else "last_hidden_state"

    @torch.inference_mode()
    def classify(output: object) -> torch.Tensor:
        return head(torch.from_numpy(np.asarray(getattr(output, output_field))).float())

    return classify
