"""Jacobian benchmark (see ``pergrad.bench.jacobian``): ``python benchmarks/bench_jacobian.py``."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pergrad.bench.jacobian import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
