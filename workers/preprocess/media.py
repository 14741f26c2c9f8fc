"""The module that prepares the media of each kind that sees or hears
(`infinity.shared.media.MEDIUM_OF_KIND`). Each has `Preprocessor(spec, args)`, run in the
tokenizer processes (an item's bytes to the model's input, with the server's limits;
with `takes_text`, the model's texts too), and `example_features(spec, count)`: the
inference process's warm-up batch of `count` items (a `MediaExample`). A new medium or
model family is one module plus one line here."""

from __future__ import annotations

import base64
import binascii
import importlib
import re
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from infinity.shared.media import MEDIUM_OF_KIND
from workers.preprocess import InputError

MODULES = {"image_text": "workers.preprocess.image", "audio_text": "workers.preprocess.audio",
           "image_multivector": "workers.preprocess.page"}
_DATA_URI = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*);base64,", re.ASCII)


@dataclass(frozen=True)
class MediaExample:
    """A warm-up batch of media items as the model takes them."""

    features: np.ndarray  # (count, ...) float32
    cost: int  # what one item costs the batcher (an image's patches, a clip's frames, a page's tokens)
    input_ids: np.ndarray | None = None  # (count, length): the prompt each item comes with, if any
    grid: np.ndarray | None = None  # (count, 3): each image's patch grid, where images vary in size


def media_module(kind: str) -> ModuleType | None:
    """The module preparing the media of model kind `kind`; None for text-only kinds.
    Imported lazily: Pillow or soundfile only where a model takes their medium."""
    return importlib.import_module(MODULES[kind]) if kind in MEDIUM_OF_KIND else None


def item_bytes(item: bytes, name: str, max_bytes: int, medium: str) -> bytes:
    """The file bytes of a media item: a data: URI's payload of `medium`, or the bytes
    fetched from its URL (no image or audio file starts with "data:")."""
    if item.startswith(b"data:"):
        return data_uri_bytes(item.decode("ascii", "replace"), name, max_bytes, medium)
    return item


def data_uri_bytes(uri: str, item: str, max_bytes: int, media_type: str = "image") -> bytes:
    """The bytes of a base64 data: URI of `media_type` ("data:image/png;base64,...")."""
    match = _DATA_URI.match(uri)
    if match is None:
        raise InputError(f"{item} is not a base64 data: URI (data:{media_type}/...;base64,...) nor an http(s) URL")
    mime = match["mime"] or ""
    if mime.split("/")[0] != media_type:
        raise InputError(f"{item} is a data: URI of type {mime or 'none'!r}, not {media_type}/*")
    payload = uri[match.end():]
    if len(payload) // 4 * 3 > max_bytes:
        raise InputError(f"{item} holds more than {max_bytes} bytes, the most this server takes of one item")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{item}: the data: URI's base64 is not valid") from None
