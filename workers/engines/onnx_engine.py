"""ONNX Runtime engine for embedders, rerankers, classifiers, sparse (masked-language-
model) encoders and two-tower (image-text) models.

On first use the transformers model is exported with torch's ONNX exporter (`torch.export`
based, dynamic batch and sequence axes; no optimum needed), its transformer blocks fused
by onnxruntime's transformer optimiser, optionally quantised, and cached (see
`artifacts`); later starts load the cached graph. A two-tower model is exported as two
graphs, its text tower and its vision tower (`VISION_GRAPH`), each giving its projected
pooled output. Sessions run with every graph optimisation on, on the CPU, or on CUDA /
TensorRT when onnxruntime has those providers.

dtypes: float32 anywhere; int8 (dynamic quantisation of the weights, for the CPU);
float16 (for CUDA: the graph in half precision, inputs and outputs kept as they are).
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from infinity.shared import devices
from infinity.shared.folders import cache_dir
from infinity.shared.kinds import TEXT, RawOutput
from infinity.shared.protocol import ModelSpec
from workers.engines.artifacts import cached_build
from workers.engines.base import auto_class, model_output, pad_id
from workers.engines.lanes import settle_wide_copy, wants_copy

log = logging.getLogger(__name__)

DTYPES = ("float32", "float16", "int8")
GRAPH = "model.onnx"
VISION_GRAPH = "vision.onnx"  # a two-tower model's vision tower, beside its text tower in GRAPH
# Above this many bytes of weights, ONNX's 2 GB protobuf limit needs the weights beside the graph.
_EXTERNAL_DATA_BYTES = 1 << 30


def exported_model(spec: ModelSpec, outputs: Mapping[str, RawOutput]) -> tuple[Path, bool]:
    """The folder holding `spec`'s graph (`GRAPH`), exporting it if no cached one matches;
    returns (folder, whether it was exported now)."""
    import onnx
    import onnxruntime
    import transformers

    def export(staging: Path) -> None:
        logging.disable(logging.INFO)  # the exporter, optimiser and quantiser log every step at INFO
        try:
            _export(spec, outputs, staging / GRAPH)
        finally:
            logging.disable(logging.NOTSET)
        log.info("exported %s to ONNX (%s)", spec.name, spec.dtype)

    return cached_build("onnx", Path(spec.path), {
        "output": str(outputs[TEXT]),
        "dtype": spec.dtype,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
    }, export)


class _Vision(torch.nn.Module):
    """A two-tower model's vision tower: pixel values -> its projected pooled output."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return model_output(self.model, {"pixel_values": pixel_values}, RawOutput.IMAGE_FEATURES)


class _Forward(torch.nn.Module):
    """The transformers module with plain tensor inputs and one output: token states, or a
    head's logits."""

    def __init__(self, model: torch.nn.Module, output: RawOutput) -> None:
        super().__init__()
        self.model = model
        self.output = output

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        return model_output(self.model, {"input_ids": input_ids, "attention_mask": attention_mask, **extra}, self.output)


def _takes_token_types(model: torch.nn.Module) -> bool:
    return "token_type_ids" in inspect.signature(model.forward).parameters


def _export(spec: ModelSpec, outputs: Mapping[str, RawOutput], path: Path) -> None:
    output = outputs[TEXT]
    # Eager attention exports to plain MatMul/Softmax, which onnxruntime fuses better than
    # the exported SDPA.
    model = auto_class(output, spec).from_pretrained(spec.path, dtype=torch.float32, attn_implementation="eager").eval()
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if _takes_token_types(model) else [])
    # A padded sample with batch and length above 1, so neither axis is specialised and the
    # mask is traced as data, not as a constant.
    ids = torch.full((2, 8), pad_id(spec) + 1, dtype=torch.int64)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    sample = (ids, mask, torch.zeros_like(ids))[:len(names)]
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    exported = path.with_name("exported.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Forward(model, output), sample, str(exported), input_names=names,
                          output_names=["output"], dynamic_shapes={n: {0: batch, 1: length} for n in names},
                          dynamo=True, external_data=_large(model), verbose=False)
    two_towers = RawOutput.IMAGE_FEATURES in outputs.values()
    _optimise(spec, model.config, exported, path, _large(model), fuse=not two_towers)
    if two_towers:
        vision = model.config.vision_config
        side = int(vision.image_size)
        pixels = torch.zeros((2, int(getattr(vision, "num_channels", 3)), side, side))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(_Vision(model), (pixels,), str(exported), input_names=["pixel_values"],
                              output_names=["output"], dynamic_shapes={"pixel_values": {0: batch}},
                              dynamo=True, external_data=_large(model), verbose=False)
        _optimise(spec, vision, exported, path.with_name(VISION_GRAPH), _large(model), fuse=False)
    for leftover in path.parent.iterdir():
        if leftover.name.startswith("exported."):
            leftover.unlink()


def _large(model: torch.nn.Module) -> bool:
    return sum(p.numel() * p.element_size() for p in model.parameters()) > _EXTERNAL_DATA_BYTES


def _optimise(spec: ModelSpec, config: object, exported: Path, path: Path, external: bool, fuse: bool = True) -> None:
    """Fuse layer norms and GELUs with onnxruntime's transformer optimiser (`fuse`), then
    convert to the requested dtype. Two-tower models are not fused: the BERT fusions
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
    fused = path.with_name("exported.fused.onnx")
    graph.save_model_to_file(str(fused), use_external_data_format=external)
    quantize_dynamic(str(fused), str(path), weight_type=QuantType.QInt8, per_channel=True,
                     nodes_to_exclude=after_gelu, use_external_data_format=external)


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


def _session(graph: Path, device: str, threads: int) -> object:
    """An onnxruntime session of `graph`, on `threads` threads."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    # Idle threads must not spin: on a small machine they would take the cores the front
    # end and tokenizers need.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(str(graph), options, providers=providers(device))


class OnnxEngine:
    name = "onnx"
    on_caller_threads = False  # its threads are its own

    def __init__(self, spec: ModelSpec, threads: int, outputs: Mapping[str, RawOutput]) -> None:
        if spec.dtype not in DTYPES:
            raise ValueError(f"the onnx engine takes dtype {', '.join(DTYPES)}; got {spec.dtype}")
        if spec.dtype == "float16" and devices.is_cpu(spec.device):
            raise ValueError("the onnx engine runs float16 on CUDA only; use float32 or int8 on the CPU")
        folder, _ = exported_model(spec, outputs)
        on_cpu = devices.is_cpu(spec.device)
        # On the CPU, single-threaded runs of the session at once, a lane each: more
        # sentences/s than one run on every thread.
        self.lanes = threads if on_cpu else 1
        self.express = self.lanes > 1  # one more single-threaded run of the same session
        self._session = _session(folder / GRAPH, spec.device, 1 if on_cpu else threads)
        two_towers = RawOutput.IMAGE_FEATURES in outputs.values()
        # Images run one pass at a time on every thread: as many images/s as a lane per
        # core, and a lone image is not left to one core (bench/results/images.md#onnx-towers).
        self._vision = _session(folder / VISION_GRAPH, spec.device, threads) if two_towers else None
        copies = wants_copy(folder / GRAPH if two_towers else folder, self.lanes)
        self._wide = _session(folder / GRAPH, spec.device, threads) if copies else None
        self._inputs = [i.name for i in self._session.get_inputs()]
        self.pad_id = pad_id(spec)
        settle_wide_copy(self, spec.max_length)

    @torch.inference_mode()
    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                token_type_ids: np.ndarray, wide: bool = False, express: bool = False) -> torch.Tensor:
        given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        session = self._wide if wide and self._wide is not None else self._session
        (output,) = session.run(None, {name: given[name] for name in self._inputs})
        return torch.from_numpy(output)

    @torch.inference_mode()
    def forward_media(self, arrays: Mapping[str, np.ndarray]) -> torch.Tensor:
        """A two-tower model's vision tower on the inputs its graph names (`pixel_values`:
        (n, channels, height, width) float32) -> (n, dim), its projected pooled output."""
        assert self._vision is not None
        (output,) = self._vision.run(None, {i.name: arrays[i.name] for i in self._vision.get_inputs()})
        return torch.from_numpy(output)
