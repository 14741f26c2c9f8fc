"""OpenVINO engine, on the CPU, for the models the ONNX Runtime engine serves: embedders,
rerankers, classifiers, sparse (masked-language-model) encoders and two-tower
(image-text) models.

On first use the transformers model is exported with torch's ONNX exporter
(`workers.engines.onnx_graphs`: one cached export, which the ONNX Runtime engine starts
from too; not its fused graphs, whose ONNX Runtime operators are its own);
each start compiles the cached graphs with `openvino.Core` for the CPU, with dynamic
batch and sequence axes, and runs them in lanes as `GraphEngine` does.

dtypes: float32, or bfloat16 on CPUs that compute it natively (AVX512_BF16 or AMX): the
precision OpenVINO computes in, set explicitly either way, since on such CPUs it
computes in bfloat16 unless told otherwise. The graphs' inputs and outputs stay as
exported (int64 ids, float32 outputs).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from infinity.shared import devices
from infinity.shared.kinds import RawOutput, dtype_refusal
from infinity.shared.protocol import ModelSpec
from workers.engines.onnx_graphs import CompiledGraph, GraphEngine, exported_graphs

if TYPE_CHECKING:
    import openvino

class CompiledOpenVinoGraph:
    """A graph compiled by OpenVINO for `runs` passes at once (a stream each) on `threads`
    threads per pass: a `CompiledGraph`. An infer request may serve one thread at a time,
    so each calling thread has its own."""

    def __init__(self, core: openvino.Core, graph: Path, precision: str, threads: int, runs: int) -> None:
        import openvino
        import openvino.properties as properties
        import openvino.properties.hint as hints

        self._compiled = core.compile_model(str(graph), "CPU", {
            hints.inference_precision: openvino.Type.bf16 if precision == "bfloat16" else openvino.Type.f32,
            properties.streams.num: runs,
            properties.inference_num_threads: threads * runs,
            # The server places its processes on cores itself (infinity.client.supervisor);
            # OpenVINO pinning its threads too would fight that placement.
            hints.enable_cpu_pinning: False,
        })
        self.input_names = [port.get_any_name() for port in self._compiled.inputs]
        self._requests = threading.local()

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        request = getattr(self._requests, "request", None)
        if request is None:
            request = self._requests.request = self._compiled.create_infer_request()
        # The output is copied out of the request (share_outputs is off): its next pass reuses the memory.
        return request.infer(dict(feeds), share_inputs=True)[0]


class OpenVinoEngine(GraphEngine):
    name = "openvino"
    # A compiled graph runs at most a pass per core at once, one stream each, so a third
    # pass beside two lanes would wait for one of them.
    express_beside_lanes = False

    def __init__(self, spec: ModelSpec, threads: int, outputs: Mapping[str, RawOutput]) -> None:
        import openvino

        refused = dtype_refusal(self.name, spec.dtype)
        if refused is not None:
            raise ValueError(refused)
        if not devices.is_cpu(spec.device):
            raise ValueError(f"the openvino engine runs on the CPU only; for device {spec.device} use "
                             'engine = "torch" or "onnx"')
        if spec.dtype == "bfloat16" and not devices.cpu_computes_bfloat16():
            raise ValueError("the openvino engine runs bfloat16 on CPUs that compute it natively (avx512_bf16 or "
                             "amx_bf16), which this one does not; use dtype = \"float32\"")
        self._core = openvino.Core()
        self._precision = spec.dtype
        folder = exported_graphs(spec, outputs)
        super().__init__(folder, spec, threads, outputs)

    def _compile(self, graph: Path, device: str, threads: int, runs: int) -> CompiledGraph:
        return CompiledOpenVinoGraph(self._core, graph, self._precision, threads, runs)
