#!/usr/bin/env bash
# GPU checks, run by hand on a lent GPU machine (CI has none), in under five minutes:
#   1. parity: the tests marked `gpu` (tests/e2e/engines/test_gpu.py,
#      tests/e2e/serving/test_devices.py): every engine that runs on CUDA against the
#      sentence-transformers reference, flash-attn's varlen path if installed,
#      torch.compile, the server on device = "cuda";
#   2. throughput: bench.run with the in-process ceiling on the GPU against our server on the
#      GPU (torch engine, float16 and float32).
# Logs go to $OUT (the device tool's result folder) or bench/out. Prepare with
# bench/gpu_prepare.sh and carry .gpu; DEVICE=cpu PYTHON=.venv/bin/python runs the same
# steps on a CPU machine, to check the script itself.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu_machine.txt"
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)" | tee -a "$out/gpu_machine.txt"
status=0

timeout 150 "$py" -m pytest -q -m gpu -p no:cacheprovider \
  tests/e2e/engines/test_gpu.py tests/e2e/serving/test_devices.py 2>&1 | tee "$out/gpu_pytest.log" || status=1

configs=$(mktemp -d)
targets=()
for dtype in ${DTYPES:-float16 float32}; do
  printf '[[models]]\nname = "all-MiniLM-L6-v2"\nsource = "default"\ndevice = "%s"\nengine = "torch"\ndtype = "%s"\n' \
    "$device" "$dtype" > "$configs/$dtype.toml"
  targets+=(--cmd "$py -m infinity serve --host 127.0.0.1 --port {port} --config $configs/$dtype.toml"
            --name "ours-$device-$dtype")
done
timeout 170 "$py" -m bench.run --device "$device" --loads "${LOADS:-1x1,1x16,32x8}" --duration 8 --warmup 2 \
  --ceiling-duration 8 --idle-wait 0 --retries 0 --max-noise 1 "${targets[@]}" 2>&1 \
  | tee "$out/gpu_bench.log" || status=1
rm -rf "$configs"
# The servers' own logs, where the device tool brings $OUT back (bench/out stays there).
[ "$out" != bench/out ] && sed -n 's/^  log: //p' "$out/gpu_bench.log" | xargs -r cp -t "$out"
exit $status
