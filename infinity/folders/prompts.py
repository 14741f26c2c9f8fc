"""The prompts of a model that embeds texts: text put before each input, by name, and the
one inputs get when a request asks for none (`ModelSpec.prompts`, `default_prompt_name`),
and whether its pooling reads the prompt's tokens (`pools_prompt`).

They come, name by name, from the model's `models.toml` entry (`prompts`,
`default_prompt_name`), over what its folder declares as sentence-transformers reads it
(config_sentence_transformers.json's `prompts` and `default_prompt_name`; the Pooling
module's `include_prompt`). A folder that declares no prompt (none, or only empty ones)
of a family whose model card prescribes them gets the family's from `FAMILY_PROMPTS`,
unless `builtin_prompts = false`.

A folder's family is found from the name it declares, the first of: the repository of a
Hugging Face hub download (its cache path holds `models--<org>--<name>`), the name its
model card gives (README.md's `model-index`), the folder's own name. That name is compared
whole with each family's names, so a fine-tune or a renamed copy gets no prompt it may not
have been trained with. config.json's `_name_or_path` is not read: it names whatever the
weights were loaded from when saved, often the base model of a fine-tune (the packaged
all-MiniLM-L6-v2 says `nreimers/MiniLM-L6-H384-uncased`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from infinity.config import ConfigError, ModelConfig
from infinity.folders import ModelFolder
from infinity.shared.kinds import KINDS

# The query instruction of BGE's English models and Snowflake's first Arctic Embed models.
RETRIEVAL_INSTRUCTION = "Represent this sentence for searching relevant passages: "
# Qwen3-Embedding's `Instruct: {task}\nQuery:` with its model card's task for retrieval;
# another task is a request's `prompt`.
QWEN3_RETRIEVAL = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


@dataclass(frozen=True)
class FamilyPrompts:
    """The prompts a family's model card prescribes, for folders of one of its `names`
    (a regular expression, matched whole, case aside)."""

    family: str
    names: str
    prompts: dict[str, str]

    def matches(self, name: str) -> bool:
        return re.fullmatch(self.names, name, re.IGNORECASE) is not None


FAMILY_PROMPTS = (
    FamilyPrompts("E5", r"(multilingual-)?e5-(small|base|large)(-v2)?", {"query": "query: ", "document": "passage: "}),
    FamilyPrompts("BGE (English)", r"bge-(small|base|large)-en(-v1\.5)?",
                  {"query": RETRIEVAL_INSTRUCTION, "document": ""}),
    FamilyPrompts("Arctic Embed", r"snowflake-arctic-embed-(xs|s|m|m-long|l)(-v1\.5)?",
                  {"query": RETRIEVAL_INSTRUCTION, "document": ""}),
    FamilyPrompts("Arctic Embed 2.0", r"snowflake-arctic-embed-(m|l)-v2\.0", {"query": "query: ", "document": ""}),
    FamilyPrompts("Nomic Embed Text", r"nomic-embed-text-(v1|v1\.5|v2-moe)",
                  {"query": "search_query: ", "document": "search_document: ",
                   "classification": "classification: ", "clustering": "clustering: "}),
    FamilyPrompts("Qwen3-Embedding", r"qwen3-embedding-(0\.6b|4b|8b)", {"query": QWEN3_RETRIEVAL, "document": ""}),
)

_HUB_CACHE_PART = re.compile(r"models--[^/]+--(?P<name>[^/]+)")
# A model card's front matter, and the first name of its model-index.
_FRONT_MATTER = re.compile(r"\A---\s*\n(?P<yaml>.*?)\n---", re.DOTALL)
_MODEL_INDEX_NAME = re.compile(r"^model-index:\s*\n\s*-\s*name:\s*(?P<name>.+?)\s*$", re.MULTILINE)


def prompt_settings(model: ModelConfig, folder: ModelFolder, kind: str,
                    declared: dict[str, str] | None = None) -> dict:
    """The prompt fields of the `ModelSpec` of `model`, of `kind`, in `folder`;
    `declared`: the prompts the kind's reader found, in place of the folder's
    sentence-transformers config (a legacy multi-vector layout composes its own)."""
    if not KINDS[kind].prompted:
        if model.prompts or model.default_prompt_name is not None:
            raise ConfigError(f"model '{model.name}': prompts apply to models that embed texts; this one is of kind "
                              f"'{kind}'")
        return {}
    settings = folder.settings()
    prompts = dict(declared if declared is not None else settings.get("prompts") or {})
    if not any(prompts.values()) and model.builtin_prompts:
        family = family_of(folder.root)
        if family is not None:
            prompts = dict(family.prompts)
    prompts.update(model.prompts)
    default = model.default_prompt_name
    if default is not None and default not in prompts:
        raise ConfigError(f"model '{model.name}': default_prompt_name {default!r} names none of its prompts "
                          f"({', '.join(prompts) or 'it has none'})")
    if default is None and settings.get("default_prompt_name") in prompts:
        default = settings["default_prompt_name"]  # one naming no prompt is none, as sentence-transformers reads it
    return {"prompts": prompts, "default_prompt_name": default, "pools_prompt": _pools_prompt(folder)}


def family_of(root: Path) -> FamilyPrompts | None:
    """The family of the name the folder at `root` declares (see the module), if the
    built-in table has it."""
    name = declared_name(root)
    return next((family for family in FAMILY_PROMPTS if family.matches(name)), None)


def declared_name(root: Path) -> str:
    """The name a model folder declares: its hub repository's, its model card's, its own."""
    hub = _HUB_CACHE_PART.search(root.resolve().as_posix())
    if hub is not None:
        return hub["name"]
    return _model_card_name(root / "README.md") or root.resolve().name


def _model_card_name(readme: Path) -> str | None:
    if not readme.is_file():
        return None
    front = _FRONT_MATTER.match(readme.read_text(errors="replace"))
    found = _MODEL_INDEX_NAME.search(front["yaml"]) if front is not None else None
    return found["name"].strip("\"'") if found is not None else None


def _pools_prompt(folder: ModelFolder) -> bool:
    """Whether the folder's Pooling module reads the prompt's tokens (`include_prompt`)."""
    if "Pooling" not in folder.modules:
        return True
    config = json.loads((folder.root / folder.modules["Pooling"] / "config.json").read_text())
    return bool(config.get("include_prompt", True))
