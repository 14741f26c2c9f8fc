"""The distribution holds every package of the server: what `pip install .` (not only an
editable install, which reads the source tree) puts in site-packages, as images do."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_of_the_server_is_distributed():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    distributed = set(find_packages(str(ROOT), include=find["include"]))
    ours = {str(init.parent.relative_to(ROOT)).replace("/", ".")
            for top in ("infinity", "workers") for init in (ROOT / top).rglob("__init__.py")}
    assert ours <= distributed, sorted(ours - distributed)
    assert not {name for name in distributed if name.split(".")[0] not in ("infinity", "workers")}
