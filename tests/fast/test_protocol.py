"""Unit tests of the message protocol, request-body checks and the shared-memory arena."""

import os
import random
import shutil

import msgspec
import numpy as np
import pytest

from infinity.api import decode
from infinity.api.errors import APIError
from infinity.api.decode import _repeated_key, decode_body
from infinity.api.inputs import text_or_token_inputs
from infinity.api.types.embeddings import EmbeddingRequest
from infinity.api.types.scores import RerankRequest
from infinity.shared import protocol, shm

MESSAGES = [
    protocol.Tokenize(1, "m", texts=["a", "b"]),
    protocol.Tokenize(2, "m", token_ids=[[1, 2], [3]]),
    protocol.Tokenize(8, "m", texts=["doc"], query="q"),
    protocol.Tokenized(9, protocol.TokenInputs(b"\x01\x00\x00\x00", [1], type_ids=b"\x01")),
    protocol.Tokenized(3, protocol.TokenInputs(np.arange(5, dtype="<i4").tobytes(), [2, 3]), [1]),
    protocol.Tokenized(10, protocol.FeatureInputs(
        [protocol.ArrayPart.of("pixel_values", np.ones((2, 3, 4, 4), np.float32)),
         protocol.ArrayPart.of("input_ids", np.arange(5, dtype=np.int64), rows=[2, 3])], [2, 3],
        [protocol.ImageInfo(4, 4, "png", 24)] * 2)),
    protocol.Infer(4, "m", [7], protocol.TokenInputs(b"\x01\x00\x00\x00", [1])),
    protocol.Cancel(5),
    protocol.Done(6, cancelled=True),
    protocol.Failed(7, protocol.ErrorKind.INVALID_INPUT, "too long", param="input"),
    protocol.Ready("inference-cpu", 123, [protocol.ModelInfo("m", "embed", 384, 256, [], "none", "arena", 10, "torch")]),
    protocol.StartupFailed("tokenizer-0", "boom"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    assert protocol.decode(protocol.encode([message])) == [message]


def test_messages_sent_together_round_trip_in_order():
    assert protocol.decode(protocol.encode(MESSAGES)) == MESSAGES


@pytest.mark.parametrize("arrays", [
    {4: np.arange(6, dtype="<f4").reshape(2, 3), 1: np.ones((1, 3), "<f4")},  # a matrix per input
    {2: np.array([(0, 0.5), (2**31 - 1, 1e-30)], [("index", "<i4"), ("value", "<f4")]),  # sparse entries
     0: np.zeros(0, [("index", "<i4"), ("value", "<f4")])},
], ids=["matrices", "records"])
def test_ragged_outputs_travel_exactly_whatever_their_dtype(arrays):
    from infinity.client.engine_client import _by_slot
    from workers.inference.worker import _ragged

    (done,) = protocol.decode(protocol.encode([protocol.Done(1, outputs=_ragged(arrays))]))
    received = _by_slot(done.outputs)
    assert set(received) == set(arrays)
    for slot, array in arrays.items():
        assert received[slot].dtype == array.dtype and received[slot].shape == array.shape
        assert received[slot].tobytes() == array.tobytes()


def test_decode_rejects_garbage():
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        protocol.decode(b"\x93garbage")


@pytest.mark.parametrize("value, texts, token_ids", [
    ("hi", ["hi"], None),
    (["a", "b"], ["a", "b"], None),
    ([1, 2, 3], None, [[1, 2, 3]]),
    ([[1, 2], [3]], None, [[1, 2], [3]]),
])
def test_text_or_token_inputs_shapes(value, texts, token_ids):
    inputs = text_or_token_inputs(value, max_items=10)
    assert (inputs.texts, inputs.token_ids) == (texts, token_ids)


@pytest.mark.parametrize("value", ["", [], ["a", ""], [1, "a"], [[1], []], [True], [1.5], {"a": 1}, 5, None,
                                   [[1, "x"]], ["a"] * 11])
def test_text_or_token_inputs_rejects(value):
    with pytest.raises(APIError) as error:
        text_or_token_inputs(value, max_items=10)
    assert error.value.status == 422
    assert error.value.param == "input"


def test_decode_body_statuses():
    with pytest.raises(APIError) as error:
        decode_body(b"{not json", EmbeddingRequest)
    assert error.value.status == 400
    with pytest.raises(APIError) as error:
        decode_body(b'{"input": "a", "model": 3}', EmbeddingRequest)
    assert (error.value.status, error.value.param) == (422, "model")
    with pytest.raises(APIError) as error:  # a required field missing (an embeddings body's input may be
        decode_body(b'{"documents": ["a"]}', RerankRequest)  # given as messages: its route checks it)
    assert (error.value.status, error.value.param) == (422, "query")
    with pytest.raises(APIError) as error:
        decode_body(b"", EmbeddingRequest)
    assert error.value.status == 400
    body = decode_body(b'{"input": "a", "encoding_format": "base64", "dimensions": 8}', EmbeddingRequest)
    assert (body.encoding_format, body.dimensions) == ("base64", 8)


_LONG = b'"' + b"x" * 5000 + b'"'  # past the length compared in place


@pytest.mark.parametrize("body, repeated", [
    (b'{"input": "a", "input": "b"}', "input"),
    (b'{"input": "a", "input": "a"}', "input"),
    (b'{"model": "m", "input": "a", "model": "other"}', "model"),
    (b'{"input": "a", "\\u0069nput": 5}', "input"),
    (b' { "a": 1 , "a" : 2 } ', "a"),
    (b'{"x": {}, "x": []}', "x"),
    (b'{"a": 12, "a": 1}', "a"),  # the kept value is a prefix of the dropped one
    (b'{"a": 1, "a": 12}', "a"),
    (b'{"a": 1, "b": 2, "a": 1}', "a"),
    (b'{"input": ' + _LONG + b', "input": ' + _LONG + b'}', "input"),
    (b'{"input": ' + _LONG + b', "model": "m"}', None),
    (b'{}', None),
    (b' {"a": {"b": 1, "b": 2}} ', None),  # only the top level is checked
    (b'{"a": "x,\\"a\\": 1", "b": [1, {"a": 2}]}', None),
    (b'{"a":1,"b":2,"c":3}', None),
])
def test_repeated_keys_are_found(body, repeated):
    members = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    assert _repeated_key(body, members) == repeated
    if repeated is not None:
        with pytest.raises(APIError) as error:
            decode_body(body, EmbeddingRequest)
        assert (error.value.status, error.value.param) == (400, repeated)


def test_the_counted_check_agrees_with_the_walk(monkeypatch):
    """Short bodies are first counted (`_KEY_END`); on bodies that repeat keys in every
    spelling and spacing, with key-like text in values and nested objects, the count never
    clears a body the walk alone would refuse, nor refuses one."""
    rng = random.Random(7)
    values = [b"1", b'"x"', b'"t\\": 1"', b'{"a": 1, "a": 2}', b'[1, {"b": 2}]', b'"a\\u0022: "', b"null"]

    def spelled(key: str) -> bytes:
        return (b'"\\u%04x' % ord(key[0]) + key[1:].encode() + b'"') if rng.random() < 0.2 else b'"%s"' % key.encode()

    bodies = []
    for _ in range(400):
        keys = [rng.choice(["a", "b", "input", "model"]) for _ in range(rng.randint(1, 5))]
        space = rng.choice([b"", b" ", b"\n "])
        members = [spelled(key) + space + b":" + rng.choice([b"", b" "]) + rng.choice(values) for key in keys]
        bodies.append((b"{" + (b"," + space).join(members) + b"}", len(set(keys)) < len(keys)))
    counted = [_repeated_key(body, msgspec.json.decode(body, type=dict[str, msgspec.Raw])) for body, _ in bodies]
    monkeypatch.setattr(decode, "_COUNTED_BYTES", -1)
    walked = [_repeated_key(body, msgspec.json.decode(body, type=dict[str, msgspec.Raw])) for body, _ in bodies]
    assert counted == walked
    assert [found is not None for found in counted] == [repeats for _, repeats in bodies]


def test_a_short_body_without_repeats_is_cleared_without_the_walk(monkeypatch):
    class NoWalk:
        def match(self, *args: object) -> None:
            raise AssertionError("the walk ran")

    monkeypatch.setattr(decode, "_KEY", NoWalk())
    body = b'{"model": "m", "input": ["a", "b"], "encoding_format": "float"}'
    assert _repeated_key(body, msgspec.json.decode(body, type=dict[str, msgspec.Raw])) is None


def test_arena_is_shared_between_mappings_and_removed_by_name():
    folder = shm.ServerFolder()
    name = folder.arena_prefix() + "unit-test"
    writer = shm.Arena(name, slots=4, dim=3, create=True)
    try:
        reader = shm.Arena(name, slots=4, dim=3, create=False)
        writer.rows[2] = [1.0, 2.0, 3.0]
        assert reader.rows[2].tolist() == [1.0, 2.0, 3.0]
        reader.close()
        writer.close()
        shm.remove(name)
        assert not (shm.SHM_DIR / name).exists()
    finally:
        folder.remove()
    assert not folder.path.exists()


def test_only_folders_of_servers_that_are_gone_are_removed_whatever_their_pid():
    """Two servers with the same pid (pid 1 in two containers sharing /dev/shm) keep their
    folders apart; a folder is stale only when its lock is free or missing."""
    live = shm.ServerFolder()
    same_pid = shm.ServerFolder()
    dead = shm.SHM_DIR / f"infinity-emb-{os.getpid()}-deadbeef"  # its owner exited: lock free
    cut_short = shm.SHM_DIR / f"infinity-emb-{os.getpid()}-0badc0de"  # removal cut short: no lock
    for folder in (dead, cut_short):
        folder.mkdir()
        (folder / "inference-cpu-m").write_bytes(b"\0" * 8)
    (dead / "lock").touch()
    try:
        assert live.name != same_pid.name and live.name.startswith(f"infinity-emb-{os.getpid()}-")
        removed = shm.remove_stale()
        assert {dead.name, cut_short.name} <= set(removed)
        assert not dead.exists() and not cut_short.exists()
        assert live.path.is_dir() and same_pid.path.is_dir()
        assert live.name not in removed and same_pid.name not in removed
    finally:
        live.remove()
        same_pid.remove()
        shutil.rmtree(dead, ignore_errors=True)
        shutil.rmtree(cut_short, ignore_errors=True)


def test_slot_pool_admits_only_what_fits():
    pool = shm.SlotPool(3)
    first = pool.take(2)
    assert pool.take(2) is None
    assert pool.free == 1
    pool.give_back(first)
    assert sorted(pool.take(3)) == [0, 1, 2]


def test_slot_pool_counts_rows_held_by_priority_either_way():
    pool = shm.SlotPool(6)
    urgent, plain, bulk = pool.take(1, -1), pool.take(2, 0), pool.take(3, 1)
    assert [pool.held_up_to(p) for p in (-1, 0, 1)] == [1, 3, 6]
    assert [pool.held_from(p) for p in (-1, 0, 1)] == [6, 5, 3]
    pool.give_back(plain)
    assert pool.held_up_to(0) == 1 and pool.held_from(0) == 3
    pool.give_back(urgent + bulk)
    assert pool.held_up_to(1) == 0


@pytest.mark.parametrize("value", [
    "x " * 300_000,
    ["short", "héllo 🙂 wörld " * 50_000, "東京" * 200_000],
    "a\\n\"é\u00e9🙂" * 60_000,  # escapes, and surrogate pairs once written as \u escapes
])
@pytest.mark.parametrize("ascii_only", [True, False])
def test_long_texts_are_decoded_in_part_as_prefixes_of_more_than_max_chars(value, ascii_only):
    import json

    max_chars = 1000
    body = json.dumps({"model": "m", "input": value}, ensure_ascii=ascii_only).encode()
    decoded = decode_body(body, EmbeddingRequest, max_chars)
    whole = [value] if isinstance(value, str) else value
    got = [decoded.input] if isinstance(decoded.input, str) else decoded.input
    assert len(got) == len(whole) and decoded.model == "m"
    for part, text in zip(got, whole):
        assert text.startswith(part)
        assert part == text or max_chars < len(part) < len(text) / 10


def test_a_cut_string_is_a_prefix_wherever_the_cut_falls():
    import json
    import random

    from infinity.api.decode import _cut_string

    rng = random.Random(0)
    alphabet = ["a", "é", "東", "🙂", "\n", "\\", '"', "\u0001", "x"]
    cuts = 0
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(20, 200)))
        literal = json.dumps(text, ensure_ascii=rng.random() < 0.5).encode()
        limit = rng.randint(2, len(literal) - 1)
        cut = _cut_string(memoryview(literal), limit)
        if cut is not None:
            cuts += 1
            assert text.startswith(msgspec.json.decode(cut)) and len(cut) <= limit + 1
    assert cuts == 2000  # every cut decodes (none falls back to keeping the whole text)


def test_every_kind_of_error_has_a_client_answer():
    from infinity.api.errors import KIND_STATUS, ServingError, from_kind

    assert set(KIND_STATUS) == set(protocol.ErrorKind)
    invalid = from_kind(ServingError(protocol.ErrorKind.INVALID_INPUT, "too long", "input"))
    assert (invalid.status, invalid.param, invalid.headers) == (422, "input", {})
    assert from_kind(ServingError(protocol.ErrorKind.INTERNAL, "boom")).status == 500
    overloaded = from_kind(ServingError(protocol.ErrorKind.OVERLOADED, "full"))
    assert (overloaded.status, overloaded.code, overloaded.headers) == (429, "overloaded", {"Retry-After": "1"})
    died = from_kind(ServingError(protocol.ErrorKind.WORKER_DIED, "gone"))
    assert (died.status, died.code, died.headers) == (503, "worker_died", {"Retry-After": "1"})
