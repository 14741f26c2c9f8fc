"""End to end: examples/ray_embed.py on a local Ray (two CPUs, one actor) over a Parquet
file of texts with the packaged default model: every row comes back with the vector the
server answers for its text, a row without text with its `error` instead; the actor's
children and its /dev/shm folder are gone once Ray stops."""

from __future__ import annotations

import os
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
PIPELINE = """
import sys
import ray
sys.path.insert(0, "examples")
from ray_embed import embed_parquet
ray.init(num_cpus=2, include_dashboard=False)
try:
    embed_parquet(sys.argv[1], sys.argv[2], concurrency=1, batch_size=16, num_cpus=1)
finally:
    ray.shutdown()
"""


def _folders() -> dict[str, int]:
    """The /dev/shm folders of our models' front ends, by name: their pids."""
    return {path.name: int(path.name.split("-")[2]) for path in SHM_DIR.glob("infinity-emb-*")}


def test_ray_pipeline_gives_the_servers_vectors(server, tmp_path: Path) -> None:
    texts: list[str | None] = list(SENTENCES[:ROWS])
    texts[7] = None
    pq.write_table(pa.table({"id": list(range(ROWS)), "text": texts}), tmp_path / "in.parquet")
    before = _folders()
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", PIPELINE, str(tmp_path / "in.parquet"), str(tmp_path / "out")],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240, preexec_fn=stop_with_parent)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
    seconds = time.monotonic() - started

    table = pa.concat_tables([pq.read_table(p) for p in sorted((tmp_path / "out").glob("*.parquet"))])
    by_id = dict(zip(table.column("id").to_pylist(), zip(table.column("embedding").to_pylist(),
                                                         table.column("error").to_pylist())))
    assert sorted(by_id) == list(range(ROWS))
    assert by_id[7][1] == "missing_input: no text"
    assert np.isnan(np.asarray(by_id[7][0], np.float32)).all()
    good = [i for i in range(ROWS) if i != 7]
    assert all(by_id[i][1] is None for i in good)
    vectors = np.array([by_id[i][0] for i in good], np.float32)
    assert vectors.shape == (len(good), DIM)

    server.wait_idle()
    answer = server.embed([texts[i] for i in good])
    assert answer.status_code == 200, answer.text
    served = np.array([item["embedding"] for item in answer.json()["data"]], np.float32)
    # Same model folder, engine and float32 on both sides: only batch shapes differ.
    np.testing.assert_allclose(vectors, served, atol=1e-5)
    cosines = np.sum(vectors * served, axis=1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(served, axis=1)
    assert cosines.min() > 0.9999

    # The actor's folder (a pid that is gone now) was removed as it stopped; folders of
    # other runs still going on this machine are not ours to judge.
    left = {name: pid for name, pid in _folders().items() if name not in before and not pid_alive(pid)}
    assert not left, f"left under /dev/shm: {sorted(left)}"
    print(f"ray pipeline: {seconds:.1f} s for {ROWS} rows")
