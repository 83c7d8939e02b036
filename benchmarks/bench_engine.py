"""Engine benchmark (see ``pergrad.bench.engine``): ``python benchmarks/bench_engine.py [--quick]``."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pergrad.bench.engine import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
