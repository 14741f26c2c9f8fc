"""ModernBERT at test time: tiny random folders (an encoder saved by sentence-transformers
with its pooling, a cross-encoder) whose local-attention window is a few tokens, so that
test inputs run past it, with the WordPiece tokenizer of `tiny_models` saved as
ModernBERT's are (no token segments)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny_models import train_tokenizer

# ModernBERT-base attends locally over 128 tokens (64 each side) in two layers of three;
# here 8 (4 each side) in the middle layer of three: inputs of 10 tokens and more reach
# beyond it.
LOCAL_ATTENTION = 8
HIDDEN = 32


# The transformers class of each head a ModernBERT folder is saved with.
_HEADS = {"encoder": "ModernBertModel", "classifier": "ModernBertForSequenceClassification",
          "masked-lm": "ModernBertForMaskedLM"}


def save_tiny_modernbert(folder: Path, seed: int = 0, head: str = "encoder", num_labels: int = 1,
                         classifier_pooling: str = "cls") -> Path:
    """A 3-layer ModernBERT (global, local, global attention; hidden size 32) in
    transformers layout, with `head` (a key of `_HEADS`): a classifier has `num_labels`
    and pools by `classifier_pooling`. Random weights from `seed`, spread wider than
    ModernBERT's initialisation so that inputs' vectors differ by more than float
    rounding."""
    import transformers
    from transformers import ModernBertConfig, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]", model_max_length=128,
                            model_input_names=["input_ids", "attention_mask"]).save_pretrained(folder)
    special = {name: tokenizer.token_to_id(token) for name, token in
               (("pad_token_id", "[PAD]"), ("cls_token_id", "[CLS]"), ("bos_token_id", "[CLS]"),
                ("sep_token_id", "[SEP]"), ("eos_token_id", "[SEP]"))}
    config = ModernBertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=HIDDEN, intermediate_size=48,
                              num_hidden_layers=3, num_attention_heads=2, global_attn_every_n_layers=2,
                              local_attention=LOCAL_ATTENTION, max_position_embeddings=128, initializer_range=0.2,
                              classifier_pooling=classifier_pooling, num_labels=num_labels, **special)
    torch.manual_seed(seed)
    getattr(transformers, _HEADS[head])(config).eval().save_pretrained(folder)
    return folder


def save_tiny_modernbert_embedder(folder: Path, pooling: str, seed: int = 0) -> Path:
    """sentence-transformers' SentenceTransformer over `save_tiny_modernbert`'s encoder
    (Transformer -> Pooling of `pooling` -> Normalize), as gte-modernbert-base (cls) and
    modernbert-embed-base (mean) are published, saved by it."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    encoder = save_tiny_modernbert(folder.with_name(folder.name + "-encoder"), seed)
    SentenceTransformer(modules=[Transformer(str(encoder)), Pooling(HIDDEN, pooling), Normalize()]).save(str(folder))
    return folder
