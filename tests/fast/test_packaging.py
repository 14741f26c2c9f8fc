"""The distribution holds every package of the server: what `pip install .` (not only an
editable install, which reads the source tree) puts in site-packages, as images do; and
the server knows its version without being installed (the checkout alone, as the GPU
checks run it)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from setuptools import find_packages

from infinity.api import app

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_of_the_server_is_distributed():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    distributed = set(find_packages(str(ROOT), include=find["include"]))
    ours = {str(init.parent.relative_to(ROOT)).replace("/", ".")
            for top in ("infinity", "workers") for init in (ROOT / top).rglob("__init__.py")}
    assert ours <= distributed, sorted(ours - distributed)
    assert not {name for name in distributed if name.split(".")[0] not in ("infinity", "workers")}


def test_the_version_without_an_installed_distribution(monkeypatch):
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(app, "version", not_installed)
    assert app.package_version() == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
