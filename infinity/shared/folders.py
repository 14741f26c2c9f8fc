"""What both sides read of a model: where the server caches files (models extracted or
downloaded, converted engines), the label count of a classification config, the special
tokens its tokenizer names, the patches
of a two-tower model's images, and the families CTranslate2 converts (the front end's
`engine = "auto"` picks it for them, its engine refuses others)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("INFINITY_CACHE_DIR", Path.home() / ".cache" / "infinity"))


def num_labels(config: dict) -> int:
    """Labels of a transformers classification config (`id2label`, else `num_labels`)."""
    return len(config.get("id2label") or {}) or int(config.get("num_labels", 2))


def special_token(folder: Path, key: str) -> str | None:
    """A special token (`pad_token`, `mask_token`, ...) named in a folder's
    tokenizer_config.json: a string, or an object holding it."""
    path = folder / "tokenizer_config.json"
    value = json.loads(path.read_text()).get(key) if path.is_file() else None
    return value.get("content") if isinstance(value, dict) else value


def image_patches(config: dict) -> int:
    """Patches a two-tower model's vision tower sees in one image: what an image costs a
    forward pass, and what it is billed."""
    vision = config["vision_config"]
    return (int(vision["image_size"]) // int(vision["patch_size"])) ** 2


# model_type values of the encoder families CTranslate2's converter handles (and whose
# classification heads its engine knows).
CTRANSLATE2_FAMILIES = ("bert", "roberta", "xlm-roberta", "camembert")
