"""The documentation site builds with `mkdocs build --strict` (mkdocs.yml, docs/hooks/site.py):
no broken link or anchor in any page, the README's links being checked by
tests/fast/test_documents.py; its API reference is the explorer of `/docs` on the document
the server's own builder makes; the benchmark results are pages of it. Built in this
process, in a second or two; skipped where the `docs` extra is not installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infinity.api import explorer
from infinity.api.app import package_version
from infinity.api.examples import MODELS_BY_KIND

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    pytest.importorskip("material", reason="the docs extra is not installed (pip install -e '.[docs]')")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    folder = tmp_path_factory.mktemp("site")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NO_MKDOCS_2_WARNING", "1")  # Material's banner about MkDocs 2, on every build
        config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(folder), strict=True)
        build(config)  # strict: any warning (a link or anchor not found) raises mkdocs' Abort
    return folder


def test_the_site_builds_strict_with_every_page(site):
    pages = {str(path.relative_to(site)) for path in site.rglob("index.html")}
    for document in ("api", "reference", "models", "configuration", "corpus", "deploy", "architecture",
                     "benchmarks", "bench/RESULTS", "bench/results/lanes"):
        assert f"{document}/index.html" in pages, document
    assert "index.html" in pages


def test_the_api_reference_is_the_servers_explorer_on_the_servers_document(site):
    document = explorer.api_document(package_version(), MODELS_BY_KIND)
    assert json.loads((site / "reference" / "openapi.json").read_text()) == document
    assert (site / "reference" / "explorer.html").read_text() == explorer.page(document, "", None)
    for name in explorer.ASSETS:
        assert (site / "reference" / name).read_bytes() == (explorer.asset_folder() / name).read_bytes()
    page = (site / "reference" / "index.html").read_text()
    assert '<iframe src="explorer.html"' in page
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            if "x-alias-of" not in operation:
                assert f"<code>{method.upper()} {path}</code>" in page, (method, path)


def test_links_out_of_docs_lead_to_the_sites_pages(site):
    """docs/benchmarks.md links `../bench/RESULTS.md` (right in the repository); in the site it
    leads to the page made of that file."""
    page = (site / "benchmarks" / "index.html").read_text()
    assert 'href="../bench/RESULTS/"' in page
