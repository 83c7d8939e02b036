"""Multi-worker benchmark (see ``pergrad.bench.multi_worker``):
``python benchmarks/bench_multi_worker.py``."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pergrad.bench.multi_worker import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
