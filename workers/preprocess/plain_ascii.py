"""Encoding plain ASCII texts past a BERT normalizer: the BERT family's tokenizers
(`BertNormalizer`: all-MiniLM, BGE, E5, GTE) spend about a third of a short text's encode
in it, looking each character up in Unicode tables. On ASCII text it only drops control
characters, turns tabs and line breaks into spaces and lower-cases, which two `str`
methods do; such texts are normalized so and encoded by a copy of the tokenizer without
its normalizer, to the same ids
(bench/results/serving-path.md#plain-ascii-texts-past-the-bert-normalizer).

A text that could hold an added token (a special token, a prompt marker) keeps the
tokenizer's own path: those are matched before normalizing, and a lower-cased `[CLS]`
would no longer be one.
"""

from __future__ import annotations

import json

from tokenizers import Encoding, Tokenizer

# What `BertNormalizer(clean_text=True)` does to ASCII: control characters dropped, tab,
# line feed and carriage return made spaces (checked against it for every ASCII character).
_CLEANED = str.maketrans({**{code: None for code in (*range(0, 9), 11, 12, *range(14, 32), 127)},
                          **{code: " " for code in (9, 10, 13)}})


class PlainAscii:
    """Encodes a batch of texts past `tokenizer`'s BERT normalizer where every one is plain
    ASCII; build it with `of`, after the tokenizer's truncation is set (it is copied)."""

    def __init__(self, bare: Tokenizer, clean: bool, lower: bool, added_starts: frozenset[str]) -> None:
        self._bare = bare
        self._clean = clean
        self._lower = lower
        self._added_starts = added_starts

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> PlainAscii | None:
        """The shortcut for `tokenizer`, or None where its normalizer is not BERT's alone."""
        serialized = tokenizer.to_str()
        normalizer = json.loads(serialized).get("normalizer") or {}
        if normalizer.get("type") != "BertNormalizer":
            return None
        bare = Tokenizer.from_str(serialized)
        bare.normalizer = None
        starts = {token.content[0] for token in tokenizer.get_added_tokens_decoder().values() if token.content}
        # Either case: a token is matched in the text as given, or (if normalized) lower-cased.
        added_starts = frozenset(starts | {start.lower() for start in starts} | {start.upper() for start in starts})
        return cls(bare, bool(normalizer.get("clean_text", True)), bool(normalizer.get("lowercase", True)),
                   added_starts)

    def encode_batch(self, texts: list[str]) -> list[Encoding] | None:
        """`texts` encoded as the tokenizer would (without offsets, as `encode_batch_fast`),
        or None unless every one is ASCII and holds no added token's first character."""
        starts = self._added_starts
        for text in texts:
            if not text.isascii() or any(start in text for start in starts):
                return None
        if self._clean:
            texts = [text.translate(_CLEANED) for text in texts]
        if self._lower:
            texts = [text.lower() for text in texts]
        return self._bare.encode_batch_fast(texts)
