"""A lone input on another runtime (workers/engines/by_shape.py): which candidates a model
gets (`resolve_model`), the choice from measured figures and its record, the split engine's
routing, and the whole request path with a split engine: a lone input on the lone engine,
a batch on the batches engine, the same vectors, the choice in `/v1/models`."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

import workers.engines.by_shape as by_shape
from infinity.config import ConfigError, ModelConfig
from infinity.folders.resolve import LONE_CANDIDATES, resolve_model
from infinity.shared.kinds import KINDS, RawOutput
from infinity.shared.protocol import ModelSpec
from tests.fast.inprocess import FakeEngine, ThreadLauncher, serving
from workers.engines.by_shape import LoneSplit, choose_lone_engine, lone_engine_of, with_lone_engine
from workers.heads import LoadedModel, load_head

pytestmark = pytest.mark.timeout(60)


# --- candidates ----------------------------------------------------------------------------

def _installed(engine: str) -> bool:
    modules = {"onnx": ("onnxruntime", "onnxscript"), "openvino": ("openvino", "onnxscript")}[engine]
    return all(importlib.util.find_spec(module) for module in modules)


def test_auto_offers_the_installed_runtimes_other_than_the_batches_engine_at_float32_on_cpus() -> None:
    spec = resolve_model(ModelConfig(name="m", dtype="float32"))
    assert spec.engine == "ctranslate2"
    assert spec.lone_engines == tuple(name for name in LONE_CANDIDATES if _installed(name))
    assert not spec.lone_engine_named


def test_candidates_follow_the_float32_engine_of_the_bfloat16_trial() -> None:
    spec = resolve_model(ModelConfig(name="m"), cpu_bfloat16=True)
    assert (spec.dtype, spec.float32_engine) == ("bfloat16", "ctranslate2")
    assert spec.lone_engines == tuple(name for name in LONE_CANDIDATES if _installed(name))


@pytest.mark.parametrize("settings", [{"lone_engine": "none"}, {"engine": "ctranslate2"}, {"dtype": "int8"}])
def test_no_candidates_when_turned_off_an_engine_is_pinned_or_the_model_is_not_float32(settings: dict) -> None:
    assert resolve_model(ModelConfig(name="m", **{"dtype": "float32", **settings})).lone_engines == ()


def test_no_candidates_where_auto_keeps_torch(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "modernbert", "architectures": ["ModernBertModel"],
                                                      "max_position_embeddings": 512}))
    spec = resolve_model(ModelConfig(name="m", source=str(tmp_path), dtype="float32"))
    assert (spec.engine, spec.lone_engines) == ("torch", ())


def test_a_named_lone_engine_is_taken_as_named() -> None:
    spec = resolve_model(ModelConfig(name="m", dtype="float32", engine="ctranslate2", lone_engine="onnx"))
    assert (spec.lone_engines, spec.lone_engine_named) == (("onnx",), True)
    same = resolve_model(ModelConfig(name="m", dtype="float32", engine="ctranslate2", lone_engine="ctranslate2"))
    assert same.lone_engines == ()


@pytest.mark.parametrize("settings, why", [({"dtype": "int8"}, "models served in float32"),
                                           ({"device": "cuda"}, "text models on CPUs")])
def test_a_named_lone_engine_where_none_can_run_is_refused(settings: dict, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        resolve_model(ModelConfig(name="m", lone_engine="onnx", **settings))


# --- the choice ----------------------------------------------------------------------------

def test_the_fastest_candidate_is_chosen_only_where_it_pays() -> None:
    assert choose_lone_engine("ctranslate2", 10.0, {"onnx": 7.0, "openvino": 8.0}) == "onnx"
    assert choose_lone_engine("ctranslate2", 10.0, {"onnx": 9.0}) is None  # within LONE_ENGINE_MAX_TIME
    assert choose_lone_engine("ctranslate2", 10.0, {}) is None


class _Engine:
    """An engine that records the passes asked of it."""

    pad_id = 0
    lanes = 2
    express = True
    on_caller_threads = False

    def __init__(self, name: str, widens: bool = False) -> None:
        self.name, self.widens = name, widens
        self.passes: list[tuple[int, bool, bool]] = []  # (inputs, wide, express)

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray,
                wide: bool = False, express: bool = False) -> torch.Tensor:
        self.passes.append((len(input_ids), wide, express))
        return torch.zeros(len(input_ids), input_ids.shape[1], 4)

    def forward_media(self, arrays: Mapping[str, np.ndarray]) -> torch.Tensor:
        raise NotImplementedError


def test_the_split_runs_a_lone_pass_on_the_lone_engine_and_the_rest_on_the_batches_engine() -> None:
    batches, lone = _Engine("ctranslate2"), _Engine("onnx", widens=True)
    split = LoneSplit(batches, lone)
    assert (split.name, split.lanes, split.express, split.widens, lone_engine_of(split)) == (
        "ctranslate2", 2, True, True, "onnx")
    ids = np.ones((1, 5), dtype=np.int64)
    split.forward(ids, ids, ids * 0, wide=True)
    split.forward(np.ones((3, 5), dtype=np.int64), np.ones((3, 5)), np.zeros((3, 5)), express=True)
    assert lone.passes == [(1, True, False)] and batches.passes == [(3, False, True)]
    assert lone_engine_of(batches) is None


@pytest.fixture
def spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelSpec:
    """A float32 spec of a model folder with two candidates; the cache in `tmp_path`."""
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    resolved = resolve_model(ModelConfig(name="m", dtype="float32"))
    return ModelSpec(**{**{f: getattr(resolved, f) for f in resolved.__struct_fields__},
                        "path": str(folder), "lone_engines": ("onnx", "openvino")})


class _Loader:
    """Loads `_Engine`s by the spec's engine name; `refuses`: names that fail to load."""

    def __init__(self, refuses: tuple[str, ...] = ()) -> None:
        self.loaded: list[str] = []
        self.refuses = refuses

    def __call__(self, spec: ModelSpec, threads: int, outputs: Mapping[str, RawOutput]) -> _Engine:
        self.loaded.append(spec.engine)
        if spec.engine in self.refuses:
            raise RuntimeError("cannot load")
        assert spec.lone_engines == () and spec.fallback_engine is None
        return _Engine(spec.engine, widens=True)


def _timed_as(monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float]) -> list[list[str]]:
    """Let every lone pass count as fast as the back-to-back check needs, and the paced
    timing give `seconds` by engine name; returns the engines of each timing asked."""
    asked: list[list[str]] = []
    monkeypatch.setattr(by_shape, "LONE_PASS_MIN_SECONDS", 0.0)

    def timed(engines: list, lengths: list[int]) -> list[float]:
        asked.append([engine.name for engine in engines])
        return [seconds[engine.name] for engine in engines]

    monkeypatch.setattr(by_shape, "lone_seconds", timed)
    return asked


def test_the_candidate_that_pays_is_kept_and_the_next_start_loads_it_untimed(spec, monkeypatch) -> None:
    asked = _timed_as(monkeypatch, {"ctranslate2": 10.0, "onnx": 8.0, "openvino": 6.0})
    loader = _Loader()
    chosen = with_lone_engine(_Engine("ctranslate2"), spec, 2, KINDS["embed"].outputs, loader)
    assert lone_engine_of(chosen) == "openvino"
    assert asked == [["ctranslate2", "onnx", "openvino"]] and loader.loaded == ["onnx", "openvino"]
    again = _Loader()
    assert lone_engine_of(with_lone_engine(_Engine("ctranslate2"), spec, 2, KINDS["embed"].outputs, again)) \
        == "openvino"
    assert asked == [["ctranslate2", "onnx", "openvino"]] and again.loaded == ["openvino"]


def test_where_no_candidate_pays_the_batches_engine_runs_lone_inputs_too(spec, monkeypatch) -> None:
    _timed_as(monkeypatch, {"ctranslate2": 10.0, "onnx": 9.0, "openvino": 9.5})
    engine = _Engine("ctranslate2")
    assert with_lone_engine(engine, spec, 2, KINDS["embed"].outputs, _Loader()) is engine
    again = _Loader()
    assert with_lone_engine(engine, spec, 2, KINDS["embed"].outputs, again) is engine
    assert again.loaded == []  # the kept figures: nothing loaded, nothing timed


def test_a_candidate_that_cannot_load_is_left_out(spec, monkeypatch) -> None:
    asked = _timed_as(monkeypatch, {"ctranslate2": 10.0, "onnx": 1.0, "openvino": 6.0})
    chosen = with_lone_engine(_Engine("ctranslate2"), spec, 2, KINDS["embed"].outputs, _Loader(refuses=("onnx",)))
    assert lone_engine_of(chosen) == "openvino" and asked == [["ctranslate2", "openvino"]]


def test_a_model_whose_lone_pass_is_short_loads_no_candidate(spec, monkeypatch) -> None:
    monkeypatch.setattr(by_shape, "LONE_PASS_MIN_SECONDS", 60.0)
    loader = _Loader()
    engine = _Engine("ctranslate2")
    assert with_lone_engine(engine, spec, 2, KINDS["embed"].outputs, loader) is engine
    assert loader.loaded == []


def test_a_named_engine_is_kept_untimed_and_other_dtypes_get_none(spec, monkeypatch) -> None:
    _timed_as(monkeypatch, {})  # any timing would fail: no figures
    named = ModelSpec(**{**{f: getattr(spec, f) for f in spec.__struct_fields__},
                         "lone_engines": ("onnx",), "lone_engine_named": True})
    assert lone_engine_of(with_lone_engine(_Engine("ctranslate2"), named, 2, KINDS["embed"].outputs, _Loader())) \
        == "onnx"
    bfloat16 = ModelSpec(**{**{f: getattr(spec, f) for f in spec.__struct_fields__}, "dtype": "bfloat16"})
    engine = _Engine("openvino")
    assert with_lone_engine(engine, bfloat16, 2, KINDS["embed"].outputs, _Loader()) is engine


# --- the request path ----------------------------------------------------------------------

class _SplitLauncher(ThreadLauncher):
    """Inference children whose model runs batches on one fake engine and a lone input on
    another (both computing the same function of the inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.lone: _RecordingFake | None = None
        self.batches: _RecordingFake | None = None

    def _load(self, spec: ModelSpec, threads: int) -> LoadedModel:
        self.batches = _RecordingFake(spec, self.gate, "fake")
        self.lone = _RecordingFake(spec, self.gate, "fake-lone")
        return LoadedModel(LoneSplit(self.batches, self.lone), load_head(spec), spec.dtype)


class _RecordingFake(FakeEngine):
    def __init__(self, spec: ModelSpec, gate: threading.Event, name: str) -> None:
        super().__init__(spec, KINDS[spec.kind].outputs, gate)
        self.name = name
        self.inputs: list[int] = []  # inputs per pass

    def forward(self, input_ids: np.ndarray, *args: object, **kwargs: object) -> torch.Tensor:
        self.inputs.append(len(input_ids))
        return super().forward(input_ids, *args, **kwargs)


def test_a_lone_input_runs_on_the_lone_engine_a_batch_on_the_batches_engine_with_the_same_vectors() -> None:
    async def test() -> None:
        launcher = _SplitLauncher()
        async with serving(launcher) as client:
            card = (await (await client.get("/v1/models")).json())["data"][0]
            lone = await (await client.post("/v1/embeddings", json={"input": "one query"})).json()
            texts = ["one query", "a second text", "and a third one"]
            batch = await (await client.post("/v1/embeddings", json={"input": texts})).json()
        assert (card["backend"], card["lone_backend"]) == ("fake", "fake-lone")
        assert (card["replicas"][0]["engine"], card["replicas"][0]["lone_engine"]) == ("fake", "fake-lone")
        assert launcher.lone.inputs[-1] == 1 and launcher.batches.inputs[-1] == 3
        np.testing.assert_allclose(lone["data"][0]["embedding"], batch["data"][0]["embedding"], atol=1e-6)

    asyncio.run(test())


def test_the_candidates_not_chosen_are_freed_before_serving(spec, monkeypatch) -> None:
    _timed_as(monkeypatch, {"ctranslate2": 10.0, "onnx": 8.0, "openvino": 6.0})
    engines: dict[str, weakref.ref] = {}

    def load(asked: ModelSpec, threads: int, outputs: Mapping[str, RawOutput]) -> _Engine:
        engine = _Engine(asked.engine, widens=True)
        engines[asked.engine] = weakref.ref(engine)
        return engine

    chosen = with_lone_engine(_Engine("ctranslate2"), spec, 2, KINDS["embed"].outputs, load)
    assert lone_engine_of(chosen) == "openvino"
    assert {name: ref() is not None for name, ref in engines.items()} == {"onnx": False, "openvino": True}
