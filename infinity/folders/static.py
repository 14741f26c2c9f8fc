"""Static-embedding folders (sentence-transformers' StaticEmbedding: model2vec's potion
models, static-retrieval-mrl): a tokenizer and a table of rows, no transformer. The
server serves one as an embedder on the static engine (`workers/engines/static_engine.py`)
from a folder it writes once in its cache: the module's table and tokenizer beside a
config.json saying its size, the tokenizer without the special tokens
sentence-transformers leaves out (it encodes a text without them), read as any folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from infinity.config import ConfigError, ModelConfig
from infinity.folders.modules import DeclaredModule
from infinity.shared.folders import STATIC_FAMILY, cache_dir

# The tokens of one input at most where its tokenizer says none: sentence-transformers then
# reads a text whole; the server cuts it here (a look-up costs nothing, but a batch still
# holds every token).
STATIC_MAX_LENGTH = 8192


def static_model_folder(model: ModelConfig, module: DeclaredModule) -> Path:
    """The folder the server reads a StaticEmbedding module as, written in the cache once
    per version of its files."""
    weights, tokenizer = module.path / "model.safetensors", module.path / "tokenizer.json"
    if not weights.is_file() or not tokenizer.is_file():
        raise ConfigError(f"model '{model.name}': a StaticEmbedding module needs model.safetensors and "
                          f"tokenizer.json in {module.path}")
    stamp = "\0".join(f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}"
                      for path in (weights, tokenizer))
    target = cache_dir() / "static" / hashlib.sha256(stamp.encode()).hexdigest()[:24]
    if (target / "config.json").is_file():
        return target
    vocabulary, dim = _table_shape(model, weights)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".static-"))
    (staging / "model.safetensors").symlink_to(weights.resolve())
    settings = json.loads(tokenizer.read_text())
    settings["post_processor"] = None
    # sentence-transformers keeps the tokenizer's own truncation, if it has one.
    longest = (settings.get("truncation") or {}).get("max_length") or STATIC_MAX_LENGTH
    (staging / "tokenizer.json").write_text(json.dumps(settings))
    (staging / "config.json").write_text(json.dumps({
        "model_type": STATIC_FAMILY, "architectures": ["StaticEmbedding"], "vocab_size": vocabulary,
        "hidden_size": dim, "max_position_embeddings": longest}))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target


def _table_shape(model: ModelConfig, weights: Path) -> tuple[int, int]:
    """(token ids, width) of the table as the static engine folds it: one row per token id
    (model2vec's `mapping` has one entry per token id)."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="numpy") as tensors:
        names = set(tensors.keys())
        if "embedding.weight" in names:
            return tuple(tensors.get_slice("embedding.weight").get_shape())  # type: ignore[return-value]
        if "embeddings" not in names:
            raise ConfigError(f"model '{model.name}': {weights} holds no embedding table (embedding.weight or "
                              f"embeddings); it has {', '.join(sorted(names))}")
        rows, dim = tensors.get_slice("embeddings").get_shape()
        if "mapping" in names:
            rows = tensors.get_slice("mapping").get_shape()[0]
        return rows, dim
