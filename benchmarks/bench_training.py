"""Training benchmark (see ``pergrad.bench.training``): ``python benchmarks/bench_training.py``."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pergrad.bench.training import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
