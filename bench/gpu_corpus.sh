#!/usr/bin/env bash
# The corpus job on a lent GPU machine (issue 26's speed on a GPU): bench.corpus --device cuda
# on the default model and on the BERT-base shape (built there with random weights), each
# against the in-process ceiling, our server at 8 clients of 32 and sentence-transformers'
# encode, all on the GPU. Prepared and carried as bench/gpu_check.sh is (bench/gpu_env.sh);
# logs go to $OUT or bench/out.
# ROWS (default 100000) and MODELS (default "default bert-base") size it; CORPUS_ARGS adds
# bench.corpus flags (--skip st, --embed-batch-size 256).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
status=0
for name in ${MODELS:-default bert-base}; do
  model=()
  if [ "$name" != default ]; then
    folder=$("$py" -m bench.base_models "$name" 2>/dev/null | tail -1) || { status=1; continue; }
    model=(--model "$folder")
  fi
  timeout "${CORPUS_TIMEOUT:-200}" "$py" -m bench.corpus --device "$device" --rows "${ROWS:-100000}" "${model[@]}" ${CORPUS_ARGS:-} 2>&1 \
    | tee "$out/gpu_corpus_$name.log" || status=1
done
exit $status
