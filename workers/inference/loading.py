"""What an inference process does before it serves, and a preparing process does whole:
check the device, load every model, size the torch threads, settle each model's lanes and
warm its passes up, fitting (or reading back) the batching cost models."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from infinity.shared import devices, protocol
from infinity.shared.protocol import ModelSpec
from workers.engines import set_torch_threads
from workers.heads import LoadedModel
from workers.inference.calibration import TextLanes, cost_model_record, text_lanes, warm_up, warm_up_media
from workers.preprocess.media import media_module


@dataclass(frozen=True)
class LoadedModels:
    """The models of one process, loaded and warm, by name, with what their queues need."""

    models: dict[str, LoadedModel]
    lanes: dict[str, TextLanes]
    costs: dict[str, tuple[float, float]]  # each model's text cost model (`warm_up`)
    media_costs: dict[str, tuple[float, int]]  # of models with a media pass (`warm_up_media`)
    # The one thread that runs wide passes: made before the warm-up, which starts its
    # OpenMP team there, so the first lone input does not.
    wide_runner: ThreadPoolExecutor


def load_and_warm(args: protocol.WorkerArgs, load: Callable[[ModelSpec, int], LoadedModel]) -> LoadedModels:
    """Every model of `args` loaded by `load` on its device and warmed up."""
    devices.require(args.models[0].device, [spec.name for spec in args.models])
    models = {spec.name: load(spec, args.threads) for spec in args.models}
    set_torch_threads([model.engine for model in models.values()], args.threads)
    lanes = {spec.name: text_lanes(models[spec.name].engine, args.threads) for spec in args.models}
    wide_runner = ThreadPoolExecutor(1, thread_name_prefix="wide-pass")
    costs = {spec.name: warm_up(models[spec.name], spec.max_length, lanes[spec.name], wide_runner,
                                cost_model_record(models[spec.name], spec, args.threads, lanes[spec.name]))
             for spec in args.models}
    media_costs = {spec.name: warm_up_media(models[spec.name], spec, args.threads, wide_runner)
                   for spec in args.models if media_module(spec.kind) is not None}
    return LoadedModels(models, lanes, costs, media_costs, wide_runner)
