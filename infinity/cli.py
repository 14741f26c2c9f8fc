"""`python -m infinity serve`: parse the command line, load the configuration, resolve the
models, and run the server until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys

from infinity.config import ConfigError, load_config

_SERVER_FLAGS = {
    # flag: (server key, type, help)
    "--host": ("host", str, "address to listen on (default 0.0.0.0)"),
    "--port": ("port", int, "port to listen on (default 7997)"),
    "--api-key": ("api_key", str, "require 'Authorization: Bearer KEY' on every route but /health"),
    "--url-prefix": ("url_prefix", str, "serve every route below this path, e.g. /embed"),
    "--tokenizer-workers": ("tokenizer_workers", int, "tokenizer processes (default 0: from the core count)"),
    "--max-queued-items": ("max_queued_items", int, "inputs waiting or running per model before 429 (default 4096)"),
    "--max-items-per-request": ("max_items_per_request", int, "inputs one request may carry (default 2048; never more than --max-queued-items)"),
    "--max-request-bytes": ("max_request_bytes", int, "largest request body, larger is 413 (default 16 MiB)"),
    "--log-level": ("log_level", str, "debug, info, warning or error (default info)"),
    "--embedding-type": ("embedding_type", str, "embeddings' output type when a request names none: float, "
                                                "int8, uint8, binary or ubinary (default float)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m infinity", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve the configured models",
        description=(
            "Serve embedding models over an OpenAI-compatible API. Values come from, in rising "
            "precedence: defaults, the --config file, INFINITY_<KEY> environment variables "
            "(e.g. INFINITY_PORT, INFINITY_API_KEY, INFINITY_MODEL), and these flags. "
            "With no model configured, the packaged all-MiniLM-L6-v2 is served."
        ),
    )
    serve.add_argument("--config", help="models.toml with [server] and [[models]] tables (see config/)")
    serve.add_argument("--model", help="serve only this model: a local folder, a hub id, or 'default'")
    serve.add_argument("--served-name", help="name clients use for --model (default: its folder name)")
    for flag, (_, kind, text) in _SERVER_FLAGS.items():
        serve.add_argument(flag, type=kind, help=text)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    overrides = {key: getattr(args, flag[2:].replace("-", "_")) for flag, (key, _, _) in _SERVER_FLAGS.items()}
    try:
        config = load_config(args.config, server_overrides=overrides, model_source=args.model,
                             model_name=args.served_name)
        logging.basicConfig(level=config.server.log_level.upper(),
                            format="%(asctime)s %(levelname)s [front] %(message)s")
        from workers.models import resolve_replicas

        specs = [spec for model in config.models for spec in resolve_replicas(model)]
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(_serve(config, specs))


def _serve(config, specs) -> int:  # type: ignore[no-untyped-def]
    import uvloop
    from aiohttp import web

    from infinity import shm
    from infinity.app import EXIT_CODE, create_app

    stale = shm.remove_stale()
    if stale:
        logging.info("removed what stopped servers left behind: %s", ", ".join(stale))
    loop = uvloop.new_event_loop()
    app = create_app(config, specs)
    web.run_app(app, host=config.server.host, port=config.server.port, loop=loop,
                handler_cancellation=True, access_log=None, shutdown_timeout=30,
                print=lambda *_: logging.info("listening on %s:%d", config.server.host, config.server.port))
    return app[EXIT_CODE][0]
