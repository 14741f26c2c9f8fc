"""Embed a Parquet dataset with Ray Data: read INPUT (a Parquet file or a folder of them),
run `infinity.ray.Embed` over it in a pool of actors (each starts the model once, on the
GPUs Ray gives it or on its CPUs), write the rows with their `embedding` and `error`
columns as Parquet files under OUTPUT. A row that cannot be embedded gets its reason in
`error` (NaN or zeros in `embedding`); it never stops the job.

Locally (Ray started in this process):

    python examples/ray_embed.py corpus/ embedded/ --concurrency 2 --batch-size 1024

On a cluster (INPUT and OUTPUT on storage every node reaches: s3://, gs://, a shared mount):

    ray job submit --working-dir . -- python examples/ray_embed.py s3://b/corpus s3://b/out \\
        --model BAAI/bge-small-en-v1.5 --concurrency 8 --num-gpus 1

Resume: with `--checkpoint PATH` (shared storage) Ray Data's own checkpointing (Ray 2.60,
`DataContext.checkpoint_config`) records the ids of the rows of each file written; run the
same command again after a failure (a `kill -9` of the whole job included) and the rows
already written are filtered out as they are read, a file whose write was cut short is
removed, and every id ends up in OUTPUT once. It needs a column of unique row ids
(`--id-column`, default id); the checkpoint is deleted when the job completes. Output is
cut into files of at least `--rows-per-file` rows (whole batches), the unit a failure
loses, each written as soon as its rows are embedded. On resume Ray runs
a checkpoint-filter actor of one CPU beside the embedding actors: leave a CPU free for it,
or the job waits for one forever.
"""

from __future__ import annotations

import argparse

import ray
import ray.data

from infinity.ray import Embed

BATCHES_PER_ACTOR = 4
# An actor sorts each batch's texts by length before the model batches them: the larger the
# batch, the less padding (bench/results/corpus.md#ray-data-one-actor).
BATCH_SIZE = 1024
ROWS_PER_FILE = 4096


def embed_parquet(input: str, output: str, *, model: str | None = None, config: str | None = None,
                  column: str = "text", concurrency: int = 1, batch_size: int = BATCH_SIZE, num_gpus: float = 0,
                  num_cpus: float | None = None, checkpoint: str | None = None, id_column: str = "id",
                  rows_per_file: int = ROWS_PER_FILE) -> None:
    """Read `input`, embed column `column` of every row, write Parquet files under `output`.
    Ray must be initialised (`ray.init()`)."""
    if checkpoint is not None:
        from ray.data.checkpoint import CheckpointConfig

        ray.data.DataContext.get_current().checkpoint_config = CheckpointConfig(id_column, checkpoint)
    # A block of rows per batch: Ray reads a file's rows as one block (up to 128 MiB) and runs
    # one task per block, so unsplit, an actor would take the batches of a file one at a time
    # and hand nothing to the writer until the file's last row was embedded.
    dataset = ray.data.read_parquet(input).repartition(target_num_rows_per_block=batch_size)
    embedded = dataset.map_batches(
        Embed,
        fn_constructor_kwargs={"model": model, "config": config, "column": column},
        compute=ray.data.ActorPoolStrategy(size=concurrency),  # `concurrency=` is deprecated since Ray 2.51
        batch_size=batch_size,
        num_gpus=num_gpus,
        # Several batches at once in an actor (its threads): one batch's rows are sent to the
        # model while another's are answered, so its children never wait between batches.
        max_concurrency=BATCHES_PER_ACTOR,
        # A GPU actor's CPU work is tokenizing: Ray's default CPU share is enough to schedule it.
        **({"num_cpus": num_cpus} if num_cpus is not None else {}),
    )
    # Streamed: a file is written as soon as its rows are embedded. Not a repartition into
    # files: that step would hold a CPU of Ray's books that the writer then lacks while the
    # actors hold the rest, and every file would wait for the end of the job.
    embedded.write_parquet(output, min_rows_per_file=rows_per_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="a Parquet file or a folder of them (local, s3://, gs://, ...)")
    parser.add_argument("output", help="the folder to write Parquet files into")
    parser.add_argument("--model", help="a model folder, hub id, or a model of --config by name "
                                        "(default: the packaged all-MiniLM-L6-v2)")
    parser.add_argument("--config", help="models.toml (its [server] and [[models]] apply)")
    parser.add_argument("--column", default="text", help="the column of texts (default text)")
    parser.add_argument("--concurrency", type=int, default=1, help="actors, each with its own model (default 1)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE,
                        help=f"rows per batch given to an actor (default {BATCH_SIZE})")
    parser.add_argument("--num-gpus", type=float, default=0, help="GPUs per actor (default 0: CPU)")
    parser.add_argument("--num-cpus", type=float, help="CPUs per actor (default: Ray's)")
    parser.add_argument("--checkpoint", help="resume with Ray Data checkpointing, kept at this path")
    parser.add_argument("--id-column", default="id", help="the unique row ids that --checkpoint records (default id)")
    parser.add_argument("--rows-per-file", type=int, default=ROWS_PER_FILE,
                        help=f"rows per output file at least, what a failure loses (default {ROWS_PER_FILE})")
    args = parser.parse_args()
    ray.init()  # joins the cluster under `ray job submit` (RAY_ADDRESS), else starts a local Ray
    embed_parquet(args.input, args.output, model=args.model, config=args.config, column=args.column,
                  concurrency=args.concurrency, batch_size=args.batch_size, num_gpus=args.num_gpus,
                  num_cpus=args.num_cpus, checkpoint=args.checkpoint, id_column=args.id_column,
                  rows_per_file=args.rows_per_file)


if __name__ == "__main__":
    main()
