"""End to end: examples/ray_embed.py on a local Ray (one actor, with a checkpoint) over a
Parquet file of texts with the packaged default model. Files are written while the job runs,
the first before the last batch is embedded. A run killed (-9, the whole process group)
after its first files is finished by the same command: every id once, every file
whole and of one schema; every row with the vector the server answers for its text, a row
without text with its `error` instead; the actor's /dev/shm folder gone once Ray stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.processes import pid_alive
from tests.support.reference import DIM, SENTENCES
from tests.support.server import REPO, stop_with_parent
from tests.support.shm import SHM_DIR

pytest.importorskip("ray", reason="the ray extra is not installed")

pytestmark = pytest.mark.timeout(300)

ROWS = 50
# As the test servers run: float32, so both sides compute the same thing.
ENV = {**os.environ, "PYTHONFAULTHANDLER": "1", "INFINITY_AUTO_BFLOAT16": "false", "RAY_USAGE_STATS_ENABLED": "0"}
# With a checkpoint, in files of 10 rows, on three CPUs. "slowed": each batch a second late,
# so that a kill lands while the job runs, and counted in the file argv[5] once embedded; its
# actor holds two CPUs, all but the one the writer needs. The resumed run's actor holds one:
# Ray's checkpoint filter takes another.
RESUMABLE = """
import sys
import time
import ray
sys.path.insert(0, "examples")
import ray_embed
slowed = sys.argv[4] == "slowed"
if slowed:
    class Slowed(ray_embed.Embed):
        counted_in = sys.argv[5]  # read here: an actor's own sys.argv is Ray's worker's

        def __call__(self, batch):
            time.sleep(1.0)
            embedded = super().__call__(batch)
            with open(self.counted_in, "a") as done:
                done.write("batch\\n")
            return embedded
    ray_embed.Embed = Slowed
ray.init(num_cpus=3, include_dashboard=False)
try:
    ray_embed.embed_parquet(sys.argv[1], sys.argv[2], concurrency=1, batch_size=10, num_cpus=2 if slowed else 1,
                            checkpoint=sys.argv[3], rows_per_file=10)
finally:
    ray.shutdown()
"""


def _folders() -> dict[str, int]:
    """The /dev/shm folders of our models' front ends, by name: their pids."""
    return {path.name: int(path.name.split("-")[2]) for path in SHM_DIR.glob("infinity-emb-*")}


def _served(server, texts: list[str]) -> np.ndarray:
    server.wait_idle()
    answer = server.embed(texts)
    assert answer.status_code == 200, answer.text
    return np.array([item["embedding"] for item in answer.json()["data"]], np.float32)


def test_ray_pipeline_resumes_after_a_kill(server, tmp_path: Path) -> None:
    rows, missing = 120, 7
    texts: list[str | None] = [SENTENCES[i % len(SENTENCES)] + f" ({i})" for i in range(rows)]
    texts[missing] = None
    source, out, checkpoint = tmp_path / "in.parquet", tmp_path / "out", tmp_path / "checkpoint"
    pq.write_table(pa.table({"id": [f"row-{i}" for i in range(rows)], "text": texts}), source)
    before = _folders()
    command = [sys.executable, "-c", RESUMABLE, str(source), str(out), str(checkpoint)]

    batches = tmp_path / "batches"
    batches.touch()
    killed = subprocess.Popen([*command, "slowed", str(batches)], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while not list(out.glob("*.parquet")) and killed.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        embedded_before_a_file = len(batches.read_text().splitlines())
        assert killed.poll() is None, "the slowed run ended before any file was written"
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    # Files stream out as their rows are embedded, not all once the last batch is done.
    assert embedded_before_a_file < rows // 10, "no file was written before the last batch was embedded"
    assert list(checkpoint.iterdir()), "no checkpoint was written before the kill"
    assert len(list(out.glob("*.parquet"))) < rows // 10, "the run was finished before the kill"

    resumed = subprocess.run([*command, "plain"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240,
                             preexec_fn=stop_with_parent)
    assert resumed.returncode == 0, resumed.stdout[-5000:] + resumed.stderr[-5000:]

    files = sorted(out.glob("*.parquet"))
    assert len({pq.read_schema(path) for path in files}) == 1, "the files do not share one schema"
    table = pq.read_table(out)  # each file whole, read as one dataset
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(f"row-{i}" for i in range(rows)), "not every id exactly once"
    by_id = dict(zip(ids, zip(table.column("embedding").to_pylist(), table.column("error").to_pylist())))
    assert by_id[f"row-{missing}"][1] == "missing_input: no text"
    assert np.isnan(np.asarray(by_id[f"row-{missing}"][0], np.float32)).all()
    good = [i for i in range(rows) if i != missing]
    assert all(by_id[f"row-{i}"][1] is None for i in good)
    vectors = np.array([by_id[f"row-{i}"][0] for i in good], np.float32)
    assert vectors.shape == (len(good), DIM)
    served = _served(server, [texts[i] for i in good])
    # Same model folder, engine and float32 on both sides: only batch shapes differ.
    np.testing.assert_allclose(vectors, served, atol=1e-5)
    assert not checkpoint.exists() or not list(checkpoint.iterdir()), "the checkpoint outlived the finished job"
    left = {name: pid for name, pid in _folders().items() if name not in before and not pid_alive(pid)}
    assert not left, f"left under /dev/shm: {sorted(left)}"
