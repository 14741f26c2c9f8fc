"""Multi-vector (ColBERT-style) model folders: which folders are one, and what each says
about encoding queries and documents (each task's prompt, maximum length, query
expansion and skipped tokens), its projection and how it scores a query against a
document, read the way sentence-transformers' MultiVectorEncoder loads and applies them.

Three layouts are read: sentence-transformers' own (a MultiVectorMask module), PyLate's
before sentence-transformers took it in (`model_type: "ColBERT"`: Transformer and Dense
modules, its settings at the top level) and Stanford ColBERT checkpoints (`HF_ColBERT`: a
BERT with its projection among its weights, settings in `artifact.metadata`). What such
a folder may ask that is not served is refused at start rather than served wrong."""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from infinity.config import ConfigError, ModelConfig
from infinity.folders import ModelFolder
from infinity.shared.folders import special_token
from infinity.shared.protocol import TaskEncoding

SIMILARITIES = ("maxsim", "meanmaxsim")  # meanmaxsim: MaxSim divided by the query's token count
# The prompt `encode_document` takes, the first of these the folder has.
DOCUMENT_PROMPTS = ("document", "passage", "corpus")
# Classic ColBERT's query length, where a legacy folder names none.
CLASSIC_QUERY_LENGTH = 32


@dataclass(frozen=True)
class MultiVectorFolder:
    """What the model's folder says, in one shape whatever its layout."""

    tasks: dict[str, TaskEncoding]
    prompts: dict[str, str]  # each task's, by its name ("query", "document")
    similarity: str  # "maxsim" or "meanmaxsim"
    projection: str | None  # a folder whose weights hold the projection (`linear.*`); None: none
    normalize: bool


# The sentence-transformers modules its folder may declare (infinity/folders/__init__.py).
MODULES = ("Transformer", "Dense", "MultiVectorMask", "Normalize")


def detect(folder: ModelFolder) -> str | None:
    return "multivector" if is_multivector(folder.root, folder.modules, folder.config) else None


def settings(model: ModelConfig, folder: ModelFolder, kind: str) -> dict:
    if folder.count("Dense") > 1:
        raise ConfigError(f"model '{model.name}': a multi-vector model with more than one Dense module is not served")
    read = read_folder(folder.root, folder.modules, folder.max_length)
    return {"tasks": read.tasks, "prompts": read.prompts, "similarity": read.similarity,
            "projection": read.projection, "normalize": read.normalize}


def is_multivector(folder: Path, modules: dict[str, str], config: dict) -> bool:
    """Whether the folder is a multi-vector model in one of the layouts read here."""
    return ("MultiVectorMask" in modules or _json(folder / "config_sentence_transformers.json").get(
        "model_type") == "ColBERT" or "HF_ColBERT" in (config.get("architectures") or []))


def read_folder(folder: Path, modules: dict[str, str], max_length: int) -> MultiVectorFolder:
    """The folder's settings, lengths kept within the model's `max_length`."""
    name = folder.name
    transformer_dir = folder / modules.get("Transformer", "")
    _refuse_unserved(name, folder, modules)
    knobs = _settings(folder, modules, transformer_dir)
    tokenizer = Tokenizer.from_file(str(transformer_dir / "tokenizer.json"))
    skip_ids = sorted({i for i in (tokenizer.token_to_id(w) for w in knobs.skiplist_words) if i is not None})
    markers = _markers(tokenizer, [knobs.query_prompt, knobs.document_prompt]) if knobs.legacy else []

    def encoding(task: str, length: int | None) -> TaskEncoding:
        return TaskEncoding(max_length=min(length, max_length) if length else None,
                            skip_ids=skip_ids if task in knobs.skiplist_tasks else [], markers=markers)

    query = encoding("query", knobs.query_length)
    if knobs.query_expansion:
        query = _expanded(name, query, knobs.query_expansion, transformer_dir, tokenizer, max_length)
    if knobs.similarity not in SIMILARITIES:
        raise ConfigError(f"model '{name}': similarity {knobs.similarity!r} is not served "
                          f"(only {', '.join(SIMILARITIES)})")
    projection = (str(folder / modules["Dense"]) if "Dense" in modules
                  else str(folder) if knobs.inline_projection else None)
    return MultiVectorFolder({"query": query, "document": encoding("document", knobs.document_length)},
                             {"query": knobs.query_prompt, "document": knobs.document_prompt},
                             knobs.similarity, projection, "Normalize" in modules or knobs.legacy)


@dataclass(frozen=True)
class _Settings:
    query_prompt: str
    document_prompt: str
    query_length: int | None
    document_length: int | None
    query_expansion: dict | None
    skiplist_words: list[str]
    skiplist_tasks: list[str]
    similarity: str
    legacy: bool  # PyLate's or Stanford's layout: normalised, prompt markers kept whole
    inline_projection: bool  # the projection is among the model's own weights (Stanford)


def _settings(folder: Path, modules: dict[str, str], transformer_dir: Path) -> _Settings:
    top = _json(folder / "config_sentence_transformers.json")
    if "HF_ColBERT" in (_json(transformer_dir / "config.json").get("architectures") or []):
        # Stanford ColBERT: markers as prompts, queries always expanded with [MASK].
        metadata = _json(folder / "artifact.metadata")
        return _Settings(
            query_prompt=(metadata.get("query_token_id") or "[unused0]") + " ",
            document_prompt=(metadata.get("doc_token_id") or "[unused1]") + " ",
            query_length=None, document_length=metadata.get("doc_maxlen"),
            query_expansion={"strategy": "fixed", "attend": bool(metadata.get("attend_to_mask_tokens")),
                             "length": metadata.get("query_maxlen") or CLASSIC_QUERY_LENGTH},
            skiplist_words=list(string.punctuation) if metadata.get("mask_punctuation", True) else [],
            skiplist_tasks=["document"], similarity="maxsim", legacy=True, inline_projection=True)
    if top.get("model_type") == "ColBERT":
        # PyLate before sentence-transformers: prefixes, lengths and expansion at the top level.
        prompts = top.get("prompts") or {}
        query_prefix, document_prefix = top.get("query_prefix") or "", top.get("document_prefix") or ""
        expansion = top.get("query_expansion") if "query_expansion" in top else (
            None if top.get("do_query_expansion") is False else
            {"strategy": "fixed", "attend": bool(top.get("attend_to_expansion_tokens")),
             "length": top.get("query_length") or CLASSIC_QUERY_LENGTH})
        skiplist = top.get("skiplist_words")
        return _Settings(
            query_prompt=query_prefix + (prompts.get("query") or "").removeprefix(query_prefix),
            document_prompt=document_prefix + (prompts.get("document") or "").removeprefix(document_prefix),
            query_length=top.get("query_length") if "query_expansion" in top or expansion is None else None,
            document_length=top.get("document_length"), query_expansion=expansion,
            skiplist_words=list(string.punctuation) if skiplist is None else skiplist, skiplist_tasks=["document"],
            # Only MaxSim's names are taken from a PyLate folder, as sentence-transformers takes them.
            similarity=top.get("similarity_fn_name") if top.get("similarity_fn_name") in SIMILARITIES else "maxsim",
            legacy=True, inline_projection=False)
    transformer = _json(transformer_dir / "sentence_bert_config.json")
    prompts = {key: value for key, value in (top.get("prompts") or {}).items() if value}
    default = prompts.get(top.get("default_prompt_name") or "", "")
    mask = _json(folder / modules["MultiVectorMask"] / "config.json") if "MultiVectorMask" in modules else {}
    tasks = mask.get("skiplist_tasks") or ["document"]
    return _Settings(
        query_prompt=prompts.get("query", default),
        document_prompt=next((prompts[key] for key in DOCUMENT_PROMPTS if key in prompts), default),
        query_length=transformer.get("query_length"), document_length=transformer.get("document_length"),
        query_expansion=transformer.get("query_expansion"), skiplist_words=mask.get("skiplist_words") or [],
        skiplist_tasks=[tasks] if isinstance(tasks, str) else list(tasks),
        similarity=top.get("similarity_fn_name") or "maxsim", legacy=False, inline_projection=False)


def _expanded(name: str, query: TaskEncoding, expansion: dict, transformer_dir: Path, tokenizer: Tokenizer,
              max_length: int) -> TaskEncoding:
    """The query side with ColBERT's expansion: "fixed" makes every query exactly `length`
    tokens (cut or filled), "min" fills shorter ones only."""
    length = min(int(expansion["length"]), max_length)
    token = expansion.get("token") or special_token(transformer_dir, "mask_token") or special_token(
        transformer_dir, "eos_token")
    token_id = tokenizer.token_to_id(token) if token else None
    if token_id is None:
        raise ConfigError(f"model '{name}': query expansion token {token!r} is not in the tokenizer's vocabulary")
    if expansion.get("strategy") == "fixed":
        cut = length
    elif expansion.get("strategy") == "min":
        cut = max(query.max_length, length) if query.max_length else None
    else:
        raise ConfigError(f"model '{name}': query expansion strategy {expansion.get('strategy')!r} is not served")
    return TaskEncoding(max_length=cut, expand_to=length, expansion_id=token_id,
                        attend_expansion=bool(expansion.get("attend", False)), skip_ids=query.skip_ids,
                        markers=query.markers)


def _markers(tokenizer: Tokenizer, prompts: list[str]) -> list[str]:
    """The prompt markers of a legacy folder that must stay one token: those the vocabulary
    has (the whole prompt, or its first word) but that text would split (Stanford's
    `[unused0]`) or, normalised, not match (PyLate's `[Q] `), as they were inserted as
    tokens in training."""
    vocabulary = tokenizer.get_vocab(with_added_tokens=True)
    markers = []
    for prompt in prompts:
        for candidate in (prompt, *prompt.split(None, 1)[:1]):
            if candidate and candidate in vocabulary:
                if tokenizer.encode(candidate, add_special_tokens=False).tokens != [candidate]:
                    markers.append(candidate)
                break
    return markers


def _refuse_unserved(name: str, folder: Path, modules: dict[str, str]) -> None:
    """An allowlist of token ids (image-document models) and a projection with an
    activation are not served."""
    if "MultiVectorMask" in modules and _json(folder / modules["MultiVectorMask"] / "config.json").get(
            "keep_only_token_ids"):
        raise ConfigError(f"model '{name}': an allowlist of token ids (keep_only_token_ids) is not served yet")
    if "Dense" in modules:
        activation = _json(folder / modules["Dense"] / "config.json").get("activation_function", "Identity")
        if not activation.endswith("Identity"):
            raise ConfigError(f"model '{name}': a projection with an activation ({activation}) is not served yet")


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
