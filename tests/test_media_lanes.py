"""Media passes in single-threaded lanes (the torch engine on a CPU): two passes at once,
each on one torch thread, give the vectors one pass on every thread gives, for a tower of
each kind; the warm-up's choice between them is one of the two."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from infinity.config import ModelConfig
from infinity.models import resolve_model
from tests.tiny_models import save_tiny_clap, save_tiny_clip, save_tiny_colpali
from workers.engines import torch_threads
from workers.heads import load_model
from workers.inference_worker import _warm_up_media
from workers.media_towers import media_module

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
    example = media_module(spec.kind).example_features(spec, 4)

    def forward(rows: slice) -> np.ndarray | list[np.ndarray]:
        ids = example.input_ids
        prompts = () if ids is None else (ids[rows], np.ones_like(ids[rows]), np.zeros_like(ids[rows]))
        grid = None if example.grid is None else example.grid[rows]
        return model.forward_media(example.features[rows], *prompts, grid=grid)

    with torch_threads(2):
        wide = _rows(forward(slice(0, 4)))
    halves: dict[int, np.ndarray] = {}
    start = threading.Barrier(2)

    def lane(index: int) -> None:
        with torch_threads(1):
            assert torch.get_num_threads() == 1
            start.wait()
            halves[index] = _rows(forward(slice(2 * index, 2 * index + 2)))

    lanes = [threading.Thread(target=lane, args=(index,)) for index in range(2)]
    for thread in lanes:
        thread.start()
    for thread in lanes:
        thread.join()
    assert torch.get_num_threads() == 2  # the lanes' counts were their own
    in_lanes = np.concatenate([halves[0], halves[1]])
    assert in_lanes.shape == wide.shape
    np.testing.assert_allclose(in_lanes, wide, atol=1e-5)


def test_the_warm_up_runs_media_passes_in_lanes_or_on_every_thread(tmp_path, caplog):
    spec = resolve_model(ModelConfig(name="tower", source=str(save_tiny_clap(tmp_path / "clap")), engine="torch",
                                     dtype="float32"))
    model = load_model(spec, threads=2)
    with caplog.at_level("INFO", logger="workers.inference_worker"):
        overhead, lanes = _warm_up_media(model, spec, threads=2)
    assert lanes in (1, 2) and overhead > 0
    assert "single-threaded lanes" in caplog.text
    _, one_thread = _warm_up_media(model, spec, threads=1)
    assert one_thread == 1
