"""What the engines that run torch's ONNX export of a model share (ONNX Runtime, which
optimises the graphs for its sessions, and OpenVINO, which compiles them): the export, and
how its graphs run in lanes.

`exported_graphs` gives the folder of the model's graphs as torch's own exporter
(`torch.export` based, dynamic batch and sequence axes; no optimum needed) writes them:
the text graph (`GRAPH`: ids, mask and, where the model takes them, token segments -> the
raw output asked for text) and, for a two-tower model, its vision tower (`VISION_GRAPH`:
pixel values -> its projected pooled output), in float32. One export, cached, serves
every engine that starts from it and every dtype they build. `GraphEngine` runs a folder
of graphs as the `Engine` protocol asks, through a runtime's `CompiledGraph`s.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import logging
import warnings
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from infinity.shared import devices
from infinity.shared.kinds import TEXT, RawOutput
from infinity.shared.protocol import ModelSpec
from workers.engines.artifacts import cached_build, versions
from workers.engines.base import auto_class, model_output, pad_id
from workers.engines.lanes import built_at_lane_niceness, settle_wide_copy, wants_copy

log = logging.getLogger(__name__)

GRAPH = "model.onnx"
VISION_GRAPH = "vision.onnx"  # a two-tower model's vision tower, beside its text tower in GRAPH
# Above this many bytes of weights, ONNX's 2 GB protobuf limit needs the weights beside the graph.
_EXTERNAL_DATA_BYTES = 1 << 30


def exported_graphs(spec: ModelSpec, outputs: Mapping[str, RawOutput]) -> Path:
    """The folder holding `spec`'s graphs giving `outputs`, exported if no cached ones match
    (the model's files, the output, the library versions: `workers.engines.artifacts`)."""
    def export(staging: Path) -> None:
        with quiet_logging():
            _export_graphs(spec, outputs, staging)
        log.info("exported %s to ONNX", spec.name)

    settings = {"output": str(outputs[TEXT]), **versions("torch", "transformers", "onnx")}
    folder, _ = cached_build("onnx-export", Path(spec.path), settings, export)
    return folder


def has_vision_tower(folder: Path) -> bool:
    """Whether the graphs in `folder` are a two-tower model's (`VISION_GRAPH` beside `GRAPH`)."""
    return (folder / VISION_GRAPH).is_file()


def weights_beside(folder: Path) -> bool:
    """Whether the graphs in `folder` keep their weights in files of their own (a model
    above ONNX's 2 GB protobuf limit), which a rewritten graph must do too."""
    return any(path.suffix != ".onnx" for path in folder.iterdir())


@contextlib.contextmanager
def quiet_logging() -> Iterator[None]:
    """No INFO records meanwhile: the exporter, and ONNX Runtime's optimiser and quantiser,
    log every step at INFO."""
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


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


def _export_graphs(spec: ModelSpec, outputs: Mapping[str, RawOutput], folder: Path) -> None:
    """Write `spec`'s model giving `outputs` into `folder` as `GRAPH` (and, for a two-tower
    model, `VISION_GRAPH`), float32 with dynamic batch and sequence axes."""
    output = outputs[TEXT]
    # Eager attention exports to plain MatMul/Softmax, which onnxruntime fuses better than
    # the exported SDPA.
    model = auto_class(output, spec).from_pretrained(spec.path, dtype=torch.float32, attn_implementation="eager",
                                                     trust_remote_code=spec.trust_remote_code).eval()
    external = sum(p.numel() * p.element_size() for p in model.parameters()) > _EXTERNAL_DATA_BYTES
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if _takes_token_types(model) else [])
    # A padded sample with batch and length above 1, so neither axis is specialised and the
    # mask is traced as data, not as a constant.
    ids = torch.full((2, 8), pad_id(spec) + 1, dtype=torch.int64)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    sample = (ids, mask, torch.zeros_like(ids))[:len(names)]
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    folder.mkdir(parents=True, exist_ok=True)
    _export(_Forward(model, output), sample, folder / GRAPH, names, {n: {0: batch, 1: length} for n in names},
            external)
    two_towers = RawOutput.IMAGE_FEATURES in outputs.values()
    if two_towers:
        vision = model.config.vision_config
        side = int(vision.image_size)
        pixels = torch.zeros((2, int(getattr(vision, "num_channels", 3)), side, side))
        _export(_Vision(model), (pixels,), folder / VISION_GRAPH, ["pixel_values"], {"pixel_values": {0: batch}},
                external)


def _export(module: torch.nn.Module, sample: tuple[torch.Tensor, ...], path: Path, names: list[str],
            dynamic_shapes: dict[str, dict[int, object]], external: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, sample, str(path), input_names=names, output_names=["output"],
                          dynamic_shapes=dynamic_shapes, dynamo=True, external_data=external, verbose=False)


class CompiledGraph(Protocol):
    """One graph as a runtime compiled it, run from any thread."""

    input_names: list[str]  # the inputs the graph takes: a model may take no token segments

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        """The graph's one output for `feeds`, its inputs by name."""
        ...


def run_text_graph(graph: CompiledGraph, input_ids: np.ndarray, attention_mask: np.ndarray,
                   token_type_ids: np.ndarray) -> np.ndarray:
    """`graph`'s output for a padded batch, given the inputs it takes (a model may take no
    token segments)."""
    given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
    return graph({name: given[name] for name in graph.input_names})


class GraphEngine(abc.ABC):
    """An engine running the graphs `export_graphs` wrote into a folder. On the CPU,
    single-threaded runs of the text graph at once, a lane each: more sentences/s than one
    run on every thread (bench/results/code-choices.md#figures-behind-the-code-choices);
    one more for the express lane; for small models a copy on every thread for a lone
    input, kept where it pays (`workers.engines.lanes`). A model too big for that copy
    runs one pass at a time on every thread instead: its passes are long enough to use
    them, and a lone input is not left to one core
    (bench/results/engines.md#big-models-lanes-or-every-thread). Images run one pass
    at a time on every thread: as many images/s as a lane per core, and a lone image is
    not left to one core (bench/results/images.md#onnx-towers).

    A runtime gives `_compile(graph, device, threads, runs)`: `graph` on `threads` threads
    per run, `runs` of them at once (`express_beside_lanes`: more where it can)."""

    on_caller_threads = False  # its threads are its own
    # Whether the lanes' graph also runs the express lane's pass beside theirs (ONNX
    # Runtime: a session runs as many at once as are asked); else the express lane gets a
    # copy of its own, made with the wide copy.
    express_beside_lanes: bool

    def __init__(self, folder: Path, spec: ModelSpec, threads: int, outputs: Mapping[str, RawOutput]) -> None:
        two_towers = RawOutput.IMAGE_FEATURES in outputs.values()
        # Lanes, with copies for wide passes and the express lane, where the text graph is
        # small enough to copy; else one pass at a time on every thread.
        in_lanes = devices.is_cpu(spec.device) and wants_copy(folder / GRAPH if two_towers else folder, threads)
        self.lanes = threads if in_lanes else 1
        express_copy = in_lanes and not self.express_beside_lanes
        self.express = self.lanes > 1 and (self.express_beside_lanes or express_copy)
        compile_lanes = partial(self._compile, folder / GRAPH, spec.device, 1 if in_lanes else threads, self.lanes)
        # A runtime may compute the lanes' passes on threads it starts here (OpenVINO's streams).
        self._graph = built_at_lane_niceness(compile_lanes) if self.express else compile_lanes()
        self._vision = self._compile(folder / VISION_GRAPH, spec.device, threads, 1) if two_towers else None
        self._wide = self._compile(folder / GRAPH, spec.device, threads, 1) if in_lanes else None
        self._express = self._compile(folder / GRAPH, spec.device, 1, 1) if express_copy else None
        self.pad_id = pad_id(spec)
        settle_wide_copy(self, spec, threads)

    @abc.abstractmethod
    def _compile(self, graph: Path, device: str, threads: int, runs: int) -> CompiledGraph: ...

    @torch.inference_mode()
    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                token_type_ids: np.ndarray, wide: bool = False, express: bool = False) -> torch.Tensor:
        graph = (self._wide if wide and self._wide is not None
                 else self._express if express and self._express is not None else self._graph)
        return torch.from_numpy(run_text_graph(graph, input_ids, attention_mask, token_type_ids))

    @torch.inference_mode()
    def forward_media(self, arrays: Mapping[str, np.ndarray]) -> torch.Tensor:
        """A two-tower model's vision tower on the inputs its graph names (`pixel_values`:
        (n, channels, height, width) float32) -> (n, dim), its projected pooled output."""
        assert self._vision is not None
        return torch.from_numpy(self._vision({name: arrays[name] for name in self._vision.input_names}))
