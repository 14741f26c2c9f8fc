"""Every message that crosses a process boundary, and how it is framed.

The front end and each child talk over one channel (`infinity.shared.channel`), both
ways. Messages sent together travel as one body, a msgpack array of msgspec Structs,
each tagged so one decoder reads any of them. Result vectors never travel here: the inference process writes them
into shared-memory slots the front end chose (see `infinity.shared.shm`), and `Done` only says
they are there.

Flow of one request:
    front end --Tokenize--> tokenizer --Tokenized | Failed--> front end
    front end --Infer--> inference --Done | Failed--> front end
    front end --Cancel--> inference (the client went away)
and, once per child at start, `Ready` (or `StartupFailed`) to the front end. A child is
started with `WorkerArgs`, which carries the `ModelSpec` of each model it serves. A lookup
(`/tokenize`, `/detokenize`) is a `Tokenize` answered with `LookedUp` (or `Failed`).

A request's inputs, once made ready for the model, are one `Inputs` value (token ids, or
named feature arrays) that the front end relays from `Tokenized` into `Infer` untouched:
a new input field is made by a preprocessor and read by an engine, nothing between.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec
import numpy as np
from numpy.lib.format import descr_to_dtype, dtype_to_descr

from infinity.shared.kinds import Kind


class PairTemplate(msgspec.Struct, frozen=True):
    """The text a causal language model scored as a reranker reads for a query-document
    pair: `prefix`, the query, `infix`, the document, `suffix` (its prompt template, with
    any instruction already in `prefix`), tokenized as one text."""

    prefix: str
    infix: str
    suffix: str

    def body(self, query: str, document: str) -> str:
        """The pair's text before `suffix`: what a long document is cut in."""
        return f"{self.prefix}{query}{self.infix}{document}"


class TaskEncoding(msgspec.Struct, frozen=True):
    """How a multi-vector model tokenizes the inputs of one task ("query" or "document"),
    as its sentence-transformers folder says (the task's prompt is one of the model's
    `ModelSpec.prompts`)."""

    max_length: int | None = None  # tokens of the task's inputs at most (None: the model's)
    # Query expansion: an input shorter than `expand_to` tokens is filled up to it with
    # `expansion_id`, tokens the encoder attends to only if `attend_expansion`, whose
    # states are part of the output either way.
    expand_to: int = 0
    expansion_id: int = 0
    attend_expansion: bool = False
    skip_ids: list[int] = []  # tokens whose states are left out of the output
    # Tokens a prompt starts with that the tokenizer must keep whole (older ColBERT
    # layouts inserted them as tokens in training; as text they would split).
    markers: list[str] = []
    # The folder of the tokenizer that encodes the task's inputs, where not the model's (a
    # Router's route), and whether it adds its special tokens.
    tokenizer: str | None = None
    special_tokens: bool = True

    @property
    def adds_unattended_tokens(self) -> bool:
        return bool(self.expand_to) and not self.attend_expansion


# What runs after a model's encoder, in its folder's order (sentence-transformers' modules
# after its Transformer: infinity/folders/modules.py), each step reading and writing one of
# two features as sentence-transformers names them: the encoder's token states
# (`TOKEN_FEATURE`, (n, L, d)) and the pooled vector (`SENTENCE_FEATURE`, (n, d)).
TOKEN_FEATURE = "token_embeddings"
SENTENCE_FEATURE = "sentence_embedding"


class PoolStep(msgspec.Struct, tag="pool", frozen=True, array_like=True):
    """sentence-transformers' Pooling: token states into one vector per input, by one mode or
    several concatenated ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean",
    "lasttoken"), over the tokens the inference process reads (a prompt's left out unless
    `ModelSpec.pools_prompt`)."""

    modes: tuple[str, ...]

    @property
    def label(self) -> str:
        """How /v1/models shows it."""
        return f"Pooling({'+'.join(self.modes)})"


class DenseStep(msgspec.Struct, tag="dense", frozen=True, array_like=True):
    """sentence-transformers' Dense: a linear layer (weights in `path`), then `activation`
    (a torch.nn activation's class name), plus the input (through a projection if the widths
    differ) where `residual`."""

    path: str
    in_features: int
    out_features: int
    bias: bool
    activation: str
    residual: bool = False
    source: str = SENTENCE_FEATURE
    target: str = SENTENCE_FEATURE

    @property
    def label(self) -> str:
        extras = [self.activation] + ["no bias"] * (not self.bias) + ["residual"] * self.residual
        extras += [f"on {self.source}"] * (self.source != SENTENCE_FEATURE)
        return f"Dense({self.in_features}->{self.out_features}, {', '.join(extras)})"


class LayerNormStep(msgspec.Struct, tag="layer_norm", frozen=True, array_like=True):
    """sentence-transformers' LayerNorm of the pooled vector (weights in `path`)."""

    path: str
    dimension: int

    @property
    def label(self) -> str:
        return f"LayerNorm({self.dimension})"


class NormalizeStep(msgspec.Struct, tag="normalize", frozen=True, array_like=True):
    """sentence-transformers' Normalize: L2 normalisation of one feature."""

    source: str = SENTENCE_FEATURE
    target: str = SENTENCE_FEATURE

    @property
    def label(self) -> str:
        return "Normalize" if self.source == SENTENCE_FEATURE else f"Normalize(on {self.source})"


ChainStep = PoolStep | DenseStep | LayerNormStep | NormalizeStep
# The chains whose vector is the token states' mean, normalised or not, and nothing more.
PLAIN_MEANS = ((PoolStep(("mean",)),), (PoolStep(("mean",)), NormalizeStep()))


# The prompt names that serve inputs of each role, the first the model has: those
# sentence-transformers' encode_query and encode_document try, and Cohere's other input types.
ROLE_PROMPTS = {"query": ("query",), "document": ("document", "passage", "corpus"),
                "classification": ("classification",), "clustering": ("clustering",)}


class ModelSpec(msgspec.Struct, frozen=True):
    """A model as the children load it: resolved folder and settled options. One spec is
    one replica: a model on several devices has one spec per device, alike but for `device`."""

    name: str
    kind: Kind  # infinity/shared/kinds.py
    path: str  # folder with config.json, weights and the tokenizer
    device: str  # normalised: "cpu", "cpu:1", "cuda:0", "rocm:0", "mps" (infinity/shared/devices.py)
    engine: str
    # The engine to load if `engine` fails, when `engine` was chosen by "auto".
    fallback_engine: str | None
    dtype: str
    # An embedder's pooling mode(s) joined by "+" (its `modules`' PoolStep, as /v1/models shows
    # it); a sparse model's "max" or "sum" over tokens; a hybrid model's dense vector's "cls" or "mean".
    pooling: str
    normalize: bool  # its vectors come out L2-normalised (an embedder's: its `modules` end so)
    max_length: int
    # An input longer than max_length: "truncate" (cut to it), "chunk" (embedded in windows
    # whose vectors are averaged; workers/preprocess/text.py) or "error" (refused).
    long_inputs: str
    max_input_chars: int  # characters of one input read at most (workers/preprocess/text.py)
    lowercase: bool  # sentence-transformers' do_lower_case: lower-case text before tokenizing
    max_batch_tokens: int
    max_batch_size: int
    compile: bool  # torch.compile the torch engine's forward
    # A multi-vector model's projection of token states: the folder of its
    # sentence-transformers Dense module (None: the token states as they are).
    projection: str | None = None
    # What an embedder runs after its encoder, in order (`ChainStep`): at least its pooling.
    modules: tuple[ChainStep, ...] = ()
    # A multi-vector model's encoding by task, "query" and "document" (empty: one way for all),
    # and how it scores a query against a document: "maxsim" or "meanmaxsim".
    tasks: dict[str, TaskEncoding] = {}
    similarity: str = ""
    # Text put before each input, by name (models.toml's, the folder's or the built-in family
    # table's: infinity/folders/prompts.py); the one inputs get when a request asks for none;
    # whether pooling reads the prompt's tokens (sentence-transformers' Pooling include_prompt).
    prompts: dict[str, str] = {}
    default_prompt_name: str | None = None
    pools_prompt: bool = True
    # A reranker's or classifier's activation as its folder saved it ("none", "sigmoid"; "":
    # none saved, the head's rule by its labels).
    score_activation: str = ""
    # An inference-free sparse model's query side (a Router's SparseStaticEmbedding): the
    # folder of its weight per vocabulary entry. Its queries (`tasks["query"]`) are weighed
    # by the tokens they hold, with no pass of the model (`QUERY_ROUTE`).
    query_weights: str | None = None
    # A sparse (SPLADE) model's activation of each token's logits before `pooling`:
    # "relu" is log(1 + relu(x)), "log1p_relu" log(1 + log(1 + relu(x))).
    sparse_activation: str = "relu"
    # A sparse model's own cap on its nonzero entries (sentence-transformers'
    # max_active_dims): only the largest this many are answered (None: all).
    max_active_dims: int | None = None
    # Set where `dtype = "auto"` chose bfloat16 on a CPU that computes it natively: the
    # engine to serve float32 with if the trial at load (workers/inference/precision.py) finds bfloat16
    # not close enough to float32 or not faster.
    float32_engine: str | None = None
    # With long_inputs "chunk": tokens each window shares with the one before, and the most
    # windows one input may take (beyond, an input to embed is refused, a document cut).
    chunk_overlap: int = 0
    max_chunks_per_input: int = 64
    # Engines that may run a lone input's pass in place of `engine` (float32 on CPUs): each
    # is timed at load and the fastest kept where it pays (workers/engines/by_shape.py);
    # with `lone_engine_named`, the one named in models.toml is kept untimed.
    lone_engines: tuple[str, ...] = ()
    lone_engine_named: bool = False
    # The folder's own modelling code may run (models.toml's trust_remote_code): passed to
    # every transformers loader of its files.
    trust_remote_code: bool = False
    # A reranker that is a causal language model: its relevance logit is the logit of the
    # first token here less that of the second (if any) at each pair's last token
    # (sentence-transformers' LogitScore: "yes" and "no"); its pairs are read through
    # `pair_template`. Empty: a sequence classifier's head gives the logits.
    score_tokens: tuple[int, ...] = ()
    pair_template: PairTemplate | None = None

    def prompt_for(self, role: str | None) -> str:
        """The prompt of inputs whose request names none, encoded as `role` ("query",
        "document", "classification", "clustering"; None: unsaid): the role's own prompt
        where the model has one (`ROLE_PROMPTS`), else its default prompt, else none. A
        model with tasks encodes every input as a query or, whatever else, a document."""
        if self.tasks:
            role = "query" if role == "query" else "document"
        names = ROLE_PROMPTS.get(role or "", ())
        name = next((name for name in names if name in self.prompts), self.default_prompt_name)
        return "" if name is None else self.prompts[name]

    @property
    def reads_unattended_states(self) -> bool:
        """Whether some inputs hold tokens the encoder must not attend to but whose states
        are read (ColBERT's query expansion): engines that drop masked positions cannot
        serve it."""
        return any(task.adds_unattended_tokens for task in self.tasks.values())


class WorkerArgs(msgspec.Struct, frozen=True):
    """Everything a child process is started with."""

    name: str  # "tokenizer-0", "inference-cpu", "inference-cuda:1", ...
    # The base of the ZeroMQ endpoints the front end binds for this start of the child:
    # "ipc://<folder>/<name>.<start>" (`infinity.shared.channel`).
    channel: str
    models: list[ModelSpec]
    cpus: list[int] | None  # CPU affinity; None leaves it alone
    threads: int
    arena_prefix: str
    arena_slots: int
    log_level: str
    # What one media item may be (`[media]`), checked in the tokenizer processes that decode them.
    max_image_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_audio_bytes: int = 25 * 1024 * 1024
    max_audio_seconds: float = 60.0
    traced: bool = False  # the front end traces requests: export this child's spans (`infinity.shared.tracing`)
    # An inference process serves at once the models whose conversions and trials the cache
    # lacks, unprepared (`workers.inference.preparing`); False: it makes them first.
    prepare_in_background: bool = False


class ModelInfo(msgspec.Struct, frozen=True, array_like=True):
    """What the front end needs to know of a loaded model."""

    name: str
    kind: Kind
    # Floats per input (per token if `ragged`): embedding size, 1 for a reranker, labels of
    # a classifier; a sparse model's vocabulary size (the range of its indices).
    dim: int
    max_length: int
    labels: list[str]  # a classifier's labels, by output index
    # "sigmoid", "softmax" or "none": what turns raw scores into relevance / probabilities
    activation: str
    # Shared-memory segment holding `slots` result vectors of `dim` float32 each.
    arena: str
    slots: int
    engine: str  # the engine that loaded it ("auto" resolved, fallback applied)
    # Its outputs vary in size and come with `Done` (`Ragged`); its arena holds nothing.
    ragged: bool = False
    dtype: str = "float32"  # what it computes in (after the bfloat16 trial, where there was one)
    lone_engine: str | None = None  # the engine a lone input's pass runs on, where not `engine`
    # False: served unprepared while a preparing process makes its conversions and trials
    # (`workers.inference.preparing`).
    prepared: bool = True


class Tokenize(msgspec.Struct, tag=True, array_like=True):
    """Tokenize `texts` (or check and truncate `token_ids`) for `model`; with `query`, each
    text is paired with it (query first; only the text side is truncated); `task`: encode
    them as the model's queries or documents (`ModelSpec.tasks`); `prompt`: put before each
    text. With `lookup`, no model runs: the answer is what the tokenizer makes of the
    inputs (`LookedUp`: each text's tokens, or each token-id sequence's text)."""

    request_id: int
    model: str
    texts: list[str] | None = None
    token_ids: list[list[int]] | None = None
    query: str | None = None
    task: str | None = None
    # Media instead of text (images, audio: the one a two-tower model takes beside text):
    # each the bytes fetched from a URL, or a data: URI's ASCII bytes (no image or audio
    # file starts with "data:"); decoded in the tokenizer process.
    media: list[bytes] | None = None
    trace: str | None = None  # the request's W3C traceparent, where it is traced (`infinity.shared.tracing`)
    prompt: str = ""
    lookup: bool = False
    # Add the model's special tokens to texts (false: vLLM's add_special_tokens false; token
    # ids never get them), and with `lookup` keep them in decoded texts.
    special_tokens: bool = True
    # How inputs longer than the model's maximum length are taken ("truncate", "chunk",
    # "error"; None: as the model's `long_inputs` says), the tokens chunks overlap by (None:
    # the model's) and the most chunks of a document to rerank, beyond which it is cut (None:
    # the model's max_chunks_per_input, beyond which a text to embed is refused and a pair's
    # document cut).
    long_inputs: str | None = None
    chunk_overlap: int | None = None
    max_chunks: int | None = None
    # Cut each text or token-id sequence at its start, to its last this many tokens (the
    # model's special tokens counted), instead of at its end (vLLM's truncate_prompt_tokens,
    # TEI's truncation_direction Left); such inputs are never chunked. None: cut at the end.
    keep_last: int | None = None


class TokenMasks(msgspec.Struct, array_like=True):
    """Per-token flags (int8, concatenated like the ids) for inputs where not every token
    is both attended to and read: `attended` by the encoder (None: all are), `read` by the
    head (None: all are)."""

    attended: bytes | None = None
    read: bytes | None = None


class ImageInfo(msgspec.Struct, array_like=True):
    """What an image was as sent (Cohere answers it): its size, its format ("png",
    "jpeg", ...) and bits per pixel."""

    width: int
    height: int
    format: str
    bit_depth: int


class TokenInputs(msgspec.Struct, tag="tokens", array_like=True):
    """A request's inputs as token ids, concatenated as int32 little-endian, `lengths` long
    each: what each costs a pass is its length."""

    ids: bytes
    lengths: list[int]
    # Segment of each token (int8), for query-document pairs; None: all zero.
    type_ids: bytes | None = None
    masks: TokenMasks | None = None
    added: int = 0  # tokens added by query expansion: in `lengths`, not billed

    @property
    def billed(self) -> int:
        """Tokens the request is billed (`usage`)."""
        return sum(self.lengths) - self.added

    @property
    def costs(self) -> list[int]:
        """What each input costs a pass: its tokens."""
        return self.lengths

    @property
    def info(self) -> None:
        """What each input was as sent: nothing to say of texts."""
        return None


class ArrayPart(msgspec.Struct, array_like=True):
    """One named array of a request's features (a transformers model's input name:
    "pixel_values", "input_features", "input_ids", "image_grid_thw", ...), its dtype as
    numpy describes it ("<f4") and its shape, the bytes in C order. Each item's share: a
    row of the first axis, or with `rows`, that many rows each, in item order."""

    name: str
    dtype: str
    shape: list[int]
    data: bytes
    rows: list[int] | None = None

    @classmethod
    def of(cls, name: str, array: np.ndarray, rows: list[int] | None = None) -> ArrayPart:
        array = np.ascontiguousarray(array)
        return cls(name, dtype_to_descr(array.dtype), list(array.shape), array.tobytes(), rows)

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=descr_to_dtype(self.dtype)).reshape(self.shape)


class FeatureInputs(msgspec.Struct, tag="features", array_like=True):
    """A request's inputs as features a preprocessor made for the model's media tower
    (an image's pixels, a clip's spectrogram, a page's pixels with its prompt's tokens):
    what each item costs a pass and is billed (an image's patches, a clip's frames, a
    page's tokens), and what each was as sent."""

    arrays: list[ArrayPart]
    costs: list[int]
    info: list[ImageInfo] | None = None  # each item as it was sent (images: what Cohere answers)

    @property
    def billed(self) -> int:
        """What the request is billed (`usage`)."""
        return sum(self.costs)


# The inputs of a request as the model takes them: relayed by the front end untouched from
# the tokenizer process that made them to the inference process that runs them.
Inputs = TokenInputs | FeatureInputs


class Tokenized(msgspec.Struct, tag=True, array_like=True):
    """The inputs of a request made ready for its model; `truncated`: the positions of
    those cut to the model's maximum length; `chunks`: where long inputs were chunked, how
    many of `inputs` each of the request's inputs became, in order (None: one each)."""

    request_id: int
    inputs: Inputs
    truncated: list[int] = []
    chunks: list[int] | None = None


class TextTokens(msgspec.Struct, array_like=True):
    """One text's tokens as its model's tokenizer cuts it, whole: ids, each as the
    vocabulary spells it, its span of characters [start, stop) in the text tokenized (the
    prompt, then the input; (0, 0) for tokens the tokenizer adds), and whether it is a
    special token."""

    ids: list[int]
    strings: list[str]
    offsets: list[tuple[int, int]]
    special: list[bool]


class LookedUp(msgspec.Struct, tag=True, array_like=True):
    """The answer to a `Tokenize` with `lookup`: each text's tokens, or each token-id
    sequence decoded into text."""

    request_id: int
    tokens: list[TextTokens] | None = None
    texts: list[str] | None = None


class Infer(msgspec.Struct, tag=True, array_like=True):
    """Run the model on the inputs of a request; the output of input i goes to arena slot
    `slots[i]`; `priority`: lower is served first."""

    request_id: int
    model: str
    slots: list[int]
    inputs: Inputs
    priority: int = 0
    trace: str | None = None  # as `Tokenize.trace`
    # The outputs a hybrid model computes for it (`KindSpec.vector_types`); for a model of one
    # vector per input, [TOKEN_STATES] asks for its token states instead, [UNNORMALIZED] its
    # vectors before their final Normalize; empty otherwise.
    vector_types: list[str] = []


# The output a pooling model gives instead of its vectors where an `Infer` asks for it: each
# input's last hidden states, (tokens, hidden) float32, a row per attended token (late chunking).
TOKEN_STATES = "token_states"
# The output a model with a static query side gives for an `Infer` of queries: each input's
# weights from its tokens alone, no pass of the model (`ModelSpec.query_weights`).
QUERY_ROUTE = "query_route"
# The output an embedder gives in place of its vectors where an `Infer` asks for it: each
# input's vector before the model's final Normalize (TEI's `normalize: false`, vLLM's
# `use_activation: false`), in the same arena row.
UNNORMALIZED = "unnormalized"


class Cancel(msgspec.Struct, tag=True, array_like=True):
    """The client of `request_id` has gone: skip what is not computed yet."""

    request_id: int


class Ragged(msgspec.Struct, array_like=True):
    """Outputs whose size depends on the input (a vector per token, a sparse vector), one
    array per input, sent with `Done` rather than written to the arena: the array of the
    input in slot `slots[i]` has shape `shapes[i]`; all are of `dtype`, concatenated in C
    order in `data`. `dtype` is numpy's description of it, as .npy files hold it
    (`numpy.lib.format.dtype_to_descr`): a type string such as "<f4", or a structured
    type's (name, type string) fields, so that records (a sparse vector's int32 index and
    float32 value, say) travel exactly."""

    slots: list[int]
    dtype: str | list[tuple[str, str]]
    shapes: list[list[int]]
    data: bytes


class Done(msgspec.Struct, tag=True, array_like=True):
    """Every output of `request_id` is in its slot, or in `outputs` for a model whose
    outputs vary in size (or, if `cancelled`, never will be)."""

    request_id: int
    cancelled: bool = False
    outputs: Ragged | None = None
    # A hybrid model's outputs by vector type, where its request asked for several; a request
    # for one has them in `outputs`, as a model of that one output would.
    outputs_by_type: dict[str, Ragged] = {}


class ErrorKind(enum.StrEnum):
    """Why a request failed: the first two a child reports in `Failed`, the others the
    front end's engine client finds. Only the front end's edge (`infinity.api.errors`) turns a
    kind into what the client is answered."""

    INVALID_INPUT = "invalid_input"  # a client's input the model cannot take
    INTERNAL = "internal"  # a child failed on a valid input
    OVERLOADED = "overloaded"  # the model's queue cannot hold the request
    MODEL_NOT_READY = "model_not_ready"  # no replica of the model is ready (loading, restarting)
    NOT_READY = "not_ready"  # no tokenizer process is ready
    WORKER_DIED = "worker_died"  # the child holding the request stopped
    SHUTTING_DOWN = "shutting_down"


class Failed(msgspec.Struct, tag=True, array_like=True):
    """A request could not be served, for a reason of `kind`; `param`: the request field
    at fault, if one is."""

    request_id: int
    kind: ErrorKind
    message: str
    param: str | None = None


class Ready(msgspec.Struct, tag=True, array_like=True):
    """A child has loaded (and warmed) everything it serves."""

    worker: str
    pid: int
    models: list[ModelInfo] = []


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    """A child could not start; the server stops with this message."""

    worker: str
    message: str


class BatchRan(msgspec.Struct, tag=True, array_like=True):
    """An inference process ran one batch of `model`: how many inputs, its padded tokens
    (an image batch: its patches), how long each input waited in the process's queue and
    how long the forward pass and head took, in seconds, and each input's priority (for
    the metrics)."""

    model: str
    inputs: int
    tokens: int
    waits: list[float]
    seconds: float
    priorities: list[int]


Message = Tokenize | Tokenized | LookedUp | Infer | Cancel | Done | Failed | Ready | StartupFailed | BatchRan

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Message])


def encode(messages: Sequence[Message]) -> bytes:
    """Messages sent together, as one msgpack array: one body for the transport to carry,
    however many messages it holds."""
    return _encoder.encode(messages)


def decode(data: bytes | memoryview) -> list[Message]:
    return _decoder.decode(data)
