"""End to end: a query sent while a large bulk request is queued is answered before the
bulk request ends, at a more urgent priority (it overtakes the queued batch train) and at
the same one (requests share the passes); its vector is the one it gets alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.support.answers import decode_embedding
from tests.support.processes import wait_until
from tests.support.reference import assert_close

pytestmark = pytest.mark.timeout(300)

# A bulk request the default model needs seconds for on two cores.
BULK = [f"passage {i}: the committee will review the proposal and publish its findings next spring"
        for i in range(2000)]
QUERY = "where is the nearest train station?"


def _queued(server, priority: int) -> bool:
    metrics = server.get("/metrics").text
    return any(line.startswith("infinity_queue_slots_in_use_by_priority") and f'priority="{priority}"' in line
               and float(line.rsplit(" ", 1)[1]) > 0 for line in metrics.splitlines())


@pytest.mark.parametrize("bulk_priority", [1, 0], ids=["bulk-less-urgent", "same-priority"])
def test_a_query_is_answered_while_a_bulk_request_still_runs(server, bulk_priority):
    server.wait_idle()
    alone = decode_embedding(server.embed([QUERY]).json()["data"][0]["embedding"])
    bulk_answer = []
    bulk = threading.Thread(target=lambda: bulk_answer.append(server.embed(BULK, priority=bulk_priority)))
    bulk.start()
    try:
        assert wait_until(lambda: _queued(server, bulk_priority), 30, 0.02), "the bulk request was not queued"
        answer = server.embed([QUERY], priority=0)
        assert answer.status_code == 200
        assert bulk.is_alive(), "the query waited for the whole bulk request"
        assert_close(decode_embedding(answer.json()["data"][0]["embedding"]), alone, "the query beside bulk")
    finally:
        bulk.join(120)
    assert bulk_answer[0].status_code == 200
    assert len(bulk_answer[0].json()["data"]) == len(BULK)
    assert np.isfinite(decode_embedding(bulk_answer[0].json()["data"][-1]["embedding"])).all()
