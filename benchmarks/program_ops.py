"""The ops each of pergrad's computations runs on the benchmark models, counted by type: a
deterministic A/B for refactors that must not change what runs (timings on a shared 2-core
machine vary by 30% between runs; an op histogram does not vary at all).

For each model and computation (a clipped sum, the gradient statistics, the ``median`` and
``clip_mean`` aggregators' steps, norms alone, the gradients) it prints one line: the model,
the computation, the number of ops and the histogram. What is counted is each backend's
program: on TensorFlow the ``tf.function`` graph with its function library (branches
included), on JAX the jaxpr, on PyTorch the ATen ops dispatched while it runs eagerly.

    KERAS_BACKEND=tensorflow python benchmarks/program_ops.py > after.txt
    git stash; KERAS_BACKEND=tensorflow python benchmarks/program_ops.py > before.txt; git stash pop
    diff before.txt after.txt    # nothing: the same programs

``--models`` picks models of :data:`pergrad.bench.models.MODELS` (default: all but the MLP),
``--batch`` the batch size (32).
"""

from __future__ import annotations

import argparse
import collections
import re
from collections.abc import Callable

import keras

import pergrad
from pergrad.bench.models import MODELS, batch
from pergrad.engine.per_example import finite_clipped_sum
from pergrad.stats.compute import statistics_from_result

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
DEFAULT_MODELS = "cnn,text_cnn,resnet,transformer,mobilenet,gru,embedding_bag"


def computations() -> dict[str, Callable]:
    """Each computation, a function of one ``PerExampleResult``."""
    def step(aggregator):
        return lambda r: aggregator.finalize(aggregator.local(r, pergrad.aggregate.Batch.of(r)),
                                             None)
    return {"clipped_sum": lambda r: finite_clipped_sum(r, 1.0),
            "statistics": lambda r: statistics_from_result(r, None),
            "median": step(pergrad.aggregate.median()),
            "clip_mean": step(pergrad.aggregate.clip_mean(1.0)),
            "norms": lambda r: r.norms(),
            "gradients": lambda r: r.gradients()}


def tensorflow_ops(pex, body, x, y) -> collections.Counter:
    import tensorflow as tf

    graph = tf.function(lambda x, y: body(pex.compute(x, y)),
                        autograph=False).get_concrete_function(x, y).graph
    counts = collections.Counter(op.type for op in graph.get_operations())
    for function in graph.as_graph_def().library.function:
        counts.update(node.op for node in function.node_def)
    return counts


def jax_ops(pex, body, x, y) -> collections.Counter:
    import jax

    variables = pex.model.variables

    def traced(values, x, y):
        with keras.StatelessScope(state_mapping=list(zip(variables, values, strict=True))):
            return body(pex.compute(x, y))

    text = str(jax.make_jaxpr(traced)([v.value for v in variables], x, y))
    return collections.Counter(re.findall(r"= ([a-z_][a-z_0-9]*)[\[ ]", text))


def torch_ops(pex, body, x, y) -> collections.Counter:
    from torch.utils._python_dispatch import TorchDispatchMode  # no public counter of ATen ops

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.counts[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Count() as counter:
        body(pex.compute(x, y))
    return counter.counts


COUNTERS = {"tensorflow": tensorflow_ops, "jax": jax_ops, "torch": torch_ops}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help=f"comma-separated, from {sorted(MODELS)}")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    count = COUNTERS[keras.backend.backend()]
    for name in args.models.split(","):
        pex = pergrad.PerExample(MODELS[name](), LOSS)
        x, y, _ = pex.prepare(*batch(name, args.batch))
        for label, body in computations().items():
            counts = count(pex, body, x, y)
            print(name, label, sum(counts.values()), sorted(counts.items()), flush=True)


if __name__ == "__main__":
    main()
