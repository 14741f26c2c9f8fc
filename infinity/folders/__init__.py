"""Model folders: where a model's files are and what its folder says (`resolve`), with one
reader per family of folder, named by the kinds table (`infinity.shared.kinds`). A
reader is a module with two functions:

- `detect(folder: ModelFolder) -> str | None`: the kind a folder of its family is, or
  None for a folder of another family;
- `settings(model: ModelConfig, folder: ModelFolder, kind: str) -> dict`: the fields of
  the model's `ModelSpec` its folder sets, after refusing (`ConfigError`) what the
  folder asks that is not served;

and a tuple `MODULES`: the sentence-transformers modules (`infinity.folders.modules`) a
folder of its kinds may declare; a folder declaring another is refused at start.

Folders are tried against every reader in the table's order; a folder no reader claims
is a plain encoder, which embeds (`FALLBACK_KIND`).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from infinity.folders.modules import DeclaredModule
from infinity.shared.kinds import KINDS

FALLBACK_KIND = "embed"


@dataclass(frozen=True)
class ModelFolder:
    """What every reader is given of a model's folder."""

    root: Path  # the folder given (a sentence-transformers folder holds its modules' sub-folders)
    # Its sentence-transformers modules in modules.json's order (`infinity.folders.modules`).
    declared: tuple[DeclaredModule, ...]
    transformer: Path  # the transformers model's folder: config.json, weights, tokenizer
    config: dict  # its config.json
    max_length: int  # tokens of one input at most, as configured or as the folder says

    @property
    def modules(self) -> dict[str, str]:
        """Module class -> its sub-folder, the first of each class (an MLMTransformer as a
        Transformer)."""
        modules: dict[str, str] = {}
        for module in self.declared:
            name = "Transformer" if module.name == "MLMTransformer" else module.name
            modules.setdefault(name, str(module.path.relative_to(self.root)))
        return modules

    def count(self, name: str) -> int:
        """How many modules of class `name` it declares."""
        return sum(module.name == name for module in self.declared)

    def settings(self) -> dict:
        """The model-wide sentence-transformers settings: its transformer's
        sentence_bert_config.json, then config_sentence_transformers.json."""
        settings: dict = {}
        for path in (self.transformer / "sentence_bert_config.json", self.root / "config_sentence_transformers.json"):
            if path.is_file():
                settings.update(json.loads(path.read_text()))
        return settings


def reader(kind: str) -> ModuleType:
    """The folder reader of `kind`."""
    return importlib.import_module(KINDS[kind].reader)


def detect_kind(folder: ModelFolder) -> str:
    """The kind of `folder`: the first reader's, in the table's order, that claims it."""
    fallback = KINDS[FALLBACK_KIND].reader
    for name in dict.fromkeys(kind.reader for kind in KINDS.values()):
        if name != fallback and (kind := importlib.import_module(name).detect(folder)) is not None:
            return kind
    return FALLBACK_KIND
