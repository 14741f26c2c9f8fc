"""Text queries and page images made ready for a page-retrieval model (ColPali, ColQwen2),
in the tokenizer processes, by the folder's own processor: a query gets its prompt and
query augmentation (`process_queries`), an image (decoded by `workers.preprocess.image_decoding`, with the
server's limits) its image tokens and prompt and its pixels (`process_images`), exactly
the inputs transformers' reference computation feeds the model: token types where the
processor gives them (PaliGemma's attention depends on them), each image's patch grid
where images vary in size (ColQwen2's `image_grid_thw`; its pixels are padded to the
request's largest image, and again to the batch's in the inference process). Every
token the processor attends to is kept, and read by the head; padding is left to the
inference process. A page costs the batcher, and counts in `usage`, its tokens (image
tokens and prompt): ColQwen2's grow with the image's size."""

from __future__ import annotations

import numpy as np

from infinity.shared import protocol
from infinity.shared.protocol import ModelSpec
from workers.preprocess.image_decoding import ImageLimits, decode_image
from workers.preprocess.media import MediaExample, item_bytes
from workers.preprocess import InputError


class Preprocessor:
    takes_text = True  # queries get the processor's prompt and augmentation

    def __init__(self, spec: ModelSpec, args: protocol.WorkerArgs) -> None:
        self._processor = _processor(spec)
        self._limits = ImageLimits(args.max_image_bytes, args.max_image_pixels)

    def prepare(self, request: protocol.Tokenize) -> protocol.Tokenized:
        """The answer to a `Tokenize` of queries or page images."""
        if request.media is not None:
            images, infos = [], []
            for i, item in enumerate(request.media):
                image, info = decode_image(item_bytes(item, f"input[{i}]", self._limits.max_bytes, "image"),
                                           f"input[{i}]", self._limits)
                images.append(image)
                infos.append(info)
            encoded = _numpy(self._processor.process_images(images))
            pixels = np.ascontiguousarray(encoded["pixel_values"], dtype=np.float32)
            return _tokenized(request.request_id, encoded, pixels, infos)
        if request.texts is None:
            raise InputError("this model takes texts (queries) or images (pages), not token ids")
        return _tokenized(request.request_id, _numpy(self._processor.process_queries(request.texts)))


def example_features(spec: ModelSpec, count: int) -> MediaExample:
    """`count` blank pages as the model takes them, with their prompts; each costs its tokens."""
    from PIL import Image

    processor = _processor(spec)
    encoded = _numpy(processor.process_images([Image.new("RGB", (64, 64))] * count))
    ids = encoded["input_ids"].astype(np.int64)
    return MediaExample(np.ascontiguousarray(encoded["pixel_values"], dtype=np.float32), ids.shape[1], ids,
                        encoded.get("image_grid_thw"))


def _processor(spec: ModelSpec):  # noqa: ANN202 (transformers stays lazy)
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(spec.path)


def _numpy(encoded: dict) -> dict[str, np.ndarray]:
    """The processor's torch tensors (it builds them with torch ops, so it cannot give
    numpy arrays directly) as numpy arrays."""
    return {key: value.numpy() for key, value in encoded.items()}


def _tokenized(request_id: int, encoded: dict, pixels: np.ndarray | None = None,
               infos: list[protocol.ImageInfo] | None = None) -> protocol.Tokenized:
    """The attended tokens of each row of the processor's output, concatenated."""
    attended = encoded["attention_mask"].astype(bool)
    types = encoded.get("token_type_ids")
    types = np.zeros_like(encoded["input_ids"]) if types is None else types
    return protocol.Tokenized(
        request_id, encoded["input_ids"][attended].astype("<i4").tobytes(), attended.sum(axis=1).tolist(), 0,
        type_ids=types[attended].astype(np.int8).tobytes(),
        features=None if pixels is None else pixels.tobytes(),
        feature_shape=None if pixels is None else list(pixels.shape), image_info=infos,
        feature_grid=encoded["image_grid_thw"].tolist() if "image_grid_thw" in encoded else None)
