"""The corpus job, `python -m infinity embed INPUT OUTPUT`: files in, Parquet parts out, on
the same children as `serve` (tokenizer processes, one inference process per device) with
no HTTP between, or with `--url` through a running server at low priority.

- `plan`: the input's files and their units of work (a Parquet row group's slice, a JSONL
  file's line range), numbered so that every run and every shard agrees; the shard split.
- `sources`: reading one unit's rows (ids, inputs, the rows bad on arrival).
- `parts`: the output folder: one Parquet part per unit written whole or not at all, the
  errors of each unit, the manifest that ties an output to one model and one set of
  options, and `errors.parquet` once every unit is done.
- `encoder`: a model for code that is not a server, a failed batch retried row by row so
  that a bad row fails alone; `LocalEncoder` runs it on children of this process.
- `remote`: the same through a running server's `/v1/embeddings` (`embed --url`), at a
  priority below its queries.
- `job`: the run: units read ahead, batches in flight, parts written as they finish,
  progress and the closing summary.
- `batch_file`: an OpenAI batch input file of `/v1/embeddings` requests answered into a
  batch output file, each body as the server's route answers it.
"""
