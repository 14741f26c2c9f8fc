"""What a start that serves at once does with a model its cache has not prepared
(`workers.inference.preparing`): within `prepared_only` every conversion and measurement
missing from the cache is refused with `NotPrepared` rather than made (and never taken
for an engine that fails), the model is served unprepared on torch, and a tokenizer
process imports no inference runtime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

import workers.engines as engines
from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from infinity.shared.kinds import KINDS
from workers.engines.artifacts import NotPrepared, cached_build, prepared_only
from workers.engines.by_shape import with_lone_engine
from workers.inference.precision import load_by_trial
from workers.inference.preparing import load_at_start, unprepared_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_build_not_in_the_cache_is_refused_within_prepared_only_and_reused_once_made(cache, tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    built = []
    with prepared_only(), pytest.raises(NotPrepared, match="not converted for ctranslate2"):
        cached_build("ctranslate2", source, {}, built.append)
    assert built == []
    folder, fresh = cached_build("ctranslate2", source, {}, lambda staging: (staging / "model.bin").write_text("x"))
    with prepared_only():
        assert cached_build("ctranslate2", source, {}, built.append) == (folder, False)
    assert fresh and built == []


def test_a_trial_and_a_lone_timing_not_kept_are_refused_within_prepared_only(cache):
    def load(*args):  # noqa: ANN002, ANN202
        raise AssertionError("nothing is loaded for a measurement that is not made")

    trial = resolve_model(ModelConfig(name="m"), cpu_bfloat16=True)
    with prepared_only(), pytest.raises(NotPrepared, match="bfloat16 trial"):
        load_by_trial(trial, 1, load)
    lone = resolve_model(ModelConfig(name="m", dtype="float32"))
    assert lone.lone_engines  # this machine's extras offer candidates
    with prepared_only(), pytest.raises(NotPrepared, match="lone inputs"):
        with_lone_engine(object(), lone, 2, KINDS["embed"].outputs, load)


def test_an_unprepared_engine_is_not_a_failed_one(cache, monkeypatch):
    spec = msgspec.structs.replace(resolve_model(ModelConfig(name="m")), engine="ctranslate2", fallback_engine="torch",
                                   lone_engines=())

    class Unprepared:
        def __init__(self, *args) -> None:  # noqa: ANN002
            raise NotPrepared("not converted")

    monkeypatch.setattr(engines, "_engine_class", lambda name: Unprepared if name == "ctranslate2" else None)
    with pytest.raises(NotPrepared):  # not the fallback engine, which would serve as if prepared
        engines.load_engine(spec, 1, KINDS["embed"].outputs)


@pytest.mark.parametrize("config, dtype", [({"dtype": "int8", "engine": "ctranslate2"}, "float32"),
                                           ({"dtype": "float32"}, "float32"),
                                           ({"dtype": "bfloat16", "engine": "openvino"}, "bfloat16")])
def test_the_unprepared_model_runs_on_torch_in_its_dtype_where_torch_computes_it(config, dtype):
    spec = unprepared_spec(resolve_model(ModelConfig(name="m", **config)))
    assert (spec.engine, spec.dtype, spec.fallback_engine, spec.float32_engine, spec.lone_engines) == (
        "torch", dtype, None, None, ())


def test_a_model_a_trial_would_choose_the_precision_of_runs_unprepared_in_float32():
    spec = unprepared_spec(resolve_model(ModelConfig(name="m"), cpu_bfloat16=True))
    assert (spec.engine, spec.dtype) == ("torch", "float32")


def test_load_at_start_serves_what_is_prepared_and_the_rest_unprepared():
    spec = resolve_model(ModelConfig(name="m", engine="ctranslate2"))
    asked, prepared = [], {}

    def load(spec_asked, threads):  # noqa: ANN001, ANN202
        asked.append(spec_asked.engine)
        if spec_asked.engine == "ctranslate2":
            raise NotPrepared("not converted")
        return spec_asked.engine

    assert load_at_start(spec, 1, load, prepared) == "torch" and prepared == {"m": False}
    assert asked == ["ctranslate2", "torch"]
    assert load_at_start(spec, 1, lambda s, t: s.engine, prepared) == "ctranslate2" and prepared == {"m": True}


def test_a_tokenizer_process_imports_no_inference_runtime():
    """A text model's tokenizer process, as it starts (`_preparers`), in a fresh interpreter."""
    code = """
import json, sys
from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from infinity.shared.protocol import WorkerArgs
from workers.preprocess.worker import _preparers
spec = resolve_model(ModelConfig(name="m"))
_preparers(WorkerArgs(name="tokenizer-0", channel="ipc://unused", models=[spec], cpus=None, threads=1,
                      arena_prefix="unused", arena_slots=1, log_level="info"))
print(json.dumps(sorted(sys.modules)))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    imported = {name.split(".")[0] for name in json.loads(done.stdout)}
    assert imported.isdisjoint({"torch", "onnxruntime", "openvino", "ctranslate2", "transformers"})
