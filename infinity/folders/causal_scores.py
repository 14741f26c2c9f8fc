"""Rerankers that are causal language models (Qwen3-Reranker): a query-document pair is
read through a prompt template, and its relevance logit is the logit of a true token
("yes") less that of a false one ("no") at the pair's last token
(`ModelSpec.score_tokens`, `ModelSpec.pair_template`). Two layouts are read:

- sentence-transformers' CrossEncoder over a text-generation Transformer and LogitScore:
  the tokens are LogitScore's; the template is the folder's chat template, rendered as the
  library renders a pair (a message of role "query", then one of role "document", with the
  Transformer's chat_template arguments) once at load, with stand-ins for the two texts,
  and split around them;
- a plain transformers folder (a `*ForCausalLM`, no modules.json) whose declared name
  (`infinity.folders.prompts.declared_name`) is one of a family in `FAMILY_TEMPLATES`: the
  template and tokens its model card prescribes.

A causal language model of neither layout is no reranker: the encoder reader refuses it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from infinity.config import ConfigError, ModelConfig
from infinity.folders import ModelFolder
from infinity.folders.modules import transformer_refusal
from infinity.folders.prompts import declared_name
from infinity.shared.folders import causal_lm
from infinity.shared.protocol import PairTemplate

# Qwen3-Reranker's model card: its system prompt, its pair with the instruction for web
# search (the card's default), and the empty reasoning block before the answer.
QWEN3_RERANKER = PairTemplate(
    prefix=("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
            "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
            "<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n<Query>: "),
    infix="\n<Document>: ",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
)


@dataclass(frozen=True)
class RerankerFamily:
    """A family of causal rerankers published as plain transformers folders: the template
    and the true and false tokens (vocabulary entries) its model card prescribes, for
    folders of one of its `names` (a regular expression, matched whole, case aside)."""

    family: str
    names: str
    template: PairTemplate
    true_token: str
    false_token: str

    def matches(self, name: str) -> bool:
        return re.fullmatch(self.names, name, re.IGNORECASE) is not None


# mxbai-rerank-v2 and bge-reranker-v2-gemma score by token logits too, but cut the query
# and the document each to its own length (mxbai) or score one token's logit alone with a
# template whose suffix is plain text (bge-gemma): not served by this table yet.
FAMILY_TEMPLATES = (
    RerankerFamily("Qwen3-Reranker", r"qwen3-reranker-(0\.6b|4b|8b)", QWEN3_RERANKER, "yes", "no"),
)

# Stand-ins for the query and the document when a chat template is rendered; two sets,
# so that a template that changes the texts (or depends on them) is found out.
_STAND_INS = (("\u2063QUERY-7e1f\u2063", "\u2063DOCUMENT-7e1f\u2063"), ("\u2063Q-91ac\u2063", "\u2063D-91ac\u2063"))
# apply_chat_template arguments that size or tokenize rather than render: the server sizes.
_SIZE_ARGUMENTS = {"max_length", "truncation", "padding", "return_tensors", "tokenize", "return_dict"}


def family(folder: ModelFolder) -> RerankerFamily | None:
    """The family of a plain causal language model's folder, by its declared name."""
    name = declared_name(folder.root)
    return next((f for f in FAMILY_TEMPLATES if f.matches(name)), None)


def detect(folder: ModelFolder) -> str | None:
    """"rerank" for a causal language model with LogitScore, or of a known family."""
    if not causal_lm(folder.config):
        return None
    if folder.count("LogitScore") or (not folder.declared and family(folder) is not None):
        return "rerank"
    return None


def settings(model: ModelConfig, folder: ModelFolder) -> dict:
    """The `score_tokens` and `pair_template` of a causal reranker's spec."""
    tokenizer = _tokenizer(model, folder)
    if folder.count("LogitScore"):
        return _logit_score_settings(model, folder, tokenizer)
    found = family(folder) if not folder.declared else None
    if found is None:
        raise ConfigError(f"model '{model.name}': {folder.transformer} holds a causal language model that is no "
                          f"known reranker (known: {', '.join(f.family for f in FAMILY_TEMPLATES)}; or "
                          "sentence-transformers' CrossEncoder with LogitScore)")
    tokens = tuple(_token_id(model, tokenizer, token, "the family's") for token in (found.true_token,
                                                                                   found.false_token))
    _check_template(model, folder, tokenizer, found.template, "its family's template")
    return {"score_tokens": tokens, "pair_template": found.template}


def _logit_score_settings(model: ModelConfig, folder: ModelFolder, tokenizer) -> dict:  # noqa: ANN001
    names = tuple(module.name for module in folder.declared)
    if names != ("Transformer", "LogitScore"):
        raise ConfigError(f"model '{model.name}': modules {', '.join(names)}: a LogitScore reranker is served as a "
                          "Transformer then LogitScore")
    path = folder.transformer / "sentence_bert_config.json"
    settings = json.loads(path.read_text()) if path.is_file() else {}
    refused = transformer_refusal(settings, "text-generation")
    if refused is not None:
        raise ConfigError(f"model '{model.name}': {refused}")
    score = next(module for module in folder.declared if module.name == "LogitScore").config()
    if score.get("module_input_name", "causal_logits") != settings.get("module_output_name", "causal_logits"):
        raise ConfigError(f"model '{model.name}': LogitScore module_input_name {score['module_input_name']!r} is not "
                          "the Transformer's output")
    tokens = [score.get("true_token_id"), score.get("false_token_id")]
    if not isinstance(tokens[0], int):
        raise ConfigError(f"model '{model.name}': LogitScore true_token_id {tokens[0]!r} is not a token id")
    message = (settings.get("modality_config") or {}).get("message")
    if message is None:
        raise ConfigError(f"model '{model.name}': its Transformer has no chat template (modality_config has no "
                          "message), so its pairs are read as plain text pairs; only chat-template rerankers are "
                          "served")
    template = _rendered_template(model, tokenizer, message.get("format", "structured"),
                                  dict((settings.get("processing_kwargs") or {}).get("chat_template") or {}))
    _check_template(model, folder, tokenizer, template, "its chat template")
    return {"score_tokens": tuple(t for t in tokens if t is not None), "pair_template": template}


def _tokenizer(model: ModelConfig, folder: ModelFolder):  # noqa: ANN202 (transformers stays lazy)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder.transformer), trust_remote_code=model.trust_remote_code)


def _token_id(model: ModelConfig, tokenizer, token: str, whose: str) -> int:  # noqa: ANN001
    found = tokenizer.convert_tokens_to_ids(token)
    if found is None or found == tokenizer.unk_token_id:
        raise ConfigError(f"model '{model.name}': {whose} token {token!r} is not in its tokenizer's vocabulary")
    return int(found)


def _rendered_template(model: ModelConfig, tokenizer, message_format: str,  # noqa: ANN001
                       arguments: dict) -> PairTemplate:
    """The folder's chat template for one pair, as sentence-transformers renders it, split
    around the query and the document."""
    if arguments.pop("restore_suffix", True) is not True:
        raise ConfigError(f"model '{model.name}': processing_kwargs chat_template restore_suffix false is not served "
                          "(a long document is cut before the template's suffix)")
    sizing = sorted(_SIZE_ARGUMENTS & set(arguments))
    if sizing:
        raise ConfigError(f"model '{model.name}': processing_kwargs chat_template {', '.join(sizing)} is not served")

    def content(text: str) -> str | list[dict]:
        return text if message_format == "flat" else [{"type": "text", "text": text}]

    templates = set()
    for query, document in _STAND_INS:
        rendered = tokenizer.apply_chat_template(
            [{"role": "query", "content": content(query)}, {"role": "document", "content": content(document)}],
            tokenize=False, **arguments)
        if rendered.count(query) != 1 or rendered.count(document) != 1 or rendered.find(query) > rendered.find(
                document):
            raise ConfigError(f"model '{model.name}': its chat_template does not render a pair as a text holding the "
                              "query once, then the document once")
        prefix, rest = rendered.split(query)
        infix, suffix = rest.split(document)
        templates.add(PairTemplate(prefix, infix, suffix))
    if len(templates) != 1:
        raise ConfigError(f"model '{model.name}': its chat_template renders a pair differently by its texts")
    return templates.pop()


def _check_template(model: ModelConfig, folder: ModelFolder, tokenizer, template: PairTemplate,  # noqa: ANN001
                    whose: str) -> None:
    """The server cuts a long document before the suffix and tokenizes the suffix apart:
    that equals tokenizing the whole text only where the suffix starts with one of the
    tokenizer's added tokens (or is empty), which no text merges into. The template alone
    must leave room for a query and a document within max_length."""
    if template.suffix and not any(template.suffix.startswith(token) for token in tokenizer.get_added_vocab()):
        raise ConfigError(f"model '{model.name}': {whose} ends the pair with {template.suffix[:20]!r}, which does "
                          "not start with a special token; not served")
    used = len(tokenizer(template.prefix + template.infix + template.suffix, add_special_tokens=False)["input_ids"])
    if used >= folder.max_length:
        raise ConfigError(f"model '{model.name}': {whose} takes {used} tokens, no fewer than its max_length "
                          f"{folder.max_length}; raise max_length")
