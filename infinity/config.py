"""Server configuration: the typed structs, and how a `models.toml`, `INFINITY_*`
environment variables and command-line flags combine into them (flags win over the
environment, the environment over the file, the file over the defaults).

Everything is validated once, at start; a bad key or value raises `ConfigError` with a
message that names it.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from infinity.shared.devices import normalise as normalise_device
from infinity.shared.kinds import ENGINE_OUTPUTS, KINDS, dtype_refusal
from infinity.shared.vectors import EmbeddingType  # what an embedding is answered as

DEFAULT_MODEL_SOURCE = "default"
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"

Pooling = Literal["mean", "cls", "lasttoken", "max", "mean_sqrt_len_tokens", "weightedmean"]
LongInputs = Literal["truncate", "chunk", "error"]
ModelKind = Literal[("auto", *KINDS)]  # type: ignore[valid-type]
EngineChoice = Literal[(*ENGINE_OUTPUTS, "auto")]  # type: ignore[valid-type]


class ConfigError(ValueError):
    """A configuration that cannot be served; the message names the offending key."""


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One `[[models]]` entry."""

    name: str = ""
    source: str = DEFAULT_MODEL_SOURCE
    kind: ModelKind = "auto"
    # One device, or several: one replica of the model on each (see infinity/shared/devices.py).
    device: str | list[str] = "cpu"
    engine: EngineChoice = "auto"
    # Each engine takes some (`ENGINE_DTYPES`): torch float32|float16|bfloat16, onnx float32|int8 (CPU)|
    # float16 (CUDA), ctranslate2 float32|float16|int8|int8_float16, openvino float32|bfloat16 (CPUs
    # that compute it natively); others fail the start naming the engine.
    dtype: Literal["float32", "float16", "bfloat16", "int8", "int8_float16", "auto"] = "auto"
    # The engine a lone input's pass runs on (one that arrives while the model idles), where
    # it is faster than the batches' engine: "auto" times, at load, the engines installed that
    # serve the model in float32 on CPUs and keeps the fastest where it pays; "none": the
    # batches' engine; an engine's name: that one (float32 on CPUs).
    lone_engine: Literal[(*ENGINE_OUTPUTS, "auto", "none")] = "auto"  # type: ignore[valid-type]
    # None: from the model folder (sentence-transformers Pooling / Normalize modules).
    pooling: Pooling | None = None
    normalize: bool | None = None
    max_length: int | None = None
    # An input longer than max_length: "truncate" (cut to it), "chunk" (embedded in windows of
    # max_length whose vectors are averaged, weighted by their tokens; models of one dense
    # vector per text, and rerankers: their documents' chunks, the best scoring) or "error"
    # (422). Requests may ask otherwise (`long_inputs`, Cohere's `truncate`, `max_chunks_per_doc`).
    long_inputs: LongInputs | None = None
    # The older spelling: false is long_inputs = "error".
    truncate: bool = True
    # Tokens each chunk shares with the one before; the most chunks of one input (beyond, an
    # input to embed is a 422, a document to rerank is scored on its first chunks).
    chunk_overlap: int = 0
    max_chunks_per_input: int = 64
    # Characters of one input the tokenizer reads at most (None: 64 per token of max_length).
    # Up to it, a long input gives exactly the tokens of the whole text, cut to max_length.
    max_input_chars: int | None = None
    # Padded tokens and inputs per batch. A wide window lets the scheduler group inputs of
    # similar length (bench/results/batching.md#a-64-input-batch-window).
    max_batch_tokens: int = 16384
    max_batch_size: int = 64
    # torch engine only: run the model through torch.compile (slower start, faster passes on GPUs).
    compile: bool = False
    # Text put before each input, by name, over those of the folder (or of the built-in family
    # table, infinity/folders/prompts.py); the one inputs get when a request asks for none.
    prompts: dict[str, str] = msgspec.field(default_factory=dict)
    default_prompt_name: str | None = None
    # The built-in table's prompts for a known family whose folder declares none; false: none.
    builtin_prompts: bool = True
    # Run the modelling code a folder ships (an `auto_map` in its config.json or
    # tokenizer_config.json), which executes in the server's processes: a folder with code is
    # refused unless trusted, and served on torch (infinity/folders/remote_code.py).
    trust_remote_code: bool = False
    # The model that requests naming none (TEI's bodies, which cannot) go to where several
    # models could answer them; at most one per kind.
    default: bool = False

    def __post_init__(self) -> None:
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError("models.max_length must be at least 2")
        if self.max_input_chars is not None and self.max_input_chars < 1:
            raise ConfigError("models.max_input_chars must be positive")
        if not self.truncate and self.long_inputs not in (None, "error"):
            raise ConfigError(f"models.truncate = false means long_inputs = \"error\", not {self.long_inputs!r}")
        if self.chunk_overlap < 0 or self.max_chunks_per_input < 1:
            raise ConfigError("models.chunk_overlap must be 0 or more, models.max_chunks_per_input positive")
        if self.max_batch_tokens < 1 or self.max_batch_size < 1:
            raise ConfigError("models.max_batch_tokens and models.max_batch_size must be positive")
        refused = None if "auto" in (self.engine, self.dtype) else dtype_refusal(self.engine, self.dtype)
        if refused is not None:
            raise ConfigError(f"models.dtype: {refused}")
        try:
            normalised = self.devices
        except ValueError as exc:
            raise ConfigError(f"models.device: {exc}") from None
        if not normalised:
            raise ConfigError("models.device must name at least one device")
        repeated = sorted({d for d in normalised if normalised.count(d) > 1})
        if repeated:
            raise ConfigError(f"models.device {self.device!r} names {', '.join(repeated)} more than once")

    @property
    def long_inputs_taken(self) -> LongInputs:
        """How inputs longer than max_length are taken: `long_inputs`, else as `truncate` says."""
        return self.long_inputs or ("truncate" if self.truncate else "error")

    @property
    def devices(self) -> list[str]:
        """The model's devices, normalised (`cuda` is `cuda:0`): one replica on each."""
        listed = [self.device] if isinstance(self.device, str) else self.device
        return [normalise_device(device) for device in listed]


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The `[server]` table."""

    host: str = "0.0.0.0"
    port: int = 7997
    api_key: str | None = None
    url_prefix: str = ""
    # 0: chosen from the number of usable cores.
    tokenizer_workers: int = 0
    # Items (sentences) waiting or running per model; beyond it requests get 429.
    max_queued_items: int = 4096
    # Of those, items of less urgent requests (priority above 0) at most, so that bulk work
    # cannot fill the queue that queries need; beyond it they get 429. 0: half of max_queued_items.
    max_queued_items_low_priority: int = 0
    max_items_per_request: int = 2048
    max_request_bytes: int = 16 * 1024 * 1024
    # Seconds a client may take to send a request's headers, and its whole body; an idle
    # keep-alive connection is closed after keepalive_timeout (see infinity/api/connections.py).
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keepalive_timeout: float = 75.0
    # Open connections at most; beyond, the longest idle one is closed (or the new one refused).
    max_connections: int = 4096
    # Seconds a stopping server (SIGTERM) gives the requests it holds to finish; meanwhile
    # /health and new requests are answered 503.
    shutdown_timeout: float = 30.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Output type of embeddings when a request names none (see infinity/shared/vectors.py).
    embedding_type: EmbeddingType = "float"
    # On CPUs that compute bfloat16 natively, `dtype = "auto"` lets a model whose outputs
    # are vectors (the kinds table's `bfloat16_trial`) run in bfloat16 where a trial at
    # load finds it faster and its vectors within a cosine of float32's
    # (workers/inference/precision.py); false: float32 always.
    auto_bfloat16: bool = True
    # A request field that no server this one stands in for names (infinity/api/peer_fields.py):
    # refused with a 422 naming it, as OpenAI refuses one; "ignore": decoded as if absent.
    unknown_fields: Literal["refuse", "ignore"] = "refuse"
    # A model whose conversions and trials are not in the cache yet (a new machine, a new
    # model): "in_background" serves it at once on torch float32 while another process
    # makes them, then hands it over to an inference process that loads it prepared
    # (workers/inference/preparing.py, infinity/client/handover.py); "before_serving"
    # makes them before the server is ready.
    prepare: Literal["in_background", "before_serving"] = "in_background"

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"server.port must be between 1 and 65535, got {self.port}")
        if self.url_prefix and (not self.url_prefix.startswith("/") or self.url_prefix.endswith("/")):
            raise ConfigError("server.url_prefix must start with '/' and not end with '/'")
        if self.tokenizer_workers < 0:
            raise ConfigError("server.tokenizer_workers must be 0 (auto) or positive")
        for key in ("max_queued_items", "max_items_per_request", "max_request_bytes", "max_connections",
                    "header_timeout", "body_timeout", "keepalive_timeout", "shutdown_timeout"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"server.{key} must be positive")
        if not 0 <= self.max_queued_items_low_priority <= self.max_queued_items:
            raise ConfigError("server.max_queued_items_low_priority must be between 0 (half of max_queued_items) "
                              "and max_queued_items")

    @property
    def low_priority_items(self) -> int:
        """Items of less urgent requests (priority above 0) a model may hold at once."""
        return self.max_queued_items_low_priority or max(self.max_queued_items // 2, 1)


# Request priorities (lower is served first, as in vLLM), in the bounds every route takes.
MIN_PRIORITY, MAX_PRIORITY = -100, 100
Priority = Annotated[int, msgspec.Meta(ge=MIN_PRIORITY, le=MAX_PRIORITY)]


class ApiKey(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One `[[api_keys]]` entry: a key clients may send beside `server.api_key`, and the
    priority of its requests that name none (an ingest key at 1 puts bulk clients behind
    queries without changing them)."""

    key: str
    priority: Priority = 0

    def __post_init__(self) -> None:
        if not self.key:
            raise ConfigError("api_keys.key must not be empty")


class MediaConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The `[media]` table: how images (and other media) given by URL are fetched, and the
    limits on every media item (see infinity/api/media_fetch.py)."""

    # Fetch http(s) URLs at all; false leaves data: URIs only.
    fetch_urls: bool = True
    # Dial private, loopback, link-local and other non-global addresses (intranets, tests).
    allow_private_networks: bool = False
    # Hosts that may be fetched (a name allows its subdomains too); empty: any public host.
    allowed_domains: list[str] = msgspec.field(default_factory=list)
    max_image_bytes: int = 10 * 1024 * 1024
    # Pixels of one image at most, read from its header before it is decoded: a small file
    # may declare a huge image (a decompression bomb).
    max_image_pixels: int = 40_000_000
    max_audio_bytes: int = 25 * 1024 * 1024
    # Seconds of one clip at most, read from its header before anything is decoded.
    max_audio_seconds: float = 60.0
    connect_timeout: float = 5.0  # seconds
    fetch_timeout: float = 10.0  # seconds for a whole fetch, redirects included
    max_redirects: int = 3
    max_concurrent_fetches: int = 16  # for the whole server

    def __post_init__(self) -> None:
        for key in ("max_image_bytes", "max_image_pixels", "max_audio_bytes", "max_audio_seconds",
                    "connect_timeout", "fetch_timeout", "max_concurrent_fetches"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"media.{key} must be positive")
        if self.max_redirects < 0:
            raise ConfigError("media.max_redirects must not be negative")

    def max_bytes(self, medium: str) -> int:
        """The most bytes one item of `medium` ("image", "audio") may be."""
        return self.max_audio_bytes if medium == "audio" else self.max_image_bytes


class EmbedConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The `[embed]` table: defaults of the corpus job, `python -m infinity embed` (its
    flags of the same names win)."""

    text_column: str = "text"
    id_column: str = "id"  # without such a column, rows are named by their file and row number
    image_column: str | None = None  # read images (paths, URLs or bytes) from this column instead
    audio_column: str | None = None  # likewise audio clips
    embedding_type: Literal["float", "float16", "int8", "uint8", "binary", "ubinary", "sparse"] | None = None
    dimensions: int | None = None
    rows_per_part: int = 4096  # rows of one output part: what a killed job may have to redo
    batch_size: int = 32  # inputs per request to the model
    # A running server to send the rows to (its /v1/embeddings) instead of loading the model
    # here, at `priority` (none: 1, below queries' 0), so that its queries go first.
    url: str | None = None
    priority: Priority | None = None

    def __post_init__(self) -> None:
        if self.image_column is not None and self.audio_column is not None:
            raise ConfigError("embed: give image_column or audio_column, not both")
        if self.priority is not None and self.url is None:
            raise ConfigError("embed.priority orders requests in a server's queue: set embed.url too")
        if self.rows_per_part < 1 or self.batch_size < 1:
            raise ConfigError("embed.rows_per_part and embed.batch_size must be positive")
        if self.dimensions is not None and self.dimensions < 1:
            raise ConfigError("embed.dimensions must be positive")


class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The whole configuration of one server."""

    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    models: list[ModelConfig] = msgspec.field(default_factory=list)
    media: MediaConfig = msgspec.field(default_factory=MediaConfig)
    embed: EmbedConfig = msgspec.field(default_factory=EmbedConfig)
    api_keys: list[ApiKey] = msgspec.field(default_factory=list)

    def key_priorities(self) -> dict[str, int]:
        """Every key a client may send, with the priority of its requests that name none."""
        keys = {} if self.server.api_key is None else {self.server.api_key: 0}
        keys.update((entry.key, entry.priority) for entry in self.api_keys)
        return keys


# Every server key may be set from the environment as INFINITY_<KEY>.
_SERVER_ENV_KEYS = tuple(field.name for field in msgspec.structs.fields(ServerConfig))


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    server_overrides: dict[str, Any] | None = None,
    model_source: str | None = None,
    model_name: str | None = None,
) -> Config:
    """Merge file, environment and command-line values into a validated `Config`.

    `model_source` (CLI `--model` or `INFINITY_MODEL`) replaces the file's model list with
    that one model; with no model anywhere the packaged default model is served.
    """
    env = os.environ if env is None else env
    raw: dict[str, Any] = _read_toml(path) if path else {}
    if not isinstance(raw.get("server", {}), dict):
        raise ConfigError("[server] must be a table")
    server = dict(raw.get("server", {}))
    for key in _SERVER_ENV_KEYS:
        value = env.get(f"INFINITY_{key.upper()}")
        if value is not None:
            server[key] = value
    server.update({k: v for k, v in (server_overrides or {}).items() if v is not None})
    raw["server"] = server

    model_source = model_source or env.get("INFINITY_MODEL")
    if model_source:
        raw["models"] = [{"source": model_source, "name": model_name or ""}]
    elif not raw.get("models"):
        raw["models"] = [{"source": DEFAULT_MODEL_SOURCE}]

    try:
        config = msgspec.convert(raw, Config, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None
    config = msgspec.structs.replace(config, models=[_named(m) for m in config.models])
    names = [m.name for m in config.models]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"models.name must be unique, repeated: {', '.join(duplicates)}")
    defaults = [m.kind for m in config.models if m.default and m.kind != "auto"]
    twice = sorted({kind for kind in defaults if defaults.count(kind) > 1})
    if twice:
        raise ConfigError(f"models.default may mark one model of each kind, not several of kind {', '.join(twice)}")
    return config


def load_one_model(path: str | os.PathLike[str] | None, model: str | None,
                   server_overrides: dict[str, Any] | None = None) -> tuple[Config, ModelConfig]:
    """The configuration at `path` and the one model a job runs: `model` names one of its
    models, or else is a source (a folder, a hub id); without it, the file's only model
    (the packaged default when it has none)."""
    config = load_config(path, server_overrides=server_overrides)
    named = {entry.name: entry for entry in config.models}
    if model is not None and model not in named:
        config = load_config(path, server_overrides=server_overrides, model_source=model)
    elif model is None and len(config.models) > 1:
        raise ConfigError(f"{path} serves several models ({', '.join(named)}): name the one to run")
    return config, named[model] if model in named else config.models[0]


def _read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _named(model: ModelConfig) -> ModelConfig:
    """Give a model without a name the last path component of its source."""
    if model.name:
        return model
    if model.source == DEFAULT_MODEL_SOURCE:
        return msgspec.structs.replace(model, name=DEFAULT_MODEL_NAME)
    return msgspec.structs.replace(model, name=Path(model.source.rstrip("/")).name)
