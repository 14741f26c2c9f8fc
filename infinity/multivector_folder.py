"""What a sentence-transformers MultiVectorEncoder folder says about encoding queries and
documents: each task's prompt, maximum length, query expansion and skipped tokens, and
how a query is scored against a document, read into `TaskEncoding`s the way
MultiVectorEncoder's `encode_query` / `encode_document` apply them. What such a folder
may ask that is not served is refused here, at start, rather than served wrong."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from infinity.config import ConfigError
from infinity.shared.protocol import TaskEncoding

SIMILARITIES = ("maxsim", "meanmaxsim")  # meanmaxsim: MaxSim divided by the query's token count
# The prompt `encode_document` takes, the first of these the folder has.
DOCUMENT_PROMPTS = ("document", "passage", "corpus")


def read_tasks(folder: Path, modules: dict[str, str], max_length: int) -> tuple[dict[str, TaskEncoding], str]:
    """The folder's encoding of "query" and "document" inputs (lengths within the model's
    `max_length`), and its similarity ("maxsim" or "meanmaxsim")."""
    name = folder.name
    transformer_dir = folder / modules.get("Transformer", "")
    settings = _json(transformer_dir / "sentence_bert_config.json")
    top = _json(folder / "config_sentence_transformers.json")
    _refuse_unserved(name, folder, modules)
    tokenizer = Tokenizer.from_file(str(transformer_dir / "tokenizer.json"))
    prompts = {key: value for key, value in (top.get("prompts") or {}).items() if value}
    default = prompts.get(top.get("default_prompt_name") or "", "")
    skip_ids, skip_tasks = _skiplist(folder, modules, tokenizer)

    def encoding(task: str, prompt: str, length: int | None) -> TaskEncoding:
        return TaskEncoding(prompt=prompt, max_length=min(length, max_length) if length else None,
                            skip_ids=skip_ids if task in skip_tasks else [])

    query = encoding("query", prompts.get("query", default), settings.get("query_length"))
    expansion = settings.get("query_expansion")
    if expansion:
        query = _expanded(name, query, expansion, transformer_dir, tokenizer, max_length)
    document_prompt = next((prompts[key] for key in DOCUMENT_PROMPTS if key in prompts), default)
    document = encoding("document", document_prompt, settings.get("document_length"))
    similarity = top.get("similarity_fn_name") or "maxsim"
    if similarity not in SIMILARITIES:
        raise ConfigError(f"model '{name}': similarity {similarity!r} is not served (only {', '.join(SIMILARITIES)})")
    return {"query": query, "document": document}, similarity


def _expanded(name: str, query: TaskEncoding, expansion: dict, transformer_dir: Path, tokenizer: Tokenizer,
              max_length: int) -> TaskEncoding:
    """The query side with ColBERT's expansion: "fixed" makes every query exactly `length`
    tokens (cut or filled), "min" fills shorter ones only."""
    length = min(int(expansion["length"]), max_length)
    token = expansion.get("token") or _special_token(transformer_dir, "mask_token") or _special_token(
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
    return TaskEncoding(prompt=query.prompt, max_length=cut, expand_to=length, expansion_id=token_id,
                        attend_expansion=bool(expansion.get("attend", False)), skip_ids=query.skip_ids)


def _skiplist(folder: Path, modules: dict[str, str], tokenizer: Tokenizer) -> tuple[list[int], list[str]]:
    """The token ids whose states are left out, and the tasks that leave them out. A word
    that is not one token of the vocabulary is dropped, as sentence-transformers drops it
    (else every unknown token would be left out)."""
    if "MultiVectorMask" not in modules:
        return [], []
    mask = _json(folder / modules["MultiVectorMask"] / "config.json")
    ids = [tokenizer.token_to_id(word) for word in mask.get("skiplist_words") or []]
    tasks = mask.get("skiplist_tasks") or ["document"]
    return sorted({i for i in ids if i is not None}), [tasks] if isinstance(tasks, str) else list(tasks)


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


def _special_token(transformer_dir: Path, key: str) -> str | None:
    """A special token named in tokenizer_config.json (a string, or an object holding it)."""
    value = _json(transformer_dir / "tokenizer_config.json").get(key)
    return value.get("content") if isinstance(value, dict) else value


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
