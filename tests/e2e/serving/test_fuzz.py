"""Property-based tests from the API's own contract: schemathesis reads `/openapi.json` from
a live server and sends, for every operation, requests generated from its schemas (valid
ones and ones broken on purpose). Every answer must be documented, of its documented shape,
and never a 5xx; errors carry the JSON error shape. Afterwards the server still answers
`/health` and none of its processes died.

Bounded for CI: `FUZZ_EXAMPLES` requests per operation and mode, aliases left out (24
operations, 19 with a body to break)."""

from __future__ import annotations

import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.support.server import running_server

pytestmark = pytest.mark.timeout(600)

FUZZ_EXAMPLES = 40


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory, models_root):
    """The scoring configuration (an embedder, a reranker, classifiers) on a server of its
    own, so that what the fuzzer queues does not share batches with other tests."""
    from tests.support.reference import MODEL_NAME
    from tests.support.tiny_models import scoring_models_config

    with running_server(config=scoring_models_config(models_root / "fuzz", MODEL_NAME),
                        log_dir=tmp_path_factory.mktemp("fuzzed-server"), shared=True) as proc:
        proc.pids_at_start = proc.worker_pids()
        yield proc


def _operations(server) -> list:
    """Every operation of the document but its aliases (`x-alias-of`: another path that
    `create_app` registers to the same handler, with the same types)."""
    schema = schemathesis.openapi.from_url(server.url("/openapi.json"))
    operations = [result.ok() for result in schema.get_all_operations()]
    return [operation for operation in operations if "x-alias-of" not in operation.definition.raw]


def test_every_answer_is_documented_and_no_5xx(fuzzed_server):
    operations = _operations(fuzzed_server)
    assert len(operations) >= 24
    assert {"/tokenize", "/detokenize"} <= {operation.path for operation in operations}
    failures = []
    for operation in operations:
        # Requests that break the schema on purpose, where there is a body to break.
        modes = list(GenerationMode) if operation.body else [GenerationMode.POSITIVE]
        for mode in modes:
            @given(case=operation.as_strategy(mode))
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def check(case) -> None:
                # Valid by the schema need not mean served: two classifiers and no model
                # named is a 422, a token id outside the vocabulary too (both documented).
                case.call_and_validate(timeout=60, excluded_checks=[positive_data_acceptance])

            try:
                check()
            except Exception as exc:  # every operation is tried; all failures are reported together
                failures.append(f"{operation.label} ({mode}): {exc}")
    assert not failures, "\n\n".join(failures)


def test_after_fuzzing_the_server_is_whole(fuzzed_server):
    assert fuzzed_server.health_status() == 200
    assert fuzzed_server.worker_pids() == fuzzed_server.pids_at_start, "a process died and was restarted"
    response = fuzzed_server.embed(["still serving"])
    assert response.status_code == 200, response.text
    assert "Traceback" not in fuzzed_server.log_text()
