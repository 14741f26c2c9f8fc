"""Engine registry: engine name -> class implementing `workers.engines.base.Engine`."""

from __future__ import annotations

import importlib

from workers.engines.base import Engine
from workers.models import ModelSpec

# Imported lazily so that a process loads only the backends it uses.
ENGINES = {
    "torch": "workers.engines.torch_engine:TorchEngine",
    "ctranslate2": "workers.engines.ctranslate2_engine:CTranslate2Engine",
}


def load_engine(spec: ModelSpec, threads: int) -> Engine:
    module_name, class_name = ENGINES[spec.engine].split(":")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    return engine_class(spec, threads)
