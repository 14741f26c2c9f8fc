"""The engines that convert the transformers model (ONNX Runtime, CTranslate2, OpenVINO):
parity with sentence-transformers on the default model (float32 and int8) and with
CrossEncoder on a reranker, the converted model cached and reused on the next start (ONNX
Runtime's dtypes built from one export per model);
OpenVINO in process against the torch engine on the default model (float32, and bfloat16
on CPUs that compute it natively); clear refusals. Every family and kind against the torch
engine: tests/e2e/engines/test_engines.py."""

import contextlib
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest

from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from infinity.shared.devices import cpu_computes_bfloat16
from tests.support.answers import decode_embedding
from tests.support.processes import wait_until
from tests.support.reference import MIN_COSINE, cosine
from tests.support.tiny_models import (assert_reranks_like_cross_encoder, save_tiny_cross_encoder,
                                       save_tiny_family_model)
from workers.engines.base import pad_id
from workers.engines.lanes import LANE_NICENESS
from workers.heads import load_model
from workers.inference import precision

# engine -> (module it needs, what its log says once per conversion of a model to a dtype)
ENGINES = {"onnx": ("onnxruntime", "for ONNX Runtime ("), "ctranslate2": ("ctranslate2", "to CTranslate2")}


def _require(engine: str) -> None:
    if importlib.util.find_spec(ENGINES[engine][0]) is None:
        pytest.skip(f"{ENGINES[engine][0]} is not installed")


def _served(server, model, texts):
    response = server.post("/v1/embeddings", {"model": model, "input": texts, "encoding_format": "base64"})
    assert response.status_code == 200, response.text
    return [decode_embedding(item["embedding"]) for item in response.json()["data"]]


def _handed_over_while_serving(server, texts: list[str], reference_vectors) -> None:
    """`server`'s models are served unprepared on torch float32 (their conversions not in
    its cache) and, requests answered all the while, handed over to converted engines."""
    cards = server.get("/v1/models").json()["data"]
    assert [(card["backend"], card["dtype"], card["prepared"]) for card in cards] == [("torch", "float32", False)] * 3
    deadline = time.monotonic() + 300  # the preparing process runs at a lower priority: slow beside other work
    while not all(card["prepared"] for card in server.get("/v1/models").json()["data"]):
        assert time.monotonic() < deadline, "not handed over"
        vectors = _served(server, "float32", texts[:8])
        assert min(cosine(v, reference_vectors[i]) for i, v in enumerate(vectors)) >= 0.9999
        time.sleep(0.1)  # a client's pace: the preparing process, at a lower priority, gets the cores between
    assert "handed over from inference-cpu (torch float32) to inference-cpu.1" in server.log_text()
    assert wait_until(lambda: "inference-cpu and prepare-cpu stopped, handed over" in server.log_text(), 30)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_parity_and_conversion_cached_across_restarts(start_server, tmp_path, monkeypatch, caplog, sentences,
                                                     reference_vectors, engine):
    _require(engine)
    reranker = save_tiny_cross_encoder(tmp_path / "reranker")
    config = f"""
[[models]]
name = "float32"
engine = "{engine}"
[[models]]
name = "int8"
engine = "{engine}"
dtype = "int8"
[[models]]
name = "reranker"
source = "{reranker}"
engine = "{engine}"
"""
    # CTranslate2's first start serves at once, unprepared, and hands over once converted.
    in_background = engine == "ctranslate2"
    env = {"INFINITY_CACHE_DIR": str(tmp_path / "cache"),
           "INFINITY_PREPARE": "in_background" if in_background else "before_serving"}
    first = start_server(config=config, env=env)
    texts = sentences[:80]
    if in_background:
        _handed_over_while_serving(first, texts, reference_vectors)
    converted = ENGINES[engine][1]
    assert first.log_text().count(converted) == 3  # one conversion per model and dtype
    if engine == "onnx":
        assert first.log_text().count("to ONNX") == 2  # one export per model: int8 is built from float32's
    replicas = [r for model in first.get("/v1/models").json()["data"] for r in model["replicas"]]
    assert [(r["engine"], r["prepared"]) for r in replicas] == [(engine, True)] * 3
    float32 = [cosine(v, reference_vectors[i]) for i, v in enumerate(_served(first, "float32", texts))]
    assert min(float32) >= 0.9999
    # int8 reaches the 0.99 on average, not for every text, on either engine (on the
    # 240 test sentences: CTranslate2 mean 0.996, min 0.978, 2% below 0.99; onnx mean 0.995,
    # min 0.975, 3.7% below 0.99; the shortest texts are the worst); recorded in the issue.
    int8 = [cosine(v, reference_vectors[i]) for i, v in enumerate(_served(first, "int8", texts))]
    assert min(int8) >= 0.97 and sum(int8) / len(int8) >= 0.99
    assert_reranks_like_cross_encoder(first, "reranker", reranker)
    first.stop()

    # The next start: each model loaded as an inference process loads it, from the cache.
    monkeypatch.setenv("INFINITY_CACHE_DIR", env["INFINITY_CACHE_DIR"])
    caplog.set_level(logging.INFO)
    specs = {name: resolve_model(ModelConfig(name=name, engine=engine, **fields))
             for name, fields in [("float32", {}), ("int8", {"dtype": "int8"}), ("reranker", {"source": str(reranker)})]}
    models = {name: load_model(spec, threads=1) for name, spec in specs.items()}
    assert [model.engine.name for model in models.values()] == [engine] * 3
    assert converted not in caplog.text and "to ONNX" not in caplog.text  # reused, not converted again
    lone = precision.text_inputs(specs["float32"], pad_id(specs["float32"]), texts[:1], batch=1, lones=1)
    again = lone.batches[0](models["float32"])
    assert cosine(np.asarray(again)[0], reference_vectors[0]) >= 0.9999


@pytest.mark.parametrize(("engine", "dtype", "message"), [
    ("onnx", "bfloat16", "dtype"),
    ("onnx", "float16", "float16 on CUDA only"),
    ("ctranslate2", "bfloat16", "dtype"),
    ("torch", "int8", "dtype"),
    ("openvino", "int8", "dtype"),
])
def test_engines_refuse_dtypes_they_cannot_run(engine, dtype, message):
    if engine in ENGINES:
        _require(engine)
    with pytest.raises(ValueError, match=message):
        load_model(resolve_model(ModelConfig(name="e", engine=engine, dtype=dtype)), 1)


def test_ctranslate2_refuses_families_it_cannot_convert(tmp_path):
    _require("ctranslate2")
    mpnet = save_tiny_family_model(tmp_path / "mpnet", "mpnet")
    with pytest.raises(ValueError, match="is mpnet"):
        load_model(resolve_model(ModelConfig(name="m", source=str(mpnet), engine="ctranslate2")), 1)


@pytest.fixture(scope="module")
def engine_cache(tmp_path_factory) -> Path:
    """A cache folder for this module's in-process engines: one OpenVINO export of the
    default model for all of them."""
    return tmp_path_factory.mktemp("engine-cache")


@pytest.fixture(scope="module")
def openvino_vectors(engine_cache, sentences) -> dict[str, list[np.ndarray]]:
    """The default model's vectors of some test sentences, in batches of similar lengths,
    by engine and dtype: torch float32, and OpenVINO float32 and (where the CPU computes
    it) bfloat16 from one export."""
    pytest.importorskip("openvino")
    spec = resolve_model(ModelConfig(name="default", engine="torch", dtype="float32"))
    texts = precision.text_inputs(spec, pad_id(spec), sentences[:24], batch=8, lones=1)
    dtypes = ["float32", "bfloat16"] if cpu_computes_bfloat16() else ["float32"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("INFINITY_CACHE_DIR", str(engine_cache))
        specs = {"torch:float32": spec} | {f"openvino:{dtype}": msgspec.structs.replace(spec, engine="openvino",
                                                                                          dtype=dtype)
                                           for dtype in dtypes}
        models = {name: load_model(each, threads=1) for name, each in specs.items()}
    assert [model.engine.name for model in models.values()] == ["torch", *["openvino"] * len(dtypes)]
    return {name: [run(model) for run in texts.batches] for name, model in models.items()}


def test_openvino_float32_matches_the_torch_engine(openvino_vectors):
    cosines = precision.row_cosines(openvino_vectors["openvino:float32"], openvino_vectors["torch:float32"])
    assert cosines.min() >= MIN_COSINE


@pytest.mark.skipif(not cpu_computes_bfloat16(), reason="this CPU has no bfloat16 instructions (avx512_bf16, amx_bf16)")
def test_openvino_bfloat16_meets_the_trials_bar(openvino_vectors):
    cosines = precision.row_cosines(openvino_vectors["openvino:bfloat16"], openvino_vectors["torch:float32"])
    assert cosines.mean() >= precision.MEAN_COSINE and cosines.min() >= precision.MIN_COSINE
    assert cosines.mean() < 1 - 1e-7  # bfloat16 was computed: OpenVINO did not keep float32


@pytest.mark.parametrize("engine", ["ctranslate2", "openvino"])
def test_lane_passes_yield_to_the_express_lane_on_engines_with_threads_of_their_own(engine, engine_cache,
                                                                                      monkeypatch):
    """CTranslate2 and OpenVINO compute a lane's pass on threads they start themselves, not
    on the lane's: beside an express lane those run at the lanes' nice value (so a query's
    express pass takes a core from a bulk pass, as on the torch engine, whose lanes' own
    threads the inference process sets), the express pass at the caller's."""
    pytest.importorskip(engine)
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(engine_cache))
    spec = resolve_model(ModelConfig(name="m", engine=engine, dtype="float32"))
    engine_ = load_model(spec, threads=2).engine
    assert (engine_.name, engine_.lanes, engine_.express) == (engine, 2, True)
    ids = np.full((16, 64), pad_id(spec) + 5, dtype=np.int64)
    mask, types = np.ones_like(ids), np.zeros_like(ids)
    caller = os.getpriority(os.PRIO_PROCESS, 0)
    lane = _cpu_by_nice_value(lambda: engine_.forward(ids, mask, types))
    express = _cpu_by_nice_value(lambda: engine_.forward(ids, mask, types, express=True))
    assert lane.get(min(caller + LANE_NICENESS, 19), 0) >= 0.8 * sum(lane.values()), lane
    assert express.get(caller, 0) >= 0.8 * sum(express.values()), express


def _cpu_by_nice_value(call: Callable[[], object], ticks: int = 60) -> dict[int, int]:
    """The CPU time (clock ticks) this process's threads spent while a thread of its own at
    the caller's nice value made `call` until `ticks` were spent, by nice value."""
    def threads() -> dict[int, tuple[int, int]]:  # thread id -> (ticks, nice value)
        found = {}
        for thread in os.listdir("/proc/self/task"):
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                fields = Path(f"/proc/self/task/{thread}/stat").read_text().rsplit(")", 1)[1].split()
                found[int(thread)] = (int(fields[11]) + int(fields[12]), int(fields[16]))
        return found

    def repeat() -> None:
        start = time.monotonic()
        while sum(spent for spent, _ in threads().values()) - before_total < ticks and time.monotonic() - start < 30:
            for _ in range(10):
                call()

    before = threads()
    before_total = sum(spent for spent, _ in before.values())
    caller = threading.Thread(target=repeat)
    caller.start()
    caller.join()
    by_nice: dict[int, int] = {}
    for thread, (spent, nice) in threads().items():
        by_nice[nice] = by_nice.get(nice, 0) + spent - before.get(thread, (0, 0))[0]
    return by_nice


def test_openvino_refuses_bfloat16_on_cpus_without_it(monkeypatch):
    pytest.importorskip("openvino")
    monkeypatch.setattr("infinity.shared.devices.cpu_computes_bfloat16", lambda: False)
    with pytest.raises(ValueError, match="bfloat16 on CPUs that compute it natively"):
        load_model(resolve_model(ModelConfig(name="e", engine="openvino", dtype="bfloat16")), 1)


def test_a_lone_input_on_the_named_lone_engine_gives_the_vector_the_batches_engine_gives(start_server, sentences,
                                                                                         reference_vectors):
    """`lone_engine = "onnx"` beside CTranslate2's batches (workers/engines/by_shape.py):
    reported in `/v1/models`; a text sent alone (its pass on ONNX Runtime) and the same text
    in a batch (on CTranslate2) give the same vector to float32's rounding, and the
    reference's."""
    _require("onnx")
    _require("ctranslate2")
    server = start_server(config='[[models]]\nname = "m"\nengine = "ctranslate2"\ndtype = "float32"\n'
                                 'lone_engine = "onnx"\n')
    card = server.get("/v1/models").json()["data"][0]
    assert (card["backend"], card["lone_backend"], card["replicas"][0]["lone_engine"]) == (
        "ctranslate2", "onnx", "onnx")
    for index in range(3):
        server.wait_idle()
        (alone,) = _served(server, "m", [sentences[index]])
        in_batch = _served(server, "m", sentences[:8])[index]
        assert cosine(alone, in_batch) >= 0.99999
        assert cosine(alone, reference_vectors[index]) >= MIN_COSINE
