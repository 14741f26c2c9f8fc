"""`/docs` in a real browser: headless Chromium (Debian's `chromium`, which .ci/run
installs) opens the explorer, which shows every route with its aliases under it; sends the
example request of `POST /v1/embeddings` from the page, and the answer it renders is the
server's answer to that body. With an API key, the page asks for the key, then sends it
(Swagger UI's Authorize) with the request it tries. Everything the page loads comes from
the server itself.

The browser is driven over the DevTools protocol (tests/support/browser.py): a test runs
JavaScript in the page to click and to read what it shows."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import requests

from tests.support.browser import CHROMIUM, Page, chromium_page

pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium on the PATH "
                                                          "(apt-get install chromium; .ci/run installs it)"),
              pytest.mark.timeout(180)]

# The operation block of POST /v1/embeddings, as Swagger UI draws it.
EMBEDDINGS = """Array.from(document.querySelectorAll('.opblock')).find(block =>
    block.querySelector('.opblock-summary-method')?.textContent.trim() === 'POST' &&
    block.querySelector('.opblock-summary-path')?.getAttribute('data-path') === '/v1/embeddings')"""


async def _try_embeddings(page: Page) -> dict[str, Any]:
    """Open POST /v1/embeddings in the explorer, send its example body, and read what the
    page shows: the body it sent, the status and the answer."""
    await page.evaluate(f"{EMBEDDINGS}.querySelector('.opblock-summary-control').click()")
    # Try-it-out is on from the start: the example body is in an editable field at once.
    await page.wait_for(f"!!{EMBEDDINGS}?.querySelector('textarea.body-param__text') && "
                        f"!!{EMBEDDINGS}.querySelector('button.execute')")
    sent = await page.evaluate(f"{EMBEDDINGS}.querySelector('textarea.body-param__text').value")
    await page.evaluate(f"{EMBEDDINGS}.querySelector('button.execute').click()")
    status = await page.wait_for(f"{EMBEDDINGS}.querySelector('.live-responses-table tbody "
                                 f".response-col_status')?.textContent.trim()")
    shown = await page.evaluate(f"{EMBEDDINGS}.querySelector('.live-responses-table tbody "
                                f".response-col_description pre')?.textContent")
    return {"sent": json.loads(sent), "status": status, "shown": shown}


async def _loaded_from(page: Page) -> set[str]:
    """The origins of everything the page loaded, itself included."""
    urls = await page.evaluate("[location.href, ...performance.getEntriesByType('resource').map(e => e.name)]")
    return {f"{urlsplit(url).scheme}://{urlsplit(url).netloc}" for url in urls}


async def _explore(url: str, profile: Path, api_key: str | None = None) -> dict[str, Any]:
    async with chromium_page(profile) as page:
        await page.open(url)
        seen: dict[str, Any] = {}
        if api_key is not None:
            seen["asked_for_the_key"] = await page.wait_for("!document.getElementById('api-key').hidden")
            await page.evaluate(f"document.getElementById('api-key-value').value = {json.dumps(api_key)}; "
                                "document.getElementById('api-key').requestSubmit()")
        await page.wait_for("document.querySelectorAll('.opblock').length > 0")
        seen["routes"] = await page.evaluate("""Array.from(document.querySelectorAll('.opblock-tag-section')).map(
            section => [section.querySelector('.opblock-tag').getAttribute('data-tag'),
                        Array.from(section.querySelectorAll('.opblock')).map(block =>
                            block.querySelector('.opblock-summary-method').textContent.trim() + ' ' +
                            block.querySelector('.opblock-summary-path').getAttribute('data-path'))])""")
        seen.update(await _try_embeddings(page))
        seen["origins"] = await _loaded_from(page)
        await page.screenshot(profile / "docs.png")  # kept with the test's files, for a person to look at
        return seen


def _assert_the_answer_shown_is_the_servers(server, seen: dict[str, Any], **headers: str) -> None:
    assert seen["status"] == "200", seen
    shown = json.loads(seen["shown"])
    direct = requests.post(server.url("/v1/embeddings"), json=seen["sent"], headers=headers, timeout=60).json()
    assert shown["model"] == direct["model"] == seen["sent"]["model"]
    assert [item["index"] for item in shown["data"]] == list(range(len(seen["sent"]["input"])))
    np.testing.assert_allclose([item["embedding"] for item in shown["data"]],
                               [item["embedding"] for item in direct["data"]], atol=1e-5)


def test_the_explorer_sends_the_example_and_shows_the_answer(server, tmp_path):
    seen = asyncio.run(_explore(server.url("/docs"), tmp_path / "browser"))
    document = server.get("/openapi.json").json()
    # Every route of the document is shown, each under its primary path's tag with its aliases.
    assert {route for _, routes in seen["routes"] for route in routes} == {
        f"{method.upper()} {path}" for path, methods in document["paths"].items() for method in methods}
    routes = dict(seen["routes"])
    assert routes["/v1/embeddings"] == ["POST /v1/embeddings", "POST /embeddings"]
    assert routes["/health"][0] == "GET /health" and sorted(routes["/health"][1:]) == ["GET /ping", "GET /v1/health"]
    assert routes["/ping"] == ["POST /ping"]
    # The form held the route's example, naming the served model.
    example = document["components"]["examples"]["post_v1_embeddings.OpenAI.request"]["value"]
    assert seen["sent"] == example
    _assert_the_answer_shown_is_the_servers(server, seen)
    assert seen["origins"] == {server.url("").rstrip("/")}


def test_with_an_api_key_the_explorer_asks_for_it_and_sends_it(api_key_server, tmp_path):
    seen = asyncio.run(_explore(api_key_server.url("/docs"), tmp_path / "browser", api_key_server.api_key))
    assert seen["asked_for_the_key"]
    _assert_the_answer_shown_is_the_servers(api_key_server, seen,
                                            Authorization=f"Bearer {api_key_server.api_key}")
