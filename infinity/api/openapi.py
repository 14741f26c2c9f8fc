"""The API's contract: an OpenAPI 3.1 document built from the routes the server registers
and the msgspec types it decodes requests into and encodes responses from (so the two
cannot drift), and a plain HTML page rendering it for `/docs` that needs nothing from
elsewhere (no CDN, no script)."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from typing import Any, NewType

import msgspec

from infinity.api import binary
from infinity.api.errors import ErrorResponse

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
    kind): a request body's `model` is one of those of its operation's kinds."""
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
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        for path in (op.path, *op.aliases):
            paths.setdefault(url_prefix + path, {})[op.method] = _operation(op, path, api_key)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "Embeddings, reranking and classification behind OpenAI-, Cohere-, TEI- and "
                                "infinity-compatible routes. Every error has the shape of `ErrorResponse`, but "
                                "on TEI's bodies, which answer TEI's `TEIErrorResponse`."},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


# Paths (by their ending) that never need the API key: probes and the Prometheus scrape.
KEYLESS_PATHS = ("/health", "/live", "/metrics", "/ping")


def _operation(op: Operation, path: str, api_key: bool) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK", "content": _json_content(op.answer)}}
    if op.binary:
        responses["200"]["content"][binary.CONTENT_TYPE] = {"schema": {"type": "string", "format": "binary"}}
    errors = (*op.errors, 401) if api_key and not path.endswith(KEYLESS_PATHS) else op.errors
    for status in sorted(errors):
        responses[str(status)] = {"description": ERROR_MEANINGS[status], "content": _json_content(op.error_answer),
                                  **({"headers": _RETRY_AFTER} if status in (429, 503) else {})}
    operation: dict[str, Any] = {
        "summary": op.summary,
        "operationId": f"{op.method}_{path.strip('/').replace('/', '_')}",
        "responses": responses,
    }
    if op.body is not None:
        operation["requestBody"] = {"required": True, "content": _json_content(op.body)}
    if api_key and path.endswith(KEYLESS_PATHS):
        operation["security"] = []
    return operation


def _json_content(named: Any) -> dict[str, Any]:
    """The content of one named type, or of any of several (`anyOf`)."""
    refs = [{"$ref": _REF.format(name=each.__name__)} for each in _named_types(named)]
    return {"application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}


def render_html(doc: dict[str, Any]) -> str:
    """A page that shows `doc` whole: each route with its body and answers, then each type."""
    info = doc["info"]
    parts = [f"<h1>{_e(info['title'])} <small>{_e(info['version'])}</small></h1>",
             f"<p>{_e(info['description'])} The machine-readable document is at "
             f"<a href='openapi.json'>openapi.json</a>.</p>", "<h2>Routes</h2>"]
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            parts.append(f"<section><h3><code>{method.upper()} {_e(path)}</code></h3><p>{_e(op['summary'])}</p>")
            if "requestBody" in op:
                parts.append(f"<p>Body: {_type_link(op['requestBody']['content'])}</p>")
            parts.append("<ul>" + "".join(
                f"<li><b>{status}</b> {_e(answer['description'])}: {_type_link(answer['content'])}</li>"
                for status, answer in op["responses"].items()) + "</ul></section>")
    parts.append("<h2>Types</h2>")
    for name, schema in doc["components"]["schemas"].items():
        parts.append(f"<h3 id='{_e(name)}'>{_e(name)}</h3><pre>{_e(json.dumps(schema, indent=2))}</pre>")
    return ("<!doctype html><html><head><meta charset='utf-8'>"
            f"<title>{_e(info['title'])}</title><style>body{{font-family:sans-serif;max-width:60em;margin:auto}}"
            "pre{background:#f4f4f4;padding:.5em;overflow:auto}section{border-top:1px solid #ccc}</style>"
            f"</head><body>{''.join(parts)}</body></html>")


def _type_link(content: dict[str, Any]) -> str:
    schema = content["application/json"]["schema"]
    names = [ref["$ref"].rsplit("/", 1)[-1] for ref in schema.get("anyOf", [schema])]
    return " or ".join(f"<a href='#{_e(name)}'><code>{_e(name)}</code></a>" for name in names)


def _e(text: str) -> str:
    return html.escape(str(text), quote=True)
