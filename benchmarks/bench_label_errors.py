"""Label-error detection benchmark (see ``pergrad.bench.label_errors``):
``python benchmarks/bench_label_errors.py``."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pergrad.bench.label_errors import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
