"""The HTTP floor: an aiohttp server on uvloop that parses each `POST /v1/embeddings` body,
tokenizes its texts with the packaged model's tokenizer (the one the null model has, cut
to 256 tokens as the server cuts it; `--no-tokenize`: skipped) and answers with one
fixed 32-wide vector per input, doing nothing else.

No embedding server built on aiohttp can answer faster on the same machine with the same
load generator, so run beside ours in one `bench.run` it says how much of the null
model's figure is the HTTP exchange, the tokenizing and the client, and how much is ours
(issue 27's target: the null model at least half this floor's requests/s at c16 and c64):

    .venv/bin/python -m bench.run --duration 10 --loads 1x16,1x64 \
        --model-dir bench/out/models/null \
        --cmd ".venv/bin/python -m bench.http_floor --port {port}" --name http-floor \
        --cmd ".venv/bin/python -m infinity serve --port {port} --model {model_dir} --served-name all-MiniLM-L6-v2" --name ours
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable

import uvloop
from aiohttp import web

DIMENSION = 32
MAX_LENGTH = 256


def _embeddings(tokenize: Callable[[list[str]], object]) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def answer(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        tokenize(inputs)
        vector = [1.0 / DIMENSION ** 0.5] * DIMENSION
        data = [{"object": "embedding", "index": index, "embedding": vector} for index in range(len(inputs))]
        return web.json_response({"object": "list", "data": data, "model": body["model"],
                                  "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}})

    return answer


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def _tokenizer() -> Callable[[list[str]], object]:
    from tokenizers import Tokenizer

    from infinity.folders.resolve import packaged_model_folder

    tokenizer = Tokenizer.from_file(str(packaged_model_folder() / "tokenizer.json"))
    tokenizer.enable_truncation(MAX_LENGTH)
    return tokenizer.encode_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=7997)
    parser.add_argument("--no-tokenize", action="store_true", help="answer without tokenizing (the bare HTTP floor)")
    args = parser.parse_args()
    app = web.Application()
    app.router.add_post("/v1/embeddings", _embeddings((lambda texts: None) if args.no_tokenize else _tokenizer()))
    app.router.add_get("/health", _health)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
