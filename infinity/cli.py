"""`python -m infinity serve`: parse the command line, load the configuration, resolve the
models, and run the server until SIGINT/SIGTERM. `python -m infinity replicas`: several
servers behind nginx (infinity/replicas.py). `python -m infinity embed`: embed a corpus
from files into Parquet (infinity/corpus)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import signal
import sys
from typing import TYPE_CHECKING

from aiohttp import web

from infinity.config import (MAX_PRIORITY, MIN_PRIORITY, Config, ConfigError, ServerConfig, load_config,
                             load_one_model)
from infinity.api.connections import ConnectionGuard, ConnectionLimits, GuardedSite
from infinity.shared import tracing
from infinity.shared.protocol import ModelSpec

if TYPE_CHECKING:
    from infinity.corpus.batch_file import BatchSummary
    from infinity.corpus.job import JobOptions, Summary

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
    "--header-timeout": ("header_timeout", float, "seconds a client may take to send a request's headers "
                                                  "(default 10)"),
    "--body-timeout": ("body_timeout", float, "seconds a client may take to send a request's whole body (default 30)"),
    "--keepalive-timeout": ("keepalive_timeout", float, "seconds an idle keep-alive connection stays open (default 75)"),
    "--max-connections": ("max_connections", int, "open connections at most; beyond, the longest idle one is closed "
                                                  "(default 4096)"),
    "--shutdown-timeout": ("shutdown_timeout", float, "seconds a stopping server gives the requests it holds to "
                                                      "finish, answering 503 to new ones (default 30)"),
    "--log-level": ("log_level", str, "debug, info, warning or error (default info)"),
    "--embedding-type": ("embedding_type", str, "embeddings' output type when a request names none: float, "
                                                "int8, uint8, binary or ubinary (default float)"),
    "--prepare": ("prepare", str, "in_background (default): a model whose conversions and trials are not cached is "
                                  "served at once unprepared and handed over once prepared; before_serving: "
                                  "prepared before the server is ready"),
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
    _add_replicas_command(commands)
    _add_embed_command(commands)
    return parser


def _add_embed_command(commands: argparse._SubParsersAction) -> None:
    embed = commands.add_parser(
        "embed",
        help="embed a corpus: Parquet or JSONL files in, Parquet parts out, resumable",
        description=(
            "Embed every row of INPUT (a Parquet or JSONL file, plain, .gz or .zst; a folder or a glob "
            "of them) into OUTPUT, a folder of Parquet parts written as the job goes, with a manifest "
            "and errors.parquet (the rows that failed, and why). Run the same command again to resume. "
            "Defaults come from the --config file's [embed] table. An OpenAI batch input file (a .jsonl file "
            "of /v1/embeddings requests, each with custom_id and body) is answered instead with an OpenAI "
            "batch output file at OUTPUT, each body as the server's /v1/embeddings answers it."
        ),
    )
    embed.add_argument("input", help="a file, a folder, or a glob of Parquet/JSONL files; or an OpenAI batch "
                                     "input file (.jsonl)")
    embed.add_argument("output", help="the output folder (created; resumed if it holds this job); for a batch "
                                      "file, the batch output file")
    embed.add_argument("--config", help="models.toml: [server], [[models]], [media] and [embed]")
    embed.add_argument("--model", help="a model of the config by name, or a model folder or hub id "
                                       "(default: the config's one model, or the packaged all-MiniLM-L6-v2)")
    embed.add_argument("--text-column", help="the column of texts (default text)")
    embed.add_argument("--id-column", help="the column of row ids (default id; without it, rows are named "
                                           "by their file and row number)")
    embed.add_argument("--image-column", help="embed images from this column: paths, URLs or bytes")
    embed.add_argument("--audio-column", help="embed audio clips from this column: paths, URLs or bytes")
    embed.add_argument("--embedding-type", help="float (default), float16, int8, uint8, binary, ubinary; "
                                                "sparse for sparse models")
    embed.add_argument("--dimensions", type=int, help="keep the first N dimensions, re-normalised")
    embed.add_argument("--shard", default="0/1", help="K/N: embed only the K-th of N shares of the input "
                                                      "(N processes write one OUTPUT together)")
    embed.add_argument("--rows-per-part", type=int, help="rows of one output part (default 4096)")
    embed.add_argument("--batch-size", type=int, help="inputs per batch sent to the model (default 32)")
    embed.add_argument("--tokenizer-workers", type=int, help="tokenizer processes (default: from the core count)")
    embed.add_argument("--url", help="send the rows to the running server at this URL (its /v1/embeddings) instead "
                                     "of loading the model here; --model then names one of its models")
    embed.add_argument("--api-key", help="with --url: the server's key (default: INFINITY_API_KEY)")
    embed.add_argument("--priority", type=int, help="with --url: the requests' priority (default 1: after queries, "
                                                    "which default to 0)")
    embed.add_argument("--log-level", default="warning", help="the children's and the job's (default warning)")
    embed.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_replicas_command(commands: argparse._SubParsersAction) -> None:
    from infinity.replicas import NGINX_CONFIG

    replicas = commands.add_parser(
        "replicas",
        help="run several servers on this machine behind nginx",
        description=(
            "Start N replicas of 'serve' on consecutive ports (each on its own cores when there "
            "are enough) and nginx in front of them with config/nginx.conf; restart a replica "
            "that dies; on SIGTERM stop nginx, drain the replicas and exit. Flags after '--' go "
            "to every replica's 'serve', e.g. -- --config models.toml."
        ),
    )
    replicas.add_argument("--replicas", type=int, default=2, help="how many servers (default 2)")
    replicas.add_argument("--listen", type=int, default=8080, help="nginx's port on 127.0.0.1 (default 8080)")
    replicas.add_argument("--first-port", type=int, default=8001,
                          help="the first replica's port on 127.0.0.1; the others follow (default 8001)")
    replicas.add_argument("--nginx", default="nginx", help="the nginx binary (default: nginx on PATH)")
    replicas.add_argument("--nginx-config", default=str(NGINX_CONFIG),
                          help="the nginx.conf whose upstream and listen port are set (default config/nginx.conf)")
    replicas.add_argument("--shutdown-timeout", type=float, default=30.0,
                          help="seconds each replica drains at stop (its --shutdown-timeout; default 30)")
    replicas.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then flags for each replica's serve")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "replicas":
        sys.exit(_replicas(args))
    if args.command == "embed":
        sys.exit(_embed(args))
    overrides = {key: getattr(args, flag[2:].replace("-", "_")) for flag, (key, _, _) in _SERVER_FLAGS.items()}
    try:
        config = load_config(args.config, server_overrides=overrides, model_source=args.model,
                             model_name=args.served_name)
        logging.basicConfig(level=config.server.log_level.upper(),
                            format="%(asctime)s %(levelname)s [front] %(message)s")
        tracing.configure("front")
        from infinity.folders.resolve import resolve_replicas

        from infinity.shared.devices import cpu_computes_bfloat16

        cpu_bfloat16 = config.server.auto_bfloat16 and cpu_computes_bfloat16()
        specs = [spec for model in config.models for spec in resolve_replicas(model, cpu_bfloat16)]
    except (ConfigError, tracing.TracingUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        sys.exit(_serve(config, specs))
    finally:
        tracing.uninstall()  # exports the front end's last spans


def _embed(args: argparse.Namespace) -> int:
    from infinity.corpus import batch_file, job
    from infinity.corpus.encoder import ModelUnavailable
    from infinity.corpus.parts import OutputError
    from infinity.corpus.plan import PlanError
    from infinity.corpus.remote import ServerRefused

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s [embed] %(message)s")
    overrides = {"log_level": args.log_level, "tokenizer_workers": args.tokenizer_workers}
    try:
        config = load_config(args.config, server_overrides=overrides)
        url = args.url or config.embed.url
        options = _embed_options(args, config)
        if url is None:
            for flag in ("priority", "api_key"):
                if getattr(args, flag) is not None:
                    raise ConfigError(f"--{flag.replace('_', '-')} applies to a job sent to a server: give --url")
            summary = _embed_here(args, options, overrides)
        else:
            if args.tokenizer_workers is not None:
                raise ConfigError("--tokenizer-workers applies to a model loaded here, not to a job sent to --url")
            summary = _embed_on_server(args, options, config, url)
    except (ConfigError, PlanError, OutputError, job.JobError, batch_file.BatchFileError, ServerRefused) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(summary, file=sys.stderr)
    return 0


def _embed_here(args: argparse.Namespace, options: JobOptions, overrides: dict[str, object]) -> Summary | BatchSummary:
    """The job on the model loaded here (`--model` within the config, with the server
    settings `overrides`), on children of this process."""
    from infinity.corpus import batch_file, job
    from infinity.corpus.encoder import LocalEncoder
    from infinity.folders.resolve import resolve_replicas
    from infinity.shared import shm
    from infinity.shared.devices import cpu_computes_bfloat16

    config, model = load_one_model(args.config, args.model, overrides)
    cpu_bfloat16 = config.server.auto_bfloat16 and cpu_computes_bfloat16()
    specs = resolve_replicas(model, cpu_bfloat16)
    shm.remove_stale()
    if batch_file.is_batch_file(args.input):
        return batch_file.run(args.input, args.output, config, specs, args.quiet)
    return job.run(options, lambda: LocalEncoder(config, specs))


def _embed_on_server(args: argparse.Namespace, options: JobOptions, config: Config,
                     url: str) -> Summary | BatchSummary:
    """The job sent to the server at `url`, at the priority asked (1 unless told)."""
    from infinity.corpus import batch_file, job
    from infinity.corpus.remote import DEFAULT_PRIORITY, ServerEncoder

    priority = next((p for p in (args.priority, config.embed.priority) if p is not None), DEFAULT_PRIORITY)
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ConfigError(f"--priority must be between {MIN_PRIORITY} and {MAX_PRIORITY}")
    api_key = args.api_key or config.server.api_key
    if batch_file.is_batch_file(args.input):
        return batch_file.run_on_server(args.input, args.output, url, args.model, api_key, priority, args.quiet)
    return job.run(options, lambda: ServerEncoder(url, args.model, api_key, priority, config.media))


def _embed_options(args: argparse.Namespace, config: Config) -> JobOptions:
    """The job's options: the flags over the config's [embed] table."""
    from infinity.corpus.job import JobOptions
    from infinity.corpus.plan import Shard
    from infinity.corpus.sources import Columns

    table = config.embed
    image = args.image_column or (None if args.audio_column else table.image_column)
    audio = args.audio_column or (None if args.image_column else table.audio_column)
    if image and audio:
        raise ConfigError("give --image-column or --audio-column, not both")
    medium, column = ("image", image) if image else ("audio", audio) if audio else ("text", None)
    column = column or args.text_column or table.text_column
    columns = Columns(column, medium, args.id_column or table.id_column)
    for flag in ("rows_per_part", "batch_size", "dimensions"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive")
    return JobOptions(
        args.input, args.output, columns, args.embedding_type or table.embedding_type,
        args.dimensions or table.dimensions, args.rows_per_part or table.rows_per_part,
        args.batch_size or table.batch_size, shard=Shard.parse(args.shard), quiet=args.quiet)


def _replicas(args: argparse.Namespace) -> int:
    from pathlib import Path

    from infinity import replicas

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s [replicas] %(message)s")
    config = Path(args.nginx_config)
    if args.replicas < 1:
        print("error: --replicas must be at least 1", file=sys.stderr)
        return 2
    if not config.is_file():
        print(f"error: nginx config not found: {config} (give --nginx-config)", file=sys.stderr)
        return 2
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    serve_args = ["--shutdown-timeout", str(args.shutdown_timeout), *serve_args]
    return replicas.run(args.replicas, args.listen, args.first_port, serve_args, args.nginx, config,
                        args.shutdown_timeout)


def _serve(config: Config, specs: list[ModelSpec]) -> int:
    import uvloop

    from infinity.api.app import EXIT_CODE, create_app
    from infinity.shared import shm

    stale = shm.remove_stale()
    if stale:
        logging.info("removed what stopped servers left behind: %s", ", ".join(stale))
    app = create_app(config, specs)
    try:
        uvloop.run(_run(app, config.server))
    except OSError as exc:  # the port is taken, say
        logging.error("cannot serve on %s:%d: %s", config.server.host, config.server.port, exc)
        return 1
    return app[EXIT_CODE][0]


async def _run(app: web.Application, server: ServerConfig) -> None:
    """Serve `app` until SIGINT or SIGTERM, then drain: answer 503 to /health and to new
    requests while those held finish (within `shutdown_timeout`), and stop."""
    from infinity.api.routes.common import ENGINE_CLIENT

    limits = ConnectionLimits(server.header_timeout, server.body_timeout, server.keepalive_timeout,
                              _connection_cap(server.max_connections))
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, shutdown_timeout=5)
    await runner.setup()
    try:
        site = GuardedSite(runner, server.host, server.port, ConnectionGuard(limits), access_log=None)
        await site.start()
        logging.info("listening on %s:%d", server.host, server.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        await app[ENGINE_CLIENT].drain(server.shutdown_timeout)
    finally:
        await runner.cleanup()


# File descriptors kept for what is not a client connection: sockets to the children,
# arenas, the event loop's own, logs.
_RESERVED_FDS = 128


def _connection_cap(wanted: int) -> int:
    """`wanted` connections, or as many as this process may open files for, after raising
    its soft limit on open files to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    if soft == resource.RLIM_INFINITY or wanted <= soft - _RESERVED_FDS:
        return wanted
    cap = max(1, soft - _RESERVED_FDS)
    logging.warning("max_connections %d lowered to %d: this process may open %d files", wanted, cap, soft)
    return cap
