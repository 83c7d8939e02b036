#!/usr/bin/env bash
# The wheels the GPU machine's image lacks for benchmarks/gpu/run.sh: Keras, the two of its
# dependencies that image does not hold (namex, optree; KINDS.md of the device tool lists what it
# holds), dp-accounting (pergrad.keras imports it; its own dependencies are there) and keras-hub
# (the real-models suite; installed without its dependencies: tensorflow-text would pull
# TensorFlow, and what it imports, regex and tokenizers, is there). The image has no TensorFlow,
# and pergrad on JAX or PyTorch never imports it.
# Run here, before the device call; the folder is git-ignored and travels with `carry`.
#   bash benchmarks/gpu/fetch_wheels.sh            # then, with the device tool:
#   run(command="bash benchmarks/gpu/run.sh", carry=[".device-wheels"], timeout_s=540)
set -euo pipefail
cd "$(dirname "$0")/../.."
KERAS_VERSION=$(.venv/bin/python -c "import keras; print(keras.__version__)")
DP_VERSION=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('dp-accounting'))")
HUB_VERSION=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('keras-hub'))")
mkdir -p .device-wheels
for py in 3.12 3.11; do  # the device's Python (3.12) and this machine's (the dry run)
  .venv/bin/pip download -q --no-deps --only-binary :all: --python-version "$py" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d .device-wheels "keras==$KERAS_VERSION" "dp-accounting==$DP_VERSION" \
    "keras-hub==$HUB_VERSION" namex optree
done
ls -la .device-wheels
