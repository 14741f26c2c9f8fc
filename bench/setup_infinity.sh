#!/usr/bin/env bash
# Create bench/.venv-infinity with the peer server, michaelfeil/infinity
# (PyPI: infinity-emb 0.0.78), its torch engine and the ctranslate2 engine.
#
# Usage: bash bench/setup_infinity.sh          (idempotent; re-run to repair)
#
# The venv is separate from the project's .venv on purpose: infinity-emb pins
# numpy<2, sentence-transformers<4, click<8.2, typer<0.13, rich<14 and
# transformers<=5.0, which clash with the project's own environment.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.venv-infinity"
python="${PYTHON:-python3.11}"

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)

# 1. torch first, pinned to the project's version. A bare `torch==2.13.0`
#    matches the local CPU build 2.13.0+cpu too, and pip prefers it where it is
#    offered (this machine's wheel cache has it). The plain PyPI 2.13.0 Linux
#    wheel would pull several GB of nvidia-* CUDA wheels that a CPU-only
#    benchmark never uses, so we keep the CPU build when it is there.
"${pip[@]}" "torch==2.13.0"

# 2. The server and its torch engine. Passing torch==2.13.0 again keeps pip's
#    resolver from "upgrading" torch while it satisfies infinity-emb's
#    torch>=2.2.1.
"${pip[@]}" "infinity-emb[server,torch]==0.0.78" "torch==2.13.0"

# 3. ctranslate2 for `--engine ctranslate2`. We do not use the [ct2] extra:
#    it only adds transformers[sentencepiece]<=5.0, which the torch extra's
#    sentence-transformers<4 already bounds tighter, and sentencepiece, which
#    this BERT-style model (WordPiece tokenizer) does not need.
"${pip[@]}" ctranslate2 "torch==2.13.0"

# Its image routes read images (data: URIs too) through aiohttp, which no extra installs;
# its audio routes decode with soundfile (the [audio] extra's, pinned as ours).
"${pip[@]}" aiohttp soundfile==0.14.0 "torch==2.13.0"

"$venv/bin/python" - <<'EOF'
import ctranslate2, infinity_emb, numpy, sentence_transformers, torch, transformers
print(
    f"infinity_emb {infinity_emb.__version__}, torch {torch.__version__}, "
    f"ctranslate2 {ctranslate2.__version__}, "
    f"sentence-transformers {sentence_transformers.__version__}, "
    f"transformers {transformers.__version__}, numpy {numpy.__version__}"
)
EOF
