"""Converted models on disk: an engine that needs the transformers weights in another
format (a CTranslate2 folder, an ONNX graph) builds it once into the cache directory and
reuses it on later starts.

A build lives in `<cache>/<engine>/<model folder name>-<fingerprint>`, where the
fingerprint covers the source folder's files (names, sizes, modification times) and the
engine's settings (quantisation, library versions): any change gives a new folder. Builds
go to a staging folder renamed into place, so a crash never leaves a half-written one.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from infinity.shared.folders import cache_dir


def versions(*packages: str) -> dict[str, str]:
    """The installed versions of `packages`, for a build's settings: read from their
    metadata, not imported (importing transformers alone takes a second of a start that
    finds its build cached)."""
    return {package: importlib.metadata.version(package) for package in packages}


def fingerprint(source: Path, settings: dict[str, str]) -> str:
    """A short digest of the model folder `source` (its files' names, sizes and
    modification times) and `settings`: any change gives another."""
    return hashlib.sha256(json.dumps({
        "source": str(source.resolve()),
        "files": sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in source.iterdir() if p.is_file()),
        **settings,
    }, sort_keys=True).encode()).hexdigest()[:16]


def cached_build(engine: str, source: Path, settings: dict[str, str],
                 build: Callable[[Path], None]) -> tuple[Path, bool]:
    """The folder holding `source` converted for `engine`; `build(staging)` writes it when
    no cached one matches. Returns (folder, whether it was built now)."""
    target = cache_dir() / engine / f"{source.name}-{fingerprint(source, settings)}"
    if target.is_dir():
        return target, False
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    try:
        build(staging)
        os.replace(staging, target)
    except OSError:
        if not target.is_dir():
            raise
        # Another process built it meanwhile: keep theirs.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target, True
