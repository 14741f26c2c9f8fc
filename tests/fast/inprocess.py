"""The server's front end in this process, its children as threads: the fast tier's way
to run the whole request path (HTTP, admission, protocol, tokenizing, batching, heads,
arenas, encoding) in milliseconds, against a fake engine whose outputs a test can compute.

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
from collections.abc import AsyncIterator, Callable

import numpy as np
import torch
from aiohttp.test_utils import TestClient, TestServer

from infinity.api.app import create_app
from infinity.config import Config, ModelConfig, ServerConfig
from infinity.folders.resolve import resolve_replicas
from infinity.shared.channel import ChannelToFront
from infinity.shared.protocol import ModelSpec, WorkerArgs
from infinity.client.topology import INFERENCE_ENTRY_POINT, TOKENIZER_ENTRY_POINT
from workers.inference import worker as inference_worker
from workers.preprocess import worker as tokenizer_worker
from infinity.shared.kinds import KINDS, TEXT, RawOutput
from workers.engines.base import pad_id
from workers.heads import LoadedModel, load_head

log = logging.getLogger(__name__)


def token_states(ids: np.ndarray, dim: int) -> np.ndarray:
    """The fake engine's state of each token id: a fixed function of the id alone."""
    return np.sin(ids[..., None].astype(np.float64) * (np.arange(1, dim + 1) * 1e-3)).astype(np.float32)


def expected_embedding(ids: list[int], dim: int) -> np.ndarray:
    """What the fake engine and the mean-pooling, normalising head give for `ids`."""
    vector = token_states(np.array(ids), dim).mean(axis=0)
    return vector / np.linalg.norm(vector)


class FakeEngine:
    """Token states (or a masked-language-model head's logits: as many values per token)
    from `token_states`; `gate`, while cleared, holds every forward pass."""

    name = "fake"
    lanes = 1
    widens = False
    express = False
    on_caller_threads = False  # its passes run no torch threads

    def __init__(self, spec: ModelSpec, output: RawOutput, dim: int, gate: threading.Event) -> None:
        assert output in (RawOutput.TOKEN_STATES, RawOutput.TOKEN_LOGITS), "the fake engine gives values per token"
        self.pad_id = pad_id(spec)
        self._dim = dim
        self._gate = gate

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray,
                wide: bool = False, express: bool = False) -> torch.Tensor:
        self._gate.wait()
        return torch.from_numpy(token_states(input_ids, self._dim))


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
    `processes` keeps every child started, by name (the latest of each)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.processes: dict[str, ThreadProcess] = {}

    def __call__(self, entry_point: str, args: WorkerArgs) -> ThreadProcess:
        def run() -> None:
            channel = ChannelToFront(args.channel)
            if entry_point == TOKENIZER_ENTRY_POINT:
                tokenizer_worker.serve(args, channel)
            else:
                assert entry_point == INFERENCE_ENTRY_POINT, entry_point
                inference_worker.serve(args, channel, load=self._load)

        process = ThreadProcess(run, args.name)
        self.processes[args.name] = process
        return process

    def _load(self, spec: ModelSpec, threads: int) -> LoadedModel:
        head = load_head(spec)
        return LoadedModel(FakeEngine(spec, KINDS[spec.kind].outputs[TEXT], head.dim, self.gate), head, spec.dtype)


@contextlib.asynccontextmanager
async def serving(launcher: ThreadLauncher | None = None, model: ModelConfig | None = None,
                  **server_settings: object) -> AsyncIterator[TestClient]:
    """An HTTP client of a server of `model` (the default model, named "m"), its children
    in threads, ready."""
    config = Config(server=ServerConfig(**server_settings), models=[model or ModelConfig(name="m", engine="torch")])
    specs = [spec for model in config.models for spec in resolve_replicas(model)]
    app = create_app(config, specs, launch=launcher or ThreadLauncher())
    async with TestClient(TestServer(app)) as client:
        for _ in range(500):
            if (await client.get("/health")).status == 200:
                break
            await asyncio.sleep(0.01)
        else:
            raise RuntimeError("the in-process server did not become ready")
        yield client
