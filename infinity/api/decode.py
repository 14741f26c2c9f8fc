"""Decoding a request body: JSON into the route's request type, with the checks a type
cannot express on the raw bytes (a key given twice) and long texts cut short before they
are decoded whole."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import numpy as np

from infinity.api.errors import APIError
from infinity.api.peer_fields import check_fields

def decode_body(body: bytes | bytearray, request_type: type[msgspec.Struct], max_chars: int | None = None,
                unknown_fields: str = "refuse") -> Any:
    """Decode a JSON body into `request_type`, or raise the matching 400/422 APIError: a
    key the type does not take is refused as `infinity.api.peer_fields` says (a peer's
    field not served here; another key unless `unknown_fields` is "ignore").

    With `max_chars`, a text in the body longer than that (at the top level, or an item of
    a top-level list) is decoded only in part, still more than `max_chars` characters of
    it: no model reads more of an input, and a 16 MiB text then costs one pass over its
    bytes (which checks the whole body) rather than two."""
    if not body:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        members = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        members = None  # not an object: the typed decode below says so
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _not_json(exc) from None
    if members is not None:
        repeated = _repeated_key(body, members)
        if repeated is not None:
            raise APIError(400, f"the request body names '{repeated}' more than once", param=repeated)
        check_fields(request_type, members, unknown_fields)
        if max_chars is not None and not _carries_media(members):
            body = _shortened(body, members, max_chars)
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        raise APIError(422, str(exc), param=_param_of(str(exc))) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _not_json(exc) from None


def _not_json(exc: msgspec.DecodeError | RecursionError) -> APIError:
    if isinstance(exc, RecursionError):
        return APIError(400, "the request body is nested too deeply")
    return APIError(400, f"the request body is not valid JSON: {exc}")


def _carries_media(members: dict[str, msgspec.Raw]) -> bool:
    """Whether a body's inputs are media (a data: URI is read whole, however long): Cohere's
    `images`, or a `modality` other than text."""
    if "images" in members:
        return True
    try:
        return "modality" in members and msgspec.json.decode(members["modality"]) != "text"
    except msgspec.DecodeError:
        return False


# A member's key and the separators around it, between two values of one JSON object.
_KEY = re.compile(rb'\s*[{,]\s*("(?:[^"\\]|\\.)*")\s*:\s*')


_END = re.compile(rb"\s*}\s*")

# A string's closing quote and a colon after it. Every member's key ends so; a quote inside a
# string is escaped (`\"`), yet `\":` in a text matches too, as do nested objects' keys: the
# matches are never fewer than the keys the top-level object names.
_KEY_END = re.compile(rb'"\s*:')

# Bodies up to this long are first counted whole (a request of a few texts); a count that
# proves no key repeated spares the walk.
_COUNTED_BYTES = 4096


def _repeated_key(body: bytes | bytearray, members: dict[str, msgspec.Raw]) -> str | None:
    """The first key the top-level object of `body` (valid JSON) names twice, or None.

    msgspec silently keeps the last of repeated keys, so a body that says two things is
    refused instead. Walks the members in order, comparing each value in place with the
    one kept for its key: a key met again, or a value that is not the one kept (a later
    member repeats its key), names a repeated key; a value that continues past the kept
    one's bytes leaves the walk off a member boundary, which only a repeated key does."""
    if not members:
        return None
    if len(body) <= _COUNTED_BYTES and len(_KEY_END.findall(body)) == len(members):
        return None  # as many key ends as distinct keys: none was named twice
    position, seen, key = 0, set(), None
    while len(seen) < len(members):
        found = _KEY.match(body, position)
        if found is None:
            return key
        key = _key_text(found.group(1))
        kept = members.get(key)
        if key in seen or kept is None or not _lies_at(body, kept, found.end()):
            return key
        seen.add(key)
        position = found.end() + len(kept)
    if _END.fullmatch(body, position) is not None:
        return None
    after = _KEY.match(body, position)  # a member past every kept one repeats a key
    return key if after is None else _key_text(after.group(1))


# Values up to this long are compared in place; longer ones by address, which costs no
# pass over their bytes.
_COMPARED_BYTES = 4096


def _lies_at(body: bytes | bytearray, value: msgspec.Raw, position: int) -> bool:
    """Whether `value`, a `Raw` decoded from `body` (which points into it), is the value
    that starts at `position`."""
    if len(value) <= _COMPARED_BYTES:
        return body.startswith(value, position)
    return _address(value) - _address(body) == position


def _address(buffer: bytes | bytearray | msgspec.Raw) -> int:
    return np.frombuffer(buffer, np.uint8).ctypes.data


def _key_text(quoted: bytes) -> str:
    """A JSON string's text (`quoted` with its quotes); without escapes, its bytes."""
    return msgspec.json.decode(quoted) if b"\\" in quoted else quoted[1:-1].decode()


# The most bytes one character takes in a JSON string: a surrogate pair of \u escapes.
_CHAR_BYTES = 12


def _shortened(body: bytes | bytearray, members: dict[str, msgspec.Raw], max_chars: int) -> bytes | bytearray:
    """`body` with each long text cut to its first `max_chars` + 1 characters or more."""
    limit = _CHAR_BYTES * (max_chars + 2)
    if len(body) <= limit:
        return body
    values = {key: _short_value(memoryview(raw), limit) for key, raw in members.items()}
    if all(value is None for value in values.values()):
        return body
    return b"{" + b",".join(msgspec.json.encode(key) + b":" + (bytes(members[key]) if value is None else value)
                            for key, value in values.items()) + b"}"


def _short_value(value: memoryview, limit: int) -> bytes | None:
    """A string (or a list's strings) of more than `limit` bytes cut short; None: unchanged."""
    if len(value) <= limit:
        return None
    if value[0] == ord('"'):
        return _cut_string(value, limit)
    if value[0] == ord("["):
        items = msgspec.json.decode(value, type=list[msgspec.Raw])
        cut = [_short_value(memoryview(item), limit) for item in items]
        if any(c is not None for c in cut):
            return b"[" + b",".join(bytes(item) if c is None else c for item, c in zip(items, cut)) + b"]"
    return None


def _cut_string(literal: memoryview, limit: int) -> bytes | None:
    """The JSON string `literal` cut after at most `limit` bytes, before any character or
    escape the cut would split, and closed again; None if no such cut decodes."""
    end = limit
    while literal[end] & 0xC0 == 0x80:  # inside a UTF-8 sequence
        end -= 1
    escape = _last_escape(literal, end)
    if escape is not None and escape + _escape_length(literal, escape) > end:  # the cut would split it
        end = escape
    escape = _last_escape(literal, end)
    if escape is not None and escape + 6 == end and _is_high_surrogate(literal[escape:end]):
        end = escape  # keep a surrogate pair whole
    cut = bytes(literal[:end]) + b'"'
    try:
        msgspec.json.decode(cut)
    except msgspec.DecodeError:
        return None
    return cut


def _escape_length(literal: memoryview, start: int) -> int:
    return 6 if literal[start + 1] == ord("u") else 2


def _is_high_surrogate(escape: memoryview) -> bool:
    return escape[1] == ord("u") and 0xD800 <= int(bytes(escape[2:6]), 16) <= 0xDBFF


def _last_escape(literal: memoryview, end: int) -> int | None:
    """Where the last escape sequence that starts in the `_CHAR_BYTES` bytes before `end`
    begins (a backslash preceded by an even number of backslashes), or None."""
    for start in range(end - 1, max(0, end - _CHAR_BYTES), -1):
        if literal[start] == ord("\\"):
            run = 1
            while start - run >= 0 and literal[start - run] == ord("\\"):
                run += 1
            return start if run % 2 == 1 else None  # else it ends a run of escaped backslashes
    return None


def _param_of(message: str) -> str | None:
    """`Expected str, got int - at $.model` -> `model`;
    `Object missing required field `input`` -> `input`."""
    _, sep, path = message.rpartition(" - at `$.")
    if sep:
        return path.rstrip("`").split("[")[0].split(".")[0]
    _, sep, field = message.rpartition("missing required field `")
    return field.rstrip("`") or None if sep else None
