"""The packaged default model as the tests know it (name, dimension, max length), the
reference its served vectors are held to (sentence-transformers on the same folder) and
how they are compared, and the deterministic sentences the parity tests send."""

from __future__ import annotations

import random

import numpy as np

MODEL_NAME = "all-MiniLM-L6-v2"
MAX_LENGTH = 256
DIM = 384
# Minimum cosine similarity between a served vector and the reference one.
MIN_COSINE = 0.99999
# How far apart two requests' float vectors of the same texts may be: the server may run
# them in other batches (other padding, other lanes) or a lone input on another runtime,
# whose sums round differently (a few 1e-7 seen). Bit-equal only where a test pins both.
SAME_TEXTS_ATOL = 1e-6
# The same for two requests' scores of the same inputs (a reranker's or a classifier's
# logits or probabilities, a sparse model's weights: not unit vectors; a few 1e-6 apart seen
# with a CPU hog beside).
SAME_SCORES_ATOL = 1e-5


def token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text, truncation=True, max_length=MAX_LENGTH)["input_ids"])


def reference_embed(model, texts: list[str]) -> np.ndarray:
    return np.asarray(model.encode(texts, normalize_embeddings=True, batch_size=32,
                                   convert_to_numpy=True), dtype=np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_close(served: np.ndarray, reference: np.ndarray, what: str = "") -> None:
    assert served.shape == reference.shape, f"{what}: shape {served.shape} != {reference.shape}"
    sim = cosine(served, reference)
    assert sim >= MIN_COSINE, f"{what}: cosine {sim:.7f} < {MIN_COSINE}"


def assert_same_vectors(first: np.ndarray, second: np.ndarray, what: str = "") -> None:
    """Two requests' vectors of the same texts agree within `SAME_TEXTS_ATOL`."""
    np.testing.assert_allclose(np.asarray(first, dtype=np.float32), np.asarray(second, dtype=np.float32),
                               atol=SAME_TEXTS_ATOL, rtol=0, err_msg=what)


def make_sentences(count: int = 240, seed: int = 1234) -> list[str]:
    """Deterministic sentences from one word to well over 256 tokens, with unicode,
    punctuation, numbers and mixed case."""
    rng = random.Random(seed)
    words = (
        "the quick brown fox jumps over lazy dog embedding server batch token vector "
        "model search query document ranking semantic similarity retrieval latency "
        "throughput process queue memory shared socket message Python Rust GPU CPU "
        "Zürich café naïve résumé façade Ångström São Paulo Kraków Straße "
        "東京 北京 数据 模型 日本語 한국어 Москва привет мир Ελλάδα γειά "
        "مرحبا שלום नमस्ते ☕ 🙂 🚀 ∑ ∞ ≈ π µs °C € £ ¥ "
        "don't it's e-mail state-of-the-art U.S.A. Dr. Mr. O'Neil "
        "42 3.14159 1,000,000 2024-06-01 12:30 -7 +15% 0xFF #hashtag @user "
        "https://example.com/path?q=1 foo_bar CamelCase ALLCAPS"
    ).split()
    punctuation = [".", ",", "!", "?", ";", ":", " -", " (see above)", "...", " —", "\"", "'"]
    fixed = [
        "hello",
        "a",
        "🙂",
        "東京",
        "42",
        "?!",
        "Hello, world!",
        "The café in Zürich serves crème brûlée for €4.50.",
        "   leading and trailing spaces   ",
        " ",  # whitespace only: just [CLS] [SEP]
        "\u00a0\u200b",  # no-break and zero-width spaces
        "ÀÉÎÕÜ àéîõü ÇçÑñ",  # accents the uncased tokenizer strips
        "\x00 control \x07 characters \x1f",
        "tabs\tand\nnewlines\r\nin one input",
        "A" * 300,
        " ".join(["word"] * 400),  # well over the 256-token limit
    ]
    out = list(fixed)
    while len(out) < count:
        bucket = rng.random()
        if bucket < 0.25:
            n = rng.randint(1, 4)
        elif bucket < 0.6:
            n = rng.randint(5, 30)
        elif bucket < 0.85:
            n = rng.randint(31, 150)
        else:
            n = rng.randint(200, 450)  # longer than max_length: truncated
        parts = []
        for _ in range(n):
            word = rng.choice(words)
            if rng.random() < 0.1:
                word = word.capitalize()
            if rng.random() < 0.12:
                word += rng.choice(punctuation)
            parts.append(word)
        out.append(" ".join(parts))
    return out


SENTENCES = make_sentences()
