"""Converted models on disk: an engine that needs the transformers weights in another
format (a CTranslate2 folder, an ONNX graph) builds it once into the cache directory and
reuses it on later starts. Also the records of what was measured at a load (the bfloat16
trial, the lone input's engine), kept so that a later start on the same machine decides
from them without measuring (`measurement_record`). Within `prepared_only` (a start that
serves at once and leaves the preparing to another process), a build or a measurement
that is not in the cache is not made: `NotPrepared` says which.

A build lives in `<cache>/<engine>/<model folder name>-<fingerprint>`, where the
fingerprint covers the source folder's files (names, sizes, modification times) and the
engine's settings (quantisation, library versions): any change gives a new folder. Builds
go to a staging folder renamed into place, so a crash never leaves a half-written one.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import msgspec

from infinity.shared.devices import cpu_identity
from infinity.shared.folders import cache_dir
from infinity.shared.protocol import ModelSpec

log = logging.getLogger(__name__)
T = TypeVar("T")


class NotPrepared(Exception):
    """A build or a measurement a load needs is not in the cache, and the load runs
    `prepared_only`."""


_PREPARED_ONLY = threading.local()


@contextmanager
def prepared_only() -> Iterator[None]:
    """Within the block, in this thread, `cached_build` and `needs_record` raise
    `NotPrepared` where they would build or measure."""
    _PREPARED_ONLY.on = True
    try:
        yield
    finally:
        _PREPARED_ONLY.on = False


def needs_record(record: Path, what: str) -> None:
    """Called where a load finds no kept figures in `record` and would measure `what`:
    within `prepared_only`, raises `NotPrepared`."""
    _refuse_within_prepared_only(f"{what} has not run on this machine (no {record})")


def _refuse_within_prepared_only(why: str) -> None:
    if getattr(_PREPARED_ONLY, "on", False):
        raise NotPrepared(why)


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
    no cached one matches (`NotPrepared` within `prepared_only`). Returns (folder,
    whether it was built now)."""
    target = cache_dir() / engine / f"{source.name}-{fingerprint(source, settings)}"
    if target.is_dir():
        return target, False
    _refuse_within_prepared_only(f"{source.name} is not converted for {engine} yet (no {target})")
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


# The libraries whose speed a measurement at load reads, by the engine that ran it.
ENGINE_PACKAGES = {"ctranslate2": ("ctranslate2",), "onnx": ("onnxruntime", "onnxruntime-gpu"),
                   "openvino": ("openvino",)}


def measurement_record(what: str, spec: ModelSpec, threads: int, engines: Iterable[str], version: str) -> Path:
    """Where the figures of measurement `what` (of that `version`) of `spec` with `threads`
    threads on this machine are kept: keyed by the model's folder, its settings, the thread
    count, the CPU and the versions of torch, this package and the `engines`' libraries."""
    found = []
    for package in sorted({"torch", "infinity-serve", *(p for e in engines for p in ENGINE_PACKAGES.get(e, ()))}):
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    # The name it is served under and the device do not change what is measured.
    measured = msgspec.json.encode(msgspec.structs.replace(spec, name="", device="")).decode()
    source = Path(spec.path)
    digest = fingerprint(source, {"spec": measured, "threads": str(threads), "cpu": cpu_identity(),
                                  "libraries": ", ".join(found), "version": version})
    return cache_dir() / what / f"{source.name}-{digest}.json"


def read_record(record: Path, kind: type[T]) -> T | None:
    """The figures kept in `record`, or None where there are none (or unreadable ones)."""
    try:
        return msgspec.json.decode(record.read_bytes(), type=kind)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("figures in %s cannot be read (%s); measuring again", record, exc)
        return None


def keep_record(record: Path, figures: object) -> None:
    """Write `figures` to `record` whole or not at all; a record that cannot be written
    only costs the next start its measurement."""
    staging = None
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=record.parent, prefix=".record-", delete=False) as staging:
            staging.write(msgspec.json.encode(figures))
        os.replace(staging.name, record)
    except OSError as exc:
        log.warning("figures cannot be kept in %s: %s", record, exc)
        if staging is not None:
            Path(staging.name).unlink(missing_ok=True)
