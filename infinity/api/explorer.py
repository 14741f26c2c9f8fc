"""The API explorer at `/docs`: Swagger UI, its assets served by this server from the pinned
`swagger-ui-bundle-v2` package (no CDN: deployments are often offline), showing the OpenAPI
document of the served routes and sending its example requests from the browser. Also the
one builder of that document (`api_document`), which the documentation site's API reference
uses too (docs/hooks/site.py), and the redirect of `GET /` to the explorer (as infinity's).

The page, its assets and the redirect need no API key: they hold nothing of the deployment.
Where the server has a key, the page asks for it before it fetches `/openapi.json`, and
hands it to Swagger UI's Authorize, which sends it with every request tried."""

from __future__ import annotations

import html
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from swagger_ui_bundle import swagger_ui_path

from infinity.api import openapi
from infinity.api.routes import ROUTES

TITLE = "infinity-serve"
# What the page loads, from Swagger UI's distribution: the rest of it (maps, other bundles,
# its own index page) is never served.
ASSETS = ("swagger-ui.css", "swagger-ui-bundle.js", "favicon-32x32.png")


def api_document(version: str, models: dict[str, list[str]], url_prefix: str = "",
                 api_key: bool = False) -> dict[str, Any]:
    """The OpenAPI document of every route, on a server serving `models` (names by kind)."""
    return openapi.document([route.operation for route in ROUTES], TITLE, version, models, url_prefix, api_key)


def asset_folder() -> Path:
    return Path(str(swagger_ui_path))


def page(document: dict[str, Any], assets: str, spec_url: str | None) -> str:
    """The explorer's HTML page: its assets below the relative URL `assets`; the document
    fetched from the relative `spec_url` (asking for the API key where it answers 401) and
    its requests sent from the page, or, without one (a page with no server behind it), the
    document written into the page and nothing sent."""
    try_it = spec_url is not None
    options = {"dom_id": "#swagger-ui", "layout": "BaseLayout", "deepLinking": True, "docExpansion": "list",
               "defaultModelsExpandDepth": 0, "displayRequestDuration": True, "tryItOutEnabled": try_it,
               "supportedSubmitMethods": ["get", "post"] if try_it else [],
               "validatorUrl": None}  # its default is a public validator's badge: nothing from elsewhere
    spec = "null" if try_it else _script_json(document)
    script = _SCRIPT.replace("OPTIONS", _script_json(options)).replace("SPEC_URL", json.dumps(spec_url)).replace(
        "INLINE_SPEC", spec)
    title = html.escape(document["info"]["title"])
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{title} API</title>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<link rel='stylesheet' href='{assets}swagger-ui.css'>"
            f"<link rel='icon' type='image/png' href='{assets}favicon-32x32.png'>"
            f"<style>body{{margin:0}}#api-key{{font-family:sans-serif;max-width:1460px;margin:2em auto;padding:0 20px}}"
            f"</style></head><body>"
            f"<noscript>{_route_list(document)}</noscript>"
            f"<form id='api-key' hidden><h1>{title} API</h1><p id='api-key-note'></p>"
            f"<label>API key <input id='api-key-value' type='password' autocomplete='off'></label> "
            f"<button type='submit'>Show the API</button></form>"
            f"<div id='swagger-ui'></div>"
            f"<script src='{assets}swagger-ui-bundle.js'></script><script>{script}</script></body></html>")


# The page's own script: fetch the document (with the key once one is given), then start
# Swagger UI on it.
_SCRIPT = """
(function () {
  "use strict";
  var options = OPTIONS;
  var form = document.getElementById("api-key");
  var field = document.getElementById("api-key-value");
  var note = document.getElementById("api-key-note");
  function show(spec, key) {
    options.spec = spec;
    options.presets = [SwaggerUIBundle.presets.apis];
    // Under each route's tag, the route before its aliases (a stable sort: else as in the document).
    options.operationsSorter = function (a, b) {
      return (a.get("operation").get("x-alias-of") ? 1 : 0) - (b.get("operation").get("x-alias-of") ? 1 : 0);
    };
    window.ui = SwaggerUIBundle(options);
    if (key) { window.ui.preauthorizeApiKey("bearer", key); }
  }
  function load(key) {
    fetch(SPEC_URL, {headers: key ? {"Authorization": "Bearer " + key} : {}})
      .then(function (answer) {
        if (answer.status === 401) {
          note.textContent = key ? "The server refused that key." : "This server needs its API key.";
          form.hidden = false;
          return null;
        }
        if (!answer.ok) { throw new Error("openapi.json answered " + answer.status); }
        return answer.json();
      })
      .then(function (spec) { if (spec) { form.hidden = true; show(spec, key); } })
      .catch(function (error) { note.textContent = String(error); form.hidden = false; });
  }
  form.addEventListener("submit", function (event) { event.preventDefault(); load(field.value); });
  var inline = INLINE_SPEC;
  if (inline) { show(inline, ""); } else { load(""); }
})();
"""


def _script_json(value: Any) -> str:
    """`value` as JSON safe inside a <script> element (no `</script>` can close it)."""
    return json.dumps(value, separators=(",", ":")).replace("<", "\\u003c")


def _route_list(document: dict[str, Any]) -> str:
    """Every route, its aliases beside it, for a browser without JavaScript."""
    groups: dict[str, list[str]] = {}
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            groups.setdefault(operation["tags"][0], []).append(f"<code>{method.upper()} {html.escape(path)}</code>")
    summaries = {tag["name"]: tag["description"] for tag in document["tags"]}
    items = "".join(f"<li>{', '.join(routes)}: {html.escape(summaries[tag])}</li>" for tag, routes in groups.items())
    return (f"<h1>{html.escape(document['info']['title'])} API</h1><p>The explorer needs JavaScript; the "
            f"document is at <a href='openapi.json'>openapi.json</a>.</p><ul>{items}</ul>")


def add_routes(app: web.Application, url_prefix: str, document: dict[str, Any]) -> frozenset[str]:
    """Serve the explorer of `document` at `{url_prefix}/docs`, its assets below it, and
    redirect `GET {url_prefix}/` to it; the paths it added, which need no API key."""
    text = page(document, "docs/", "openapi.json")

    async def serve_page(request: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/html")

    async def to_the_explorer(request: web.Request) -> web.StreamResponse:
        # Relative, so that it holds behind a proxy that serves the API below a path of its own.
        raise web.HTTPFound("docs")

    paths = {f"{url_prefix}/docs": serve_page, f"{url_prefix}/": to_the_explorer}
    for name in ASSETS:
        paths[f"{url_prefix}/docs/{name}"] = _asset(asset_folder() / name)
    for path, handler in paths.items():
        app.router.add_get(path, handler)
    return frozenset(paths)


def _asset(file: Path) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def serve(request: web.Request) -> web.StreamResponse:
        # FileResponse answers conditional requests (ETag, Last-Modified) with 304.
        return web.FileResponse(file, headers={"Cache-Control": "public, max-age=3600"})

    return serve
