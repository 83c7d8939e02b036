"""JAX process-wide settings, each in a fresh JAX subprocess: ``PerExampleModel`` under
``keras.distribution.DataParallel`` on two host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2`` must be set before JAX initializes), and
DP noise refused without ``jax_enable_x64``. The children always run JAX, so these tests run
once, in the PyTorch run of the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from processes import jax_children

pytestmark = jax_children(
    "its KERAS_BACKEND=jax children (XLA_FLAGS for two host devices, "
    "jax_enable_x64 on or off)")

SCRIPT = textwrap.dedent(r"""
    import json
    import os
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    jax.config.update("jax_enable_x64", True)
    import keras
    import numpy as np
    from pergrad import aggregate
    from pergrad.keras import PerExampleModel

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.integers(0, 3, size=32)
    w = rng.uniform(0.5, 1.5, size=32).astype("float32")
    keras.utils.set_random_seed(0)
    init = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)]).get_weights()
    devices = keras.distribution.list_devices()

    def train(agg, distributed, epochs=2):
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices) if distributed else None)
        inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(3)])
        inner.set_weights(init)
        model = PerExampleModel(inner, agg)
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, sample_weight=w, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
        noise = None if model.noise_state is None else np.asarray(model.noise_state).tolist()
        if distributed:  # the weights live on both devices, replicated
            out["weight_devices"] = len(inner.trainable_variables[0].value.sharding.device_set)
        return inner.get_weights(), noise

    def max_diff(a, b):
        return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b))

    out = {"devices": len(devices)}
    for name, make in [("mean", aggregate.mean), ("clip_mean", lambda: aggregate.clip_mean(0.5)),
                       ("dp_mean_sigma0", lambda: aggregate.dp_mean(0.5, 0.0)),
                       ("median", aggregate.median)]:
        one, _ = train(make(), False)
        two, _ = train(make(), True)
        out[name] = max_diff(one, two)
    # The noise is drawn once per global step from the replicated key: the same seed gives the
    # same update on one device and on two.
    one, noise_one = train(aggregate.dp_mean(0.5, 1.0, seed=4), False)
    two, noise_two = train(aggregate.dp_mean(0.5, 1.0, seed=4), True)
    noiseless, _ = train(aggregate.dp_mean(0.5, 0.0), True)
    out["dp_mean_seeded"] = max_diff(one, two)
    out["noise_states"] = [noise_one, noise_two]
    out["noise_moved_weights"] = max_diff(two, noiseless)
    print("RESULT" + json.dumps(out))
""")


def test_data_parallel_on_two_devices_equals_one_device(tmp_path):
    script = tmp_path / "data_parallel.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(s for s in done.stdout.splitlines() if s.startswith("RESULT"))
    out = json.loads(line.removeprefix("RESULT"))
    assert out["devices"] == 2 and out["weight_devices"] == 2
    for name in ("mean", "clip_mean", "dp_mean_sigma0", "median", "dp_mean_seeded"):
        assert out[name] < 1e-5, (name, out[name])
    assert out["noise_states"] == [[4, 4], [4, 4]]  # 2 epochs x 2 steps, one key per step
    assert out["noise_moved_weights"] > 1e-3



def test_dp_noise_on_jax_without_64_bit_integers_is_refused(tmp_path):
    """Without jax_enable_x64 a noise key's 62-bit seed would be truncated to 32 bits: the DP
    model refuses to build (a separate process: x64 is a process-wide switch)."""
    script = tmp_path / "no_x64.py"
    script.write_text(
        "import keras, pergrad\n"
        "from pergrad import aggregate\n"
        "model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
        "try:\n"
        "    pergrad.keras.PerExampleModel(model, aggregate.dp_mean(1.0, 1.0))\n"
        "except ValueError as error:\n"
        "    print('refused:', error)\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    env.update(KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: DP noise on the JAX backend needs 64-bit integer keys" in done.stdout

