"""The API's contract: an OpenAPI 3.1 document built from the routes the server registers
and the msgspec types it decodes requests into and encodes responses from (so the two
cannot drift), with an example request and answer per route (`infinity.api.examples`).
`/docs` shows it in an explorer (`infinity.api.explorer`), and the documentation site's
API reference is built from the same function (docs/hooks/site.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NewType

import msgspec

from infinity.api import binary
from infinity.api.errors import ErrorResponse
from infinity.api.examples import EXAMPLES, MODELS_BY_KIND

_REF = "#/components/schemas/{name}"

# What each error status means on this API; routes list the ones they can answer.
ERROR_MEANINGS = {
    400: "The body is not valid JSON, is nested too deeply, names a key twice, or cannot be read; "
         "or the model serves another route",
    401: "The API key is missing or wrong",
    404: "No such model (or route)",
    408: "The request's headers or body did not arrive in time",
    413: "The body is larger than the server accepts",
    415: "The body is not declared as JSON",
    422: "The body is JSON but not a valid request: a field of the wrong type or out of range, too many "
         "inputs, an input too long with truncation off",
    429: "The model's queue is full: retry after `Retry-After` seconds",
    503: "Not ready: loading, restarting a worker process, or shutting down; retry after `Retry-After` seconds",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}}


@dataclass(frozen=True)
class Operation:
    """One route as the contract states it."""

    method: str  # "get" or "post"
    path: str  # below the url prefix, e.g. "/v1/embeddings"
    aliases: tuple[str, ...]  # other paths serving the same operation
    summary: str
    # A Struct, or several where a path takes the bodies of several dialects (the route's
    # `body_of` tells them apart).
    body: type[msgspec.Struct] | tuple[type[msgspec.Struct], ...] | None
    # A Struct, or a NewType that names an answer of another shape (a bare list), or a
    # union of shapes (answered in the shape its body asks); several: one per dialect.
    answer: type[msgspec.Struct] | NewType | tuple[type[msgspec.Struct] | NewType, ...]
    errors: tuple[int, ...]
    kinds: tuple[str, ...] = ()  # the kinds of model the body's `model` may name (embed, rerank, ...)
    # Its bodies are other operations' and each is served as there, where their kinds apply
    # (SageMaker's one path): it declares none of its own.
    forwards: bool = False
    media: bool = False  # its inputs are always media (data: URIs, URLs), not texts
    binary: bool = False  # it may also answer raw bytes (application/octet-stream), as its body asks
    error_answer: Any = ErrorResponse  # the shape of its errors (a dialect's own), or a tuple of shapes


def _named_types(named: Any) -> tuple[Any, ...]:
    return named if isinstance(named, tuple) else () if named is None else (named,)


def document(operations: list[Operation], title: str, version: str, models: dict[str, list[str]],
             url_prefix: str = "", api_key: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `operations`, on a server that serves `models` (names by
    kind): a request body's `model` is one of those of its operation's kinds. Each
    operation's aliases share its tag (explorers group by tag) and its examples
    (`infinity.api.examples`); every error answer is one entry of `components.responses`."""
    types = list(dict.fromkeys([ErrorResponse] + [t for op in operations for shape in (op.body, op.answer,
                                                                                       op.error_answer)
                                                  for t in _named_types(shape)]))
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    for named, schema in zip(types, schemas):
        if "$ref" not in schema:  # a NewType's: referenced by its name like the others
            components[named.__name__] = schema
    # A body type shared by several operations names a model of any of their kinds.
    kinds_by_body: dict[str, list[str]] = {}
    for op in operations:
        for body in _named_types(op.body) if op.kinds else ():
            kinds_by_body.setdefault(body.__name__, [])
            kinds_by_body[body.__name__] += [kind for kind in op.kinds if kind not in kinds_by_body[body.__name__]]
    for body, kinds in kinds_by_body.items():
        if "model" not in components[body]["properties"]:  # a dialect whose bodies name no model (TEI's)
            continue
        components[body]["properties"]["model"] = {
            "anyOf": [{"enum": [name for kind in kinds for name in models.get(kind, [])]}, {"type": "null"}],
            "description": f"A served model of kind {' or '.join(kinds)}; none: the only one of those kinds"}
    parts = _Parts(models, api_key)
    paths: dict[str, dict[str, Any]] = {}
    tags = []
    for op in operations:
        tag = op.path if sum(other.path == op.path for other in operations) == 1 else f"{op.method.upper()} {op.path}"
        tags.append({"name": tag, "description": op.summary})
        examples = parts.examples(op)
        for path in (op.path, *op.aliases):
            paths.setdefault(url_prefix + path, {})[op.method] = parts.operation(op, path, tag, examples)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "Embeddings, reranking and classification behind OpenAI-, Cohere-, Jina-, TEI-, "
                                "vLLM- and infinity-compatible routes, each route with its aliases under one tag. "
                                "Every error has the shape of `ErrorResponse`, but on TEI's bodies, which answer "
                                "TEI's `TEIErrorResponse`; what each status means is said once, in "
                                "`components.responses`."},
        "tags": tags,
        "paths": paths,
        "components": {"schemas": components, "responses": parts.responses, "examples": parts.example_objects},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                            "description": "The server's API key"}}
        doc["security"] = [{"bearer": []}]
    return doc


# Paths (by their ending) that never need the API key: probes and the Prometheus scrape.
KEYLESS_PATHS = ("/health", "/live", "/metrics", "/ping")


class _Parts:
    """What the operations of one document share, each defined once in its components:
    the error answers (by status and shape) and the examples (by operation)."""

    def __init__(self, models: dict[str, list[str]], api_key: bool) -> None:
        self.models = models
        self.api_key = api_key
        self.responses: dict[str, Any] = {}
        self.example_objects: dict[str, Any] = {}

    def examples(self, op: Operation) -> list[tuple[str, str, str | None]]:
        """(name, answer's component, request's component or None) of each of `op`'s
        examples, their `model` a served one of its kinds where one is served (of a
        forwarding operation, of the kind the example's own model is of)."""
        found = []
        for example in EXAMPLES.get(f"{op.method} {op.path}", ()):
            kinds = op.kinds if not op.forwards else [
                kind for kind, names in MODELS_BY_KIND.items()
                if isinstance(example.request, dict) and example.request.get("model") in names]
            served = next((name for kind in kinds for name in self.models.get(kind, [])), None)
            key = f"{op.method}_{op.path.strip('/').replace('/', '_') or 'root'}.{example.name}"
            request = _naming(example.request, served)
            if request is not None:
                self.example_objects[f"{key}.request"] = {"summary": example.summary, "value": request}
            self.example_objects[f"{key}.answer"] = {"summary": example.summary,
                                                     "value": _naming(example.answer, served)}
            found.append((example.name, f"{key}.answer", f"{key}.request" if request is not None else None))
        return found

    def operation(self, op: Operation, path: str, tag: str, examples: list[tuple[str, str, str | None]]
                  ) -> dict[str, Any]:
        answer = _json_content(op.answer)
        if examples:
            answer["application/json"]["examples"] = {name: _example_ref(key) for name, key, _ in examples}
        responses: dict[str, Any] = {"200": {"description": "OK", "content": answer}}
        if op.binary:
            responses["200"]["content"][binary.CONTENT_TYPE] = {"schema": {"type": "string", "format": "binary"}}
        errors = (*op.errors, 401) if self.api_key and not path.endswith(KEYLESS_PATHS) else op.errors
        for status in sorted(errors):
            responses[str(status)] = {"$ref": f"#/components/responses/{self._error(status, op.error_answer)}"}
        operation: dict[str, Any] = {
            "tags": [tag],
            # An alias says what it is one of; what the operation does is its tag's description.
            "summary": op.summary if path == op.path else f"The same as {op.path}",
            "operationId": f"{op.method}_{path.strip('/').replace('/', '_')}",
            "responses": responses,
        }
        if op.aliases:
            operation["description"] = ("Also served at " + ", ".join(f"`{alias}`" for alias in op.aliases) + "."
                                        if path == op.path else f"{op.summary}: an alias of `{op.path}`.")
        if path != op.path:
            # For explorers: a path may hold operations of two routes (GET /ping is an alias of
            # /health, POST /ping a route of its own), so the document's order cannot put
            # every route before its aliases; /docs sorts by this.
            operation["x-alias-of"] = f"{op.method.upper()} {op.path}"
        if op.body is not None:
            body = _json_content(op.body)
            requests = {name: _example_ref(key) for name, _, key in examples if key is not None}
            if requests:
                body["application/json"]["examples"] = requests
            operation["requestBody"] = {"required": True, "content": body}
        if self.api_key and path.endswith(KEYLESS_PATHS):
            operation["security"] = []
        return operation

    def _error(self, status: int, shape: Any) -> str:
        """The name of the error answer of `status` in `shape` (one error type or several),
        added to the components the first time."""
        named = _named_types(shape)
        name = "Or".join(each.__name__.removesuffix("Response") for each in named) + str(status)
        if name not in self.responses:
            self.responses[name] = {"description": ERROR_MEANINGS[status], "content": _json_content(shape),
                                    **({"headers": _RETRY_AFTER} if status in (429, 503) else {})}
        return name


def _example_ref(key: str) -> dict[str, str]:
    return {"$ref": f"#/components/examples/{key}"}


def _naming(value: Any, model: str | None) -> Any:
    """`value` (an example's body or answer), its `model` replaced by `model` if one is given."""
    if model is not None and isinstance(value, dict) and "model" in value:
        return {**value, "model": model}
    return value


def _json_content(named: Any) -> dict[str, Any]:
    """The content of one named type, or of any of several (`anyOf`)."""
    refs = [{"$ref": _REF.format(name=each.__name__)} for each in _named_types(named)]
    return {"application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}
