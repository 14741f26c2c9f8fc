"""Engine registry: engine name -> class implementing `workers.engines.base.Engine`."""

from __future__ import annotations

import importlib
import logging

import msgspec

from workers.engines.base import Engine
from workers.models import ModelSpec

log = logging.getLogger(__name__)

# Imported lazily so that a process loads only the backends it uses.
ENGINES = {
    "torch": "workers.engines.torch_engine:TorchEngine",
    "ctranslate2": "workers.engines.ctranslate2_engine:CTranslate2Engine",
    "onnx": "workers.engines.onnx_engine:OnnxEngine",
}


def load_engine(spec: ModelSpec, threads: int) -> Engine:
    """The spec's engine; if it fails and "auto" chose it, the fallback engine."""
    if spec.compile and spec.engine != "torch":
        raise ValueError(f"compile = true applies to the torch engine; '{spec.name}' runs on {spec.engine}")
    try:
        return _engine_class(spec.engine)(spec, threads)
    except Exception:
        if spec.fallback_engine is None:
            raise
        log.warning("engine %s cannot load %s; using %s", spec.engine, spec.name, spec.fallback_engine,
                    exc_info=True)
        return _engine_class(spec.fallback_engine)(msgspec.structs.replace(spec, engine=spec.fallback_engine,
                                                                           fallback_engine=None), threads)


def _engine_class(name: str) -> type:
    module_name, class_name = ENGINES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
