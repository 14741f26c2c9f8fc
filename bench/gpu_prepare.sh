#!/usr/bin/env bash
# Run here (not on the GPU machine), before bench/gpu_check.sh: fills .gpu/ (ignored by git)
# with what the lent GPU machine lacks. That machine has Python 3.12 with torch, transformers,
# sentence-transformers, onnxruntime, aiohttp and uvloop, and no network; a call to it
# carries at most 64 MiB. So .gpu/ holds the wheels of msgspec and pyzmq for Python 3.12,
# and the default model with its weights stored in float16 (the packaged 83 MB zip does not
# fit; config.json says float32, so they load as float32), which both our engines and the
# reference load from the same folder.
# Usage: bash bench/gpu_prepare.sh   (then: run with carry [".gpu"], command: bash bench/gpu_check.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu/wheels
grep -qsx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/wheels msgspec==0.23.0 pyzmq==27.3.0
.venv/bin/python - <<'PY'
import json, shutil, tempfile, zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from infinity.folders.resolve import packaged_model_folder

source = packaged_model_folder()
with tempfile.TemporaryDirectory() as staging:
    folder = Path(staging) / "model"
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns(".extracted-from"))
    weights = load_file(folder / "model.safetensors")
    save_file({k: v.to(torch.float16) if v.is_floating_point() else v for k, v in weights.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    # Stored in float16 to fit, loaded in float32: transformers otherwise keeps the stored dtype.
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=2))
    with zipfile.ZipFile(".gpu/model.zip", "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                archive.write(path, path.relative_to(folder))
PY
du -sh .gpu .gpu/*
