"""Long inputs are tokenized from a bounded prefix that gives exactly the tokens of the
whole text: parity with tokenizing the whole text and truncating, over many shapes of long
input (whitespace runs, no spaces, multi-byte and combining characters), for three
tokenizer families (WordPiece as BERT's, byte-level BPE as RoBERTa's, Unigram as
XLM-RoBERTa's), single texts (a prompt before them too) and rerank pairs; and the bound on
what is read."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from infinity.config import ModelConfig
from infinity.folders.resolve import CHARS_PER_TOKEN_READ, resolve_model
from infinity.shared import protocol
from workers.preprocess.text import PREFIX_CHARS_PER_TOKEN, ModelTokenizer, model_tokenizer

WORDS = ("the quick brown fox jumps over a lazy dog embedding server token Zürich café naïve "
         "東京 北京 数据 Москва привет Ελλάδα مرحبا 🙂 🚀 don't e-mail 3.14 1,000 #tag @user "
         "https://example.com/a?b=1 CamelCase ALLCAPS straße ﬁle").split()


def _corpus() -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(300)]


def _byte_level_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return tokenizer


def _unigram() -> Tokenizer:
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.train_from_iterator(_corpus(), trainers.UnigramTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return tokenizer


def _spec(family: str, folder: Path, kind: str, max_length: int, long_inputs: str = "truncate") -> protocol.ModelSpec:
    base = resolve_model(ModelConfig(name="m"))  # the packaged model: WordPiece, BERT's normaliser
    if family != "wordpiece":
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer = _byte_level_bpe() if family == "bpe" else _unigram()
        tokenizer.save(str(folder / "tokenizer.json"))
        (folder / "config.json").write_text(json.dumps({"vocab_size": tokenizer.get_vocab_size()}))
        base = msgspec.structs.replace(base, path=str(folder))
    return msgspec.structs.replace(base, kind=kind, max_length=max_length, long_inputs=long_inputs,
                                   max_input_chars=CHARS_PER_TOKEN_READ * max_length)


def _whole_text_tokenizer(spec: protocol.ModelSpec) -> ModelTokenizer:
    """The same tokenizer, reading every input whole (no prefix is ever taken)."""
    tokenizer = ModelTokenizer(msgspec.structs.replace(spec, max_input_chars=10 ** 12))
    tokenizer._first_prefix = 10 ** 12
    return tokenizer


def long_text(rng: random.Random, chars: int) -> str:
    """About `chars` characters of one of many shapes of long input."""
    shape = rng.choice(["words", "whitespace runs", "no spaces", "endless word first", "cjk", "combining",
                        "punctuation", "lines"])
    parts: list[str] = []
    while sum(map(len, parts)) < chars:
        word = rng.choice(WORDS)
        if shape == "whitespace runs" and rng.random() < 0.05:
            parts.append(rng.choice([" ", "\t", "\n", "\u00a0", "\u3000"]) * rng.randint(50, 600))
        elif shape == "no spaces":
            parts.append(word)
            continue
        elif shape == "endless word first" and not parts:
            parts.append("x" * rng.randint(chars // 4, chars // 2))
        elif shape == "cjk":
            parts.append("".join(rng.choice("東京北京数据模型日本語한국어") for _ in range(rng.randint(5, 40))))
        elif shape == "combining":
            parts.append("".join(c + "\u0301\u0308" for c in word))
        elif shape == "punctuation":
            parts.append(rng.choice(["...", "!?", "--", "(", ")", "\"", "'"]) + word)
        elif shape == "lines":
            parts.append(word + rng.choice(["\n", "\r\n", "\n\n\n"]))
        else:
            parts.append(word)
        parts.append(" ")
    return "".join(parts)[:chars]


def _split(tokenized: protocol.Tokenized) -> list[list[int]]:
    ids = list(memoryview(tokenized.inputs.ids).cast("i"))
    out, start = [], 0
    for length in tokenized.inputs.lengths:
        out.append(ids[start:start + length])
        start += length
    return out


@pytest.mark.parametrize("family", ["wordpiece", "bpe", "unigram"])
@pytest.mark.parametrize("max_length", [16, 128])
def test_long_texts_give_the_ids_of_the_whole_text(tmp_path, family, max_length):
    spec = _spec(family, tmp_path / family, "embed", max_length)
    tokenizer = ModelTokenizer(spec)
    reference = Tokenizer.from_file(str(Path(spec.path) / "tokenizer.json"))
    reference.no_padding()
    reference.enable_truncation(max_length)
    rng = random.Random(max_length)
    first_prefix = PREFIX_CHARS_PER_TOKEN * max_length
    # From below the first prefix to the most that is read, and a few short ones.
    texts = [long_text(rng, rng.randint(first_prefix // 2, spec.max_input_chars)) for _ in range(60)]
    texts += ["short one", "two words"]
    answer = tokenizer.tokenize(protocol.Tokenize(1, "m", texts=texts))
    expected = reference.encode_batch(texts)
    for i, (ids, encoding) in enumerate(zip(_split(answer), expected)):
        assert ids == encoding.ids, f"text {i} ({len(texts[i])} chars): {texts[i][:80]!r}"
    assert answer.truncated == [i for i, e in enumerate(expected) if e.overflowing]


@pytest.mark.parametrize("family", ["wordpiece", "bpe", "unigram"])
def test_keep_last_gives_the_ids_of_a_tokenizer_cutting_on_the_left(tmp_path, family):
    """vLLM's truncate_prompt_tokens and TEI's truncation_direction Left: each text's last
    `keep` tokens, special tokens counted, as the tokenizer truncating on the left gives
    them; token ids keep their last `keep`."""
    spec = _spec(family, tmp_path / family, "embed", 128)
    tokenizer = ModelTokenizer(spec)
    rng = random.Random(7)
    texts = [long_text(rng, rng.randint(200, spec.max_input_chars)) for _ in range(30)] + ["short one"]
    for keep in (9, 128):
        reference = Tokenizer.from_file(str(Path(spec.path) / "tokenizer.json"))
        reference.no_padding()
        reference.enable_truncation(keep, direction="left")
        answer = tokenizer.tokenize(protocol.Tokenize(1, "m", texts=texts, keep_last=keep))
        expected = reference.encode_batch(texts)
        for i, (ids, encoding) in enumerate(zip(_split(answer), expected)):
            assert ids == encoding.ids, f"text {i} ({len(texts[i])} chars): {texts[i][-80:]!r}"
        assert answer.truncated == [i for i, e in enumerate(expected) if e.overflowing]
    sequences = [list(range(1, 40)), [5, 6]]
    answer = tokenizer.tokenize(protocol.Tokenize(1, "m", token_ids=sequences, keep_last=9))
    assert _split(answer) == [sequences[0][-9:], [5, 6]] and answer.truncated == [0]


@pytest.mark.parametrize("family", ["wordpiece", "bpe", "unigram"])
def test_a_prompt_goes_before_each_text_and_may_be_left_out_of_pooling(tmp_path, family):
    """The prompt's tokens, then the text's: those of the whole prompted text cut to
    max_length. Where the model's pooling leaves the prompt out, the head reads none of the
    tokens of the prompt tokenized alone (less the special token it ends with)."""
    spec = msgspec.structs.replace(_spec(family, tmp_path / family, "embed", 16), pools_prompt=False)
    reference = Tokenizer.from_file(str(Path(spec.path) / "tokenizer.json"))
    reference.no_padding()
    reference.enable_truncation(16)
    rng = random.Random(1)
    texts = [long_text(rng, rng.randint(50, spec.max_input_chars)) for _ in range(20)] + ["x"]
    prompt = "search query: "
    answer = ModelTokenizer(spec).tokenize(protocol.Tokenize(1, "m", texts=texts, prompt=prompt))
    expected = reference.encode_batch([prompt + text for text in texts])
    assert _split(answer) == [encoding.ids for encoding in expected]
    alone = reference.encode(prompt)
    prompt_tokens = len(alone.ids) - alone.special_tokens_mask[-1]
    read = np.frombuffer(answer.inputs.masks.read, np.int8).tolist()
    assert read == [int(i >= prompt_tokens) for encoding in expected for i in range(len(encoding.ids))]


@pytest.mark.parametrize("family", ["wordpiece", "bpe", "unigram"])
def test_cuts_that_end_right_after_the_tokens_kept_give_the_ids_of_the_whole_text(tmp_path, family):
    """Texts whose density of tokens puts token max_length near the end of a prefix, and
    shifted a character at a time: the cut runs through every position around it."""
    max_length = 16
    spec = _spec(family, tmp_path / family, "embed", max_length)
    tokenizer = ModelTokenizer(spec)
    reference = Tokenizer.from_file(str(Path(spec.path) / "tokenizer.json"))
    reference.no_padding()
    reference.enable_truncation(max_length)
    words = ["ab", "fox", "lazy", "quick", "brown!", "e-mail", "Zürich", "東京", "naïve,", "straße"]
    texts = [" " * shift + (word + " ") * (spec.max_input_chars // len(word)) for word in words for shift in range(8)]
    texts = [text[:spec.max_input_chars] for text in texts]
    answer = tokenizer.tokenize(protocol.Tokenize(1, "m", texts=texts))
    for i, (ids, encoding) in enumerate(zip(_split(answer), reference.encode_batch(texts))):
        assert ids == encoding.ids, f"text {i}: {texts[i][:60]!r}"


@pytest.mark.parametrize("family", ["wordpiece", "bpe", "unigram"])
def test_rerank_pairs_give_the_ids_of_the_whole_texts(tmp_path, family):
    max_length = 32
    spec = _spec(family, tmp_path / family, "rerank", max_length)
    tokenizer, whole = ModelTokenizer(spec), _whole_text_tokenizer(spec)
    rng = random.Random(7)
    cases = [
        ("a short query", [long_text(rng, rng.randint(100, spec.max_input_chars)) for _ in range(30)]),
        (long_text(rng, spec.max_input_chars - 10), ["short document", "two words here", "x"]),
    ]
    for query, documents in cases:
        request = protocol.Tokenize(1, "m", texts=documents, query=query)
        answer, expected = tokenizer.tokenize(request), whole.tokenize(request)
        assert _split(answer) == _split(expected)
        assert answer.inputs.type_ids == expected.inputs.type_ids
        assert answer.truncated == expected.truncated


def test_pairs_of_a_long_query_and_long_documents_keep_each_side_a_prefix(tmp_path):
    """Both sides cut: each keeps the first tokens of its whole text, the pair max_length
    tokens (which side keeps an odd last token is decided on what was read)."""
    spec = _spec("wordpiece", tmp_path, "rerank", 32)
    plain = Tokenizer.from_file(str(Path(spec.path) / "tokenizer.json"))
    plain.no_truncation()
    rng = random.Random(3)
    query, document = long_text(rng, 1500), long_text(rng, 1800)
    answer = ModelTokenizer(spec).tokenize(protocol.Tokenize(1, "m", texts=[document], query=query))
    (ids,) = _split(answer)
    assert len(ids) == 32 and answer.truncated == [0]
    query_ids = plain.encode(query, add_special_tokens=False).ids
    document_ids = plain.encode(document, add_special_tokens=False).ids
    first_sep = ids.index(ids[-1])
    assert ids[1:first_sep] == query_ids[:first_sep - 1]
    assert ids[first_sep + 1:-1] == document_ids[:len(ids) - first_sep - 2]


class _CountingTokenizer:
    """Stands in for a `tokenizers.Tokenizer`, counting the characters it is given."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.chars = 0

    def encode(self, text: str, **kwargs):
        self.chars += len(text)
        return self.inner.encode(text, **kwargs)

    def encode_batch_fast(self, texts: list[str], **kwargs):
        self.chars += sum(len(t[0]) + len(t[1]) if isinstance(t, tuple) else len(t) for t in texts)
        return self.inner.encode_batch_fast(texts, **kwargs)


@pytest.mark.parametrize("shape", ["x ", "x", " ", "東", "\u0301", "word " * 9 + "\n" * 5000])
def test_a_16_mib_input_is_read_only_up_to_a_bound(shape):
    spec = resolve_model(ModelConfig(name="m"))
    tokenizer = ModelTokenizer(spec)
    counters = [_CountingTokenizer(tokenizer._untruncated), _CountingTokenizer(tokenizer._tokenizer)]
    tokenizer._untruncated, tokenizer._tokenizer = counters
    text = (shape * (16 * 2 ** 20 // len(shape) + 1))[:16 * 2 ** 20]
    answer = tokenizer.tokenize(protocol.Tokenize(1, "m", texts=[text]))
    assert answer.truncated == [0] and answer.inputs.lengths[0] <= spec.max_length
    # Prefixes grow four-fold up to max_input_chars; then one last pass on what is kept.
    assert sum(c.chars for c in counters) <= 3 * spec.max_input_chars


def test_what_lies_beyond_the_characters_read_is_not_seen(tmp_path):
    spec = _spec("wordpiece", tmp_path, "embed", 16)
    tokenizer = ModelTokenizer(spec)
    hidden = " " * spec.max_input_chars + "hello world"
    answer = tokenizer.tokenize(protocol.Tokenize(1, "m", texts=[hidden, " " * 100 + "hello world"]))
    first, second = _split(answer)
    assert len(first) == 2 and len(second) == 4  # [CLS] [SEP], and [CLS] hello world [SEP]
    assert answer.truncated == [0]


def test_with_truncation_off_a_long_input_is_refused_without_reading_it_all(tmp_path):
    from workers.preprocess import InputError

    spec = _spec("wordpiece", tmp_path, "embed", 16, long_inputs="error")
    tokenizer = ModelTokenizer(spec)
    with pytest.raises(InputError, match=r"input\[1\] has more than \d+ tokens \(those of its first"):
        tokenizer.tokenize(protocol.Tokenize(1, "m", texts=["fine", "many words " * 10 ** 5]))
    with pytest.raises(InputError, match=rf"input\[0\] is longer than {spec.max_input_chars} characters"):
        tokenizer.tokenize(protocol.Tokenize(1, "m", texts=[" " * (spec.max_input_chars + 1) + "a"]))
    with pytest.raises(InputError, match=r"input\[0\] has 20 tokens, more than the maximum of 16"):
        tokenizer.tokenize(protocol.Tokenize(1, "m", texts=["word " * 18]))


def test_a_model_that_lower_cases_reads_its_prefixes_lower_cased(tmp_path):
    """sentence-transformers' do_lower_case: the prefix is found and tokenized lower-cased,
    as the whole text would be."""
    spec = msgspec.structs.replace(_spec("bpe", tmp_path / "bpe", "embed", 16), lowercase=True)
    tokenizer = ModelTokenizer(spec)
    reference = Tokenizer.from_file(str(Path(spec.path) / "tokenizer.json"))
    reference.no_padding()
    reference.enable_truncation(16)
    rng = random.Random(5)
    texts = [long_text(rng, rng.randint(200, spec.max_input_chars)).upper() for _ in range(20)]
    answer = tokenizer.tokenize(protocol.Tokenize(1, "m", texts=texts))
    expected = reference.encode_batch([text.lower() for text in texts])
    assert _split(answer) == [encoding.ids for encoding in expected]


def test_queries_and_documents_are_tokenized_each_their_own_way():
    """A model with tasks: the query's prompt and expansion up to its length with tokens
    the encoder does not attend to (not billed), the document's prompt, length and
    skipped tokens; a request without a task is the model's documents, prompt included."""
    tokenizer_base = resolve_model(ModelConfig(name="m"))
    vocab = Tokenizer.from_file(str(Path(tokenizer_base.path) / "tokenizer.json"))
    vocab.no_padding()
    mask_id, the_id = vocab.token_to_id("[MASK]"), vocab.token_to_id("the")
    tasks = {"query": protocol.TaskEncoding(max_length=8, expand_to=8, expansion_id=mask_id),
             "document": protocol.TaskEncoding(max_length=6, skip_ids=[the_id])}
    spec = msgspec.structs.replace(tokenizer_base, kind="multivector", tasks=tasks,
                                   prompts={"query": "query: ", "document": "passage: "})
    tokenizer = model_tokenizer(spec)

    answer = tokenizer.tokenize(protocol.Tokenize(1, "m", texts=["the fox"], task="query",
                                                  prompt=spec.prompt_for("query")))
    query = answer.inputs
    real = vocab.encode("query: the fox").ids
    assert list(np.frombuffer(query.ids, "<i4")) == real + [mask_id] * (8 - len(real))
    assert query.lengths == [8] and query.added == 8 - len(real)
    assert list(np.frombuffer(query.masks.attended, np.int8)) == [1] * len(real) + [0] * (8 - len(real))
    assert query.masks.read is None

    for task in ("document", None):
        answer = tokenizer.tokenize(protocol.Tokenize(2, "m", texts=["the fox and the dog ran"], task=task,
                                                      prompt=spec.prompt_for(task)))
        document = answer.inputs
        ids = vocab.encode("passage: the fox and the dog ran").ids
        cut = ids[:5] + ids[-1:]  # six tokens, [SEP] kept
        assert list(np.frombuffer(document.ids, "<i4")) == cut and answer.truncated == [0]
        assert document.masks.attended is None
        assert list(np.frombuffer(document.masks.read, np.int8)) == [int(i != the_id) for i in cut]
