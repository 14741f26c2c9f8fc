"""Plain ASCII texts past the BERT normalizer (workers/preprocess/plain_ascii.py): the same
ids as the tokenizer's own path, on the packaged all-MiniLM-L6-v2 tokenizer, and its own
path wherever the shortcut does not hold."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, normalizers

from infinity.folders.resolve import packaged_model_folder
from workers.inference.corpus import sentences
from workers.preprocess.plain_ascii import PlainAscii


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(packaged_model_folder() / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(32)
    return tokenizer


def _same_as_the_tokenizer(tokenizer: Tokenizer, texts: list[str]) -> None:
    shortcut = PlainAscii.of(tokenizer)
    assert shortcut is not None
    fast = shortcut.encode_batch(texts)
    assert fast is not None
    own = tokenizer.encode_batch_fast(texts)
    assert [e.ids for e in fast] == [e.ids for e in own]
    assert [e.type_ids for e in fast] == [e.type_ids for e in own]
    # What the truncation left over: the server reads it to report cut inputs.
    assert [len(e.overflowing) for e in fast] == [len(e.overflowing) for e in own]


def test_corpus_texts_get_the_tokenizers_ids(tokenizer: Tokenizer) -> None:
    _same_as_the_tokenizer(tokenizer, sentences(300, 0))


def test_every_ascii_character_gets_the_tokenizers_ids(tokenizer: Tokenizer) -> None:
    """Control characters dropped, tab and line breaks made spaces, upper case lowered:
    each of the 128 inside a word, beside punctuation and between words."""
    texts = [f"Word{chr(code)}Next, then{chr(code)} MORE{chr(code)}." for code in range(128) if chr(code) != "["]
    _same_as_the_tokenizer(tokenizer, texts)


def test_random_ascii_gets_the_tokenizers_ids(tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    alphabet = [chr(code) for code in range(128) if chr(code) != "["] + list("aeiou  ") * 8
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 120))) for _ in range(300)]
    _same_as_the_tokenizer(tokenizer, texts)


def test_texts_the_shortcut_does_not_hold_go_the_tokenizers_own_way(tokenizer: Tokenizer) -> None:
    shortcut = PlainAscii.of(tokenizer)
    assert shortcut is not None
    assert shortcut.encode_batch(["plain", "café au lait"]) is None  # not ASCII
    # A special token in the text is matched as the tokenizer matches it, before lower-casing.
    assert shortcut.encode_batch(["plain", "one [SEP] two"]) is None
    assert shortcut.encode_batch(["plain", "just text"]) is not None


def test_only_a_bert_normalizer_has_the_shortcut(tokenizer: Tokenizer) -> None:
    other = Tokenizer.from_str(tokenizer.to_str())
    other.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    assert PlainAscii.of(other) is None
    other.normalizer = None
    assert PlainAscii.of(other) is None
