"""Page-retrieval model folders (ColPali, ColQwen2): a vision-language model that gives a
vector per token for text queries and for page images alike, scored by late
interaction. The layout served is transformers' own (`ColPaliForRetrieval`,
`ColQwen2ForRetrieval`, as the "-hf" checkpoints ship); colpali-engine's (PEFT adapters,
`architectures: ["ColPali"]`) is refused at start with how to convert it."""

from __future__ import annotations

from pathlib import Path

from infinity.config import ConfigError, ModelConfig
from infinity.folders import ModelFolder

SERVED_ARCHITECTURES = ("ColPaliForRetrieval", "ColQwen2ForRetrieval")
_ENGINE_FORMATS = ("ColPali", "ColQwen2", "ColQwen2_5", "ColIdefics3")

# The sentence-transformers modules its folder may declare (infinity/folders/__init__.py).
MODULES = ("Transformer",)


def detect(folder: ModelFolder) -> str | None:
    return "image_multivector" if is_page_retrieval(folder.transformer, folder.config) else None


def settings(model: ModelConfig, folder: ModelFolder, kind: str) -> dict:
    if not is_page_retrieval(folder.transformer, folder.config):
        raise ConfigError(f"model '{model.name}': kind = \"image_multivector\" needs a page-retrieval folder "
                          f"(ColPali); {folder.transformer} is {folder.config.get('model_type')}")
    refuse_unserved(model.name, folder.transformer, folder.config)
    return {}


def is_page_retrieval(folder: Path, config: dict) -> bool:
    """Whether the folder is a page-retrieval model, served or not (see `refuse_unserved`)."""
    architectures = config.get("architectures") or []
    return (config.get("model_type") in ("colpali", "colqwen2")
            or any(a in SERVED_ARCHITECTURES + _ENGINE_FORMATS or a.endswith("ForRetrieval") for a in architectures)
            or (folder / "adapter_config.json").is_file()
            and "colpali" in (folder / "adapter_config.json").read_text().lower())


def refuse_unserved(name: str, folder: Path, config: dict) -> None:
    """Stop the start for page-retrieval folders this server does not read."""
    architectures = config.get("architectures") or []
    if any(a in SERVED_ARCHITECTURES for a in architectures):
        return
    if (folder / "adapter_config.json").is_file() or any(a in _ENGINE_FORMATS for a in architectures):
        raise ConfigError(f"model '{name}': {folder} is a colpali-engine checkpoint; serve its transformers "
                          "conversion instead (the '-hf' checkpoints, e.g. vidore/colpali-v1.3-hf, or convert it "
                          "with transformers' models/colpali/convert_colpali_weights_to_hf.py)")
    raise ConfigError(f"model '{name}': {', '.join(architectures) or config.get('model_type')} is not served yet; "
                      f"page-retrieval models served: {', '.join(SERVED_ARCHITECTURES)}")
