"""How an engine running exported graphs (ONNX Runtime, OpenVINO) lays out its passes on a
CPU: lanes of one thread each, with a copy on every thread, for a small model; one pass at
a time on every thread for a model too big for that copy (so a lone input is not left to
one core)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from infinity.shared.kinds import KINDS
from workers.engines.lanes import WIDE_COPY_MAX_BYTES
from workers.engines.onnx_graphs import GRAPH, GraphEngine

SMALL, BIG = 1024, WIDE_COPY_MAX_BYTES + 1


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of the test's own: the wide-copy choice these stand-in graphs make is kept
    there (`settle_wide_copy`), not where a real engine of the same model would read it."""
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


class _Graph:
    input_names = ["input_ids", "attention_mask"]

    def __call__(self, feeds):
        return np.zeros((*feeds["input_ids"].shape, 4), np.float32)


class _Recorded(GraphEngine):
    """A runtime that records what it is asked to compile: (graph file, threads per run, runs)."""

    name = "onnx"
    express_beside_lanes = False

    def __init__(self, folder: Path, threads: int) -> None:
        self.compiled: list[tuple[str, int, int]] = []
        spec = resolve_model(ModelConfig(name="default", engine="onnx", dtype="float32"))
        super().__init__(folder, spec, threads, KINDS[spec.kind].outputs)

    def _compile(self, graph, device, threads, runs):
        self.compiled.append((graph.name, threads, runs))
        return _Graph()


def _graphs(folder: Path, size: int) -> Path:
    folder.mkdir()
    with (folder / GRAPH).open("wb") as graph:
        graph.truncate(size)  # sparse: no disk used
    return folder


def test_a_small_model_runs_in_lanes_with_copies_for_wide_passes_and_the_express_lane(tmp_path):
    engine = _Recorded(_graphs(tmp_path / "small", SMALL), 2)
    assert (engine.lanes, engine.express) == (2, True)
    assert engine.compiled == [(GRAPH, 1, 2), (GRAPH, 2, 1), (GRAPH, 1, 1)]  # lanes, wide copy, express copy


def test_a_model_too_big_for_a_copy_runs_one_pass_on_every_thread(tmp_path):
    engine = _Recorded(_graphs(tmp_path / "big", BIG), 2)
    assert (engine.lanes, engine.widens, engine.express) == (1, False, False)
    assert engine.compiled == [(GRAPH, 2, 1)]


@pytest.mark.parametrize("size", [SMALL, BIG], ids=["small", "big"])
def test_one_thread_is_one_lane(tmp_path, size):
    engine = _Recorded(_graphs(tmp_path / "model", size), 1)
    assert (engine.lanes, engine.compiled) == (1, [(GRAPH, 1, 1)])


class _Timed(_Recorded):
    """Its wide passes take `wide_s`, a lane's 4 ms; counts the wide passes."""

    def __init__(self, folder: Path, wide_s: float) -> None:
        self.wide_s, self.wide_passes = wide_s, 0
        super().__init__(folder, 2)

    def forward(self, input_ids, attention_mask, token_type_ids, wide=False, express=False):
        self.wide_passes += wide
        time.sleep(self.wide_s if wide else 0.004)
        return np.zeros((*input_ids.shape, 4), np.float32)


@pytest.mark.parametrize("wide_s, widens", [(0.001, True), (0.008, False)])
def test_the_wide_copy_choice_is_kept_and_a_later_load_times_nothing(tmp_path, cache, wide_s, widens):
    first = _Timed(_graphs(tmp_path / "model", SMALL), wide_s)
    assert first.widens is widens and first.wide_passes > 0
    assert len(list((cache / "wide-copy").iterdir())) == 1
    again = _Timed(tmp_path / "model", 0.001)  # would pay now: the kept choice stands
    assert again.widens is widens and again.wide_passes == 0
