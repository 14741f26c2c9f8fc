"""Images made ready for a two-tower model's vision tower, in the tokenizer processes:
each item decoded (`workers.preprocess.image_decoding`: a data: URI or fetched bytes, with
the server's limits) and run through the folder's own image processor (resize, crop,
normalise, as transformers does for the reference) into its `pixel_values`. An image
costs the batcher, and is billed, its patches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from infinity.shared import protocol
from infinity.shared.folders import image_patches
from infinity.shared.protocol import ModelSpec
from workers.preprocess.image_decoding import ImageLimits, decode_image
from workers.preprocess.media import item_bytes, stack_items


class Preprocessor:
    def __init__(self, spec: ModelSpec, args: protocol.WorkerArgs) -> None:
        from transformers import AutoImageProcessor

        self._processor = AutoImageProcessor.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
        self._patches = image_patches(_config(spec))
        self._limits = ImageLimits(args.max_image_bytes, args.max_image_pixels)

    def prepare(self, request: protocol.Tokenize) -> protocol.Tokenized:
        """The answer to a `Tokenize` of images: their pixels, and their patches as lengths."""
        images, infos = [], []
        for i, item in enumerate(request.media or []):
            name = f"input[{i}]"
            image, info = decode_image(item_bytes(item, name, self._limits.max_bytes, "image"), name, self._limits)
            images.append(image)
            infos.append(info)
        pixels = np.asarray(self._processor(images=images, return_tensors="np")["pixel_values"], dtype=np.float32)
        return protocol.Tokenized(request.request_id, protocol.FeatureInputs(
            [protocol.ArrayPart.of("pixel_values", pixels)], [self._patches] * len(images), infos))


def example(spec: ModelSpec, count: int) -> protocol.FeatureInputs:
    """`count` blank images as the vision tower takes them; each costs its patches."""
    config = _config(spec)
    vision = config["vision_config"]
    side = int(vision["image_size"])
    pixels = np.zeros((count, int(vision.get("num_channels", 3)), side, side), dtype=np.float32)
    return protocol.FeatureInputs([protocol.ArrayPart.of("pixel_values", pixels)], [image_patches(config)] * count)


collate = stack_items


def _config(spec: ModelSpec) -> dict:
    return json.loads((Path(spec.path) / "config.json").read_text())
