"""Tiny random-weight models built at test time (no hub): a WordPiece tokenizer trained on
the fly and a small BERT encoder saved in transformers layout."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
         "boxing matches of jumbo sized vexing quartz sphinx numbers 0 1 2 3 4 5 6 7 8 9").split()


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                                         show_progress=False)
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tokenizer.train_from_iterator(corpus, trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tokenizer


def save_tiny_bert(folder: Path, seed: int = 0, max_positions: int = 64) -> Path:
    """A 2-layer BERT with hidden size 32 and its tokenizer, in transformers layout."""
    from transformers import BertConfig, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=max_positions,
                        pad_token_id=0)
    torch.manual_seed(seed)
    BertModel(config).eval().save_pretrained(folder)
    return folder
