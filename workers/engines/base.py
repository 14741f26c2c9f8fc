"""The engine interface: what an inference process needs from a backend.

An engine is built from a `ModelSpec` on one device, and turns a padded batch of token
ids into one float32 row per input: for an embedder the pooled (and, if the model says
so, normalised) vector, for a reranker or classifier the head's raw scores. A new engine
is one module in this package plus one line in `ENGINES`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from infinity.shared.folders import num_labels
from infinity.shared.protocol import ModelSpec


class Engine(Protocol):
    name: str  # its key in `ENGINES`
    dim: int  # floats per input
    pad_id: int
    labels: list[str]  # a classifier's labels by output index; empty for embedders
    activation: str  # "sigmoid", "softmax" or "none": applied by the front end unless raw scores are asked
    # Forward passes it runs at once, from as many threads: on a CPU an engine may run one
    # single-threaded pass per core instead of one pass on all of them (bench/RESULTS.md,
    # "Engines"): the inference process then runs a lane per pass (workers/batching.py).
    lanes: int
    # Whether it can also run a pass on all its threads at once (`forward(wide=True)`), for
    # a lone input while the other lanes are idle, and that pass was measured faster at
    # start (`wide_copy_pays`): CTranslate2 at float32, 1.6 against 4.0 ms for an
    # 11-token sentence on 2 cores (bench/RESULTS.md, "Lanes").
    widens: bool

    def __init__(self, spec: ModelSpec, threads: int) -> None: ...

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                token_type_ids: np.ndarray, wide: bool = False) -> np.ndarray:
        """(n, longest) int64 ids, mask and token segments -> (n, dim) float32; `wide`:
        on every thread (only asked of an engine that `widens`)."""
        ...


def describe(engine: Engine, spec: ModelSpec) -> None:
    """Set what every engine reports of its model, read from config.json: the padding id;
    for an embedder the hidden size; for a reranker or classifier the head's size, labels,
    and the activation that sentence-transformers' CrossEncoder (one label) or
    transformers' text-classification pipeline (several) applies to its logits."""
    config = json.loads((Path(spec.path) / "config.json").read_text())
    engine.pad_id = int(config.get("pad_token_id") or 0)
    if spec.kind == "embed":
        engine.dim, engine.labels, engine.activation = int(config["hidden_size"]), [], "none"
        return
    count = num_labels(config)
    if spec.kind == "rerank" and count != 1:
        raise ValueError(f"a reranker needs a head with one output; {spec.path} has {count}")
    id2label = config.get("id2label") or {}
    engine.dim = count
    engine.labels = [str(id2label.get(str(i), f"LABEL_{i}")) for i in range(count)]
    saved = (config.get("sentence_transformers") or {}).get("activation_fn", "")
    if saved.endswith("Identity"):
        engine.activation = "none"
    elif saved.endswith("Sigmoid") or count == 1 or config.get("problem_type") == "multi_label_classification":
        engine.activation = "sigmoid"
    else:
        engine.activation = "softmax"


# A wide pass needs a second copy of the weights, set to use every thread; it is made for
# models up to this size only, and kept only if it takes at most this share of a one-lane
# pass. Measured here (2 cores, default model, inputs of 16 and 64 tokens): 0.67 for
# CTranslate2 float32, 0.78 ONNX Runtime float32, 0.74-0.89 ONNX Runtime int8
# (borderline), 1.5 CTranslate2 int8.
WIDE_COPY_MAX_BYTES = 512 * 2**20
WIDE_COPY_MAX_TIME = 0.85
WIDE_COPY_TRIES = 3
WIDE_COPY_PAUSE = 0.3  # seconds between tries


def wants_wide_copy(folder: Path, lanes: int) -> bool:
    """Whether an engine with `lanes` lanes should load a wide copy of the model in `folder`."""
    size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    return lanes > 1 and size <= WIDE_COPY_MAX_BYTES


def wide_copy_pays(engine: Engine, max_length: int) -> bool:
    """Whether the engine's wide passes over one input of 16 and of 64 tokens take under
    `WIDE_COPY_MAX_TIME` of one-lane passes, measured as the server runs them: with one
    torch thread (`workers.engines.set_torch_threads`). They need not: CTranslate2 at int8
    takes 5.4 against 0.9 ms for one sentence on 2 threads rather than 1
    (bench/RESULTS.md, "Lanes"). A wide pass suffers most from a core that is busy
    elsewhere (at a server's start, the tokenizer processes loading their models), so a
    copy that does not pay is measured again after a pause, `WIDE_COPY_TRIES` times in
    all, keeping the best time of each pass."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best: dict[int, list[float]] = {}  # input length -> best seconds of [wide, one lane]
        for attempt in range(WIDE_COPY_TRIES):
            if attempt:
                time.sleep(WIDE_COPY_PAUSE)
            for length in {min(16, max_length), min(64, max_length)}:
                ids = np.full((1, length), engine.pad_id + 1, dtype=np.int64)
                mask, types = np.ones_like(ids), np.zeros_like(ids)
                seconds = best_seconds([lambda: engine.forward(ids, mask, types, wide=True),
                                        lambda: engine.forward(ids, mask, types)])
                best[length] = [min(pair) for pair in zip(best.get(length, seconds), seconds)]
            if sum(wide for wide, _ in best.values()) < WIDE_COPY_MAX_TIME * sum(lane for _, lane in best.values()):
                return True
        return False
    finally:
        torch.set_num_threads(threads)


def best_seconds(calls: Sequence[Callable[[], object]], repeats: int = 5) -> list[float]:
    """The least disturbed of `repeats` timed runs of each call, after one untimed run
    that pays any one-time costs. Other processes may be busy (at a server's start most of
    all), so the calls are timed in turns: a disturbance falls on all of them alike."""
    for call in calls:
        call()
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for index, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[index] = min(best[index], time.perf_counter() - start)
    return best
