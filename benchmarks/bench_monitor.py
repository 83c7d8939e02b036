"""Monitor benchmark (see ``pergrad.bench.monitor``): ``python benchmarks/bench_monitor.py``."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pergrad.bench.monitor import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
