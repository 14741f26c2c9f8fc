"""What the preprocessors of media share. A kind that takes a medium beside text names
its preprocessor module in the kinds table (`infinity.shared.kinds.KindSpec.preprocessor`);
each such module has:

- `Preprocessor(spec, args)`, run in the tokenizer processes: `prepare(request)` turns a
  request's media items (the bytes fetched, or data: URIs) into `FeatureInputs` with the
  server's limits (and, for a kind whose texts its processor encodes, its texts too);
- `example(spec, count)`: `count` blank items as `prepare` makes them (the inference
  process's warm-up, the bfloat16 trial);
- `collate(items, pad_id)`: a batch of items (`feature_items` splits a request's
  `FeatureInputs` into them) as the engine's media pass takes it, a dict of arrays named
  as the model's inputs.

A new medium or model family is one such module and its kind's entry in the table; what
it adds to `FeatureInputs` reaches the engine's media pass without any code between."""

from __future__ import annotations

import base64
import binascii
import importlib
import re
from types import ModuleType

import numpy as np

from infinity.shared import protocol
from infinity.shared.kinds import KINDS
from workers.preprocess import InputError

_DATA_URI = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*);base64,", re.ASCII)


def media_module(kind: str) -> ModuleType | None:
    """The module preparing the media of model kind `kind`; None for text-only kinds.
    Imported lazily: Pillow or soundfile only where a model takes their medium."""
    name = KINDS[kind].preprocessor
    return importlib.import_module(name) if name is not None else None


def feature_items(inputs: protocol.FeatureInputs) -> tuple[list[int], list[dict[str, np.ndarray]]]:
    """(what each item costs a pass, each item's arrays by name) of `inputs`."""
    items: list[dict[str, np.ndarray]] = [{} for _ in inputs.costs]
    for part in inputs.arrays:
        array = part.array()
        if part.rows is None:
            for item, row in zip(items, array, strict=True):
                item[part.name] = row
        else:
            offsets = np.cumsum([0, *part.rows])
            for item, start, end in zip(items, offsets[:-1], offsets[1:], strict=True):
                item[part.name] = array[start:end]
    return inputs.costs, items


def stack_items(items: list[dict[str, np.ndarray]], pad_id: int = 0) -> dict[str, np.ndarray]:
    """Each named array of `items` stacked into a batch, zero-padded along each item's
    first axis to the longest (images of varying size: the padding patches lie beyond each
    one's grid). What most media towers take; `pad_id` is not used."""
    return {name: _stacked([item[name] for item in items]) for name in items[0]}


def _stacked(arrays: list[np.ndarray]) -> np.ndarray:
    if all(a.shape == arrays[0].shape for a in arrays):
        return np.stack(arrays)
    out = np.zeros((len(arrays), max(len(a) for a in arrays), *arrays[0].shape[1:]), dtype=arrays[0].dtype)
    for row, array in enumerate(arrays):
        out[row, :len(array)] = array
    return out


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
