"""`dtype = "auto"` and bfloat16 on CPUs, without loading a model: which models try it,
what the trial's figures decide, how they are kept for later starts, and how the CPU's
support is read."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from infinity.config import ModelConfig, load_config
from infinity.folders import resolve
from infinity.folders.resolve import resolve_model
from infinity.shared.devices import cpu_computes_bfloat16, cpu_identity
import workers.inference.precision
from workers.inference.corpus import sentences
from workers.engines.artifacts import read_record
from workers.inference.precision import TrialFigures, keeps_bfloat16, load_by_trial, trial_record

CLOSE = {"inputs": "texts", "mean_cosine": 0.99995, "min_cosine": 0.9999}
FASTER = {"bfloat16_per_s": 300.0, "float32_per_s": 140.0, "bfloat16_lone_ms": 3.0, "float32_lone_ms": 2.8}


def test_bfloat16_is_kept_when_it_is_close_and_faster():
    keep, why = keeps_bfloat16([TrialFigures(**CLOSE, **FASTER)])
    assert keep and "300.0 texts/s" in why


@pytest.mark.parametrize("changed, reason", [
    ({"mean_cosine": 0.99985}, "not close enough"),
    ({"min_cosine": 0.998}, "not close enough"),
    ({"bfloat16_per_s": 140.0}, "not faster"),
    ({"bfloat16_per_s": 100.0}, "not faster"),
    ({"bfloat16_lone_ms": 4.3}, "lone input is slower"),
])
def test_bfloat16_is_refused_when_it_strays_or_is_slower(changed, reason):
    keep, why = keeps_bfloat16([TrialFigures(**{**CLOSE, **FASTER, **changed})])
    assert not keep and reason in why


def test_a_two_tower_model_keeps_bfloat16_only_if_both_kinds_of_input_pass():
    texts = TrialFigures(**CLOSE, **FASTER)
    images = TrialFigures(**{**CLOSE, **FASTER, "inputs": "images", "bfloat16_per_s": 40.0, "float32_per_s": 18.0})
    keep, why = keeps_bfloat16([texts, images])
    assert keep and "texts:" in why and "images: 40.0 images/s" in why
    slower_texts = TrialFigures(**{**CLOSE, **FASTER, "bfloat16_per_s": 100.0})
    keep, why = keeps_bfloat16([slower_texts, images])
    assert not keep and why.startswith("texts: it is not faster")


@pytest.mark.parametrize("openvino_installed, engine, fallback", [(True, "openvino", "torch"), (False, "torch", None)],
                         ids=["openvino", "without-openvino"])
def test_on_a_cpu_computing_bfloat16_an_auto_embedder_tries_it_against_its_float32_engine(
        monkeypatch, openvino_installed, engine, fallback):
    installed = resolve._installed
    monkeypatch.setattr(resolve, "_installed", lambda name: (openvino_installed if name == "openvino"
                                                              else installed(name)))
    spec = resolve_model(ModelConfig(name="m"), cpu_bfloat16=True)
    assert (spec.engine, spec.dtype, spec.fallback_engine) == (engine, "bfloat16", fallback)
    assert spec.float32_engine == resolve_model(ModelConfig(name="m")).engine


def test_a_named_bfloat16_engine_tries_it_against_its_own_float32():
    spec = resolve_model(ModelConfig(name="m", engine="openvino"), cpu_bfloat16=True)
    assert (spec.engine, spec.dtype, spec.float32_engine, spec.fallback_engine) == (
        "openvino", "bfloat16", "openvino", None)


@pytest.mark.parametrize("model", [
    ModelConfig(name="m", dtype="float32"),  # float32 asked for: exact
    ModelConfig(name="m", engine="ctranslate2"),  # an engine that computes no bfloat16 on CPUs
    ModelConfig(name="m", engine="onnx"),
    ModelConfig(name="m", compile=True),
    ModelConfig(name="m", device="cuda"),
], ids=["float32", "ctranslate2", "onnx", "compile", "cuda"])
def test_other_models_do_not_try_bfloat16(model):
    spec = resolve_model(model, cpu_bfloat16=True)
    assert spec.float32_engine is None and spec.dtype != "bfloat16"


@pytest.mark.parametrize("kind", ["rerank", "classify"])
def test_scoring_models_do_not_try_bfloat16(tmp_path, kind):
    """Scores, not vectors: no cosine to hold them to."""
    from tests.support.tiny_models import save_tiny_classifier, save_tiny_cross_encoder

    folder = (save_tiny_cross_encoder if kind == "rerank" else save_tiny_classifier)(tmp_path / kind)
    spec = resolve_model(ModelConfig(name="m", source=str(folder)), cpu_bfloat16=True)
    assert spec.kind == kind and spec.float32_engine is None and spec.dtype != "bfloat16"


def test_without_the_cpu_support_auto_stays_float32():
    spec = resolve_model(ModelConfig(name="m"), cpu_bfloat16=False)
    assert spec.float32_engine is None and spec.dtype == "float32"


def test_an_operator_can_turn_the_choice_off():
    assert load_config(env={}).server.auto_bfloat16
    assert not load_config(env={"INFINITY_AUTO_BFLOAT16": "false"}).server.auto_bfloat16


@pytest.mark.parametrize("flags, computes", [
    ("fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni", True),
    ("fpu sse2 avx2 amx_bf16 amx_tile", True),
    ("fpu sse2 avx2 avx512f avx512_vnni", False),
])
def test_the_cpu_support_is_read_from_its_flags(tmp_path, flags, computes):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: a CPU\nflags\t\t: {flags}\n\n")
    assert cpu_computes_bfloat16(str(cpuinfo)) is computes
    assert cpu_computes_bfloat16(str(tmp_path / "missing")) is False


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path))
    return tmp_path


def _loader(loaded: list[str], forward=None):  # noqa: ANN001, ANN202
    """A stand-in for `load_model` that records the dtypes it was asked for."""
    def load(asked, threads):  # noqa: ANN001, ANN202
        loaded.append(asked.dtype)
        return SimpleNamespace(dtype=asked.dtype, forward=forward,
                               engine=SimpleNamespace(pad_id=0, lanes=1, widens=False))
    return load


def test_a_model_whose_trial_fails_is_served_in_float32(cache):
    spec = resolve_model(ModelConfig(name="m"), cpu_bfloat16=True)
    loaded = []

    def fails(*args, **kwargs):
        raise RuntimeError("no bfloat16 kernel for this op")

    chosen = load_by_trial(spec, 1, _loader(loaded, fails))
    assert loaded == ["float32", "bfloat16"] and chosen.dtype == "float32"
    assert not trial_record(spec, 1).exists()  # the next start tries again


def test_the_bfloat16_model_is_loaded_with_its_fallback_to_torch(cache, monkeypatch):
    # OpenVINO chosen by auto: if it cannot load the model, torch's bfloat16 is tried in its place.
    spec = msgspec.structs.replace(resolve_model(ModelConfig(name="m"), cpu_bfloat16=True),
                                   engine="openvino", fallback_engine="torch")
    monkeypatch.setattr(workers.inference.precision, "run_trial",
                        lambda *args: [TrialFigures(**CLOSE, **FASTER)])
    asked = []

    def load(spec_asked, threads):  # noqa: ANN001, ANN202
        asked.append((spec_asked.engine, spec_asked.dtype, spec_asked.fallback_engine))
        return SimpleNamespace(dtype=spec_asked.dtype)

    assert load_by_trial(spec, 1, load).dtype == "bfloat16"
    assert asked == [(spec.float32_engine, "float32", "torch"), ("openvino", "bfloat16", "torch")]


@pytest.mark.parametrize("figures, chosen", [(FASTER, "bfloat16"), ({**FASTER, "bfloat16_per_s": 100.0}, "float32")])
def test_a_later_start_serves_what_the_first_ones_trial_chose_without_trying_again(cache, monkeypatch,
                                                                                    figures, chosen):
    spec = resolve_model(ModelConfig(name="m"), cpu_bfloat16=True)
    trials = []
    monkeypatch.setattr(workers.inference.precision, "run_trial",
                        lambda *args: trials.append(args) or [TrialFigures(**CLOSE, **figures)])
    first, later = [], []
    assert load_by_trial(spec, 2, _loader(first)).dtype == chosen
    assert len(trials) == 1 and first == ["float32", "bfloat16"]
    assert load_by_trial(spec, 2, _loader(later)).dtype == chosen
    assert len(trials) == 1 and later == [chosen]  # the losing model is not even loaded
    # Under another name the model is the same; with other threads its speed is not.
    assert trial_record(msgspec.structs.replace(spec, name="other"), 2) == trial_record(spec, 2)
    assert load_by_trial(spec, 1, _loader([])).dtype == chosen and len(trials) == 2


def test_unreadable_kept_figures_are_measured_again(cache, monkeypatch):
    spec = resolve_model(ModelConfig(name="m"), cpu_bfloat16=True)
    record = trial_record(spec, 2)
    record.parent.mkdir(parents=True)
    record.write_text('[{"inputs": "texts"')
    monkeypatch.setattr(workers.inference.precision, "run_trial", lambda *args: [TrialFigures(**CLOSE, **FASTER)])
    loaded = []
    assert load_by_trial(spec, 2, _loader(loaded)).dtype == "bfloat16" and loaded == ["float32", "bfloat16"]
    assert keeps_bfloat16(read_record(record, list[TrialFigures]))[0]
    assert [p.name for p in record.parent.iterdir()] == [record.name]  # no staging file left behind


def test_the_cpu_identity_holds_its_model_and_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: a CPU\nflags\t\t: avx2 amx_bf16\n\n"
                       "processor\t: 1\nmodel name\t: another\n")
    assert cpu_identity(str(cpuinfo)) == "a CPU | avx2 amx_bf16"
    assert cpu_identity(str(tmp_path / "missing")) == ""


def test_lone_inputs_span_the_trials_lengths_and_alternate_the_models(monkeypatch):
    spec = resolve_model(ModelConfig(name="m"), cpu_bfloat16=True)
    precision = workers.inference.precision
    texts = precision.text_inputs(spec, 0, sentences(precision.TRIAL_TEXTS, 1), precision.TRIAL_BATCH,
                                  precision.TRIAL_LONE_TEXTS)
    lengths = [lone.keywords["arrays"]["input_ids"].shape[1] for lone in texts.lones]
    assert len(lengths) == workers.inference.precision.TRIAL_LONE_TEXTS and lengths == sorted(lengths)
    assert lengths[0] < 10 and lengths[-1] > 100  # queries and passages, as one client sends them
    monkeypatch.setattr(workers.inference.precision, "LONE_PAUSE_S", 0.0)
    monkeypatch.setattr(workers.inference.precision, "SPIN_DOWN_S", 0.0)
    ran = []

    def model(name: str) -> SimpleNamespace:
        def forward(input_ids, attention_mask, token_type_ids, wide=False):  # noqa: ANN001, ANN202
            ran.append((name, wide))
            return np.ones((len(input_ids), 2), dtype=np.float32)
        return SimpleNamespace(forward=forward, engine=SimpleNamespace(lanes=1, widens=True))

    figures = workers.inference.precision._measure(texts, {"bfloat16": model("bfloat16"), "float32": model("float32")}, 1)
    lone_turns = [name for name, wide in ran if wide]
    # Each model's warm-up first; then per round the lone inputs alternate input by input.
    timed = lone_turns[2 * len(texts.lones):]
    assert timed == ["bfloat16", "float32"] * (workers.inference.precision.TRIAL_ROUNDS * len(texts.lones))
    assert figures.mean_cosine == pytest.approx(1.0) and figures.bfloat16_lone_ms > 0


class _Model:
    """A loaded model stand-in that a weak reference can follow."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


@pytest.mark.parametrize("figures, chosen", [(FASTER, "bfloat16"), ({**FASTER, "bfloat16_per_s": 100.0}, "float32")])
def test_the_model_a_trial_rejects_is_freed_before_serving(cache, monkeypatch, figures, chosen):
    spec = resolve_model(ModelConfig(name="m"), cpu_bfloat16=True)
    monkeypatch.setattr(workers.inference.precision, "run_trial", lambda *args: [TrialFigures(**CLOSE, **figures)])
    loaded: dict[str, weakref.ref] = {}

    def load(asked, threads):  # noqa: ANN001, ANN202
        model = _Model(asked.dtype)
        loaded[asked.dtype] = weakref.ref(model)
        return model

    kept = load_by_trial(spec, 1, load)
    assert kept.dtype == chosen
    assert {dtype: ref() is not None for dtype, ref in loaded.items()} == {
        "float32": chosen == "float32", "bfloat16": chosen == "bfloat16"}
