"""The import rule of the tree, room by room (infinity/shared/__init__.py): the shared
contracts import nothing else of ours; the workers only the contracts; the front end no
worker module but the inline tokenizer; the engine client no HTTP; the folder readers
neither HTTP nor the engine client; the corpus job no HTTP server (of the API only the
media fetcher, and what answers an embeddings body, for OpenAI batch files). Bench (its modules and the Python inside its shell
scripts) uses only public names of the product that exist, and no test fixtures."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("infinity", "workers")


def _imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) of every absolute import in `tree`, at any depth."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def _our_imports(path: Path) -> set[str]:
    """Modules of `infinity` and `workers` that `path` imports."""
    return {module for module, _ in _imports(ast.parse(path.read_text())) if module.split(".")[0] in OURS}


def _modules(folder: str) -> list[Path]:
    """The project's modules under `folder`; hidden folders (bench/.venv-infinity, the
    peer's environment) and bench/out hold none."""
    return sorted(path for path in (ROOT / folder).rglob("*.py")
                  if not any(part.startswith(".") or part == "out" for part in path.relative_to(ROOT).parts))


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", _modules("infinity/shared"), ids=_name)
def test_the_shared_contracts_import_nothing_else_of_ours(path):
    assert {name for name in _our_imports(path) if not name.startswith("infinity.shared")} == set()


@pytest.mark.parametrize("path", _modules("workers"), ids=_name)
def test_workers_import_only_the_shared_contracts(path):
    assert {name for name in _our_imports(path) if not name.startswith(("infinity.shared", "workers"))} == set()


@pytest.mark.parametrize("path", [p for p in _modules("infinity") if "shared" not in p.parts], ids=_name)
def test_the_front_end_runs_no_worker_code_but_the_inline_tokenizer(path):
    allowed = {"workers.preprocess", "workers.preprocess.text"} if path.name == "engine_client.py" else set()
    assert {name for name in _our_imports(path) if name.startswith("workers")} <= allowed


@pytest.mark.parametrize("path", _modules("infinity/client"), ids=_name)
def test_the_engine_client_knows_no_http(path):
    assert {name for name in _our_imports(path) if name.startswith("infinity.api")} == set()


@pytest.mark.parametrize("path", _modules("infinity/folders"), ids=_name)
def test_the_folder_readers_know_neither_http_nor_the_engine_client(path):
    assert {name for name in _our_imports(path) if name.startswith(("infinity.api", "infinity.client"))} == set()


# What the corpus job may use of the API: nothing that serves HTTP (`binary`: the codec of
# the raw answers a job sent to a server reads).
_CORPUS_API = ("infinity.api.media_fetch", "infinity.api.types", "infinity.api.errors", "infinity.api.decode",
               "infinity.api.embedding", "infinity.api.long_inputs", "infinity.api.binary")


@pytest.mark.parametrize("path", _modules("infinity/corpus"), ids=_name)
def test_the_corpus_job_serves_no_http(path):
    api = {name for name in _our_imports(path) if name.startswith("infinity.api")}
    assert {name for name in api if not name.startswith(_CORPUS_API)} == set()


def _defined(module: str) -> set[str] | None:
    """The top-level names of our module `module` (None: no such module)."""
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.is_file():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    if not path.is_file():
        return None
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    submodules = {p.stem for p in path.parent.glob("*.py")} | {p.name for p in path.parent.iterdir() if p.is_dir()}
    return names | (submodules if path.name == "__init__.py" else set())


# The Python a bench shell script runs: `python - <<'TAG' ... TAG` heredocs and `-c "..."`.
_HEREDOC = re.compile(r"python3?(?:\.\d+)? - <<'?(\w+)'?\n(.*?)\n\1\n", re.S)
_INLINE = re.compile(r"""python3?(?:\.\d+)? -c (['"])(.*?)\1""", re.S)


def _bench_sources() -> list[tuple[str, str]]:
    sources = [(_name(path), path.read_text()) for path in _modules("bench")]
    for script in sorted((ROOT / "bench").glob("*.sh")):
        text = script.read_text()
        sources += [(f"{_name(script)} (python)", match.group(2))
                    for pattern in (_HEREDOC, _INLINE) for match in pattern.finditer(text)]
    return sources


@pytest.mark.parametrize("source", _bench_sources(), ids=lambda source: source[0])
def test_bench_uses_only_public_names_that_exist_and_no_test_fixtures(source):
    _, text = source
    for module, names in _imports(ast.parse(text)):
        assert module != "tests.conftest" and not module.startswith("tests.fast"), module
        if module.split(".")[0] not in (*OURS, "tests"):
            continue
        defined = _defined(module)
        assert defined is not None, f"{module} does not exist"
        for name in names:
            assert not name.startswith("_"), f"{module}.{name} is private"
            assert name in defined, f"{module} has no {name}"


def test_the_bench_scripts_python_is_found():
    assert any(name.startswith("bench/gpu_prepare.sh") for name, _ in _bench_sources())
