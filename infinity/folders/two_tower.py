"""Two-tower model folders, a text tower beside a medium's: image-text (CLIP, SigLIP and
their relatives) and audio-text (CLAP). Which folders are one, and how their text must be
tokenized to give the model's own vectors. CLIP pools
its text at the tokenizer's end-of-text token, so a tokenizer that never emits the id the
model pools at would give every text the same vector: refused at start. SigLIP was
trained on texts padded to its full length and pools the last position, so its texts
are filled up to that length with the padding token (attended to as its tokenizer
says), whatever else is in the batch."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from infinity.config import ConfigError, ModelConfig
from infinity.folders import ModelFolder
from infinity.shared.folders import special_token
from infinity.shared.protocol import TaskEncoding

# Families with both towers in one folder, by config.json's model_type.
IMAGE_TEXT_FAMILIES = ("clip", "siglip", "siglip2", "chinese_clip")
# Families whose text is padded to the text tower's full length.
FULL_LENGTH_TEXT = ("siglip", "siglip2")
# CLIP's original checkpoints say 2 and pool at the highest token id (the end-of-text
# token of their vocabulary), which no tokenizer check can confirm.
LEGACY_CLIP_EOS = 2

# The sentence-transformers modules its folder may declare (infinity/folders/__init__.py).
MODULES = ("Transformer", "Normalize")


# Audio-text families, by config.json's model_type.
AUDIO_TEXT_FAMILIES = ("clap",)


def detect(folder: ModelFolder) -> str | None:
    return two_tower_kind(folder.config)


def settings(model: ModelConfig, folder: ModelFolder, kind: str) -> dict:
    """A two-tower model's text encoding (image-text models: `text_tasks`), after checking
    the folder is of `kind`."""
    if two_tower_kind(folder.config) != kind:
        families = IMAGE_TEXT_FAMILIES if kind == "image_text" else AUDIO_TEXT_FAMILIES
        raise ConfigError(f"model '{model.name}': kind = \"{kind}\" needs a two-tower folder "
                          f"({', '.join(families)}); {folder.transformer} is {folder.config.get('model_type')}")
    return ({"tasks": text_tasks(model.name, folder.transformer, folder.config, model.trust_remote_code)}
            if kind == "image_text" else {})


def is_image_text(config: dict) -> bool:
    return config.get("model_type") in IMAGE_TEXT_FAMILIES and "text_config" in config and "vision_config" in config


def is_audio_text(config: dict) -> bool:
    return config.get("model_type") in AUDIO_TEXT_FAMILIES and "text_config" in config and "audio_config" in config


def two_tower_kind(config: dict) -> str | None:
    """"image_text", "audio_text", or None for a folder that is neither."""
    return "image_text" if is_image_text(config) else "audio_text" if is_audio_text(config) else None


def text_tasks(name: str, folder: Path, config: dict, trust_remote_code: bool) -> dict[str, TaskEncoding]:
    """How the model's texts are encoded (as `TaskEncoding`s, for every task alike), after
    checking that its tokenizer gives the token its text tower pools at."""
    text_config = config["text_config"]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    if config["model_type"] == "clip":
        eos = text_config.get("eos_token_id", LEGACY_CLIP_EOS)
        if eos != LEGACY_CLIP_EOS and eos not in tokenizer.encode("a photo of a cat").ids:
            raise ConfigError(f"model '{name}': its text tower pools at token id {eos} (text_config.eos_token_id), "
                              "which its tokenizer never emits: every text would get the same vector; fix the "
                              "config or the tokenizer")
    if config["model_type"] not in FULL_LENGTH_TEXT:
        return {}
    pad = _pad_id(folder, tokenizer, text_config)
    full = TaskEncoding(max_length=text_config.get("max_position_embeddings", 64),
                        expand_to=text_config.get("max_position_embeddings", 64), expansion_id=pad,
                        attend_expansion=not _returns_attention_mask(folder, trust_remote_code))
    return {"query": full, "document": full}


def _pad_id(folder: Path, tokenizer: Tokenizer, text_config: dict) -> int:
    token = special_token(folder, "pad_token")
    pad = tokenizer.token_to_id(token) if token else None
    return pad if pad is not None else int(text_config.get("pad_token_id") or 0)


def _returns_attention_mask(folder: Path, trust_remote_code: bool) -> bool:
    """Whether the model's transformers tokenizer hands the model an attention mask (then
    padding is masked out of attention; SigLIP's sentencepiece tokenizer hands none, so
    its padding is attended to)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    return "attention_mask" in tokenizer.model_input_names
