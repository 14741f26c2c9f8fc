"""Images made ready for a two-tower model's vision tower, in the tokenizer processes:
each item decoded (`workers.images`: a data: URI or fetched bytes, with the server's
limits) and run through the folder's own image processor (resize, crop, normalise, as
transformers does for the reference), into one float32 array sent to the inference
process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from infinity.shared import protocol
from infinity.shared.folders import image_patches
from infinity.shared.protocol import ModelSpec
from workers.images import ImageLimits, data_uri_bytes, decode_image


class ImagePreprocessor:
    def __init__(self, spec: ModelSpec, limits: ImageLimits) -> None:
        from transformers import AutoImageProcessor

        self._processor = AutoImageProcessor.from_pretrained(spec.path)
        self._patches = image_patches(json.loads((Path(spec.path) / "config.json").read_text()))
        self._limits = limits

    def prepare(self, request: protocol.Tokenize) -> protocol.Tokenized:
        """The answer to a `Tokenize` of images: their pixels, and their patches as lengths."""
        images, infos = [], []
        for i, item in enumerate(request.images or []):
            name = f"input[{i}]"
            data = (data_uri_bytes(item.decode("ascii", "replace"), name, self._limits.max_bytes)
                    if item.startswith(b"data:") else item)
            image, info = decode_image(data, name, self._limits)
            images.append(image)
            infos.append(info)
        pixels = np.ascontiguousarray(self._processor(images=images, return_tensors="np")["pixel_values"],
                                      dtype=np.float32)
        return protocol.Tokenized(request.request_id, b"", [self._patches] * len(images), 0,
                                  pixels=pixels.tobytes(), pixel_shape=list(pixels.shape), image_info=infos)
