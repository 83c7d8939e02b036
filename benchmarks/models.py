"""The benchmark models live in the package (``pergrad.bench.models``) so ``pergrad bench`` has them."""

from pergrad.bench.models import MODELS, batch, cnn, mlp, transformer  # noqa: F401
