"""A model whose conversions and trials are not in the cache is served at once unprepared,
prepared by another process, and handed over to an inference process that loads it
prepared (`workers.inference.preparing`, `infinity.client.handover`): no request is sent
to a process before it is ready, a request held at the switch finishes where it runs, and
the process handed over from stops once it holds none. Children are threads here
(tests/fast/inprocess.py), with an engine that is "unprepared" until a preparing process
has loaded it."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from infinity.api.routes.common import ENGINE_CLIENT
from infinity.client.handover import PREPARING_ENTRY_POINT
from infinity.config import ModelConfig
from infinity.folders.resolve import resolve_model
from infinity.shared.channel import ChannelToFront
from infinity.shared.kinds import KINDS
from infinity.shared.protocol import ModelSpec, WorkerArgs
from tests.fast.inprocess import FakeEngine, ThreadLauncher, ThreadProcess, expected_embedding, serving
from workers.engines.artifacts import needs_record
from workers.heads import LoadedModel, load_head
from workers.inference import preparing

pytestmark = pytest.mark.timeout(60)

TEXTS = ["a short sentence", "another sentence, a little longer"]


class _CountingEngine(FakeEngine):
    """A fake engine that counts its passes in `passes`, under the name of the process
    that loaded it, and holds them while its own `gate` is clear."""

    def __init__(self, spec: ModelSpec, gate: threading.Event, passes: Counter, process: str) -> None:
        super().__init__(spec, KINDS[spec.kind].outputs, gate)
        self.name = spec.engine
        self._passes, self._process = passes, process

    def forward(self, *args, **kwargs):
        self._passes[self._process] += 1
        return super().forward(*args, **kwargs)


class _UnpreparedLauncher(ThreadLauncher):
    """Models are not prepared until a preparing process has loaded them; the successor's
    load waits for `successor_may_load`; each inference process's engine holds its passes
    while its gate (`gates[process name]`) is clear."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: set[str] = set()
        self.successor_may_load = threading.Event()
        self.gates: dict[str, threading.Event] = {}
        self.passes: Counter = Counter()
        self.loaded: dict[str, str] = {}  # process -> the engine its spec named

    def __call__(self, entry_point: str, args: WorkerArgs) -> ThreadProcess:
        if entry_point != PREPARING_ENTRY_POINT:
            return super().__call__(entry_point, args)

        def run() -> None:
            channel = ChannelToFront(args.channel)
            try:
                preparing.prepare(args, channel, load=self._load)
            finally:
                channel.close()

        process = ThreadProcess(run, args.name)
        self.processes[args.name] = process
        return process

    def _load(self, spec: ModelSpec, threads: int) -> LoadedModel:
        process = threading.current_thread().name
        if spec.name not in self.prepared:
            needs_record(Path("/nonexistent"), "the fake preparation")  # raises within `prepared_only`
        if process.startswith("prepare-"):
            self.prepared.add(spec.name)
        if process.endswith(".1"):
            assert self.successor_may_load.wait(30)
        gate = self.gates.setdefault(process, threading.Event())
        gate.set()
        self.loaded[process] = spec.engine
        return LoadedModel(_CountingEngine(spec, gate, self.passes, process), load_head(spec), spec.dtype)


def _expected(texts: list[str]) -> list[list[float]]:
    spec = resolve_model(ModelConfig(name="m"))
    tokenizer = Tokenizer.from_file(f"{spec.path}/tokenizer.json")
    tokenizer.enable_truncation(spec.max_length)
    return [expected_embedding(encoding.ids, 384).tolist() for encoding in tokenizer.encode_batch(texts)]


async def _embed(client, texts: list[str]) -> list[list[float]]:
    answer = await client.post("/v1/embeddings", json={"input": texts})
    body = await answer.json()
    assert answer.status == 200, body
    return [item["embedding"] for item in body["data"]]


def _close(got: list[list[float]], expected: list[list[float]]) -> None:
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-6)


async def _card(client) -> dict:
    return (await (await client.get("/v1/models")).json())["data"][0]


async def _until(condition, seconds: float = 20.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if await condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("not reached in time")


def test_served_unprepared_then_handed_over_once_the_successor_is_ready():
    launcher = _UnpreparedLauncher()
    expected = _expected(TEXTS)

    async def test():
        async with serving(launcher, ModelConfig(name="m", engine="ctranslate2")) as client:
            card = await _card(client)
            assert (card["backend"], card["prepared"]) == ("torch", False)  # ready, on the unprepared engine
            assert launcher.loaded["inference-cpu"] == "torch"
            engine_client = client.app[ENGINE_CLIENT]
            [first] = engine_client.inference  # the process serving unprepared
            await _until(lambda: asyncio.sleep(0, "inference-cpu.1" in launcher.processes))
            # The preparer is done and the successor loads: requests still go to the first.
            assert "m" in launcher.prepared
            assert (await client.get("/health")).status == 200
            for _ in range(3):
                _close(await _embed(client, TEXTS), expected)
            assert launcher.passes["inference-cpu.1"] == 0
            # A request held in the first process at the switch finishes there.
            launcher.gates["inference-cpu"].clear()
            held = asyncio.ensure_future(_embed(client, TEXTS))
            await _until(lambda: asyncio.sleep(0, launcher.passes["inference-cpu"] > 3))
            launcher.successor_may_load.set()

            async def handed_over() -> bool:
                card = await _card(client)
                return (card["backend"], card["prepared"]) == ("ctranslate2", True)

            await _until(handed_over)
            before = launcher.passes["inference-cpu"]
            _close(await _embed(client, TEXTS), expected)
            assert launcher.passes["inference-cpu"] == before  # new requests go to the successor only
            assert launcher.processes["inference-cpu"].is_alive()  # it still holds one
            launcher.gates["inference-cpu"].set()
            _close(await held, expected)
            await _until(lambda: asyncio.sleep(0, not launcher.processes["inference-cpu"].is_alive()))
            assert not launcher.processes["prepare-cpu"].is_alive()
            card = await _card(client)
            assert [(r["engine"], r["ready"], r["prepared"]) for r in card["replicas"]] == [("ctranslate2", True, True)]
            # A restart that was waiting when the process was handed over starts nothing.
            retired = launcher.processes["inference-cpu"]
            engine_client._restart(first)
            assert launcher.processes["inference-cpu"] is retired

    asyncio.run(test())


def test_a_failed_preparation_leaves_the_model_served_unprepared():
    class FailingPreparation(_UnpreparedLauncher):
        def _load(self, spec: ModelSpec, threads: int) -> LoadedModel:
            if threading.current_thread().name.startswith("prepare-"):
                raise RuntimeError("the conversion failed")
            return super()._load(spec, threads)

    launcher = FailingPreparation()

    async def test():
        async with serving(launcher, ModelConfig(name="m", engine="ctranslate2")) as client:
            await _until(lambda: asyncio.sleep(0, "prepare-cpu" in launcher.processes
                                               and not launcher.processes["prepare-cpu"].is_alive()))
            _close(await _embed(client, TEXTS), _expected(TEXTS))
            assert (await client.get("/health")).status == 200
            card = await _card(client)
            assert (card["backend"], card["prepared"]) == ("torch", False)
            assert "inference-cpu.1" not in launcher.processes

    asyncio.run(test())


def test_before_serving_prepares_first():
    launcher = _UnpreparedLauncher()

    async def test():
        async with serving(launcher, ModelConfig(name="m", engine="ctranslate2"), prepare="before_serving") as client:
            card = await _card(client)
            assert (card["backend"], card["prepared"]) == ("ctranslate2", True)
            assert set(launcher.processes) == {"tokenizer-0", "inference-cpu"}

    asyncio.run(test())
