"""pergrad on the JAX backend: see pergrad.bench.jax_engine (run with KERAS_BACKEND=jax)."""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)  # DP noise keys are 64-bit

from pergrad.bench.jax_engine import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
