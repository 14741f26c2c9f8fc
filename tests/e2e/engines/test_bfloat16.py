"""bfloat16 on CPUs that compute it natively: its fidelity to float32 on the packaged model,
and a server whose `dtype = "auto"` may choose it reporting what it chose. Skipped, with
the reason, on CPUs without bfloat16 instructions (there `auto` is float32, as the last
test checks on any machine). On any CPU: the padding-free pass in bfloat16 computes every
step in bfloat16 (dtypes, not speed)."""

from __future__ import annotations

import importlib.util
import re

import msgspec
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from infinity.shared.devices import cpu_computes_bfloat16
from tests.support.modernbert import save_tiny_modernbert_embedder
from tests.support.reference import MODEL_NAME
from tests.support.tiny_models import (save_tiny_clap, save_tiny_clip, save_tiny_colpali, save_tiny_colqwen2,
                                       save_tiny_family_model, save_tiny_siglip)
from workers.heads import load_model
from workers.inference.precision import MEAN_COSINE, MIN_COSINE, run_trial

pytestmark = pytest.mark.timeout(300)

needs_bfloat16 = pytest.mark.skipif(not cpu_computes_bfloat16(),
                                    reason="this CPU has no bfloat16 instructions (avx512_bf16, amx_bf16)")


@needs_bfloat16
@pytest.mark.parametrize("family", ["packaged", "modernbert"])
def test_bfloat16_vectors_meet_the_bar_against_float32(tmp_path, family):
    """The packaged model (BERT) and a ModernBERT embedder, each padding-free in bfloat16 on
    torch (OpenVINO's bfloat16: tests/e2e/engines/test_converted_engines.py)."""
    source = ({} if family == "packaged"
              else {"source": str(save_tiny_modernbert_embedder(tmp_path / "modernbert", "mean"))})
    spec = resolve_model(ModelConfig(name="default", engine="torch", **source), cpu_bfloat16=True)
    reduced = load_model(msgspec.structs.replace(spec, float32_engine=None), threads=2)
    exact = load_model(msgspec.structs.replace(spec, float32_engine=None, dtype="float32"), threads=2)
    assert (reduced.dtype, exact.dtype) == ("bfloat16", "float32")
    assert reduced.engine._packed is not None
    (figures,) = run_trial(spec, reduced, exact, threads=2)
    assert figures.inputs == "texts"
    assert figures.mean_cosine >= MEAN_COSINE and figures.min_cosine >= MIN_COSINE, figures
    assert figures.mean_cosine < 1.0  # bfloat16 was computed, not float32 twice


class _FloatingOutputs(TorchDispatchMode):
    """Records every operator that makes a floating tensor, with that tensor's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[tuple[str, torch.dtype]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                self.made.add((str(func), tensor.dtype))
        return out


@pytest.mark.parametrize("family", ["packaged", "roberta", "xlm-roberta"])
def test_the_padding_free_pass_in_bfloat16_computes_every_step_in_bfloat16(tmp_path, family):
    # No operator of the transformer may widen to float32 on the way (a silent upcast would
    # cost the speed bfloat16 is chosen for); only the head turns the pooled vector to float32.
    source = {} if family == "packaged" else {"source": str(save_tiny_family_model(tmp_path, family))}
    spec = resolve_model(ModelConfig(name="m", engine="torch", dtype="bfloat16", **source))
    model = load_model(spec, threads=2)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    ids = np.where(mask == 1, np.arange(10).reshape(2, 5) + 5, model.engine.pad_id)
    assert model.engine._packed is not None, "the padding-free pass is not the one run"
    seen = _FloatingOutputs()
    with seen:
        model.engine.forward(ids, mask, np.zeros_like(ids))
    assert seen.made and {dtype for _, dtype in seen.made} == {torch.bfloat16}, sorted(
        op for op, dtype in seen.made if dtype != torch.bfloat16)
    vectors = model.forward(ids, mask, np.zeros_like(ids))
    assert vectors.dtype == np.float32


@needs_bfloat16
@pytest.mark.parametrize("save, float32_engine, items", [(save_tiny_clip, "onnx", "images"),
                                                          (save_tiny_siglip, "onnx", "images"),
                                                          (save_tiny_clap, "torch", "clips"),
                                                          (save_tiny_colpali, "torch", "images"),
                                                          (save_tiny_colqwen2, "torch", "images")],
                         ids=["clip", "siglip", "clap", "colpali", "colqwen2"])
def test_a_model_that_sees_or_hears_is_tried_on_its_texts_and_its_media(tmp_path, save, float32_engine, items):
    folder = save(tmp_path / "two-tower")
    spec = resolve_model(ModelConfig(name="tower", source=str(folder)), cpu_bfloat16=True)
    assert (spec.engine, spec.dtype, spec.float32_engine) == ("torch", "bfloat16", float32_engine)
    reduced = load_model(msgspec.structs.replace(spec, float32_engine=None), threads=2)
    exact = load_model(msgspec.structs.replace(spec, float32_engine=None, dtype="float32"), threads=2)
    texts, media = run_trial(spec, reduced, exact, threads=2)
    assert (texts.inputs, media.inputs) == ("texts", items)
    for figures in (texts, media):
        # Near float32 but computed in bfloat16. Whether the bar is met is the trial's verdict:
        # tiny random towers round further than real ones (tiny CLAP's clips: mean 0.99988, below
        # MEAN_COSINE; the real-size towers' figures are in bench/results/bfloat16.md#towers-in-bfloat16).
        assert figures.min_cosine >= MIN_COSINE and figures.mean_cosine < 1.0, figures
    if items == "images":
        assert min(texts.mean_cosine, media.mean_cosine) >= MEAN_COSINE, (texts, media)


@needs_bfloat16
def test_a_server_that_may_choose_bfloat16_reports_what_its_trial_chose(start_server, server):
    chooser = start_server(env={"INFINITY_AUTO_BFLOAT16": "true"})
    card = chooser.get("/v1/models").json()["data"][0]
    chosen = re.search(rf"'{MODEL_NAME}' serves (\w+): ", chooser.log_text())
    assert chosen is not None, "the trial's decision is not logged"
    assert card["dtype"] == chosen[1] and card["replicas"][0]["dtype"] == chosen[1]
    bfloat16_engine = "openvino" if importlib.util.find_spec("openvino") else "torch"
    assert card["backend"] == (bfloat16_engine if chosen[1] == "bfloat16" else "ctranslate2")
    texts = ["a short query", "a longer passage about rivers, bridges and the cities built beside them " * 3]
    ours, exact = (np.array([row["embedding"] for row in s.embed(texts).json()["data"]]) for s in (chooser, server))
    assert ((ours * exact).sum(axis=1) >= MIN_COSINE).all()


def test_a_float32_server_reports_float32(server):
    card = server.get("/v1/models").json()["data"][0]
    assert card["dtype"] == "float32" and card["replicas"][0]["dtype"] == "float32"
