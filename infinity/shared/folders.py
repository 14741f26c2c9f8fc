"""What both sides read of a model: where the server caches files (models extracted or
downloaded, converted engines), the label count of a classification config, the special
tokens its tokenizer names, the patches of a two-tower model's images, and whether an
engine can serve a model (the front end's `engine = "auto"` and its check of a chosen
engine, and the engine itself at load, ask the same `engine_refusal`); a folder's content
hash (the corpus job's manifest, the model list's `digest`)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path

from infinity.shared.kinds import RAW_OUTPUT_MEANING, RawOutput, lacking


def cache_dir() -> Path:
    return Path(os.environ.get("INFINITY_CACHE_DIR", Path.home() / ".cache" / "infinity"))


def num_labels(config: dict) -> int:
    """Labels of a transformers classification config (`id2label`, else `num_labels`)."""
    return len(config.get("id2label") or {}) or int(config.get("num_labels", 2))


def causal_lm(config: dict) -> bool:
    """Whether a transformers config.json is a causal language model's (`*ForCausalLM`)."""
    return any(a.endswith("ForCausalLM") for a in config.get("architectures") or [])


def special_token(folder: Path, key: str) -> str | None:
    """A special token (`pad_token`, `mask_token`, ...) named in a folder's
    tokenizer_config.json: a string, or an object holding it."""
    path = folder / "tokenizer_config.json"
    value = json.loads(path.read_text()).get(key) if path.is_file() else None
    return value.get("content") if isinstance(value, dict) else value


# The torch `Linear` state dicts a hybrid (BGE-M3) folder holds beside its encoder, as
# FlagEmbedding saves them: each token's sparse weight, and its vector of the multi-vector output.
SPARSE_LINEAR = "sparse_linear.pt"
COLBERT_LINEAR = "colbert_linear.pt"


def image_patches(config: dict) -> int:
    """Patches a two-tower model's vision tower sees in one image: what an image costs a
    forward pass, and what it is billed."""
    vision = config["vision_config"]
    return (int(vision["image_size"]) // int(vision["patch_size"])) ** 2


# The model_type of the config written for a static-embedding model (infinity/folders/static.py).
STATIC_FAMILY = "static_embedding"
# model_type values of the encoder families CTranslate2's converter handles (and whose
# classification heads its engine knows).
CTRANSLATE2_FAMILIES = ("bert", "roberta", "xlm-roberta", "camembert")
# model_type values of the families whose export ONNX Runtime's transformer optimiser, which
# the onnx engine fuses every text graph with, cannot fuse: ModernBERT's layer norms have no
# bias, and its skip-layer-norm fusion fails on them. (OpenVINO compiles the same export
# unfused.)
ONNX_UNFUSABLE_FAMILIES = ("modernbert",)


def engine_refusal(engine: str, outputs: Mapping[str, RawOutput], config: dict,
                   reads_unattended_states: bool = False) -> str | None:
    """Why `engine` cannot give a model whose config.json is `config` the raw `outputs` its
    kind asks (`infinity.shared.kinds.KindSpec.outputs`), or None: an output it does not
    compute (`ENGINE_OUTPUTS`); for any engine but torch, a model of the folder's own code;
    for a static-embedding model, any engine but the static one, and the reverse;
    for any engine but torch, a causal language model scored as a reranker;
    for ONNX Runtime, a family its optimiser cannot fuse; for CTranslate2, a family its
    converter does not handle, or tokens whose states are read without being attended to
    (ColBERT's query expansion), which it cannot compute."""
    missing = lacking(engine, outputs)
    if missing:
        return f"the {engine} engine cannot compute {RAW_OUTPUT_MEANING[missing[0]]}"
    # A causal reranker's logits are two rows of its language-model head at each pair's last
    # token (`ModelSpec.score_tokens`): the converters and exports give a classifier's head.
    if engine != "torch" and RawOutput.SEQUENCE_LOGITS in outputs.values() and causal_lm(config):
        return (f"the {engine} engine computes a sequence classifier's logits; this reranker is a causal language "
                "model scored by its token logits, which only the torch engine computes")
    # The converters and exports know transformers' own architectures: custom code may
    # convert wrongly or not at all, and a family name such a config keeps (jina's "bert")
    # says nothing of what its code computes.
    if engine != "torch" and config.get("auto_map"):
        return (f"the {engine} engine serves transformers' own architectures; this model runs its folder's own code "
                "(config.json's auto_map), which only the torch engine runs")
    family = config.get("model_type")
    if (engine == "static") != (family == STATIC_FAMILY):
        return ("the static engine serves static-embedding models (sentence-transformers' StaticEmbedding), and "
                "only it does")
    if engine == "onnx" and family in ONNX_UNFUSABLE_FAMILIES:
        return (f"the onnx engine fuses its graphs with onnxruntime's transformer optimiser, which fails on "
                f"{family}'s layer norms (they have no bias)")
    if engine != "ctranslate2":
        return None
    if family not in CTRANSLATE2_FAMILIES:
        return f"the ctranslate2 engine serves the {', '.join(CTRANSLATE2_FAMILIES)} families; this model is {family}"
    # What its converter requires; transformers 5 writes no key: absolute positions.
    if config.get("position_embedding_type", "absolute") != "absolute":
        return ("the ctranslate2 engine converts absolute positions only; this model has "
                f"{config['position_embedding_type']}")
    if reads_unattended_states:
        return ("the ctranslate2 engine computes attended tokens only; this model reads the states of tokens it does "
                "not attend to (query expansion)")
    return None


class Stopped(Exception):
    """A long read of a folder was asked to stop."""


def folder_digest(path: str, stop: threading.Event | None = None) -> str:
    """sha256 over a model folder's files (names and contents; hidden ones left out);
    `Stopped` once `stop` is set (a server stopping does not wait for a large folder)."""
    digest = hashlib.sha256()
    root = Path(path)
    for file in sorted(p for p in root.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(root).parts)):
        digest.update(f"{file.relative_to(root)}\0".encode())
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                if stop is not None and stop.is_set():
                    raise Stopped(path)
                digest.update(chunk)
    return digest.hexdigest()
