#!/usr/bin/env bash
# The JAX benchmark on the lent GPU machine, in one call (issue 11, item 6). It installs the
# carried wheels (benchmarks/gpu/fetch_wheels.sh) into a scratch folder, runs pergrad from src/
# (no install, no TensorFlow), and writes the tables (jax_gpu.md), every timing as it is made
# (progress.txt) and the device (device.txt) to $OUT. JAX Privacy is not on that image, so its
# columns are left out; everything else is bench_jax.py's default suite.
#   QUICK=1 bash benchmarks/gpu/run_jax.sh   # two models at batch 64: the CPU dry run
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pergrad-gpu-out}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
DEPS=$(mktemp -d)
trap 'rm -rf "$DEPS"' EXIT
"$PYTHON" -m pip install -q --no-index --no-deps --find-links .device-wheels --target "$DEPS" \
  keras namex optree dp-accounting
export PYTHONPATH="$DEPS:$PWD/src" KERAS_BACKEND=jax PYTHONUNBUFFERED=1
"$PYTHON" - <<'PY' | tee "$OUT/device.txt"
import platform, jax, keras
print(platform.python_version(), "jax", jax.__version__, "keras", keras.__version__)
print(jax.devices())
PY
# One bench_jax.py call per model, so that a run stopped at its limit still returns the models
# it finished (progress.txt has every timing as it is made). Largest compile times last.
MODELS=${MODELS:-mlp,cnn,embedding_bag,text_cnn,transformer,gru,resnet,mobilenet}
SKIP="jax_privacy step,jax_privacy micro32 step"
if [ -n "${QUICK:-}" ]; then MODELS=mlp,cnn; fi
: > "$OUT/jax_gpu.md"
for model in ${MODELS//,/ }; do
  ARGS=(--models "$model" --skip "$SKIP")
  if [ -n "${QUICK:-}" ]; then ARGS+=(--batch-sizes 64); fi
  "$PYTHON" benchmarks/bench_jax.py "${ARGS[@]}" 2>> "$OUT/progress.txt" | tee -a "$OUT/jax_gpu.md"
done
