"""TensorFlow, imported on first use.

Modules that serve every backend name TensorFlow through :data:`tensorflow` here, so that pergrad
on JAX or PyTorch never loads it (a second framework in the process costs seconds at start-up and
hundreds of megabytes) unless a TensorFlow-only part (``tf.data`` sampling, ``fit_distributed``)
is really used. TensorFlow is imported the first time an attribute is read; where it is not
installed (it is the extra ``pergrad[tensorflow]``), that read raises a ``ModuleNotFoundError``
that says how to install it.
"""

from __future__ import annotations

import importlib
import types
from typing import Any


class LazyModule(types.ModuleType):
    """A stand-in for the module ``name`` that imports it when an attribute is first read.

    ``install``: how to install the module, added to the ``ModuleNotFoundError`` raised when it
    is missing (not when something it imports is)."""

    def __init__(self, name: str, install: str | None = None) -> None:
        super().__init__(name)
        self._module: types.ModuleType | None = None
        self._install = install

    def _load(self) -> types.ModuleType:
        if self._module is None:
            try:
                self._module = importlib.import_module(self.__name__)
            except ModuleNotFoundError as err:
                if self._install is None or err.name != self.__name__:
                    raise
                raise ModuleNotFoundError(
                    f"No module named {self.__name__!r}: this part of pergrad needs it, "
                    f"whatever the Keras backend. Install it with: {self._install}",
                    name=self.__name__) from err
        return self._module

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") and attribute.endswith("__"):
            raise AttributeError(attribute)  # copy, pickle and inspect probe these
        return getattr(self._load(), attribute)

    def __dir__(self) -> list[str]:
        return dir(self._load())


tensorflow = LazyModule("tensorflow", install="pip install pergrad[tensorflow]")

__all__ = ["LazyModule", "tensorflow"]
