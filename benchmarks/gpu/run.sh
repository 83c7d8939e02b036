#!/usr/bin/env bash
# pergrad's benchmarks on the lent GPU machine, in one call: the JAX and PyTorch engine tables
# (bench_jax.py, bench_torch.py) and the real-models suite (bench_real_models.py: KerasHub
# transformers with and without LoRA, keras.applications CNNs) on both backends. It installs the
# carried wheels (benchmarks/gpu/fetch_wheels.sh) into a scratch folder and runs pergrad from src/
# (no install; the image has no TensorFlow, and pergrad on JAX or PyTorch never imports it).
# JAX Privacy is not on that image, so its columns are left out.
#
# Each section runs in its own process under its own time limit (the machine is lent for 15
# minutes in all), so a section stopped at its limit still returns the rows it finished: every
# table row is written to $OUT as soon as it is measured, and progress.txt has each section's
# log and exit status. Files written to $OUT: device.txt, progress.txt, jax_engine.md,
# torch_engine.md, jax_real_models.md, torch_real_models.md.
#   bash benchmarks/gpu/fetch_wheels.sh            # here, once; then, with the device tool:
#   run(command="bash benchmarks/gpu/run.sh", carry=[".device-wheels"], timeout_s=540)
#   QUICK=1 PYTHON=.venv/bin/python bash benchmarks/gpu/run.sh   # the CPU dry run (minutes)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pergrad-gpu-out}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
DEPS=$(mktemp -d)
trap 'rm -rf "$DEPS"' EXIT
"$PYTHON" -m pip install -q --no-index --no-deps --find-links .device-wheels --target "$DEPS" \
  keras namex optree dp-accounting keras-hub || exit 1
export PYTHONPATH="$DEPS:$PWD/src" PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
# JAX takes 75% of the GPU's memory at start by default; PyTorch's sections run after it in
# other processes, but the tables should not depend on the order.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
KERAS_BACKEND=jax "$PYTHON" - <<'PY' | tee "$OUT/device.txt"
import platform, jax, torch, keras
print(platform.python_version(), "jax", jax.__version__, "torch", torch.__version__,
      "keras", keras.__version__)
print(jax.devices(), torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")
PY

# section NAME SECONDS BACKEND COMMAND...: the command's stdout (the table) to $OUT/NAME.md, its
# stderr (per-call timings, errors) to progress.txt, stopped after SECONDS.
section() {
  local name=$1 limit=$2 backend=$3
  shift 3
  echo "## $name (limit ${limit}s; started at ${SECONDS}s)" >> "$OUT/progress.txt"
  KERAS_BACKEND=$backend timeout --kill-after=5 "$limit" "$@" \
    > "$OUT/$name.md" 2>> "$OUT/progress.txt"
  echo "## $name: exit $? at ${SECONDS}s" >> "$OUT/progress.txt"
}

# per_model NAME SECONDS BACKEND MODELS COMMAND...: section's command once per model of the comma
# list MODELS (appended as --models M), all within SECONDS, so that a stop at the limit keeps
# the tables of the models finished (bench_jax.py prints its table at the end).
per_model() {
  local name=$1 limit=$2 backend=$3 models=$4 start=$SECONDS model left
  shift 4
  : > "$OUT/$name.md"
  for model in ${models//,/ }; do
    left=$((limit - (SECONDS - start)))
    if [ "$left" -le 5 ]; then
      echo "## $name: no time left for $model" >> "$OUT/progress.txt"
      break
    fi
    echo "## $name $model (limit ${left}s; started at ${SECONDS}s)" >> "$OUT/progress.txt"
    KERAS_BACKEND=$backend timeout --kill-after=5 "$left" "$@" --models "$model" \
      >> "$OUT/$name.md" 2>> "$OUT/progress.txt"
    echo "## $name $model: exit $? at ${SECONDS}s" >> "$OUT/progress.txt"
  done
}

if [ -n "${QUICK:-}" ]; then
  per_model jax_engine 300 jax mlp,cnn "$PYTHON" benchmarks/bench_jax.py --batch-sizes 64 \
    --skip "jax_privacy step,jax_privacy micro32 step"
  per_model torch_engine 300 torch mlp "$PYTHON" benchmarks/bench_torch.py --batch 64 \
    --repeats 3
  section jax_real_models 300 jax "$PYTHON" benchmarks/bench_real_models.py --quick \
    --models bert_lora --skip "jax_privacy step"
  section torch_real_models 300 torch "$PYTHON" benchmarks/bench_real_models.py --quick \
    --models bert_lora
  exit 0
fi
# Largest compile times last in each section; about 460 s in all. Each section's models and
# seconds can be set from the environment (a second call that finishes what the first did not):
#   JAX_ENGINE=mlp,resnet:80 TORCH_REAL=bert_lora:60 ... ; a section set to "" is left out.
JAX_ENGINE=${JAX_ENGINE-cnn,transformer,mlp,resnet,mobilenet:150}
TORCH_ENGINE=${TORCH_ENGINE-cnn,transformer,mlp,resnet:90}
ALL_REAL=bert_lora,gemma_lora,gpt2_lora,mobilenet_v3_small,bert,gpt2,gemma,efficientnet_v2_b0
JAX_REAL=${JAX_REAL-$ALL_REAL:120}
TORCH_REAL=${TORCH_REAL-$ALL_REAL:100}
if [ -n "$JAX_ENGINE" ]; then
  per_model jax_engine "${JAX_ENGINE#*:}" jax "${JAX_ENGINE%:*}" "$PYTHON" benchmarks/bench_jax.py \
    --batch-sizes 256 --skip "jax_privacy step,jax_privacy micro32 step"
fi
if [ -n "$TORCH_ENGINE" ]; then
  per_model torch_engine "${TORCH_ENGINE#*:}" torch "${TORCH_ENGINE%:*}" "$PYTHON" \
    benchmarks/bench_torch.py --batch 256
fi
if [ -n "$JAX_REAL" ]; then
  section jax_real_models "${JAX_REAL#*:}" jax "$PYTHON" benchmarks/bench_real_models.py \
    --batch-size 64 --models "${JAX_REAL%:*}" --skip "jax_privacy step"
fi
if [ -n "$TORCH_REAL" ]; then
  section torch_real_models "${TORCH_REAL#*:}" torch "$PYTHON" benchmarks/bench_real_models.py \
    --batch-size 64 --models "${TORCH_REAL%:*}"
fi
