"""Time to the first and second DP step of a benchmark model: the compile (the example-mixing
check and the train step) and one warm step, each run in a fresh process.

    KERAS_BACKEND=jax python benchmarks/first_dp_step.py --model cnn --repeats 3

Prints, per fresh process, the first ``train_on_batch`` (compiles the check and the step), the
second (warm) and the process's CPU time for the first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _one(model_name: str, batch_size: int) -> dict:
    try:  # on JAX, DP noise keys are 64-bit (README); harmless where JAX is not the backend
        import jax

        jax.config.update("jax_enable_x64", True)
    except ImportError:
        pass
    import keras

    import pergrad
    from pergrad.bench.models import MODELS, batch

    keras.utils.set_random_seed(0)
    model = pergrad.keras.PerExampleModel(MODELS[model_name](), aggregator=pergrad.aggregate.dp_mean(
        l2_norm_clip=1.0, noise_multiplier=1.0, seed=0))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = batch(model_name, batch_size)
    times = []
    for _ in range(2):
        wall, cpu = time.perf_counter(), time.process_time()
        model.train_on_batch(x, y)
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return {"first_s": times[0][0], "first_cpu_s": times[0][1], "second_s": times[1][0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_one(args.model, args.batch_size)))
        return
    print(f"{os.environ.get('KERAS_BACKEND', 'tensorflow')}, {args.model}, batch "
          f"{args.batch_size}: first step (compile) / its CPU / second step, seconds")
    for _ in range(args.repeats):
        child = subprocess.run([sys.executable, __file__, "--child", "--model", args.model,
                                "--batch-size", str(args.batch_size)],
                               capture_output=True, text=True)
        if child.returncode:
            sys.exit(f"the timed process failed:\n{child.stderr}")
        row = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"{row['first_s']:.2f} / {row['first_cpu_s']:.2f} / {row['second_s']:.3f}")


if __name__ == "__main__":
    main()
