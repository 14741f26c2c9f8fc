"""The fixtures and hooks of the whole test tree: the servers the end-to-end tests share
(the default one, one with an API key, one with the scoring models), the factory for a
test's own servers, the reference model and its vectors; and the hooks that attach the
servers' logs to a failing test's report and leave no server behind the session.

The library they use (starting and watching servers, the reference, tiny models) is in
tests/support/.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # so `tests`, `workers` and `infinity` import however pytest is run
    sys.path.insert(0, str(REPO))

from tests.support.reference import MAX_LENGTH, MODEL_NAME, SENTENCES, reference_embed  # noqa: E402
from tests.support.server import (API_KEY, ServerProcess, clean_up_every_server, log_sections,  # noqa: E402
                                  running_server, start_server_process, started_by)


# --- servers ---------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """The default server (packaged all-MiniLM-L6-v2, default limits) shared by the session."""
    with running_server(log_dir=tmp_path_factory.mktemp("session-server"), shared=True) as proc:
        yield proc


@pytest.fixture(scope="session")
def api_key_server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """A default server started with --api-key (`.api_key` holds the key)."""
    with running_server("--api-key", API_KEY, log_dir=tmp_path_factory.mktemp("api-key-server"),
                        shared=True) as proc:
        proc.api_key = API_KEY
        yield proc


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("scoring-models")


@pytest.fixture(scope="session")
def scoring_server(tmp_path_factory: pytest.TempPathFactory, models_root: Path) -> ServerProcess:
    """The default embedder, a tiny reranker and a tiny classifier (see
    `tests.support.tiny_models.scoring_models_config`) from one models.toml, shared by the
    rerank and classify tests."""
    from tests.support.tiny_models import scoring_models_config  # torch: not for the fast tier

    with running_server(config=scoring_models_config(models_root, MODEL_NAME),
                        log_dir=tmp_path_factory.mktemp("scoring-server"), shared=True) as proc:
        yield proc


@pytest.fixture
def start_server(tmp_path: Path):
    """Factory for servers of one test: `start_server("--api-key", "k", config=..., env=...)`.
    Every server it started is stopped and cleaned up after the test."""
    started: list[ServerProcess] = []

    def start(*args: str, **kwargs: Any) -> ServerProcess:
        kwargs.setdefault("log_dir", tmp_path)
        return start_server_process(*args, started=started, **kwargs)

    yield start
    for proc in started:
        proc.cleanup()


# --- the reference ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def model_folder() -> Path:
    from infinity.folders.resolve import packaged_model_folder

    return packaged_model_folder()


@pytest.fixture(scope="session")
def reference_model(model_folder: Path):
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model = SentenceTransformer(str(model_folder), device="cpu")
    assert model.max_seq_length == MAX_LENGTH
    return model


@pytest.fixture(scope="session")
def reference_tokenizer(reference_model):
    return reference_model.tokenizer


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    return SENTENCES


@pytest.fixture(scope="session")
def reference_vectors(reference_model, sentences: list[str]) -> np.ndarray:
    return reference_embed(reference_model, sentences)


# --- hooks -----------------------------------------------------------------------------------

def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """However the session ends, no server outlives it."""
    clean_up_every_server()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    with started_by(item.nodeid):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.extend(log_sections(item.nodeid))
