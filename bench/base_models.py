"""Models of realistic size with random weights, for speed (which does not depend on the
values): BERT-base and XLM-RoBERTa-base shapes (12 layers, 768 wide, 3072 in the feed
forward), ModernBERT-base's (gte-modernbert-base, modernbert-embed-base), a decoder
embedder's (Qwen3-Embedding-0.6B), and null models (one layer 32 wide; no layer, 768
wide) whose inference costs next to nothing, so that a server's figures on them measure
the serving path alone. Each is a transformers folder with the packaged model's WordPiece
tokenizer, built once under bench/out/models/: the encoders plain (our server and
sentence-transformers pool them by the mean), the decoder with its sentence-transformers
modules (last-token pooling, normalised, prompts).

Usage: .venv/bin/python -m bench.base_models [NAME ...]   (prints each folder; default all)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from infinity.folders.resolve import packaged_model_folder

MODELS_DIR = Path(__file__).resolve().parent / "out" / "models"
SHAPES = {
    "bert-base": ("bert", {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                           "intermediate_size": 3072}),
    # BERT-large's shape (bge-large-en-v1.5, e5-large-v2, mxbai-embed-large-v1): 335M
    # parameters, above the size for which engines that run lanes keep a second copy.
    "bert-large": ("bert", {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                            "intermediate_size": 4096}),
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
    # Qwen3-Embedding-0.6B's shape: a 28-layer Qwen3 decoder 1024 wide, 16 query heads of
    # 128 sharing 8 key-value heads, a gated feed forward of 3072, with its
    # sentence-transformers modules (last-token pooling, normalised) and prompts, so that
    # sentence-transformers and infinity-emb load it as they load the real one. Its own
    # vocabulary is 151669 byte-level BPE tokens; with the WordPiece one (about as many
    # tokens per English text), a text's last token, which it pools, is [SEP].
    "qwen3-embedding-0.6b": ("qwen3", {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                                       "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
                                       "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                                       "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "pad_token_id": 0,
                                       "bos_token_id": None, "eos_token_id": 102}),
    "null": ("bert", {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 32}),
    # The null model at BERT-base's width (no layers: its embeddings, pooled): answers the size
    # of a real model's, for what encoding them costs the serving path.
    "null-768": ("bert", {"hidden_size": 768, "num_hidden_layers": 0, "num_attention_heads": 1,
                          "intermediate_size": 32}),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
# The decoder embedders' sentence-transformers modules and prompts (Qwen3-Embedding's query
# instruction, as its model card gives it), written under the names every
# sentence-transformers version reads (infinity-emb 0.0.78 pins one below 4).
_DECODER_PROMPTS = {"query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\n"
                             "Query:", "document": ""}
_SENTENCE_TRANSFORMERS_FILES = {
    "modules.json": [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                     {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                     {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}],
    "sentence_bert_config.json": {"max_seq_length": 512, "do_lower_case": False},
    "config_sentence_transformers.json": {"prompts": _DECODER_PROMPTS, "default_prompt_name": None,
                                          "similarity_fn_name": "cosine"},
    "1_Pooling/config.json": {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
                              "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
                              "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True,
                              "include_prompt": True},
}


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
    if family in _DECODER_FAMILIES:
        _write_sentence_transformers_modules(staging, config.hidden_size)
    staging.rename(folder)
    return folder


_DECODER_FAMILIES = ("qwen2", "qwen3")


def _write_sentence_transformers_modules(folder: Path, width: int) -> None:
    for name, content in _SENTENCE_TRANSFORMERS_FILES.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.startswith("1_Pooling"):
            content = {"word_embedding_dimension": width, **content}
        path.write_text(json.dumps(content, indent=2))
    (folder / "2_Normalize").mkdir(exist_ok=True)


if __name__ == "__main__":
    for model_name in sys.argv[1:] or SHAPES:
        print(build(model_name))
