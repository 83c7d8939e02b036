"""PyTorch's noise keys and Gaussian draws (the contract: :mod:`pergrad.aggregate.noise`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import torch
from keras import ops

from pergrad._compat import is_keras_variable
from pergrad.backend.host_random import host_generator, host_normal
from pergrad.backend.keys import check_key, initial_state


def check_noise_keys() -> None:
    """Nothing to check: PyTorch has 64-bit integers."""


def enable_noise_keys() -> None:
    """Nothing to enable: PyTorch has 64-bit integers."""


def new_key_state(seed: int) -> Any:
    """A host array ``[seed, 0]`` (everything runs eagerly)."""
    return np.array(initial_state(seed), np.int64)


def take_key(state: Any) -> Any:
    key = state.copy()
    state[1] += 1
    return key


def next_key(state: Any, step: Any) -> Any:
    """A host copy first: a PyTorch variable is assigned in place, under any view of it."""
    key = np.array(ops.convert_to_numpy(state.value if is_keras_variable(state) else state),
                   np.int64)
    state.assign(key + np.array([0, int(ops.convert_to_numpy(step))], np.int64))
    return ops.convert_to_tensor(key)


def gaussian_noise(key: Any, values: list, stddev: float) -> list:
    """The Box-Muller draw made on the host by NumPy's Philox generator keyed by the whole
    128-bit ``[seed, counter]`` (:func:`pergrad.backend.host_random.host_generator`), the values
    drawn one after another from that stream and copied to each value's device.

    Not ``torch.Generator``: its CPU generator (MT19937) keeps only the low 32 bits of a seed
    (``manual_seed(5)``, ``manual_seed(5 + 2**32)`` and ``manual_seed(5 + 2**40)`` draw the same
    numbers in torch 2.13), so any folding of a 62-bit seed and a 64-bit counter into its seed
    would repeat noise across steps or streams. Philox4x64 takes the key as it is: two keys
    never share a stream, the same key gives the same numbers."""
    generator = host_generator(np.asarray(check_key(key).detach().cpu()))
    out = []
    for v in values:
        dtype = keras.backend.standardize_dtype(v.dtype)
        # NumPy has no bfloat16 torch can read: half precision is drawn in float32 and cast.
        wide = "float64" if dtype == "float64" else "float32"
        draw = host_normal(generator, tuple(int(n) for n in v.shape), wide, stddev)
        out.append(torch.from_numpy(draw).to(device=v.device, dtype=v.dtype))
    return out


def generator_state() -> Any:
    """torch's CPU generator state (and every CUDA device's, where CUDA is in use): Keras's
    torch dropout draws from them when the layer was given no seed."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def replaying_generators(state: Any) -> Iterator[None]:
    """Draws inside the block are those drawn from ``state``; the generators are put back as
    they were before the block, so a replay leaves the stream of draws unchanged."""
    if state is None:
        yield
        return
    before = generator_state()
    _set_generators(state)
    try:
        yield
    finally:
        _set_generators(before)


def _set_generators(state: Any) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
