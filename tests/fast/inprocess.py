"""The server's front end in this process, its children as threads: the fast tier's way
to run the whole request path (HTTP, admission, protocol, tokenizing, batching, heads,
arenas, encoding) in milliseconds, against a fake engine whose outputs a test can compute
(or, with `ModelLauncher`, each tiny model on its own engine).

`launch_in_threads` stands in for `infinity.client.supervisor.spawn_process`: it runs a worker's
`serve` loop (the same code its process runs, minus the process set-up) in daemon
threads, behind an object with the part of `multiprocessing.Process` the supervisor uses.
A "killed" thread child stops being heard of (its pipe sentinel fires, and the front end
closes its channel); its threads end when they next read or write the channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aiohttp.test_utils import TestClient, TestServer

from infinity.api.app import create_app
from infinity.client.topology import INFERENCE_ENTRY_POINT, TOKENIZER_ENTRY_POINT
from infinity.config import ApiKey, Config, ModelConfig, ServerConfig
from infinity.folders.resolve import resolve_replicas
from infinity.shared.channel import ChannelToFront
from infinity.shared.kinds import KINDS, TEXT, RawOutput
from infinity.shared.protocol import Infer, Message, ModelSpec, Tokenize, WorkerArgs
from workers.engines.base import model_config, pad_id
from workers.heads import LoadedModel, load_head, load_model
from workers.inference import worker as inference_worker
from workers.preprocess import worker as tokenizer_worker

log = logging.getLogger(__name__)


def token_states(ids: np.ndarray, dim: int) -> np.ndarray:
    """The fake engine's state of each token id: a fixed function of the id alone."""
    return np.sin(ids[..., None].astype(np.float64) * (np.arange(1, dim + 1) * 1e-3)).astype(np.float32)


def expected_embedding(ids: list[int], dim: int) -> np.ndarray:
    """What the fake engine and the mean-pooling, normalising head give for `ids`."""
    vector = token_states(np.array(ids), dim).mean(axis=0)
    return vector / np.linalg.norm(vector)


def pooled_states(ids: np.ndarray, mask: np.ndarray, dim: int) -> np.ndarray:
    """The mean of each input's attended token states: the fake engine's one vector per
    input (sequence logits, a text tower's features)."""
    mask = mask[..., None].astype(np.float64)
    return ((token_states(ids, dim) * mask).sum(axis=1) / mask.sum(axis=1)).astype(np.float32)


def media_features(values: np.ndarray, dim: int) -> np.ndarray:
    """The fake engine's vector of each item of a media batch (its first axis): a fixed
    function of the mean of the item's values."""
    means = values.reshape(len(values), -1).astype(np.float64).mean(axis=1)
    return np.sin((means[:, None] + 1.0) * np.arange(1, dim + 1) * 1e-1).astype(np.float32)


def output_width(output: RawOutput, config: dict) -> int:
    """Floats per input (or per token) a real engine gives of `output` for a model of `config`."""
    from infinity.shared.folders import num_labels
    from workers.heads.two_tower import shared_dim

    if output is RawOutput.TOKEN_STATES:
        return int(config["hidden_size"])
    if output is RawOutput.TOKEN_LOGITS:
        return int(config["vocab_size"])
    if output is RawOutput.SEQUENCE_LOGITS:
        return num_labels(config)
    if output is RawOutput.RETRIEVAL_EMBEDDINGS:
        return int(config["embedding_dim"])
    return shared_dim(config)


class FakeEngine:
    """Every raw output a kind may ask, as a fixed function of the inputs a test can
    compute too: values per token (token states, logits per token, a retrieval model's
    vectors of a text) from `token_states`; one vector per input (sequence logits, a text
    tower's features) from `pooled_states`; a media tower's vector per item from
    `media_features` of its first floating array; a retrieval model's vectors of a page,
    its prompt's token states plus its pixels' features. `media_seen` keeps the arrays of
    every media pass, as they reached the engine; `gate`, while cleared, holds every pass."""

    name = "fake"
    lanes = 1
    widens = False
    express = False
    on_caller_threads = False  # its passes run no torch threads

    def __init__(self, spec: ModelSpec, outputs: Mapping[str, RawOutput], gate: threading.Event) -> None:
        config = model_config(spec)
        self.pad_id = pad_id(spec)
        self._outputs = dict(outputs)
        self._widths = {output: output_width(output, config) for output in outputs.values()}
        self._gate = gate
        self.media_seen: list[dict[str, np.ndarray]] = []

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray,
                wide: bool = False, express: bool = False) -> torch.Tensor:
        self._gate.wait()
        output = self._outputs[TEXT]
        width = self._widths[output]
        if output in (RawOutput.SEQUENCE_LOGITS, RawOutput.TEXT_FEATURES):
            return torch.from_numpy(pooled_states(input_ids, attention_mask, width))
        return torch.from_numpy(token_states(input_ids, width))

    def forward_media(self, arrays: Mapping[str, np.ndarray]) -> torch.Tensor:
        self._gate.wait()
        self.media_seen.append(dict(arrays))
        output = next(output for medium, output in self._outputs.items() if medium != TEXT)
        width = self._widths[output]
        values = next(array for array in arrays.values() if np.issubdtype(array.dtype, np.floating))
        features = media_features(values, width)
        if output is RawOutput.RETRIEVAL_EMBEDDINGS:
            return torch.from_numpy(token_states(arrays["input_ids"], width) + features[:, None, :])
        return torch.from_numpy(features)


class ThreadProcess:
    """What `infinity.client.supervisor.Child` uses of a process, for a target run in a thread."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self._target = target
        self.name = name
        self.pid = os.getpid()
        self.exitcode: int | None = None
        self._ended = threading.Event()
        self.sentinel, self._write_end = os.pipe()

    def start(self) -> None:
        threading.Thread(target=self._run, name=self.name, daemon=True).start()

    def _run(self) -> None:
        try:
            self._target()
        except Exception:
            log.exception("%s failed", self.name)
            self._end(1)
        else:
            self._end(0)

    def _end(self, code: int) -> None:
        if not self._ended.is_set():
            self.exitcode = code
            self._ended.set()
            os.close(self._write_end)  # the sentinel becomes readable, as a dead process's does

    def is_alive(self) -> bool:
        return not self._ended.is_set()

    def terminate(self) -> None:
        self._end(-15)

    def kill(self) -> None:
        self._end(-9)

    def join(self, timeout: float | None = None) -> None:
        self._ended.wait(timeout)

    def close(self) -> None:
        os.close(self.sentinel)


class ThreadLauncher:
    """Starts children as threads; inference children run `FakeEngine` with the real heads.
    `processes` keeps every child started, by name (the latest of each); `engines` the
    fake engine of each model."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.processes: dict[str, ThreadProcess] = {}
        self.engines: dict[str, FakeEngine] = {}  # the latest of each model

    def __call__(self, entry_point: str, args: WorkerArgs) -> ThreadProcess:
        def run() -> None:
            channel = ChannelToFront(args.channel)
            try:
                if entry_point == TOKENIZER_ENTRY_POINT:
                    tokenizer_worker.serve(args, channel)
                else:
                    assert entry_point == INFERENCE_ENTRY_POINT, entry_point
                    inference_worker.serve(args, channel, load=self._load)
            finally:
                channel.close()  # as `workers.process.run_child` does

        process = ThreadProcess(run, args.name)
        self.processes[args.name] = process
        return process

    def _load(self, spec: ModelSpec, threads: int) -> LoadedModel:
        engine = FakeEngine(spec, KINDS[spec.kind].outputs, self.gate)
        self.engines[spec.name] = engine
        return LoadedModel(engine, load_head(spec), spec.dtype)


class ModelLauncher(ThreadLauncher):
    """`ThreadLauncher` whose inference children run each model on its own engine: the
    whole request path held to a reference library's vectors, on tiny model folders."""

    def _load(self, spec: ModelSpec, threads: int) -> LoadedModel:
        return load_model(spec, threads)


def _on_child_send(monkeypatch, record: Callable[[Message, float], None]) -> None:  # noqa: ANN001 (pytest's fixture)
    """Have `record` see every message the front end sends a child from now on, with the
    hold it is sent with."""
    from infinity.client.supervisor import Child

    send = Child.send

    def recording_send(child: Child, message: Message, hold_s: float = 0.0) -> None:
        record(message, hold_s)
        send(child, message, hold_s)

    monkeypatch.setattr(Child, "send", recording_send)


def tokenize_messages(monkeypatch) -> list[Tokenize]:  # noqa: ANN001 (pytest's fixture)
    """Every `Tokenize` the front end sends a child from now on (those it tokenizes itself
    are not sent), in order."""
    sent: list[Tokenize] = []
    _on_child_send(monkeypatch, lambda message, hold_s: sent.append(message) if isinstance(message, Tokenize) else None)
    return sent


def infer_holds(monkeypatch) -> list[float]:  # noqa: ANN001 (pytest's fixture)
    """The hold (`Child.send`'s `hold_s`) of every `Infer` the front end sends from now on."""
    holds: list[float] = []
    _on_child_send(monkeypatch, lambda message, hold_s: holds.append(hold_s) if isinstance(message, Infer) else None)
    return holds


@contextlib.asynccontextmanager
async def serving(launcher: ThreadLauncher | None = None, model: ModelConfig | list[ModelConfig] | None = None,
                  api_keys: list[ApiKey] | None = None, **server_settings: object) -> AsyncIterator[TestClient]:
    """An HTTP client of a server of `model`, or of each model of a list (the default
    model, named "m"), its children in threads, ready."""
    models = model if isinstance(model, list) else [model or ModelConfig(name="m", engine="torch")]
    config = Config(server=ServerConfig(**server_settings), models=models, api_keys=api_keys or [])
    specs = [spec for model in config.models for spec in resolve_replicas(model)]
    app = create_app(config, specs, launch=launcher or ThreadLauncher())
    async with TestClient(TestServer(app)) as client:
        for _ in range(500):
            if (await client.get(f"{config.server.url_prefix}/health")).status == 200:
                break
            await asyncio.sleep(0.01)
        else:
            raise RuntimeError("the in-process server did not become ready")
        yield client


@dataclass(frozen=True)
class LoopedClient:
    """A client of a server that runs on an event loop of its own, so that a module's
    tests (plain functions) share one server."""

    loop: asyncio.AbstractEventLoop
    client: TestClient

    def ask(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        """(status, JSON answer) of one request."""
        async def ask() -> tuple[int, Any]:
            answer = await self.client.request(method, path, json=body)
            return answer.status, await answer.json()

        return self.loop.run_until_complete(ask())


def scoring_models(root: Path) -> list[ModelConfig]:
    """An embedder on the fake engine ("m"), and a tiny cross-encoder ("rerank") and
    classifier ("classify") saved under `root`: the models of the tests of the routes
    that serve several kinds."""
    from tests.support.tiny_models import save_tiny_classifier, save_tiny_cross_encoder

    return [ModelConfig(name="m", engine="torch"),
            ModelConfig(name="rerank", source=str(save_tiny_cross_encoder(root / "rerank")), engine="torch"),
            ModelConfig(name="classify", source=str(save_tiny_classifier(root / "classify")), engine="torch")]


@contextlib.contextmanager
def serving_on_its_own_loop(launcher: ThreadLauncher | None = None,
                            model: ModelConfig | list[ModelConfig] | None = None,
                            **server_settings: object) -> Iterator[LoopedClient]:
    """`serving`, on an event loop of its own (for a module-scoped fixture)."""
    loop = asyncio.new_event_loop()
    server = serving(launcher, model, **server_settings)
    try:
        yield LoopedClient(loop, loop.run_until_complete(server.__aenter__()))
        loop.run_until_complete(server.__aexit__(None, None, None))
    finally:
        loop.close()
