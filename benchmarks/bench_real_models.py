"""Real-models benchmark (see ``pergrad.bench.real_models``): KerasHub BERT, GPT-2 and Gemma with
and without LoRA, keras.applications CNNs made DP-ready, on the backend ``KERAS_BACKEND`` names:
``python benchmarks/bench_real_models.py``."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.environ.get("KERAS_BACKEND") == "jax":
    import jax

    jax.config.update("jax_enable_x64", True)  # DP noise keys are 64-bit

from pergrad.bench.real_models import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
