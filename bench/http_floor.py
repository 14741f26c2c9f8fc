"""The HTTP floor: an aiohttp server on uvloop that parses each `POST /v1/embeddings` body
and answers with one fixed 32-wide vector per input, doing nothing else.

No embedding server built on aiohttp can answer faster on the same machine with the same
load generator, so run beside ours in one `bench.run` it says how much of the null
model's figure is the HTTP exchange and the client, and how much is ours:

    .venv/bin/python -m bench.run --duration 10 --loads 1x16,1x64 \
        --model-dir bench/out/models/null \
        --cmd ".venv/bin/python -m bench.http_floor --port {port}" --name http-floor \
        --cmd ".venv/bin/python -m infinity serve --port {port} --model {model_dir} --served-name all-MiniLM-L6-v2" --name ours
"""

from __future__ import annotations

import argparse
import json

import uvloop
from aiohttp import web

DIMENSION = 32


async def _embeddings(request: web.Request) -> web.Response:
    body = json.loads(await request.read())
    inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
    vector = [1.0 / DIMENSION ** 0.5] * DIMENSION
    data = [{"object": "embedding", "index": index, "embedding": vector} for index in range(len(inputs))]
    return web.json_response({"object": "list", "data": data, "model": body["model"],
                              "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}})


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=7997)
    args = parser.parse_args()
    app = web.Application()
    app.router.add_post("/v1/embeddings", _embeddings)
    app.router.add_get("/health", _health)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
