"""Text queries and page images made ready for a page-retrieval model (ColPali, ColQwen2),
in the tokenizer processes, by the folder's own processor: a query gets its prompt and
query augmentation (`process_queries`), an image (decoded by
`workers.preprocess.image_decoding`, with the server's limits) its image tokens and prompt
and its pixels (`process_images`), exactly
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
from workers.preprocess import InputError
from workers.preprocess.image_decoding import ImageLimits, decode_image
from workers.preprocess.media import item_bytes, stack_items
from workers.preprocess.text import TokenItem, collate_tokens


class Preprocessor:
    def __init__(self, spec: ModelSpec, args: protocol.WorkerArgs) -> None:
        self._processor = _processor(spec)
        self._limits = ImageLimits(args.max_image_bytes, args.max_image_pixels)

    def prepare(self, request: protocol.Tokenize) -> protocol.Tokenized:
        """The answer to a `Tokenize` of queries (token ids) or page images (features)."""
        if request.media is not None:
            images, infos = [], []
            for i, item in enumerate(request.media):
                image, info = decode_image(item_bytes(item, f"input[{i}]", self._limits.max_bytes, "image"),
                                           f"input[{i}]", self._limits)
                images.append(image)
                infos.append(info)
            return protocol.Tokenized(request.request_id, _pages(_numpy(self._processor.process_images(images)),
                                                                 infos))
        if request.texts is None:
            raise InputError("this model takes texts (queries) or images (pages), not token ids")
        encoded = _numpy(self._processor.process_queries(request.texts))
        ids, types, lengths = _attended_tokens(encoded)
        return protocol.Tokenized(request.request_id, protocol.TokenInputs(
            ids.astype("<i4").tobytes(), lengths, types.astype(np.int8).tobytes()))


def example(spec: ModelSpec, count: int) -> protocol.FeatureInputs:
    """`count` blank pages as the model takes them, with their prompts; each costs its tokens."""
    from PIL import Image

    return _pages(_numpy(_processor(spec).process_images([Image.new("RGB", (64, 64))] * count)))


def collate(items: list[dict[str, np.ndarray]], pad_id: int) -> dict[str, np.ndarray]:
    """A batch of pages: their prompts' tokens padded as texts are (with their attention
    mask), their pixels (and patch grids) stacked."""
    arrays = collate_tokens([TokenItem(item["input_ids"], item["token_type_ids"]) for item in items], pad_id)
    arrays.update(stack_items([{name: array for name, array in item.items() if name not in _TOKENS}
                               for item in items]))
    return arrays


_TOKENS = ("input_ids", "token_type_ids")


def _processor(spec: ModelSpec):  # noqa: ANN202 (transformers stays lazy)
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)


def _numpy(encoded: dict) -> dict[str, np.ndarray]:
    """The processor's torch tensors (it builds them with torch ops, so it cannot give
    numpy arrays directly) as numpy arrays."""
    return {key: value.numpy() for key, value in encoded.items()}


def _attended_tokens(encoded: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The attended tokens of each row of the processor's output, concatenated, with their
    token types (zero where the processor gives none), and each row's count."""
    attended = encoded["attention_mask"].astype(bool)
    types = encoded.get("token_type_ids")
    types = np.zeros_like(encoded["input_ids"]) if types is None else types
    return encoded["input_ids"][attended], types[attended], attended.sum(axis=1).tolist()


def _pages(encoded: dict[str, np.ndarray], infos: list[protocol.ImageInfo] | None = None) -> protocol.FeatureInputs:
    """Pages as the model takes them: their pixels (padded to the largest page), their
    prompts' attended tokens, and each one's patch grid where pages vary in size."""
    ids, types, lengths = _attended_tokens(encoded)
    arrays = [protocol.ArrayPart.of("pixel_values", encoded["pixel_values"].astype(np.float32)),
              protocol.ArrayPart.of("input_ids", ids.astype(np.int64), rows=lengths),
              protocol.ArrayPart.of("token_type_ids", types.astype(np.int64), rows=lengths)]
    if "image_grid_thw" in encoded:
        arrays.append(protocol.ArrayPart.of("image_grid_thw", encoded["image_grid_thw"].astype(np.int64)))
    return protocol.FeatureInputs(arrays, lengths, infos)
