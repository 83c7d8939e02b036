"""TensorFlow, imported on first use.

Modules that serve every backend name TensorFlow through :data:`tensorflow` here, so that pergrad
on JAX or PyTorch never loads it (a second framework in the process costs seconds at start-up and
hundreds of megabytes) unless a TensorFlow-only part (``tf.data`` sampling, ``fit_distributed``)
is really used. TensorFlow is imported the first time an attribute is read.
"""

from __future__ import annotations

import importlib
import types
from typing import Any


class LazyModule(types.ModuleType):
    """A stand-in for the module ``name`` that imports it when an attribute is first read."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._module: types.ModuleType | None = None

    def _load(self) -> types.ModuleType:
        if self._module is None:
            self._module = importlib.import_module(self.__name__)
        return self._module

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") and attribute.endswith("__"):
            raise AttributeError(attribute)  # copy, pickle and inspect probe these
        return getattr(self._load(), attribute)

    def __dir__(self) -> list[str]:
        return dir(self._load())


tensorflow = LazyModule("tensorflow")

__all__ = ["LazyModule", "tensorflow"]
