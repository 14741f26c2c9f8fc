"""The engine interface: what an inference process needs from a backend.

An engine is built from a `ModelSpec` on one device and the raw output the model's head
asks for (`RawOutput`), and turns a padded batch of token ids into that output: the
encoder's token states, a sequence-classification head's logits, or a masked-language-
model head's logits per token. What a model kind makes of it (pooling, normalisation,
scores, sparse vectors) is the head's (`workers.heads`): no engine knows the kinds. A
new engine is one module in this package plus one line in `ENGINES`.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from infinity.shared.protocol import ModelSpec


class RawOutput(enum.StrEnum):
    """What an engine's forward pass returns, as a torch tensor on any device."""

    TOKEN_STATES = "token_states"  # (n, longest, hidden): the encoder's last hidden states
    SEQUENCE_LOGITS = "sequence_logits"  # (n, labels): a sequence-classification head's logits
    TOKEN_LOGITS = "token_logits"  # (n, longest, vocabulary): a masked-language-model head's logits
    # (n, dim): a two-tower (image-text) model's text tower, its projected pooled output
    TEXT_FEATURES = "text_features"
    # (n, longest, dim): a retrieval model's own per-token vectors (ColPali's `embeddings`)
    RETRIEVAL_EMBEDDINGS = "retrieval_embeddings"


def auto_class(output: RawOutput, spec: ModelSpec) -> type:
    """The transformers class whose model gives `output`: an auto class, or for retrieval
    models (which have none) the folder's own architecture."""
    import transformers

    if output is RawOutput.RETRIEVAL_EMBEDDINGS:
        return getattr(transformers, model_config(spec)["architectures"][0])
    return {RawOutput.TOKEN_STATES: transformers.AutoModel,
            RawOutput.SEQUENCE_LOGITS: transformers.AutoModelForSequenceClassification,
            RawOutput.TOKEN_LOGITS: transformers.AutoModelForMaskedLM,
            RawOutput.TEXT_FEATURES: transformers.AutoModel}[output]


def model_output(model: torch.nn.Module, inputs: dict[str, torch.Tensor], output: RawOutput) -> torch.Tensor:
    """Run a model of `auto_class(output, spec)` on `inputs`; return its `output`."""
    if output is RawOutput.TEXT_FEATURES:
        # transformers 5 returns an output object; the projected vector is its pooler output.
        return model.get_text_features(**inputs).pooler_output
    result = model(**inputs)
    if output is RawOutput.RETRIEVAL_EMBEDDINGS:
        return result.embeddings
    return result.last_hidden_state if output is RawOutput.TOKEN_STATES else result.logits


class Engine(Protocol):
    name: str  # its key in `ENGINES`
    pad_id: int
    # Forward passes it runs at once, from as many threads: on a CPU an engine may run one
    # single-threaded pass per core instead of one pass on all of them: the inference
    # process then runs a lane per pass (workers/batching.py).
    lanes: int
    # Whether it can also run a pass on all its threads at once (`forward(wide=True)`), for
    # a lone input while the other lanes are idle, kept only where that pass measured
    # faster at start (`wide_copy_pays`).
    widens: bool
    # Whether it can run one more pass beside its lanes, on one thread, for a small
    # request while every lane runs a long pass (the express lane, workers/batching.py),
    # without slowing its lanes when idle.
    express: bool
    # Whether its passes run on the torch threads of the thread that calls it (the torch
    # engine on a CPU): then the inference process can run several single-threaded media
    # passes at once, where that measures faster than one pass on every thread.
    on_caller_threads: bool

    def __init__(self, spec: ModelSpec, threads: int, output: RawOutput) -> None: ...

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                token_type_ids: np.ndarray, wide: bool = False, express: bool = False) -> torch.Tensor:
        """(n, longest) int64 ids, mask and token segments -> the engine's `RawOutput`;
        `wide`: on every thread (only asked of an engine that `widens`); `express`: on the
        express lane (only asked of an engine with one)."""
        ...


def model_config(spec: ModelSpec) -> dict:
    """The model's transformers config.json."""
    return json.loads((Path(spec.path) / "config.json").read_text())


def pad_id(spec: ModelSpec) -> int:
    return int(model_config(spec).get("pad_token_id") or 0)


# A wide pass needs a second copy of the weights, set to use every thread (and CTranslate2's
# express lane one more, on one thread); they are made for models up to this size only, and kept only if it takes at most this share of a one-lane
# pass: some engines' wide passes pay, some are borderline, some lose (bench/RESULTS.md,
# "Figures behind the code's choices").
WIDE_COPY_MAX_BYTES = 512 * 2**20
WIDE_COPY_MAX_TIME = 0.85
WIDE_COPY_TRIES = 3
WIDE_COPY_PAUSE = 0.3  # seconds between tries


def wants_copy(model: Path, lanes: int) -> bool:
    """Whether an engine with `lanes` lanes should load a second copy of the model in
    `model` (a folder, or one file of it) for wide passes or the express lane."""
    files = [model] if model.is_file() else [path for path in model.rglob("*") if path.is_file()]
    size = sum(path.stat().st_size for path in files)
    return lanes > 1 and size <= WIDE_COPY_MAX_BYTES


def wide_copy_pays(engine: Engine, max_length: int) -> bool:
    """Whether the engine's wide passes over one input of 16 and of 64 tokens take under
    `WIDE_COPY_MAX_TIME` of one-lane passes, measured as the server runs them: with one
    torch thread (`workers.engines.set_torch_threads`). They need not: CTranslate2 at int8
    is slower on 2 threads than on 1 (bench/RESULTS.md, "Lanes"). A wide pass suffers most from a core that is busy
    elsewhere (at a server's start, the tokenizer processes loading their models), so a
    copy that does not pay is measured again after a pause, `WIDE_COPY_TRIES` times in
    all, keeping the best time of each pass."""
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
