"""CTranslate2 engine for embedding models: the transformers model is converted once into
CTranslate2's format, cached under the cache directory keyed by the model's files, the
requested quantisation and the library versions, and reused on later starts."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from workers import devices
from workers.engines.artifacts import cached_build
from workers.models import ModelSpec
from workers.pooling import pool

log = logging.getLogger(__name__)

# dtype in models.toml -> CTranslate2 compute type (and the quantisation stored on disk).
COMPUTE_TYPES = {"float32": "float32", "float16": "float16", "int8": "int8", "int8_float16": "int8_float16"}


def converted_model(spec: ModelSpec) -> tuple[Path, bool]:
    """The CTranslate2 folder of `spec`, converting it if no cached one matches; returns
    (folder, whether it was converted now)."""
    import ctranslate2
    import transformers

    def convert(staging: Path) -> None:
        from ctranslate2.converters import TransformersConverter

        TransformersConverter(spec.path).convert(str(staging), quantization=COMPUTE_TYPES[spec.dtype], force=True)
        log.info("converted %s to CTranslate2 (%s)", spec.name, spec.dtype)

    return cached_build("ctranslate2", Path(spec.path), {
        "quantization": COMPUTE_TYPES[spec.dtype],
        "ctranslate2": ctranslate2.__version__,
        "transformers": transformers.__version__,
    }, convert)


class CTranslate2Engine:
    def __init__(self, spec: ModelSpec, threads: int) -> None:
        import ctranslate2

        if spec.kind != "embed":
            raise ValueError(f"the ctranslate2 engine serves embedding models; '{spec.name}' is a {spec.kind} model")
        if spec.dtype not in COMPUTE_TYPES:
            raise ValueError(f"the ctranslate2 engine takes dtype {', '.join(COMPUTE_TYPES)}; got {spec.dtype}")
        folder, _ = converted_model(spec)
        self._spec = spec
        device, index = devices.ctranslate2_device(spec.device)
        self._encoder = ctranslate2.Encoder(str(folder), device=device, device_index=index,
                                            compute_type=COMPUTE_TYPES[spec.dtype], intra_threads=threads)
        config = json.loads((Path(spec.path) / "config.json").read_text())
        self.dim = int(config["hidden_size"])
        self.pad_id = int(config.get("pad_token_id") or 0)
        self.labels: list[str] = []
        self.activation = "none"

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                token_type_ids: np.ndarray) -> np.ndarray:
        import ctranslate2

        lengths = attention_mask.sum(axis=1).astype(np.int32)
        output = self._encoder.forward_batch(ctranslate2.StorageView.from_array(input_ids.astype(np.int32)),
                                             ctranslate2.StorageView.from_array(lengths))
        hidden = torch.from_numpy(np.asarray(output.last_hidden_state))
        vectors = pool(self._spec.pooling, hidden, torch.from_numpy(attention_mask)).float()
        if self._spec.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        return vectors.numpy()
