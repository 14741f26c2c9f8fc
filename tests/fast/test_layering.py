"""The import rule of the tree (infinity/shared/__init__.py): the shared contracts import
nothing else of ours, the workers only the contracts, and the front end no worker module
but the inline tokenizer."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _our_imports(path: Path) -> set[str]:
    """Modules of `infinity` and `workers` that `path` imports, at any depth."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {name for name in names if name.split(".")[0] in ("infinity", "workers")}


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _modules("infinity/shared"), ids=lambda p: p.name)
def test_the_shared_contracts_import_nothing_else_of_ours(path):
    assert {name for name in _our_imports(path) if not name.startswith("infinity.shared")} == set()


@pytest.mark.parametrize("path", _modules("workers"), ids=lambda p: str(p.relative_to(ROOT)))
def test_workers_import_only_the_shared_contracts(path):
    assert {name for name in _our_imports(path)
            if not name.startswith(("infinity.shared", "workers"))} == set()


@pytest.mark.parametrize("path", [p for p in _modules("infinity") if "shared" not in p.parts],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_front_end_runs_no_worker_code_but_the_inline_tokenizer(path):
    allowed = {"workers.preprocess", "workers.preprocess.text"} if path.name == "engine_client.py" else set()
    assert {name for name in _our_imports(path) if name.startswith("workers")} <= allowed
