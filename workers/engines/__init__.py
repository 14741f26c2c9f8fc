"""Engine registry: engine name -> class implementing `workers.engines.base.Engine`."""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterable, Iterator, Mapping

import msgspec

from infinity.shared.kinds import RawOutput
from infinity.shared.protocol import ModelSpec
from workers.engines.artifacts import NotPrepared
from workers.engines.base import Engine
from workers.engines.by_shape import with_lone_engine

log = logging.getLogger(__name__)

# Imported lazily so that a process loads only the backends it uses.
ENGINES = {
    "torch": "workers.engines.torch_engine:TorchEngine",
    "ctranslate2": "workers.engines.ctranslate2_engine:CTranslate2Engine",
    "onnx": "workers.engines.onnx_engine:OnnxEngine",
    "openvino": "workers.engines.openvino_engine:OpenVinoEngine",
    "static": "workers.engines.static_engine:StaticEngine",
}


def load_engine(spec: ModelSpec, threads: int, outputs: Mapping[str, RawOutput]) -> Engine:
    """The spec's engine, giving `outputs` (by medium); if it fails and "auto" chose it,
    the fallback engine; with another runtime for a lone input where the spec names
    candidates and one pays (`workers.engines.by_shape`)."""
    return with_lone_engine(_load_batches_engine(spec, threads, outputs), spec, threads, outputs,
                            _load_batches_engine)


def _load_batches_engine(spec: ModelSpec, threads: int, outputs: Mapping[str, RawOutput]) -> Engine:
    if spec.compile and spec.engine != "torch":
        raise ValueError(f"compile = true applies to the torch engine; '{spec.name}' runs on {spec.engine}")
    try:
        return _engine_class(spec.engine)(spec, threads, outputs)
    except NotPrepared:
        raise  # not a failure of the engine: its conversion is for the preparing process
    except Exception:
        if spec.fallback_engine is None:
            raise
        log.warning("engine %s cannot load %s; using %s", spec.engine, spec.name, spec.fallback_engine,
                    exc_info=True)
        return _engine_class(spec.fallback_engine)(msgspec.structs.replace(spec, engine=spec.fallback_engine,
                                                                           fallback_engine=None), threads, outputs)


def _engine_class(name: str) -> type:
    module_name, class_name = ENGINES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def set_torch_threads(engines: Iterable[Engine], threads: int) -> None:
    """Size torch's process-wide thread pool for the engines of one process. Engines that
    run lanes use torch only for heads, where a second OpenMP thread spins and takes CPU
    from the lanes (bench/results/lanes.md#lanes-and-a-wide-pass-for-a-lone-input); engines running one pass at a time get
    every thread."""
    import torch

    torch.set_num_threads(threads if any(engine.lanes == 1 for engine in engines) else 1)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the calling thread's torch passes on `count` threads. OpenMP keeps the count per
    calling thread, so lanes can each run a single-threaded pass at the same time while
    another thread's passes keep every core."""
    import torch

    before = torch.get_num_threads()
    if before == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
