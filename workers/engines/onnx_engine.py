"""ONNX Runtime engine for embedders, rerankers, classifiers, sparse (masked-language-
model) encoders and two-tower (image-text) models.

On first use the transformers model is exported with torch's ONNX exporter
(`workers.engines.onnx_graphs`: a two-tower model as two graphs, its text tower and its
vision tower), its transformer blocks fused by onnxruntime's transformer optimiser,
optionally quantised, and cached (see `artifacts`); later starts load the cached graphs.
Sessions run with every graph optimisation on, on the CPU, or on CUDA / TensorRT when
onnxruntime has those providers, in lanes as `GraphEngine` runs them.

dtypes: float32 anywhere; int8 (dynamic quantisation of the weights, for the CPU);
float16 (for CUDA: the graph in half precision, inputs and outputs kept as they are).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from infinity.shared import devices
from infinity.shared.folders import cache_dir, engine_refusal
from infinity.shared.kinds import RawOutput, dtype_refusal
from infinity.shared.protocol import ModelSpec
from workers.engines.artifacts import cached_build
from workers.engines.base import model_config
from workers.engines.onnx_graphs import (GRAPH, VISION_GRAPH, CompiledGraph, GraphEngine, exported_graphs,
                                         has_vision_tower, quiet_logging, weights_beside)

log = logging.getLogger(__name__)


def exported_model(spec: ModelSpec, outputs: Mapping[str, RawOutput]) -> Path:
    """The folder holding `spec`'s graphs optimised for ONNX Runtime in its dtype, built
    from the model's export (`exported_graphs`, shared with other dtypes and engines) if no
    cached one matches."""
    import onnxruntime
    from transformers import AutoConfig

    exported = exported_graphs(spec, outputs)

    def build(staging: Path) -> None:
        two_towers, external = has_vision_tower(exported), weights_beside(exported)
        with quiet_logging():
            config = (None if two_towers
                      else AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code))
            _optimise(spec, config, exported / GRAPH, staging / GRAPH, external, fuse=not two_towers)
            if two_towers:
                _optimise(spec, None, exported / VISION_GRAPH, staging / VISION_GRAPH, external, fuse=False)
        log.info("optimised %s for ONNX Runtime (%s)", spec.name, spec.dtype)

    folder, _ = cached_build("onnx", Path(spec.path), {
        "export": exported.name, "dtype": spec.dtype, "onnxruntime": onnxruntime.__version__}, build)
    return folder


def _optimise(spec: ModelSpec, config: object, exported: Path, path: Path, external: bool, fuse: bool = True) -> None:
    """Fuse layer norms and GELUs with onnxruntime's transformer optimiser (`fuse`), then
    convert `exported` to the requested dtype into `path` (an intermediate graph goes in a
    folder beside `path`, removed after). Two-tower models are not fused: the BERT fusions
    moved SigLIP's vectors by 1e-4 and made CLIP's towers no faster
    (bench/results/images.md#onnx-towers)."""
    import onnx
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.onnx_model import OnnxModel

    graph = optimizer.optimize_model(str(exported), model_type="bert", opt_level=0,
                                     num_heads=int(getattr(config, "num_attention_heads", 0) or 0),
                                     hidden_size=int(getattr(config, "hidden_size", 0) or 0)) if fuse else \
        OnnxModel(onnx.load(str(exported)))
    if spec.dtype == "float16":
        graph.convert_float_to_float16(keep_io_types=True)
    if spec.dtype != "int8":
        graph.save_model_to_file(str(path), use_external_data_format=external)
        return
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # Weights per output channel; the feed-forward output projections stay in float32:
    # their inputs (GELU outputs) have outliers that per-tensor 8-bit activations clip
    # (the fidelity either way: bench/results/code-choices.md#figures-behind-the-code-choices).
    producers = {out: node for node in graph.model.graph.node for out in node.output}
    after_gelu = [node.name for node in graph.model.graph.node if node.op_type == "MatMul"
                  and "Gelu" in getattr(producers.get(node.input[0]), "op_type", "")]
    fused = path.parent / f".fused-{path.stem}" / path.name
    fused.parent.mkdir()
    try:
        graph.save_model_to_file(str(fused), use_external_data_format=external)
        quantize_dynamic(str(fused), str(path), weight_type=QuantType.QInt8, per_channel=True,
                         nodes_to_exclude=after_gelu, use_external_data_format=external)
    finally:
        shutil.rmtree(fused.parent)


def providers(device: str) -> list:
    """onnxruntime execution providers for a device, best first; raises if this
    onnxruntime cannot run on it."""
    import onnxruntime

    kind, index = devices.split(device)
    if kind == "cpu":
        return ["CPUExecutionProvider"]
    wanted = {"cuda": "CUDAExecutionProvider", "rocm": "ROCMExecutionProvider"}.get(kind)
    available = onnxruntime.get_available_providers()
    if wanted not in available:
        raise ValueError(f"device {device}: this onnxruntime has no execution provider for it (it has "
                         f"{', '.join(available)}); for CUDA install onnxruntime-gpu, or use engine = \"torch\"")
    chosen: list = []
    if kind == "cuda" and "TensorrtExecutionProvider" in available:
        chosen.append(("TensorrtExecutionProvider", {
            "device_id": index, "trt_engine_cache_enable": True,
            "trt_engine_cache_path": str(cache_dir() / "tensorrt"),
        }))
    chosen.append((wanted, {"device_id": index}))
    return [*chosen, "CPUExecutionProvider"]


class _Session:
    """An onnxruntime session of a graph, on `threads` threads: a `CompiledGraph`."""

    def __init__(self, graph: Path, device: str, threads: int) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        # Idle threads must not spin: on a small machine they would take the cores the front
        # end and tokenizers need.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = onnxruntime.InferenceSession(str(graph), options, providers=providers(device))
        self.input_names = [i.name for i in self._session.get_inputs()]

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        (output,) = self._session.run(None, dict(feeds))
        return output


class OnnxEngine(GraphEngine):
    name = "onnx"
    express_beside_lanes = True  # a session runs as many single-threaded runs at once as are asked

    def __init__(self, spec: ModelSpec, threads: int, outputs: Mapping[str, RawOutput]) -> None:
        refused = (engine_refusal(self.name, outputs, model_config(spec), spec.reads_unattended_states)
                   or dtype_refusal(self.name, spec.dtype))
        if refused is not None:
            raise ValueError(refused)
        if spec.dtype == "float16" and devices.is_cpu(spec.device):
            raise ValueError("the onnx engine runs float16 on CUDA only; use float32 or int8 on the CPU")
        folder = exported_model(spec, outputs)
        super().__init__(folder, spec, threads, outputs)

    def _compile(self, graph: Path, device: str, threads: int, runs: int) -> CompiledGraph:
        return _Session(graph, device, threads)
