"""pergrad on the JAX backend: see pergrad.bench.jax_engine (run with KERAS_BACKEND=jax)."""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

from pergrad.bench.jax_engine import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
