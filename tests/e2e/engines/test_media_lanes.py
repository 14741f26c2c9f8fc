"""Passes in single-threaded lanes (the torch engine on a CPU): two passes at once, each on
one torch thread, give the vectors one pass on every thread gives, for a tower of each
kind and for texts; the warm-up's choice for media is one of the two."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from tests.support.tiny_models import save_tiny_bert, save_tiny_clap, save_tiny_clip, save_tiny_colpali
from workers.engines import torch_threads
from workers.heads import load_model
from workers.inference.calibration import warm_up_media
from workers.preprocess.media import feature_items, media_module

pytestmark = pytest.mark.timeout(300)


def _rows(output: np.ndarray | list[np.ndarray]) -> np.ndarray:
    """A batch's vectors as rows: a multi-vector model's per-token vectors stacked."""
    return np.concatenate(output) if isinstance(output, list) else np.asarray(output)


@pytest.mark.parametrize("save", [save_tiny_clip, save_tiny_clap, save_tiny_colpali], ids=["clip", "clap", "colpali"])
def test_two_single_threaded_passes_at_once_give_the_vectors_of_one_wide_pass(tmp_path, save):
    spec = resolve_model(ModelConfig(name="tower", source=str(save(tmp_path / "tower")), engine="torch",
                                     dtype="float32"))
    model = load_model(spec, threads=2)
    assert model.engine.on_caller_threads
    module = media_module(spec.kind)
    _, items = feature_items(module.example(spec, 4))

    def forward(rows: slice) -> np.ndarray | list[np.ndarray]:
        return model.forward_media(module.collate(items[rows], pad_id=model.engine.pad_id))

    _assert_lanes_give_the_wide_vectors(lambda rows: _rows(forward(rows)), 4)


def test_two_single_threaded_text_passes_at_once_give_the_vectors_of_one_wide_pass(tmp_path):
    """Texts run in lanes on torch too (the padding-free pass where the model has one)."""
    folder = save_tiny_bert(tmp_path / "bert")
    # bfloat16: a pass of other rows may take another kernel, rounding within bfloat16's
    # precision (identical here; far below what rows mixed across lanes would give).
    for dtype, atol in (("float32", 1e-5), ("bfloat16", 2e-3)):
        model = load_model(resolve_model(ModelConfig(name="text", source=str(folder), engine="torch", dtype=dtype)),
                           threads=2)
        lengths = np.array([5, 9, 3, 12])
        mask = (np.arange(lengths.max()) < lengths[:, None]).astype(np.int64)
        ids = np.where(mask == 1, np.arange(mask.size).reshape(mask.shape) % 50 + 5, 0)
        _assert_lanes_give_the_wide_vectors(lambda rows: model.forward(ids[rows], mask[rows], np.zeros_like(ids[rows])),
                                            4, atol)


def _assert_lanes_give_the_wide_vectors(forward: Callable[[slice], np.ndarray], rows: int, atol: float = 1e-5) -> None:
    """`forward` over all `rows` on two torch threads gives what two lanes give at once,
    each on one thread and half the rows."""
    with torch_threads(2):
        wide = np.asarray(forward(slice(0, rows)))
    halves: dict[int, np.ndarray] = {}
    start = threading.Barrier(2)
    half = rows // 2

    def lane(index: int) -> None:
        with torch_threads(1):
            assert torch.get_num_threads() == 1
            start.wait()
            halves[index] = np.asarray(forward(slice(half * index, half * index + half)))

    lanes = [threading.Thread(target=lane, args=(index,)) for index in range(2)]
    for thread in lanes:
        thread.start()
    for thread in lanes:
        thread.join()
    assert torch.get_num_threads() == 2  # the lanes' counts were their own
    in_lanes = np.concatenate([halves[0], halves[1]])
    assert in_lanes.shape == wide.shape
    np.testing.assert_allclose(in_lanes, wide, atol=atol)


def test_the_warm_up_runs_media_passes_in_lanes_or_on_every_thread(tmp_path, caplog):
    spec = resolve_model(ModelConfig(name="tower", source=str(save_tiny_clap(tmp_path / "clap")), engine="torch",
                                     dtype="float32"))
    model = load_model(spec, threads=2)
    with caplog.at_level("INFO", logger="workers.inference.calibration"):
        overhead, lanes = warm_up_media(model, spec, threads=2)
    assert lanes in (1, 2) and overhead > 0
    assert "single-threaded lanes" in caplog.text
    _, one_thread = warm_up_media(model, spec, threads=1)
    assert one_thread == 1
