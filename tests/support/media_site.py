"""A plain HTTP site on loopback serving files, standing in for the web where media is
given to the server by URL."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def files_site(files: list[bytes], suffix: str) -> Iterator[str]:
    """A plain HTTP server on loopback answering `/<i><suffix>` with `files[i]` (404 for
    any other path); yields its base URL."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            index = self.path.strip("/").removesuffix(suffix)
            if not index.isdigit() or int(index) >= len(files):
                self.send_error(404)
                return
            body = files[int(index)]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{site.server_address[1]}"
    finally:
        site.shutdown()
        site.server_close()
