"""Encoders of realistic size with random weights, for speed (which does not depend on the
values): BERT-base and XLM-RoBERTa-base shapes (12 layers, 768 wide, 3072 in the feed
forward), ModernBERT-base's (gte-modernbert-base, modernbert-embed-base), and null models (one layer 32 wide; no layer, 768 wide) whose inference costs
next to nothing, so that a server's figures on them measure the serving path alone. Each is a plain
transformers folder (our server and sentence-transformers pool it by the mean) with the
packaged model's WordPiece tokenizer, built once under bench/out/models/.

Usage: .venv/bin/python -m bench.base_models [NAME ...]   (prints each folder; default all)
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from infinity.folders.resolve import packaged_model_folder

MODELS_DIR = Path(__file__).resolve().parent / "out" / "models"
SHAPES = {
    "bert-base": ("bert", {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                           "intermediate_size": 3072}),
    # XLM-RoBERTa-base's own vocabulary is 250002 tokens; the WordPiece one is used here, which
    # changes the size of the embedding table, not the work per token. Its pad id is 1, as in
    # the real models: positions count from the pad id, and CTranslate2's conversion follows
    # that only for 1 (with 0, its vectors and torch's differ). Id 1 is a WordPiece token no
    # text yields; a client's padding with the tokenizer's [PAD] (0) is masked all the same.
    "xlm-roberta-base": ("xlm-roberta", {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                                         "intermediate_size": 3072, "pad_token_id": 1, "bos_token_id": 101,
                                         "eos_token_id": 102}),
    # all-mpnet-base-v2's shape: a family the torch engine runs padded (no padding-free pass).
    "mpnet-base": ("mpnet", {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                             "intermediate_size": 3072, "pad_token_id": 1, "bos_token_id": 101,
                             "eos_token_id": 102}),
    # ModernBERT-base's shape (transformers' ModernBertConfig defaults, as gte-modernbert-base
    # and modernbert-embed-base publish it): 22 layers, 768 wide, a gated feed forward of
    # 1152, rotary positions, every third layer global and the others attending 64 tokens
    # each side. Its own vocabulary is 50368 tokens; with the WordPiece one, its special
    # tokens are WordPiece's.
    "modernbert-base": ("modernbert", {"hidden_size": 768, "num_hidden_layers": 22, "num_attention_heads": 12,
                                       "intermediate_size": 1152, "global_attn_every_n_layers": 3,
                                       "local_attention": 128, "max_position_embeddings": 8192, "pad_token_id": 0,
                                       "cls_token_id": 101, "bos_token_id": 101, "sep_token_id": 102,
                                       "eos_token_id": 102}),
    "null": ("bert", {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 32}),
    # The null model at BERT-base's width (no layers: its embeddings, pooled): answers the size
    # of a real model's, for what encoding them costs the serving path.
    "null-768": ("bert", {"hidden_size": 768, "num_hidden_layers": 0, "num_attention_heads": 1,
                          "intermediate_size": 32}),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def build(name: str) -> Path:
    """The folder of model `name` (a key of `SHAPES`), built on first use."""
    import torch
    from transformers import AutoConfig, AutoModel

    folder = MODELS_DIR / name
    if (folder / "config.json").is_file():
        return folder
    family, shape = SHAPES[name]
    source = packaged_model_folder()
    config = AutoConfig.for_model(family, **{"vocab_size": 30522, "max_position_embeddings": 514, **shape})
    torch.manual_seed(0)
    staging = folder.with_name(f".{name}-building")
    shutil.rmtree(staging, ignore_errors=True)
    AutoModel.from_config(config).save_pretrained(staging)
    for file in _TOKENIZER_FILES:
        if (source / file).is_file():
            shutil.copy(source / file, staging / file)
    staging.rename(folder)
    return folder


if __name__ == "__main__":
    for model_name in sys.argv[1:] or SHAPES:
        print(build(model_name))
