"""The documentation site's hook (mkdocs.yml): the pages that are not files of docs/.

- The API reference (what `reference.md` holds after its prose): the server's explorer
  (`infinity.api.explorer`) on the OpenAPI document that the server's own builder makes for
  a server of one model of each kind (`infinity.api.examples.MODELS_BY_KIND`), with Swagger
  UI's assets from the same pinned package, and the routes and errors as tables that the
  site's search finds.
- The benchmark results (`bench/RESULTS.md`, `bench/results/*.md`), as pages at the same
  paths below the site's root.
- The links of every page that leave docs/ (to `../bench/...`), pointed at those pages, so
  that the same Markdown links work on the repository's own view and in the site.
"""

from __future__ import annotations

import json
import posixpath
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
# The site shows the API of this checkout, whichever copy of the package the environment has.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from infinity.api import explorer, openapi  # noqa: E402
from infinity.api.app import package_version  # noqa: E402
from infinity.api.examples import MODELS_BY_KIND  # noqa: E402

DOCS = "docs"
REFERENCE = "reference.md"
EXPLORER = "reference/explorer.html"
# A Markdown link's target: `[text](target)`.
LINK = re.compile(r"(\]\(\s*<?)([^)\s>]+)")


def _bench_pages() -> list[str]:
    return ["bench/RESULTS.md", *sorted(str(path.relative_to(ROOT)) for path in (ROOT / "bench" / "results")
                                        .glob("*.md"))]


def site_document() -> dict[str, Any]:
    """The API reference's OpenAPI document: the server's, for one model of each kind."""
    return explorer.api_document(package_version(), MODELS_BY_KIND)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for page in _bench_pages():
        files.append(File.generated(config, page, abs_src_path=str(ROOT / page)))
    document = site_document()
    files.append(File.generated(config, "reference/openapi.json", content=json.dumps(document, indent=2)))
    files.append(File.generated(config, EXPLORER, content=explorer.page(document, "", None)))
    for name in explorer.ASSETS:
        files.append(File.generated(config, f"reference/{name}", abs_src_path=str(explorer.asset_folder() / name)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    source = _repository_path(page.file.src_uri)
    here = posixpath.dirname(page.file.src_uri)

    def retarget(match: re.Match[str]) -> str:
        target, hash_, anchor = match.group(2).partition("#")
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            return match.group(0)  # an anchor of the page itself, a URL, or a path the site checks as it is
        in_site = _site_path(posixpath.normpath(posixpath.join(posixpath.dirname(source), target)))
        if in_site is None:
            return match.group(0)  # no page of the site: left for the strict build to report
        return match.group(1) + posixpath.relpath(in_site, here or ".") + hash_ + anchor

    if page.file.src_uri == REFERENCE:
        page.meta["hide"] = ["toc"]  # Material's: the explorer takes the page's width
        markdown += _reference(site_document(), files.get_file_from_path(EXPLORER).url_relative_to(page.file))
    return LINK.sub(retarget, markdown)


def _repository_path(src_uri: str) -> str:
    """Where in the repository a page of the site comes from."""
    return src_uri if src_uri.startswith("bench/") else f"{DOCS}/{src_uri}"


def _site_path(path: str) -> str | None:
    """The site's path of the repository's file `path`, if the site has it."""
    if path.startswith(f"{DOCS}/"):
        return path.removeprefix(f"{DOCS}/")
    if path in _bench_pages():
        return path
    return None


def _reference(document: dict[str, Any], explorer_url: str) -> str:
    """What the API reference page shows after its prose: the explorer (at `explorer_url`,
    relative to the page), then the routes and the errors as tables."""
    rows = []
    for tag in document["tags"]:
        operations = [(method, path, operation) for path, methods in document["paths"].items()
                      for method, operation in methods.items() if operation["tags"] == [tag["name"]]]
        primary = next(each for each in operations if "x-alias-of" not in each[2])
        method, path, operation = primary
        aliases = ", ".join(f"`{alias}`" for _, alias, each in operations if each is not operation)
        body = _type_names(operation["requestBody"]["content"]) if "requestBody" in operation else ""
        answer = _type_names(operation["responses"]["200"]["content"])
        rows.append(f"| `{method.upper()} {path}` | {aliases} | {_cell(tag['description'])} | {body} | {answer} |")
    errors = [f"| {status} | {_cell(meaning)} |" for status, meaning in openapi.ERROR_MEANINGS.items()]
    return "\n".join([
        "",
        "The document itself: [openapi.json](reference/openapi.json); the explorer alone:",
        "[explorer.html](reference/explorer.html).",
        "",
        f'<iframe src="{explorer_url}" title="The API explorer" style="width:100%;height:80vh;border:1px solid #ddd">',
        "</iframe>",
        "",
        "## Routes",
        "",
        "| route | also at | what | body | answer |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
        "## Errors",
        "",
        "Every error is `{\"error\": {\"message\", \"type\", \"param\", \"code\"}}` (`ErrorResponse`), but on TEI's",
        "bodies, which answer TEI's `{\"error\", \"error_type\"}` (`TEIErrorResponse`). What each status means:",
        "",
        "| status | meaning |",
        "| --- | --- |",
        *errors,
        "",
    ])


def _type_names(content: dict[str, Any]) -> str:
    schema = content["application/json"]["schema"]
    return " or ".join(f"`{ref['$ref'].rsplit('/', 1)[-1]}`" for ref in schema.get("anyOf", [schema]))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
