"""Texts: turning request inputs into token ids (fast tokenizers, prompts, truncation, real
token counts), answering lookups (a text's tokens with their offsets, token ids decoded),
and, in the inference process, splitting a request's `TokenInputs` into its inputs and
padding a batch of them (`token_items`, `collate_tokens`).

Padding is never applied when tokenizing (a model's tokenizer.json may pad every input to
a fixed length, which makes the model several times slower on short inputs): the
inference process pads each batch to its own longest input.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
from tokenizers import AddedToken, Encoding, Tokenizer

from infinity.shared import protocol
from infinity.shared.protocol import ModelSpec
from workers.preprocess import InputError
from workers.preprocess.plain_ascii import PlainAscii

log = logging.getLogger(__name__)


# The first prefix tried for a long input: this many characters per token of max_length.
PREFIX_CHARS_PER_TOKEN = 6


def model_tokenizer(spec: ModelSpec) -> "ModelTokenizer | TaskTokenizer":
    """The tokenizer of a model: one that encodes queries and documents each their own way
    for a model with tasks (`ModelSpec.tasks`), else the plain one."""
    return TaskTokenizer(spec) if spec.tasks else ModelTokenizer(spec)


def load_tokenizer(spec: ModelSpec, markers: Sequence[str] = (), encoding: protocol.TaskEncoding | None = None
                   ) -> Tokenizer:
    """The model's fast tokenizer (or the one a task's `encoding` names, with or without
    its special tokens), without padding or truncation; `markers` kept whole."""
    folder = (encoding.tokenizer if encoding is not None else None) or spec.path
    path = Path(folder) / "tokenizer.json"
    if path.is_file() and not _sets_special_tokens(folder):
        tokenizer = Tokenizer.from_file(str(path))
    else:  # sentencepiece-only folders, or special tokens set beside tokenizer.json: transformers' reading
        tokenizer = _transformers_tokenizer(spec, folder)
    if encoding is not None and not encoding.special_tokens:
        tokenizer.post_processor = None
    tokenizer.no_padding()
    tokenizer.no_truncation()
    if markers:
        tokenizer.add_special_tokens([AddedToken(marker, normalized=False, special=True) for marker in markers])
    return tokenizer


# tokenizer_config.json keys with which transformers adds special tokens that tokenizer.json
# need not say (Llama's and Gemma's tokenizers rebuild their post-processor from them).
_SPECIAL_TOKEN_KEYS = ("add_bos_token", "add_eos_token")


def _sets_special_tokens(folder: str) -> bool:
    path = Path(folder) / "tokenizer_config.json"
    return path.is_file() and any(key in json.loads(path.read_text()) for key in _SPECIAL_TOKEN_KEYS)


def _transformers_tokenizer(spec: ModelSpec, folder: str) -> Tokenizer:
    """The fast tokenizer transformers builds from the folder, after checking that it
    encodes a text as transformers' own tokenizer does (which adds the special tokens
    `_SPECIAL_TOKEN_KEYS` ask); a folder where it does not is refused naming them."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(folder, use_fast=True, trust_remote_code=spec.trust_remote_code)
    probe = "probe text"
    if loaded.backend_tokenizer.encode(probe).ids != loaded(probe)["input_ids"]:
        raise ValueError(f"{folder}: transformers adds special tokens its fast tokenizer does not "
                         f"({', '.join(_SPECIAL_TOKEN_KEYS)} in tokenizer_config.json); not served")
    return loaded.backend_tokenizer


def _feeds_token_types(spec: ModelSpec) -> bool:
    """Whether the model's transformers tokenizer hands segment ids to the model (BERT's
    does; a generic fast tokenizer does not), so pairs are encoded as its authors trained."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
        return "token_type_ids" in tokenizer.model_input_names
    except Exception:  # no transformers tokenizer files: the tokenizer.json's segments stand
        return True


class ModelTokenizer:
    """Tokenizes the inputs of one model.

    The work per input is bounded by what the model can use: an input much longer than
    `max_length` tokens is tokenized from a prefix that is sure to hold its first
    `max_length` tokens, which are exactly those of the whole text (see `_readable`).
    """

    def __init__(self, spec: ModelSpec, encoding: protocol.TaskEncoding | None = None) -> None:
        """`encoding`: a task's (`ModelSpec.tasks`): the tokens a prompt starts with, kept
        whole (`TaskEncoding.markers`), and the task's own tokenizer where it has one."""
        self._spec = spec
        self._tokenizer = load_tokenizer(spec, encoding.markers if encoding is not None else (), encoding)
        config = json.loads((Path(spec.path) / "config.json").read_text())
        # A two-tower model's vocabulary is its text tower's.
        self._vocab_size = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
        # Pairs keep the query whole and cut the document, unless the query alone is too
        # long; then both sides are cut (longest first), as for single texts.
        self._pair_tokenizer = Tokenizer.from_str(self._tokenizer.to_str())
        # A reranker's pairs are known at start; a classifier's (TEI's /predict of a pair) are
        # rare, so whether they take segments is found at the first (it imports transformers).
        self._pair_segments: bool | None = (spec.pair_template is None and _feeds_token_types(spec)
                                            if spec.kind == "rerank" else None)
        self._untruncated = Tokenizer.from_str(self._tokenizer.to_str())
        # A causal reranker's pairs are read through its template (`_templated_pairs`).
        self._template = spec.pair_template
        self._suffix = None if self._template is None else self._untruncated.encode(self._template.suffix,
                                                                                    add_special_tokens=False)
        # Natural text holds max_length tokens in this many characters, most of the time.
        self._first_prefix = PREFIX_CHARS_PER_TOKEN * spec.max_length
        # Cut always: whether a long input is then kept cut, chunked or refused is the request's.
        self._tokenizer.enable_truncation(spec.max_length)
        self._pair_tokenizer.enable_truncation(spec.max_length, strategy="only_second")
        self._plain_ascii = PlainAscii.of(self._tokenizer)
        self._left_tokenizers: dict[int, Tokenizer] = {}  # by the count of last tokens they keep

    def tokenize(self, request: protocol.Tokenize) -> protocol.Tokenized | protocol.LookedUp:
        """`request`'s inputs made ready for the model: its texts (each after the request's
        prompt) or token ids; or, for a lookup, what the tokenizer makes of them."""
        if request.lookup:
            return self._look_up(request)
        long_inputs = request.long_inputs or self._spec.long_inputs
        type_ids = masks = chunks = None
        if request.query is not None:
            (query,), query_cut = self._readable([request.query])
            documents, cut = self._readable(request.texts or [])
            encodings = self._encode_pairs(query, documents)
            cut = [c or query_cut[0] for c in cut]
            if long_inputs == "chunk":
                budget = self._document_room(query)
                # Cohere's rule: a document is scored on its first max_chunks chunks.
                chunking = _Chunking(budget, self._overlap(request), self._max_chunks(request), refuse_beyond=False)
                encodings, truncated, chunks = self._chunked(
                    encodings, request.texts or [], cut, chunking, lambda spans: self._encode_pairs(query, spans))
            else:
                truncated = self._truncated(encodings, cut, long_inputs, request.texts or [],
                                            lambda document: self._pair_tokens(query, document))
            sequences = [e.ids for e in encodings]
            if self._pair_segments is None:
                self._pair_segments = self._template is None and _feeds_token_types(self._spec)
            if self._pair_segments:
                type_ids = np.fromiter(itertools.chain.from_iterable(e.type_ids for e in encodings),
                                       dtype=np.int8).tobytes()
        elif request.texts is not None and request.keep_last is not None:
            encodings = self._encode_last([self._cased(request.prompt + text[-self._spec.max_input_chars:])
                                           for text in request.texts], request.keep_last, request.special_tokens)
            sequences = [e.ids for e in encodings]
            truncated = [i for i, (e, text) in enumerate(zip(encodings, request.texts))
                         if e.overflowing or len(text) > self._spec.max_input_chars]
        elif request.texts is not None:
            texts, cut = self._readable(request.texts)
            prompt = self._cased(request.prompt)
            # What is read of a text holds its first max_length tokens: after a prompt too.
            encodings = self._encode([prompt + text for text in texts], request.special_tokens)
            if long_inputs == "chunk":
                budget = self._spec.max_length - self._tokenizer.num_special_tokens_to_add(False) - self._tokens(prompt)
                # A text to embed is refused beyond the model's cap; a document (its cap the request's), cut.
                chunking = _Chunking(budget, self._overlap(request), self._max_chunks(request),
                                     refuse_beyond=request.max_chunks is None)
                encodings, truncated, chunks = self._chunked(
                    encodings, request.texts, cut, chunking,
                    lambda spans: self._encode([prompt + span for span in spans]))
            else:
                truncated = self._truncated(encodings, cut, long_inputs, request.texts,
                                            lambda text: self._tokens(prompt + text, special_tokens=True))
            sequences = [e.ids for e in encodings]
            if request.prompt and not self._spec.pools_prompt:
                masks = _left_out(sequences, self._prompt_tokens(request.prompt))
        else:
            sequences, truncated, chunks = self._check_token_ids(request.token_ids or [], long_inputs, request)
        lengths = [len(s) for s in sequences]
        ids = np.fromiter(itertools.chain.from_iterable(sequences), dtype="<i4", count=sum(lengths))
        return protocol.Tokenized(request.request_id, protocol.TokenInputs(ids.tobytes(), lengths, type_ids, masks),
                                  truncated, chunks)

    def _encode(self, texts: list[str], special_tokens: bool = True) -> list[Encoding]:
        """`texts` cut to their first max_length tokens, past the BERT normalizer where they
        are plain ASCII (`PlainAscii`); without character offsets, which nothing here reads
        (`encode_batch_fast`: 15-20% less time); without the model's special tokens where
        `special_tokens` is false."""
        if not special_tokens:
            return self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        encodings = self._plain_ascii.encode_batch(texts) if self._plain_ascii is not None else None
        return self._tokenizer.encode_batch_fast(texts) if encodings is None else encodings

    def _encode_last(self, texts: list[str], keep: int, special_tokens: bool) -> list[Encoding]:
        """`texts` cut at their start to their last `keep` tokens, special tokens counted
        (what a tokenizer truncating on the left gives; one per count asked, kept)."""
        tokenizer = self._left_tokenizers.get(keep)
        if tokenizer is None:
            tokenizer = Tokenizer.from_str(self._untruncated.to_str())
            tokenizer.enable_truncation(keep, direction="left")
            self._left_tokenizers[keep] = tokenizer
        return tokenizer.encode_batch_fast(texts, add_special_tokens=special_tokens)

    def _overlap(self, request: protocol.Tokenize) -> int:
        return self._spec.chunk_overlap if request.chunk_overlap is None else request.chunk_overlap

    def _max_chunks(self, request: protocol.Tokenize) -> int:
        return request.max_chunks or self._spec.max_chunks_per_input

    def _tokens(self, text: str, pair: str | None = None, special_tokens: bool = False) -> int:
        """How many tokens `text` (and `pair` beside it) makes, whole; with or without the
        special tokens the model adds."""
        return len(self._untruncated.encode(text, pair, add_special_tokens=special_tokens).ids)

    def _chunked(self, encodings: list[Encoding], texts: list[str], cut: list[bool], chunking: "_Chunking",
                 encode: Callable[[list[str]], list[Encoding]]) -> tuple[list[Encoding], list[int], list[int] | None]:
        """(`encodings` with each input longer than the model replaced by its chunks', the
        positions of the inputs cut, how many encodings each input became; None: one each).

        A chunk is a span of the text's characters (`_windows`: `chunking.budget` tokens at
        most, cut between words where a word fits) encoded as any input is, by `encode`: so
        each chunk is exactly what embedding that span alone gives. Only what the tokenizer
        reads of a text (`max_input_chars`) is chunked; the rest makes it cut."""
        if chunking.budget < 1:  # the prompt or query leaves no room: long inputs are cut as before
            return encodings, [i for i, (e, was_cut) in enumerate(zip(encodings, cut)) if e.overflowing or was_cut], None
        out: list[Encoding] = []
        counts, truncated = [], []
        for i, (encoding, was_cut) in enumerate(zip(encodings, cut)):
            if not (encoding.overflowing or was_cut):
                out.append(encoding)
                counts.append(1)
                continue
            read = self._cased(texts[i][:self._spec.max_input_chars])
            whole = self._untruncated.encode(read, add_special_tokens=False)
            if len(whole.ids) <= chunking.budget:  # long in characters only (runs of spaces): all it reads fits
                out.append(encoding)
                counts.append(1)
                truncated.append(i)
                continue
            windows = _windows(whole.word_ids, chunking.budget, chunking.overlap, chunking.most + 1)
            beyond = len(windows) > chunking.most
            if beyond and chunking.refuse_beyond:
                self._too_many_chunks(i, len(whole.ids), chunking)
            windows = windows[:chunking.most]
            spans = encode([read[whole.offsets[start][0]:whole.offsets[stop - 1][1]] for start, stop in windows])
            if beyond or len(texts[i]) > len(read) or any(span.overflowing for span in spans):
                truncated.append(i)
            out += spans
            counts.append(len(spans))
        return out, truncated, counts if len(out) > len(encodings) else None

    def _prompt_tokens(self, prompt: str) -> int:
        """How many tokens a prompt takes at the start of each input, as sentence-transformers
        counts them to leave out of pooling: the prompt tokenized alone, less a special token
        the tokenizer ends it with."""
        encoding = self._tokenizer.encode(self._cased(prompt))
        return len(encoding.ids) - encoding.special_tokens_mask[-1:].count(1)

    def _look_up(self, request: protocol.Tokenize) -> protocol.LookedUp:
        """Each text's tokens, whole (not cut to the model's length), after the request's
        prompt; or each token-id sequence decoded."""
        if request.token_ids is not None:
            known = self._untruncated.get_vocab_size(with_added_tokens=True)
            for i, ids in enumerate(request.token_ids):
                unknown = next((t for t in ids if t >= known), None)
                if unknown is not None:
                    raise InputError(f"input[{i}] holds token id {unknown}, outside the tokenizer's vocabulary "
                                     f"(0 to {known - 1})")
            return protocol.LookedUp(request.request_id, texts=self._untruncated.decode_batch(
                request.token_ids, skip_special_tokens=not request.special_tokens))
        encodings = self._untruncated.encode_batch([self._cased(request.prompt + text) for text in request.texts or []],
                                                   add_special_tokens=request.special_tokens)
        return protocol.LookedUp(request.request_id, tokens=[
            protocol.TextTokens(e.ids, e.tokens, e.offsets, [flag == 1 for flag in e.special_tokens_mask])
            for e in encodings])

    def _readable(self, texts: list[str]) -> tuple[list[str], list[bool]]:
        """What of each text the tokenizer reads (lower-cased if the model wants it), and
        whether that is less than the whole text."""
        read, cut = [], []
        for text in texts:
            prefix, was_cut = self._prefix(text)
            read.append(prefix)
            cut.append(was_cut)
        return read, cut

    def _cased(self, text: str) -> str:
        return text.lower() if self._spec.lowercase else text

    def _prefix(self, text: str) -> tuple[str, bool]:
        """(`text`, or a prefix of it with the same first `max_length` tokens, lower-cased
        if the model wants it; whether it is a prefix).

        A prefix qualifies when its token `max_length` lies in a word (a piece of the
        pre-tokenizer's split) that is not its last: words before the cut tokenize as in the
        whole text, only the word the cut runs through may not. Prefixes grow four-fold
        until one qualifies, up to `max_input_chars`, beyond which nothing is read."""
        size = self._first_prefix
        while size < len(text):
            if size >= self._spec.max_input_chars:
                return self._cased(text[:self._spec.max_input_chars]), True
            prefix = self._cased(text[:size])
            if self._holds_first_tokens(prefix):
                return prefix, True
            size = min(4 * size, self._spec.max_input_chars)
        return self._cased(text), False

    def _holds_first_tokens(self, prefix: str) -> bool:
        words = self._untruncated.encode(prefix, add_special_tokens=False).word_ids
        last = self._spec.max_length - 1
        return len(words) > last and words[last] is not None and words[last] != words[-1]

    def _document_room(self, query: str) -> int:
        """Tokens left for a document beside `query` (and the special tokens or template)."""
        if self._template is None:
            return self._spec.max_length - self._tokenizer.num_special_tokens_to_add(True) - self._tokens(query)
        assert self._suffix is not None
        return self._spec.max_length - len(self._suffix.ids) - self._tokens(self._template.body(query, ""))

    def _pair_tokens(self, query: str, document: str) -> int:
        """How many tokens the pair makes, whole."""
        if self._template is None:
            return self._tokens(query, document, special_tokens=True)
        assert self._suffix is not None
        return self._tokens(self._template.body(query, document)) + len(self._suffix.ids)

    def _templated_pairs(self, query: str, documents: list[str]) -> list[Encoding]:
        """Each pair through the model's template, tokenized as one text (as its model card
        or chat template does), no special token added; a pair longer than max_length cut
        at the end of its text before the suffix (the document's end, and the query's too
        if it alone leaves no room), the suffix kept whole: the model reads its answer
        after it."""
        assert self._template is not None and self._suffix is not None
        bodies = self._untruncated.encode_batch_fast([self._template.body(query, document) for document in documents],
                                                     add_special_tokens=False)
        room = self._spec.max_length - len(self._suffix.ids)
        for body in bodies:
            if len(body.ids) > room:
                body.truncate(room)
        return [Encoding.merge([body, self._suffix], growing_offsets=False) for body in bodies]

    def _encode_pairs(self, query: str, documents: list[str]) -> list[Encoding]:
        if self._template is not None:
            return self._templated_pairs(query, documents)
        pairs = [(query, document) for document in documents]
        try:
            return self._pair_tokenizer.encode_batch_fast(pairs)
        except Exception:  # the query alone does not fit: cut both sides
            return self._tokenizer.encode_batch_fast(pairs)

    def _truncated(self, encodings: list[Encoding], cut: list[bool], long_inputs: str, texts: list[str],
                   tokens: Callable[[str], int]) -> list[int]:
        """The positions of the inputs cut to max_length (or to what was read of them); with
        `long_inputs` "error", the first such input of `texts` is refused, naming the
        `tokens` of what the tokenizer reads of it."""
        truncated = [i for i, (e, was_cut) in enumerate(zip(encodings, cut)) if e.overflowing or was_cut]
        if long_inputs != "error" or not truncated:
            return truncated
        i = truncated[0]
        limit = self._spec.max_input_chars
        count = tokens(self._cased(texts[i][:limit]))
        if len(texts[i]) <= limit:
            self._too_long(i, f"{count} tokens")
        if count > self._spec.max_length:
            self._too_long(i, f"more than {count} tokens (those of its first {limit} characters, all that is read "
                              "of one input)")
        raise InputError(f"input[{i}] is longer than {limit} characters, the most model '{self._spec.name}' reads "
                         "of one input (long inputs are refused here)")

    def _check_token_ids(self, sequences: list[list[int]], long_inputs: str,
                         request: protocol.Tokenize) -> tuple[list[list[int]], list[int], list[int] | None]:
        """(the sequences as the model takes them, the positions of those cut, how many
        sequences each became where long ones were chunked). Token ids are taken as they
        are: chunks are windows of max_length ids, no special token added; with
        `keep_last`, a longer sequence keeps its last ids."""
        truncated, out, counts = [], [], []
        most = self._max_chunks(request)
        for i, ids in enumerate(sequences):
            if any(t < 0 or t >= self._vocab_size for t in ids):
                raise InputError(f"input[{i}] holds a token id outside the model's vocabulary "
                                 f"(0 to {self._vocab_size - 1})")
            windows = [(0, len(ids))]
            if request.keep_last is not None and len(ids) > request.keep_last:
                windows = [(len(ids) - request.keep_last, len(ids))]
                truncated.append(i)
            elif len(ids) > self._spec.max_length:
                if long_inputs == "error":
                    self._too_long(i, f"{len(ids)} tokens")
                if long_inputs == "chunk":
                    chunking = _Chunking(self._spec.max_length, self._overlap(request), most, refuse_beyond=True)
                    windows = _windows(list(range(len(ids))), chunking.budget, chunking.overlap, most + 1)
                    if len(windows) > most:
                        self._too_many_chunks(i, len(ids), chunking)
                else:
                    windows = [(0, self._spec.max_length)]
                    truncated.append(i)
            out += [ids[start:stop] for start, stop in windows]
            counts.append(len(windows))
        return out, truncated, counts if len(out) > len(sequences) else None

    def _too_many_chunks(self, index: int, tokens: int, chunking: "_Chunking") -> None:
        """Refuse input `index` of `tokens` tokens, which `chunking` cuts into more chunks than it takes."""
        raise InputError(f"input[{index}] has {tokens} tokens, more than the {chunking.most} chunks of at most "
                         f"{chunking.budget} tokens (max_chunks_per_input) model '{self._spec.name}' takes of one "
                         "input")

    def _too_long(self, index: int, tokens: str) -> None:
        """Refuse input `index`, which has `tokens` ("520 tokens")."""
        raise InputError(f"input[{index}] has {tokens}, more than the maximum of {self._spec.max_length} "
                         f"for model '{self._spec.name}' (long inputs are refused here)")


class TaskTokenizer:
    """Tokenizes the inputs of a model that encodes queries and documents each its own way
    (a multi-vector model, `ModelSpec.tasks`): the task's maximum length, query expansion
    and the tokens whose states are left out, as sentence-transformers' MultiVectorEncoder
    applies them. A request without a task is encoded as documents (a lookup too)."""

    def __init__(self, spec: ModelSpec) -> None:
        self._tasks = {task: (encoding, ModelTokenizer(msgspec.structs.replace(
                           spec, tasks={}, max_length=encoding.max_length or spec.max_length), encoding))
                       for task, encoding in spec.tasks.items()}

    def tokenize(self, request: protocol.Tokenize) -> protocol.Tokenized | protocol.LookedUp:
        encoding, tokenizer = self._tasks[request.task or "document"]
        answer = tokenizer.tokenize(request)
        if isinstance(answer, protocol.LookedUp):
            return answer
        inputs = answer.inputs
        assert isinstance(inputs, protocol.TokenInputs)
        if encoding.expand_to:
            inputs = _expand(inputs, encoding)
        if encoding.skip_ids:
            read = ~np.isin(np.frombuffer(inputs.ids, dtype="<i4"), encoding.skip_ids)
            attended = None if inputs.masks is None else inputs.masks.attended
            inputs.masks = protocol.TokenMasks(attended, read.astype(np.int8).tobytes())
        answer.inputs = inputs
        return answer


@dataclass(frozen=True, slots=True)
class _Chunking:
    """How a request's long inputs are chunked: windows of `budget` tokens of the text (what
    the model's length leaves beside its special tokens and the prompt or query), sharing
    `overlap` tokens, `most` per input; beyond, the input is refused (`refuse_beyond`) or
    its chunks past `most` left out."""

    budget: int
    overlap: int
    most: int
    refuse_beyond: bool


def _windows(words: list[int | None], budget: int, overlap: int, most: int) -> list[tuple[int, int]]:
    """Token ranges [start, stop) over tokens that belong to `words`, each at most `budget`
    long and starting `overlap` tokens before the one before it stops, `most` at most.

    A window stops before the word its last token would cut, and starts at the first token
    of a word, unless that word alone is longer than the room left (then it is cut): a span
    of whole words tokenizes alone as it does in the whole text."""
    windows: list[tuple[int, int]] = []
    start = 0
    while len(windows) < most:
        stop = min(start + budget, len(words))
        if stop < len(words):
            stop = _word_start(words, stop, start)
        windows.append((start, stop))
        if stop == len(words):
            break
        start = _word_start(words, max(stop - overlap, start + 1), start)
    return windows


def _word_start(words: list[int | None], token: int, floor: int) -> int:
    """The first token of the word `token` is in, if that is after `floor`; else `token`."""
    first = token
    while first > floor and words[first] is not None and words[first - 1] == words[first]:
        first -= 1
    return first if first > floor else token


def _left_out(sequences: list[list[int]], prompt_tokens: int) -> protocol.TokenMasks:
    """Masks that leave each input's first `prompt_tokens` tokens (its prompt's) out of
    what the head reads."""
    lengths = [len(ids) for ids in sequences]
    starts = np.repeat(np.cumsum([0, *lengths[:-1]]), lengths)
    read = np.arange(sum(lengths)) - starts >= prompt_tokens
    return protocol.TokenMasks(read=read.astype(np.int8).tobytes())


def _expand(answer: protocol.TokenInputs, encoding: protocol.TaskEncoding) -> protocol.TokenInputs:
    """ColBERT's query expansion: each input shorter than `expand_to` tokens filled up to
    it with the expansion token, attended to by the encoder only if the model says so."""
    ids = np.frombuffer(answer.ids, dtype="<i4")
    offsets = np.cumsum([0, *answer.lengths])
    pieces, attended, lengths = [], [], []
    for i, length in enumerate(answer.lengths):
        added = max(encoding.expand_to - length, 0)
        pieces += [ids[offsets[i]:offsets[i + 1]], np.full(added, encoding.expansion_id, dtype="<i4")]
        attended += [np.ones(length, dtype=np.int8), np.full(added, int(encoding.attend_expansion), dtype=np.int8)]
        lengths.append(length + added)
    masks = None if encoding.attend_expansion else protocol.TokenMasks(np.concatenate(attended).tobytes())
    return protocol.TokenInputs(np.concatenate(pieces).tobytes(), lengths, answer.type_ids, masks,
                                added=sum(lengths) - sum(answer.lengths))


@dataclass(frozen=True, slots=True)
class TokenItem:
    """One input of `TokenInputs` as the inference process queues it."""

    ids: np.ndarray  # int32
    type_ids: np.ndarray | None = None  # int8 segment per token (None: all zero)
    attended: np.ndarray | None = None  # int8 per token: the encoder attends to it (None: all)
    read: np.ndarray | None = None  # int8 per token: the head reads its state (None: all)


def token_items(inputs: protocol.TokenInputs) -> tuple[list[int], list[TokenItem]]:
    """(what each input costs a pass: its length, each input) of `inputs`."""
    ids = np.frombuffer(inputs.ids, dtype="<i4")
    flags = [None if array is None else np.frombuffer(array, dtype=np.int8)
             for array in (inputs.type_ids, *_masks(inputs.masks))]
    offsets = list(itertools.accumulate(inputs.lengths, initial=0))  # ints: numpy's would slice slower
    spans = zip(offsets, offsets[1:])
    if all(array is None for array in flags):  # a plain text's: the ids alone
        return inputs.lengths, [TokenItem(ids[start:end]) for start, end in spans]
    return inputs.lengths, [TokenItem(ids[start:end], *(None if array is None else array[start:end] for array in flags))
                            for start, end in spans]


def _masks(masks: protocol.TokenMasks | None) -> tuple[bytes | None, bytes | None]:
    return (None, None) if masks is None else (masks.attended, masks.read)


def collate_tokens(items: list[TokenItem], pad_id: int) -> dict[str, np.ndarray]:
    """A padded batch of `items`: (n, longest) int64 `input_ids` (right-padded with
    `pad_id`), `attention_mask` and `token_type_ids`, and `read_mask` (the tokens whose
    states the head reads) where some input's differ from the attended ones (ColBERT's
    query expansion, skipped tokens)."""
    longest = max(len(item.ids) for item in items)
    input_ids = np.full((len(items), longest), pad_id, dtype=np.int64)
    attention_mask = np.zeros((len(items), longest), dtype=np.int64)
    token_type_ids = np.zeros((len(items), longest), dtype=np.int64)
    read_mask = None
    if any(item.attended is not None or item.read is not None for item in items):
        read_mask = np.zeros_like(attention_mask)
    for row, item in enumerate(items):
        length = len(item.ids)
        input_ids[row, :length] = item.ids
        attention_mask[row, :length] = 1 if item.attended is None else item.attended
        if item.type_ids is not None:
            token_type_ids[row, :length] = item.type_ids
        if read_mask is not None:
            read_mask[row, :length] = 1 if item.read is None else item.read
    arrays = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
    if read_mask is not None:
        arrays["read_mask"] = read_mask
    return arrays
