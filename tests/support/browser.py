"""Headless Chromium driven over the Chrome DevTools Protocol, for the tests that check a
page as a person's browser shows it (tests/e2e/serving/test_docs_page.py): Debian's
`chromium` (installed by .ci/run), started with a profile of its own in a temporary folder,
its one page spoken to over the protocol's WebSocket with aiohttp. A test reads and clicks
the page with JavaScript (`Page.evaluate`), waiting for what it expects (`Page.wait_for`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserError(Exception):
    """The page threw, or what a test waited for did not come."""


class Page:
    """One page of the browser: commands sent one at a time, each answered in turn (the
    events the browser sends meanwhile are dropped: no domain is enabled that a test reads)."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self._socket = socket
        self._ids = itertools.count(1)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        command = next(self._ids)
        await self._socket.send_json({"id": command, "method": method, "params": params})
        async for message in self._socket:
            answer = json.loads(message.data)
            if answer.get("id") == command:
                if "error" in answer:
                    raise BrowserError(f"{method}: {answer['error']}")
                return answer["result"]
        raise BrowserError("the browser closed the page's connection")

    async def evaluate(self, expression: str) -> Any:
        """The value of `expression` (a promise's, once settled) in the page."""
        answer = await self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in answer:
            details = answer["exceptionDetails"]
            raise BrowserError(details.get("exception", {}).get("description") or details.get("text"))
        return answer["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        """The first truthy value of `expression`, tried every 50 ms."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"waited {timeout_s} s for: {expression}")
            await asyncio.sleep(0.05)

    async def open(self, url: str) -> None:
        """Go to `url` and wait until it has loaded (its scripts have run)."""
        await self.send("Page.navigate", url=url)
        # Navigating answers once the new document is asked for: the old one may still be there.
        await self.wait_for(f"location.href === {json.dumps(url)} && document.readyState === 'complete'")

    async def screenshot(self, path: Path) -> None:
        """The page as the browser shows it, as a PNG (for a person to look at)."""
        import base64

        answer = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(answer["data"]))


@contextlib.asynccontextmanager
async def chromium_page(profile: Path, width: int = 1280, height: int = 1600) -> AsyncIterator[Page]:
    """A blank page of a headless Chromium whose profile is the folder `profile`; the
    browser is stopped afterwards."""
    assert CHROMIUM is not None, "no chromium on the PATH"
    profile.mkdir(parents=True, exist_ok=True)
    (profile / "DevToolsActivePort").unlink(missing_ok=True)  # a browser's before, in a profile used again
    log = (profile / "chromium.log").open("wb")
    process = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox",  # no sandbox: CI runs as root, which the sandbox refuses
         "--disable-gpu", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--window-size={width},{height}", "--remote-debugging-port=0", f"--user-data-dir={profile}",
         "about:blank"], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        port = await _debugging_port(profile / "DevToolsActivePort", process)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as answer:
                targets = await answer.json()
            target = next(target for target in targets if target["type"] == "page")
            async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as socket:
                yield Page(socket)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


async def _debugging_port(file: Path, process: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """The port Chromium listens on for the protocol: the first line of the file it writes
    into its profile once it listens."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BrowserError(f"chromium exited with {process.returncode}")
        lines = file.read_text().splitlines() if file.exists() else []
        if len(lines) >= 2:  # written whole: the port, then the browser's own path
            return int(lines[0])
        await asyncio.sleep(0.05)
    raise BrowserError(f"chromium did not listen within {timeout_s} s")
