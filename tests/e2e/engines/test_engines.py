"""Engines against each other: the torch engine's padding-free forward (BERT's families,
ModernBERT) against the transformers module's own, and every engine on every encoder family and model kind
against the torch engine (itself checked against sentence-transformers and the
transformers pipeline in the end-to-end tests)."""

import importlib.util
import json
import os
import time
from functools import partial
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from infinity.config import ConfigError, ModelConfig
from infinity.folders.resolve import resolve_model
from tests.support.modernbert import save_tiny_modernbert
from tests.support.tiny_models import FAMILIES, save_tiny_bert, save_tiny_decoder_embedder, save_tiny_family_model
from workers.engines import onednn
from workers.engines.packing import token_bucket
from workers.heads import load_model


# bfloat16 keeps 8 bits of mantissa: two paths that round in different places differ by a
# few of its steps.
_PACKED_TOLERANCE = {"float32": {"atol": 1e-5, "rtol": 1e-4}, "bfloat16": {"atol": 0.06, "rtol": 0.02}}


def _tiny_encoder(folder: Path, family: str) -> Path:
    """A tiny random encoder of a family the torch engine runs padding-free."""
    builders = {"bert": save_tiny_bert, "modernbert": save_tiny_modernbert,
                "qwen3": partial(save_tiny_decoder_embedder, family="qwen3"),
                "qwen2": partial(save_tiny_decoder_embedder, family="qwen2")}
    return builders[family](folder) if family in builders else save_tiny_family_model(folder, family)


@pytest.mark.parametrize("dtype", sorted(_PACKED_TOLERANCE))
@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta", "modernbert", "qwen3", "qwen2"])
def test_the_padding_free_pass_equals_the_padded_module_forward(tmp_path, family, dtype):
    """In bfloat16 on a CPU the packed path pads its 125 tokens to a bucket of 128 rows.
    RoBERTa's positions count from its pad id (1), BERT's from 0; ModernBERT's rotary ones
    from 0, and its local layers attend 4 tokens each side, fewer than most inputs here;
    the decoders (Qwen3, Qwen2) attend causally, 4 query heads to 2 key-value heads."""
    folder = _tiny_encoder(tmp_path / "tiny", family)
    engine = load_model(resolve_model(ModelConfig(name="tiny", source=str(folder), pooling="mean", engine="torch",
                                                  dtype=dtype)), threads=1).engine
    assert engine._packed is not None  # the encoder takes the padding-free path
    config = json.loads((folder / "config.json").read_text())
    rng = np.random.default_rng(0)
    lengths = [3, 17, 64, 1, 40]
    ids = np.full((len(lengths), max(lengths)), config["pad_token_id"], dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(5, config["vocab_size"], length)
        mask[row, :length] = 1
    types = np.zeros_like(ids)
    if config.get("type_vocab_size", 1) > 1:
        types[:, 2:] = mask[:, 2:]  # a second segment, as in query-document pairs
    tensors = [torch.from_numpy(a) for a in (ids, mask, types)]
    with torch.inference_mode():
        packed = engine._packed(*tensors)
        padded = engine._padded(*tensors)
    keep = torch.from_numpy(mask).bool()
    torch.testing.assert_close(packed[keep].float(), padded[keep].float(), **_PACKED_TOLERANCE[dtype])
    assert (packed[~keep] == 0).all()


@pytest.mark.parametrize("tokens, rows", [(1, 8), (8, 8), (125, 128), (128, 128), (129, 136), (1000, 1024),
                                          (1025, 1088), (16384, 16384)])
def test_a_reduced_precision_pass_on_a_cpu_runs_at_a_bucket_of_rows(tokens, rows):
    assert token_bucket(tokens) == rows


@pytest.mark.parametrize("shape", [(5, 48), (3, 7, 48)], ids=["rows", "batch of rows"])
def test_a_prepacked_linear_layer_gives_the_plain_layers_results(shape):
    """The padded and padding-free passes share the prepacked layers, so only this compares
    them with what torch computes without prepacking."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40).to(torch.bfloat16)
    x = torch.randn(*shape).to(torch.bfloat16)
    with torch.inference_mode():
        plain = linear(x)
        onednn.prepack(linear)
        packed = linear(x)
    assert packed.shape == plain.shape
    torch.testing.assert_close(packed.float(), plain.float(), atol=0.02, rtol=0.01)


def test_buckets_are_few_and_add_at_most_a_sixteenth():
    buckets = {token_bucket(tokens) for tokens in range(1, 16385)}
    assert len(buckets) <= 130
    assert all(token_bucket(tokens) <= tokens * 17 / 16 for tokens in range(129, 16385))
    assert all(token_bucket(tokens) % 8 == 0 for tokens in range(1, 16385))


# engine -> the module it needs; families CTranslate2 has no converter for.
_OPTIONAL = {"onnx": "onnxruntime", "ctranslate2": "ctranslate2", "openvino": "openvino"}
_UNSUPPORTED = {("ctranslate2", "mpnet")}
_KINDS_BY_LABELS = {0: "embed", 1: "rerank", 3: "classify"}
# OpenVINO compiles the graphs the onnx cases export for every family and kind: a BERT
# reranker (pairs: token segments) stands for them (its embedder:
# tests/e2e/engines/test_converted_engines.py).
_ONLY = {"openvino": [("bert", 1)]}


def _engine_cases() -> list:
    """(engine, family, labels) of every engine's cases, named kind-family-engine."""
    every = [(family, labels) for labels in _KINDS_BY_LABELS for family in FAMILIES]
    return [pytest.param(engine, family, labels, id=f"{_KINDS_BY_LABELS[labels]}-{family}-{engine}")
            for engine in sorted(_OPTIONAL) for family, labels in _ONLY.get(engine, every)]


@pytest.mark.parametrize("engine, family, labels", _engine_cases())
def test_every_engine_family_and_kind_matches_the_torch_engine(tmp_path, monkeypatch, engine, family, labels):
    if importlib.util.find_spec(_OPTIONAL[engine]) is None:
        pytest.skip(f"{_OPTIONAL[engine]} is not installed")
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    folder = save_tiny_family_model(tmp_path / family, family, labels)
    pad = 0 if family == "bert" else 1
    ids = np.array([[2, 5, 6, 7, 8, 3, 9, 10], [2, 9, 10, 3, pad, pad, pad, pad]], dtype=np.int64)
    mask = np.array([[1] * 8, [1] * 4 + [0] * 4], dtype=np.int64)
    types = np.zeros_like(ids)
    if family == "bert" and labels:
        types[0, 6:] = 1  # a pair's second segment
    if (engine, family) in _UNSUPPORTED:  # refused at start and by the engine itself, naming the family
        with pytest.raises(ConfigError, match=f"is {family}"):
            resolve_model(ModelConfig(name="tiny", source=str(folder), engine=engine))
        torch_spec = resolve_model(ModelConfig(name="tiny", source=str(folder), engine="torch"))
        with pytest.raises(ValueError, match=f"is {family}"):
            load_model(msgspec.structs.replace(torch_spec, engine=engine), 1)
        return
    specs = {name: resolve_model(ModelConfig(name="tiny", source=str(folder), engine=name))
             for name in ("torch", engine)}
    assert specs[engine].kind == _KINDS_BY_LABELS[labels]
    # On the CPU a lane per thread, a wide copy (kept here even if it is not faster) and an
    # express lane.
    monkeypatch.setattr("workers.engines.lanes.wide_copy_pays", lambda *args: True)
    reference, tested = load_model(specs["torch"], 1), load_model(specs[engine], 2)
    assert (tested.head.dim, tested.head.labels, tested.head.activation) == \
        (reference.head.dim, reference.head.labels, reference.head.activation)
    assert (tested.engine.lanes, tested.engine.widens, tested.engine.express) == (2, True, True)
    expected = reference.forward(ids, mask, types)
    np.testing.assert_allclose(tested.forward(ids, mask, types), expected, atol=2e-5)
    np.testing.assert_allclose(tested.forward(ids, mask, types, wide=True), expected, atol=2e-5)
    np.testing.assert_allclose(tested.forward(ids, mask, types, express=True), expected, atol=2e-5)


def _ctranslate2_runs_mkl_on_intel() -> bool:
    """Whether CTranslate2 multiplies with Intel MKL on an Intel CPU here (its default
    there). Elsewhere it uses oneDNN, and MKL on other CPUs takes other paths: their
    kernels change with a product's row count, which moves the last bits."""
    return ("GenuineIntel" in Path("/proc/cpuinfo").read_text()
            and os.environ.get("CT2_USE_MKL", "1").lower() not in ("0", "false", "off"))


@pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None, reason="ctranslate2 is not installed")
def test_an_inputs_vector_does_not_depend_on_its_batch_mates(tmp_path, monkeypatch):
    """The CPU default (CTranslate2 float32 and the pooled head): the same input gives the
    same vector alone and in batches padded to other lengths, so a request repeated gets
    its answer again whatever else was queued: to the bit where CTranslate2 multiplies with
    MKL on an Intel CPU; elsewhere within float32 rounding (its kernels there change with
    the batch's row count: docs/configuration.md#repeatable-vectors)."""
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    folder = save_tiny_bert(tmp_path / "bert", max_positions=128)
    model = load_model(resolve_model(ModelConfig(name="tiny", source=str(folder), engine="ctranslate2")), 2)
    rng = np.random.default_rng(0)
    lengths = [17, 5, 40, 23, 64, 9, 31, 12, 50, 3]
    texts = [np.concatenate([[2], rng.integers(5, 90, length - 2), [3]]) for length in lengths]

    def vectors(rows: list[int]) -> np.ndarray:
        ids = np.zeros((len(rows), max(lengths[row] for row in rows)), dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, :lengths[row]], mask[i, :lengths[row]] = texts[row], 1
        return model.forward(ids, mask, np.zeros_like(ids))

    alone = np.concatenate([vectors([row]) for row in range(len(lengths))])
    for rows in ([0, 1, 2, 3], [4, 0], [5, 6, 7, 8, 9, 0], list(range(len(lengths)))):
        if _ctranslate2_runs_mkl_on_intel():
            np.testing.assert_array_equal(vectors(rows), alone[rows])
        else:
            np.testing.assert_allclose(vectors(rows), alone[rows], rtol=0, atol=1e-6)


def _reference_varlen(q, k, v, bounds_q, bounds_k, longest_q, longest_k, window_size=(-1, -1)):
    """flash-attn's variable-length attention, computed sequence by sequence with SDPA:
    what the packed path must agree with (flash-attn itself needs a CUDA GPU). A window
    (left, right) other than (-1, -1) limits each query to the keys from `left` before it
    to `right` after it. Keys and values may have fewer heads than queries (grouped-query
    attention)."""
    assert bounds_q.dtype == torch.int32 and torch.equal(bounds_q, bounds_k) and longest_q == longest_k
    assert int((bounds_q[1:] - bounds_q[:-1]).max()) == longest_q
    out = torch.empty_like(q)
    for start, end in zip(bounds_q[:-1].tolist(), bounds_q[1:].tolist()):
        heads_first = [t[start:end].transpose(0, 1) for t in (q, k, v)]
        index = torch.arange(end - start)
        offset = index[None, :] - index[:, None]  # key minus query position
        left, right = (side if side >= 0 else end - start for side in window_size)
        window = (offset >= -left) & (offset <= right)
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            *heads_first, attn_mask=window, enable_gqa=k.shape[1] != q.shape[1]).transpose(0, 1)
    return out


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_the_padding_free_pass_through_varlen_attention(tmp_path, family):
    """ModernBERT's local layers give flash-attn their window."""
    folder = _tiny_encoder(tmp_path / "tiny", family)
    model = load_model(resolve_model(ModelConfig(name="tiny", source=str(folder), engine="torch")), threads=1)
    assert model.engine._packed.varlen is None  # flash-attn only on CUDA in half precision
    rng = np.random.default_rng(1)
    lengths = [5, 31, 1, 12]
    ids = np.zeros((len(lengths), max(lengths)), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(5, 100, length)
        mask[row, :length] = 1
    padded = model.forward(ids, mask, np.zeros_like(ids))
    model.engine._packed.varlen = _reference_varlen
    np.testing.assert_allclose(model.forward(ids, mask, np.zeros_like(ids)), padded, atol=1e-5)


def test_compiled_torch_engine_matches_eager(tmp_path):
    folder = save_tiny_bert(tmp_path / "tiny")
    rng = np.random.default_rng(2)
    ids = rng.integers(5, 100, (3, 9)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 4:] = 0
    outputs = []
    for compiled in (False, True):
        # With compile, "auto" picks the torch engine, the one that compiles.
        spec = resolve_model(ModelConfig(name="tiny", source=str(folder), engine="auto" if compiled else "torch",
                                         compile=compiled))
        assert spec.engine == "torch"
        outputs.append(load_model(spec, threads=1).forward(ids, mask, np.zeros_like(ids)))
    np.testing.assert_allclose(outputs[1], outputs[0], atol=1e-5)


def test_compile_is_refused_by_other_engines():
    with pytest.raises(ValueError, match="compile = true applies to the torch engine"):
        load_model(resolve_model(ModelConfig(name="e", engine="onnx", compile=True)), 1)


def test_wide_copy_only_for_small_models_with_several_lanes(tmp_path):
    from workers.engines.lanes import WIDE_COPY_MAX_BYTES, wants_copy

    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.bin"
    with weights.open("wb") as f:
        f.truncate(WIDE_COPY_MAX_BYTES - 1024)  # sparse: no disk used
    assert wants_copy(tmp_path, lanes=2)
    assert not wants_copy(tmp_path, lanes=1)
    with weights.open("r+b") as f:
        f.truncate(WIDE_COPY_MAX_BYTES + 1)
    assert not wants_copy(tmp_path, lanes=2)
    # One file of a folder (a two-tower model's text graph) is judged by its own size.
    (tmp_path / "text.onnx").write_bytes(b"x" * 1024)
    assert wants_copy(tmp_path / "text.onnx", lanes=2)


class _TimedEngine:
    pad_id = 0

    def __init__(self, narrow_seconds: float, wide_seconds: float) -> None:
        self.seconds = {False: narrow_seconds, True: wide_seconds}

    def forward(self, input_ids, attention_mask, token_type_ids, wide=False, express=False):
        time.sleep(self.seconds[wide])
        return torch.zeros((len(input_ids), 1))


@pytest.mark.parametrize("narrow, wide, kept", [(0.01, 0.002, True), (0.002, 0.01, False), (0.005, 0.005, False)])
def test_the_wide_copy_is_kept_only_if_clearly_faster(narrow, wide, kept):
    from workers.engines.lanes import wide_copy_pays

    assert wide_copy_pays(_TimedEngine(narrow, wide), 16) is kept


class _DisturbedEngine(_TimedEngine):
    """Its wide passes are slow for a while (a core busy elsewhere), then fast."""

    def __init__(self, slow_wide_passes: int) -> None:
        super().__init__(narrow_seconds=0.005, wide_seconds=0.015)
        self.slow_wide_passes = slow_wide_passes

    def forward(self, input_ids, attention_mask, token_type_ids, wide=False, express=False):
        if wide:
            self.slow_wide_passes -= 1
            if self.slow_wide_passes < 0:
                self.seconds[True] = 0.002
        return super().forward(input_ids, attention_mask, token_type_ids, wide, express)


def test_a_wide_copy_measured_while_disturbed_is_measured_again():
    from workers.engines.lanes import WIDE_COPY_TRIES, wide_copy_pays

    one_try = 6  # wide passes per try for one input length: one untimed, five timed
    assert wide_copy_pays(_DisturbedEngine(slow_wide_passes=one_try), 16)
    assert not wide_copy_pays(_DisturbedEngine(slow_wide_passes=one_try * WIDE_COPY_TRIES), 16)


@pytest.mark.parametrize("lanes, expected", [([2, 2], 1), ([2, 1], 3), ([1], 3)])
def test_torch_gets_one_thread_only_where_every_engine_runs_lanes(lanes, expected):
    from types import SimpleNamespace

    from workers.engines import set_torch_threads

    before = torch.get_num_threads()
    try:
        set_torch_threads([SimpleNamespace(lanes=n) for n in lanes], threads=3)
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)


def test_no_engine_reads_the_model_kind():
    """What a kind makes of the raw output is its head's (workers/heads); engines only
    learn which raw output to give."""
    import ast
    from pathlib import Path

    for path in (Path(__file__).resolve().parents[3] / "workers" / "engines").glob("*.py"):
        attributes = {node.attr for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)}
        assert "kind" not in attributes, path.name
