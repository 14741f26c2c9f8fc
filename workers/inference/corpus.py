"""A deterministic corpus of English-like sentences of varied length: the texts of the
benchmarks, and of the inference processes' bfloat16 trial (workers/inference/precision.py).

Texts are built from a fixed vocabulary with a seeded ``random.Random``, so the
same ``(n, seed)`` always gives the same list, on any machine, with no download.
Each text is one or more grammatical-looking clauses and has between
``MIN_WORDS`` and ``MAX_WORDS`` words. Lengths are log-uniform, so short queries
and long passages both appear often (median around 25 words).

Usage: ``python -m workers.inference.corpus [N] [SEED]`` prints N texts, one per line.
"""

from __future__ import annotations

import math
import random
import sys

MIN_WORDS = 3
MAX_WORDS = 200


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_DETERMINERS = _words("the a this every our their one that some each")
_ADJECTIVES = _words(
    "quick quiet ancient bright careful distant early fragile gentle heavy honest large local "
    "modern narrow new old open patient private public rapid recent simple small steady "
    "strange strong sudden warm wild young curious digital empty famous frozen hidden "
    "northern remote silent tired useful vivid wooden yellow"
)
_NOUNS = _words(
    "river city teacher engine garden market report window village scientist bridge computer "
    "student forest museum kitchen library mountain doctor harbor train company network "
    "painter server farmer question journey letter model storm island council child machine "
    "recipe theory festival station customer lake highway manager dataset musician planet "
    "software hospital road camera winter signal neighbor factory orchestra process battery "
    "valley"
)
_VERBS = _words(
    "builds carries changes describes explains finds follows helps improves joins keeps "
    "leaves measures moves opens protects reaches repairs shows studies supports teaches "
    "tests visits watches writes answers collects designs feeds guides ignores loads notices "
    "observes paints predicts records sends sorts"
)
_ADVERBS = _words(
    "slowly quickly carefully quietly often rarely suddenly usually finally gladly barely "
    "mostly openly calmly eagerly nearly"
)
_PREPOSITIONS = _words(
    "near behind across inside beyond under over through along around before after without "
    "beside toward against between"
)
_CONNECTIVES = _words("and but because while although so when after until since")


def _noun_phrase(rng: random.Random) -> list[str]:
    words = [rng.choice(_DETERMINERS)]
    if rng.random() < 0.6:
        words.append(rng.choice(_ADJECTIVES))
    words.append(rng.choice(_NOUNS))
    if words[0] == "a" and words[1][0] in "aeiou":
        words[0] = "an"
    return words


def _clause(rng: random.Random) -> list[str]:
    words = _noun_phrase(rng)
    if rng.random() < 0.3:
        words.append(rng.choice(_ADVERBS))
    words.append(rng.choice(_VERBS))
    words += _noun_phrase(rng)
    if rng.random() < 0.5:
        words.append(rng.choice(_PREPOSITIONS))
        words += _noun_phrase(rng)
    return words


def _target_length(rng: random.Random) -> int:
    """Draw a word count, log-uniform on ``[MIN_WORDS, MAX_WORDS]``."""
    low, high = math.log(MIN_WORDS), math.log(MAX_WORDS + 1)
    return min(MAX_WORDS, int(math.exp(rng.uniform(low, high))))


def _text(rng: random.Random, length: int) -> str:
    """Build one text of exactly ``length`` words, split into capitalised sentences."""
    sentences: list[list[str]] = []
    total = 0
    while total < length:
        words = _clause(rng)
        while rng.random() < 0.35:
            words += [rng.choice(_CONNECTIVES), *_clause(rng)]
        sentences.append(words)
        total += len(words)
    # The last clause pushed ``total`` past ``length`` by less than its own size.
    sentences[-1] = sentences[-1][: len(sentences[-1]) - (total - length)]
    return " ".join(" ".join(s).capitalize() + "." for s in sentences)


def sentences(n: int, seed: int = 0) -> list[str]:
    """Return ``n`` deterministic texts of 3 to 200 words each for the given ``seed``."""
    if n < 0:
        raise ValueError("n must be >= 0")
    rng = random.Random(seed)
    return [_text(rng, _target_length(rng)) for _ in range(n)]


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    for line in sentences(count, int(sys.argv[2]) if len(sys.argv) > 2 else 0):
        print(line)
