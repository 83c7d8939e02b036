"""JAX's DP noise draws against each other, alone and inside a ``dp_mean`` training step.

Three samplers of ``N(0, 1)`` in float32 on XLA's CPU:

* ``inverse cdf``: pergrad's draw (``pergrad.aggregate.noise._jax_normal``), ``-ndtri`` of a
  uniform with 63 random bits and a sign bit from one 64-bit word (cut at 9.16 sigma);
* ``box-muller``: the transform TensorFlow's draw uses, with a 53-bit uniform under the
  radius (cut at 8.65), as pergrad drew on JAX before;
* ``jax normal``: ``jax.random.normal`` (cut at +5.22/-5.42: not sound for DP, the speed
  reference).

Each is timed alone on ``--values`` values (alternately, ratios to ``jax normal``), then
swapped into a ``PerExampleModel(dp_mean)`` whose ``train_on_batch`` is timed alternately with
the plain Keras step on the same weights and batch (ratios to the Keras step); medians. Nothing here asserts on timings.

    KERAS_BACKEND=jax python benchmarks/ab_noise_jax.py --model mlp --rounds 60
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)  # DP noise keys are 64-bit

import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import pergrad  # noqa: E402
from pergrad.aggregate import noise  # noqa: E402
from pergrad.bench.models import DEFAULT_BATCH, MODELS, batch, twin  # noqa: E402
from pergrad.bench.timing import alternating_medians, print_ratios  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def box_muller(key, shape, dtype):
    """``r cos 2 pi a`` and ``r sin 2 pi a`` with ``r = sqrt(-2 ln u)``, ``u`` from 53 bits."""
    count = int(np.prod(shape))
    pairs = (count + 1) // 2
    radius_key, angle_key = jax.random.split(key)
    words = jax.random.bits(radius_key, (pairs,), jnp.uint64)
    u = ((words >> 11).astype(jnp.float64) + 0.5) * 2.0 ** -53
    radius = jnp.sqrt(-2.0 * jnp.log(u)).astype(jnp.float32)
    angle = jax.random.uniform(angle_key, (pairs,), jnp.float32)
    quarter = jnp.asarray([0.0, 0.25], jnp.float32)[:, None]
    normals = radius[None, :] * jnp.cos((2.0 * np.pi) * (angle[None, :] - quarter))
    return normals.reshape(-1)[:count].reshape(shape).astype(dtype)


SAMPLERS = {
    "inverse cdf": noise._jax_normal,
    "box-muller": box_muller,
    "jax normal": lambda key, shape, dtype: jax.random.normal(key, shape, dtype),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--values", type=int, default=670_000)
    args = parser.parse_args()
    key = jax.random.key(0)
    jitted = {label: jax.jit(lambda k, s=sampler: s(k, (args.values,), jnp.float32))
              for label, sampler in SAMPLERS.items()}
    draws = {label: (lambda d=draw: d(key)) for label, draw in jitted.items()}
    print_ratios(f"one draw of {args.values:,} float32 values ({args.rounds} alternating "
                 "rounds, medians)", alternating_medians(draws, args.rounds), "jax normal")

    keras.utils.set_random_seed(0)
    model = MODELS[args.model]()
    x, y = (jnp.asarray(t) for t in batch(args.model, DEFAULT_BATCH[args.model][-1]))

    steps = {"keras step": twin(model, LOSS)}
    for label, sampler in SAMPLERS.items():
        private = pergrad.keras.PerExampleModel(
            twin(model), pergrad.aggregate.dp_mean(1.0, 1.0,
                                                   expected_batch_size=int(x.shape[0])))
        private.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS)
        kept, noise._jax_normal = noise._jax_normal, sampler
        try:
            private.train_on_batch(x, y)  # traced (and the noise drawn) with this sampler
        finally:
            noise._jax_normal = kept
        steps[f"dp_mean, {label}"] = private
    calls = {label: (lambda m=m: m.train_on_batch(x, y)) for label, m in steps.items()}
    print_ratios(f"{args.model}, batch {int(x.shape[0])}, {args.rounds} alternating rounds "
                 "(medians)", alternating_medians(calls, args.rounds), "keras step")


if __name__ == "__main__":
    main()
