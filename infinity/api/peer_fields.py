"""Every request field the servers we stand in for name, per request type: who names it
(OpenAI, Cohere, TEI, vLLM, Jina, infinity, or a client that sends it) and what it does
here. A field is honoured (a field of the request type, with that peer's meaning) or
refused (a 422 naming it and saying why); a key no peer names is refused too, unless
`[server] unknown_fields = "ignore"`. `check_fields` applies the rule to a body's keys;
`markdown` renders the table docs/api.md carries."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import msgspec

from infinity.api.errors import APIError
from infinity.api.types.common import ImageUrl
from infinity.api.types.embeddings import ChatMessage, CohereEmbedRequest, EmbeddingRequest, SparseEmbedRequest
from infinity.api.types.scores import ClassifyRequest, RerankRequest
from infinity.api.types.tei import (TEIDecodeRequest, TEIEmbedAllRequest, TEIEmbedRequest, TEIPredictRequest,
                                    TEIRerankRequest, TEISimilarityRequest)
from infinity.api.types.tokens import DetokenizeRequest, TokenizeRequest
from infinity.api.types.vllm import PoolingRequest, ScoreRequest

if TYPE_CHECKING:
    from infinity.api.routes.common import Route

OPENAI, COHERE, TEI, VLLM, JINA, INFINITY = "OpenAI", "Cohere", "TEI", "vLLM", "Jina", "infinity"
OURS = "ours"  # a field of this server's own
HF_CLIENT, LITELLM = "huggingface_hub", "LiteLLM"  # clients that send a field no server names


@dataclass(frozen=True)
class PeerField:
    """One field: who names it, and what it does here (or why it is refused)."""

    peers: tuple[str, ...]
    does: str
    refused: bool = False


def _honoured(does: str, *peers: str) -> PeerField:
    return PeerField(peers, does)


def _refused(why: str, *peers: str) -> PeerField:
    return PeerField(peers, why, refused=True)


_PRIORITY = _honoured("lower is served first; none: the API key's", VLLM, OURS)
_VLLM_TRUNCATE = _honoured("k: each input cut at its start to its last k tokens (special tokens counted; up to the "
                           "model's length, not after a prompt); -1 or none: cut at its end to the model's length",
                           VLLM)
_VLLM_PAIRS_TRUNCATE = _honoured("-1 or none only: a pair is cut at its document's end (keeping last tokens is "
                                 "refused)", VLLM)
_VLLM_SPECIAL_TOKENS = _honoured("false: texts tokenized without the model's special tokens (not after a prompt, "
                                 "nor with chunks)", VLLM)
# vLLM's fields of every pooling request that this server does not serve.
_VLLM_UNSERVED = {
    "request_id": _refused("answers carry this server's own id", VLLM),
    "mm_processor_kwargs": _refused("the model's processor runs with its saved settings", VLLM),
    "cache_salt": _refused("no prefix cache here to salt", VLLM),
    "truncation_side": _refused("truncate_prompt_tokens k keeps the last k tokens (left); -1 cuts at the end",
                                VLLM),
    "padding": _refused("each input is computed as if alone: padding is not chosen by the request", VLLM),
}
_VLLM_CHAT = {name: _refused("chat templates are not applied: `messages` hold one text or medium, embedded as it is",
                             VLLM)
              for name in ("chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")}
_PROMPT_NAME = _honoured("the model's prompt of this name before each text", TEI, OURS)
_PROMPT = _honoured("a prompt of the request's own before each text", OURS)
_TEI_TRUNCATE = _honoured("true: cut long inputs to the model's length; false: refuse them; none: as the model "
                          "is set", TEI)
_TEI_DIRECTION = _honoured("Right: a long input's end is cut; Left: its start (its last tokens kept; not after a "
                           "prompt)", TEI)
_DIMENSIONS = _honoured("keep the first this many dimensions, re-normalised unless normalisation is off; 0: all "
                        "(infinity's client sends 0)", OPENAI, VLLM, JINA, INFINITY, TEI)
_USER = _honoured("accepted (an end user's id; changes nothing)", OPENAI, VLLM, INFINITY, TEI)

EMBEDDINGS = {
    "input": _honoured("a text, texts, token ids, or lists of token ids; data: URIs or URLs for `modality` image "
                       "or audio", OPENAI, VLLM, JINA, INFINITY, TEI),
    "model": _honoured("the served model's name; none: the only model of its kind", OPENAI, VLLM, JINA, INFINITY, TEI),
    "encoding_format": _honoured("float, base64 (raw float32, or `embed_dtype` in `endianness`), bytes, bytes_only; "
                                 "null: float", OPENAI, VLLM, INFINITY, TEI),
    "dimensions": _DIMENSIONS,
    "output_dimension": _honoured("as `dimensions` (LiteLLM's infinity provider sends it so)", LITELLM),
    "user": _USER,
    "modality": _honoured("text, image or audio: what `input` holds", INFINITY),
    "messages": _honoured("one text, image_url, audio_url or input_audio part, instead of `input`", VLLM),
    "embed_dtype": _honoured("float32, float16, bfloat16, fp8_e4m3 or fp8_e5m2: the wire type of base64 and "
                             "bytes (with bytes, vLLM's metadata header too)", VLLM),
    "endianness": _honoured("little or big (native: this machine's) for base64 and bytes (with bytes, vLLM's "
                            "metadata header too)", VLLM),
    "truncate_prompt_tokens": _VLLM_TRUNCATE,
    "add_special_tokens": _VLLM_SPECIAL_TOKENS,
    "use_activation": _honoured("false: the vectors before the model's final Normalize", VLLM),
    "normalize": _refused("vLLM's earlier name, which it removed: use use_activation", VLLM),
    "priority": _PRIORITY,
    **_VLLM_UNSERVED, **_VLLM_CHAT,
    "embedding_type": _honoured("float, int8, uint8, binary or ubinary (Jina's base64: use encoding_format)",
                                JINA, OURS),
    "embedding_types": _honoured("several types at once, each item's `embeddings` by type", OURS),
    "task": _refused("Jina's task adapters are not served: input_type or prompt_name picks a model's prompt", JINA),
    "normalized": _refused("vectors are as the model gives them: use_activation false asks for them before its "
                           "final Normalize", JINA),
    "truncate": _refused("use long_inputs (truncate, chunk or error)", JINA),
    "late_chunking": _honoured("a vector per span of each text from one reading, with `spans` or `split` (Jina's "
                               "form without them is refused)", JINA, OURS),
    "input_type": _honoured("the inputs' role (query, document, ...): the model's prompt for it", OURS),
    "prompt_name": _PROMPT_NAME,
    "prompt": _PROMPT,
    "top_k": _honoured("a sparse model's largest values only", OURS),
    "outputs": _honoured("a hybrid model's outputs (dense, sparse, multivector)", OURS),
    "long_inputs": _honoured("truncate, chunk or error for inputs longer than the model", OURS),
    "chunk_overlap": _honoured("tokens each chunk shares with the one before", OURS),
    "input_usage": _honoured("each input's tokens in `usage`", OURS),
    "spans": _honoured("character spans of each text (late chunking)", OURS),
    "split": _honoured("sentences: the spans are the text's sentences (late chunking)", OURS),
}

COHERE_EMBED = {
    "texts": _honoured("the texts to embed", COHERE),
    "images": _honoured("images as data: URIs or URLs", COHERE),
    "inputs": _honoured("v2's content parts, one text or image each", COHERE),
    "model": _honoured("the served model's name", COHERE),
    "input_type": _honoured("search_query, search_document, classification, clustering or image: the model's "
                            "prompt for it", COHERE),
    "embedding_types": _honoured("float, int8, uint8, binary, ubinary, base64", COHERE),
    "truncate": _honoured("NONE refuses long inputs, END cuts them; START is refused", COHERE),
    "output_dimension": _honoured("keep the first this many dimensions, re-normalised", COHERE),
    "max_tokens": _refused("inputs are cut at the model's length, not a length of the request's", COHERE),
    "priority": _PRIORITY,
    "long_inputs": _honoured("truncate, chunk or error for inputs longer than the model", OURS),
    "chunk_overlap": _honoured("tokens each chunk shares with the one before", OURS),
    "late_chunking": _honoured("refused on Cohere's bodies: use /v1/embeddings", OURS),
    "spans": _honoured("refused on Cohere's bodies (late chunking)", OURS),
    "split": _honoured("refused on Cohere's bodies (late chunking)", OURS),
    "prompt_name": _PROMPT_NAME,
    "prompt": _PROMPT,
}

SPARSE = {
    "inputs": _honoured("a text, texts or token ids", TEI),
    "truncate": _TEI_TRUNCATE,
    "truncation_direction": _honoured("Right only (the end of an input is cut); Left is refused", TEI),
    "prompt_name": _PROMPT_NAME,
    "model": _honoured("the served model's name; none: the only sparse model", OURS),
    "top_k": _honoured("each vector's largest values only", OURS),
    "priority": _PRIORITY,
    "prompt": _PROMPT,
}

RERANK = {
    "query": _honoured("the query each document is scored against", COHERE, JINA, VLLM, INFINITY),
    "documents": _honoured("texts or {text} objects; a page-retrieval model's page images", COHERE, JINA, VLLM,
                           INFINITY),
    "model": _honoured("the served model's name", COHERE, JINA, VLLM, INFINITY),
    "top_n": _honoured("the best this many; 0 or none: all", COHERE, JINA, VLLM, INFINITY),
    "return_documents": _honoured("each result's document: {text} on /v1 and /v2, the text on /rerank", COHERE,
                                  JINA, INFINITY),
    "raw_scores": _honoured("the model's logits instead of its activation", INFINITY),
    "max_chunks_per_doc": _honoured("a long document scored as its best of this many chunks", COHERE),
    "texts": _refused("TEI's: a body with documents is Cohere's and Jina's (TEI's rerank: texts without documents)",
                      TEI),
    "rank_fields": _refused("documents are texts or {text}: no fields to choose", COHERE),
    "max_tokens_per_doc": _refused("documents are cut at the model's length (or chunked: max_chunks_per_doc)",
                                   COHERE, VLLM),
    "max_tokens_per_query": _refused("queries are cut at the model's length", VLLM),
    "use_activation": _honoured("false: the logits, as raw_scores", VLLM),
    "truncate_prompt_tokens": _VLLM_PAIRS_TRUNCATE,
    "user": _USER,
    "chunk_overlap": _honoured("tokens each chunk shares with the one before", OURS),
    "priority": _PRIORITY,
    **_VLLM_UNSERVED,
}

CLASSIFY = {
    "input": _honoured("a text, texts or token ids", INFINITY, VLLM),
    "model": _honoured("the served model's name", INFINITY, VLLM),
    "raw_scores": _honoured("the logits instead of probabilities", INFINITY),
    "use_activation": _honoured("false: the logits; any of vLLM's fields: vLLM's answer", VLLM),
    "truncate_prompt_tokens": _VLLM_TRUNCATE,
    "add_special_tokens": _VLLM_SPECIAL_TOKENS,
    "messages": _refused("classify takes `input` here", VLLM),
    "softmax": _refused("vLLM's earlier name: use use_activation", VLLM),
    "activation": _refused("vLLM's earlier name: use use_activation", VLLM),
    "user": _USER,
    "priority": _PRIORITY,
    **_VLLM_UNSERVED, **_VLLM_CHAT,
}

SCORE = {
    "model": _honoured("the served model's name", VLLM),
    "text_1": _honoured("a text or texts, scored against text_2", VLLM),
    "text_2": _honoured("a text or texts", VLLM),
    "queries": _honoured("a text or texts, scored against documents", VLLM),
    "documents": _honoured("a text or texts", VLLM),
    "items": _refused("use queries and documents", VLLM),
    "data_1": _refused("use text_1 and text_2", VLLM),
    "data_2": _refused("use text_1 and text_2", VLLM),
    "use_activation": _honoured("false: a reranker's logits", VLLM),
    "truncate_prompt_tokens": _VLLM_PAIRS_TRUNCATE,
    "max_tokens_per_query": _honoured("0 only: queries are cut at the model's length", VLLM),
    "max_tokens_per_doc": _honoured("0 only: documents are cut at the model's length", VLLM),
    "user": _USER,
    "priority": _PRIORITY,
    **_VLLM_UNSERVED,
}

POOLING = {
    "input": _honoured("a text, texts or token ids", VLLM),
    "model": _honoured("the served model's name", VLLM),
    "task": _honoured("embed or classify: the model's (token_embed, token_classify are refused)", VLLM),
    "encoding_format": _honoured("float only", VLLM),
    "use_activation": _honoured("false: a classifier's logits, an embedder's vectors before its final Normalize",
                                VLLM),
    "truncate_prompt_tokens": _VLLM_TRUNCATE,
    "messages": _refused("pooling takes `input` here", VLLM),
    "dimensions": _refused("use /v1/embeddings for dimensions", VLLM),
    "embed_dtype": _refused("pooling answers JSON floats: use /v1/embeddings for embed_dtype", VLLM),
    "endianness": _refused("pooling answers JSON floats: use /v1/embeddings for endianness", VLLM),
    "add_special_tokens": _VLLM_SPECIAL_TOKENS,
    "data": _refused("plugin inputs are not served", VLLM),
    "user": _USER,
    "priority": _PRIORITY,
    **_VLLM_UNSERVED, **_VLLM_CHAT,
}

TOKENIZE = {
    "model": _honoured("the served model's name", VLLM),
    "prompt": _honoured("a text (vLLM's answer)", VLLM),
    "inputs": _honoured("a text or texts (TEI's answer)", TEI),
    "add_special_tokens": _honoured("the model's special tokens too", VLLM, TEI),
    "return_token_strs": _honoured("each token as the vocabulary spells it", VLLM),
    "prompt_name": _honoured("the model's prompt of this name before the text", TEI),
    "messages": _refused("chat templates are not applied: tokenize a prompt", VLLM),
    **_VLLM_CHAT,
    "tools": _refused("chat templates are not applied", VLLM),
    "mm_processor_kwargs": _VLLM_UNSERVED["mm_processor_kwargs"],
}

DETOKENIZE = {
    "model": _honoured("the served model's name", VLLM),
    "tokens": _honoured("one sequence of ids (vLLM's answer)", VLLM),
    "ids": _honoured("a sequence of ids or a list of them (TEI's answer)", TEI),
    "skip_special_tokens": _honoured("leave the special tokens out of the text", TEI),
}

_TEI_PRIORITY = _honoured("lower is served first; none: the API key's", OURS)

TEI_EMBED = {
    "inputs": _honoured("a text, texts or token ids", TEI, HF_CLIENT),
    "normalize": _honoured("false: the vectors before the model's final Normalize", TEI, HF_CLIENT),
    "truncate": _TEI_TRUNCATE,
    "truncation_direction": _TEI_DIRECTION,
    "prompt_name": _PROMPT_NAME,
    "dimensions": _honoured("keep the first this many dimensions (re-normalised where normalize)", TEI, HF_CLIENT),
    "encoding_format": _refused("TEI's /embed answers JSON floats: use /v1/embeddings for base64", HF_CLIENT),
    "priority": _TEI_PRIORITY,
}

TEI_EMBED_ALL = {
    "inputs": _honoured("a text, texts or token ids", TEI),
    "truncate": _TEI_TRUNCATE,
    "truncation_direction": _TEI_DIRECTION,
    "prompt_name": _PROMPT_NAME,
    "priority": _TEI_PRIORITY,
}

TEI_RERANK = {
    "query": _honoured("the query each text is scored against", TEI),
    "texts": _honoured("the texts to score", TEI),
    "raw_scores": _honoured("the logits instead of the activation", TEI),
    "return_text": _honoured("each result's text", TEI),
    "truncate": _TEI_TRUNCATE,
    "truncation_direction": _honoured("Right only (Left is refused: a pair is cut at its text's end)", TEI),
    "priority": _TEI_PRIORITY,
}

TEI_PREDICT = {
    "inputs": _honoured("a text, a pair of texts, or a batch of texts and pairs", TEI, HF_CLIENT),
    "raw_scores": _honoured("the logits instead of probabilities", TEI),
    "truncate": _TEI_TRUNCATE,
    "truncation_direction": _TEI_DIRECTION,
    "parameters": _honoured("empty only (function_to_apply and top_k are refused: use raw_scores; every label is "
                            "answered)", HF_CLIENT),
    "priority": _TEI_PRIORITY,
}

TEI_SIMILARITY = {
    "inputs": _honoured("{source_sentence, sentences}", TEI, HF_CLIENT),
    "parameters": _honoured("truncate, truncation_direction, prompt_name", TEI, HF_CLIENT),
    "priority": _TEI_PRIORITY,
}

TEI_DECODE = {
    "ids": _honoured("a sequence of ids or a list of them", TEI),
    "skip_special_tokens": _honoured("leave the special tokens out of the text", TEI),
    "priority": _TEI_PRIORITY,
}

# The objects inside bodies (content parts, TEI's parameters): their peers' fields that are
# not theirs here. Their own fields are honoured; any other key is unknown.
IMAGE_URL = {"detail": _refused("an image's detail level is a chat model's: this model reads each image as its "
                                "processor sizes it", OPENAI, VLLM)}
CHAT_MESSAGE = {"name": _refused("chat templates are not applied: a message's name has nowhere to go", OPENAI, VLLM)}
NESTED_FIELDS: dict[type[msgspec.Struct], dict[str, PeerField]] = {ImageUrl: IMAGE_URL, ChatMessage: CHAT_MESSAGE}

# Every request type a route decodes, and its fields.
FIELDS: dict[type[msgspec.Struct], dict[str, PeerField]] = {
    EmbeddingRequest: EMBEDDINGS, CohereEmbedRequest: COHERE_EMBED, SparseEmbedRequest: SPARSE,
    RerankRequest: RERANK, ClassifyRequest: CLASSIFY, ScoreRequest: SCORE, PoolingRequest: POOLING,
    TokenizeRequest: TOKENIZE, DetokenizeRequest: DETOKENIZE, TEIEmbedRequest: TEI_EMBED,
    TEIEmbedAllRequest: TEI_EMBED_ALL, TEIRerankRequest: TEI_RERANK, TEIPredictRequest: TEI_PREDICT,
    TEISimilarityRequest: TEI_SIMILARITY, TEIDecodeRequest: TEI_DECODE,
}


@cache
def _fields_of(struct_type: type[msgspec.Struct]) -> dict[str, msgspec.inspect.Type]:
    """A Struct's fields by their JSON names, with their types (as msgspec sees them), and
    its tag's field (a content part's `type`)."""
    info = msgspec.inspect.type_info(struct_type)
    assert isinstance(info, msgspec.inspect.StructType)
    tag = {info.tag_field: msgspec.inspect.StrType()} if info.tag_field else {}
    return {**tag, **{field.encode_name: field.type for field in info.fields}}


def check_fields(request_type: type[msgspec.Struct], members: dict[str, msgspec.Raw], unknown: str = "refuse",
                 path: str = "") -> None:
    """A 422 naming the first key of a body's `members` (its top-level object, undecoded),
    or of an object inside it (a content part, TEI's parameters: `path` is where), that
    its type does not honour: a peer's field refused here (with why), or, unless `unknown`
    is "ignore", a key no peer names."""
    own, table = _fields_of(request_type), FIELDS.get(request_type) or NESTED_FIELDS.get(request_type, {})
    nested = _nested_fields(request_type)
    for key, value in members.items():
        if key in own:
            if key in nested:
                _check_value(nested[key], value, unknown, f"{path}{key}")
            continue
        param = f"{path}{key}"
        field = table.get(key)
        if field is not None:
            raise APIError(422, f"{param} ({', '.join(field.peers)}) is not served here: {field.does}", param=param)
        if unknown != "ignore":
            raise APIError(422, f"unknown field '{param}': no server this one stands in for names it here (set "
                                "[server] unknown_fields = \"ignore\" to ignore such fields)", param=param)


@cache
def _nested_fields(struct_type: type[msgspec.Struct]) -> dict[str, msgspec.inspect.Type]:
    """The fields of a Struct whose values hold objects of their own (content parts,
    parameters): the only ones `check_fields` looks inside."""
    return {name: field_type for name, field_type in _fields_of(struct_type).items() if _holds_structs(field_type)}


def _check_value(field_type: msgspec.inspect.Type, value: msgspec.Raw, unknown: str, path: str) -> None:
    """`check_fields` on the objects inside a member of type `field_type`: a Struct's, a
    list's items', the member of a union its JSON shape (and a part's `type` tag) picks.
    A value of another shape is left to the typed decode, which says what is wrong."""
    if isinstance(field_type, msgspec.inspect.Metadata):
        field_type = field_type.type
    if isinstance(field_type, msgspec.inspect.StructType):
        members = _object_members(value)
        if members is not None:
            check_fields(field_type.cls, members, unknown, f"{path}.")
    elif isinstance(field_type, msgspec.inspect.ListType) and _holds_structs(field_type.item_type):
        items = _decoded(value, list[msgspec.Raw])
        for i, item in enumerate(items or ()):
            _check_value(field_type.item_type, item, unknown, f"{path}[{i}]")
    elif isinstance(field_type, msgspec.inspect.UnionType) and _holds_structs(field_type):
        shapes = [member for member in field_type.types if _holds_structs(member)]
        members = _object_members(value)
        structs = [s for s in shapes if isinstance(s, msgspec.inspect.StructType)]
        if members is not None and structs:
            tag = _decoded(members.get(structs[0].tag_field or "", msgspec.Raw(b"null")), object)
            chosen = next((s for s in structs if s.tag_field is None or s.tag == tag), None)
            if chosen is not None:
                _check_value(chosen, value, unknown, path)
        elif members is None:
            for shape in shapes:
                if isinstance(shape, msgspec.inspect.ListType):
                    _check_value(shape, value, unknown, path)


def _holds_structs(field_type: msgspec.inspect.Type) -> bool:
    if isinstance(field_type, msgspec.inspect.Metadata):
        return _holds_structs(field_type.type)
    if isinstance(field_type, msgspec.inspect.StructType):
        return True
    if isinstance(field_type, msgspec.inspect.ListType):
        return _holds_structs(field_type.item_type)
    if isinstance(field_type, msgspec.inspect.UnionType):
        return any(_holds_structs(member) for member in field_type.types)
    return False


def _object_members(value: msgspec.Raw) -> dict[str, msgspec.Raw] | None:
    return _decoded(value, dict[str, msgspec.Raw])


def _decoded(value: msgspec.Raw, as_type: object) -> object:
    try:
        return msgspec.json.decode(value, type=as_type)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def markdown(routes: Iterable[Route]) -> str:
    """The table of every request type's fields under the paths of `routes` that take it
    (`/invocations`, which forwards every other's bodies, aside): field, who names it,
    what it does here. `python -m infinity.api.peer_fields` prints it for docs/api.md."""
    paths: dict[type, list[str]] = {}
    for route in routes:
        body = route.operation.body
        for body_type in () if body is None or route.operation.forwards else body if isinstance(body, tuple) else (body,):
            paths.setdefault(body_type, []).extend([route.operation.path, *route.operation.aliases])
    sections = []
    for request_type, fields in {**FIELDS, **NESTED_FIELDS}.items():
        rows = [f"| `{name}` | {', '.join(field.peers)} | {'refused: ' if field.refused else ''}{field.does} |"
                for name, field in fields.items()]
        taken_on = ", ".join(f"`{path}`" for path in paths.get(request_type, [])) or "inside the bodies above"
        sections.append("\n".join([f"`{request_type.__name__}` ({taken_on})", "", "| field | named by | here |",
                                   "| --- | --- | --- |", *rows]))
    return "\n\n".join(sections)


if __name__ == "__main__":
    from infinity.api.routes import ROUTES

    print(markdown(ROUTES))
