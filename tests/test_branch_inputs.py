"""What only a conditional branch reads is computed inside that branch.

A graph computes a branch's captured inputs before the branch runs, even on the steps that skip
it. The aggregators' NaN fallback and the monitor's ``every_n_steps`` branch read the per-example
norms, which need a convolution's patches; an aggregator such as ``mean()`` never needs them
otherwise. These tests look at the compiled TensorFlow graph: the patches must appear only in the
branch functions, and (the control that shows the check can fail) at the top level of a step
that does need them.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import pergrad

tf = pytest.importorskip("tensorflow", reason="needs tensorflow (pip install pergrad[tensorflow])")

pytestmark = pytest.mark.tensorflow_only(reason=(
    "inspects the compiled TensorFlow graph of a tf.function(autograph=False) step: which ops "
    "land in its tf.cond branch functions and which at its top level"))

L = keras.layers
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# 5x5 x 8 input channels = 200 patch columns, dilated (so no grouped filter gradient): the
# rule gathers them with ExtractImagePatches.
PATCHES = "ExtractImagePatches"


def _conv() -> keras.Model:
    return keras.Sequential([keras.Input((8, 8, 8)),
                             L.Conv2D(4, 5, dilation_rate=2, padding="same", activation="relu"),
                             L.Flatten(), L.Dense(3)])


def _conv_transpose() -> keras.Model:
    # 3x3 x 16 filters = 144 columns of output-gradient patches: ExtractImagePatches again.
    return keras.Sequential([keras.Input((8, 8, 16)),
                             L.Conv2DTranspose(16, 3, strides=2, padding="same",
                                               activation="relu"),
                             L.Flatten(), L.Dense(3)])


MODELS = {"conv2d": _conv, "conv2d_transpose": _conv_transpose}


def _data(channels: int = 8):
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=(6, 8, 8, channels)).astype("float32")),
            tf.constant(rng.integers(0, 3, 6)))


def _top_level_ops(fn, *args) -> set[str]:
    """The types of the ops the function's outputs depend on, outside any branch function: what
    runs at every call (TensorFlow prunes the ops nothing depends on)."""
    graph = fn.get_concrete_function(*args).graph
    pending = [t.op for t in graph.outputs] + list(graph.control_outputs)
    seen: set = set()
    while pending:
        op = pending.pop()
        if op in seen:
            continue
        seen.add(op)
        pending.extend(t.op for t in op.inputs)
        pending.extend(op.control_inputs)
    return {op.type for op in seen}


def _library_ops(fn, *args) -> set[str]:
    library = fn.get_concrete_function(*args).graph.as_graph_def().library
    return {node.op for function in library.function for node in function.node_def}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_mean_computes_patches_only_in_its_nan_branch(name):
    pex = pergrad.PerExample(MODELS[name](), LOSS)
    mean = pergrad.aggregate.mean()

    @tf.function(autograph=False)
    def step(x, y):
        return mean(pex.compute(x, y))

    x, y = _data(MODELS[name]().input_shape[-1])
    assert PATCHES not in _top_level_ops(step, x, y)
    assert PATCHES in _library_ops(step, x, y)  # the non-finite fallback's norms


@pytest.mark.parametrize("name", sorted(MODELS))
def test_clip_mean_computes_patches_at_the_top_level(name):
    """The control: a step that needs the norms at every call does build the patches there."""
    pex = pergrad.PerExample(MODELS[name](), LOSS)
    clip = pergrad.aggregate.clip_mean(1.0)

    @tf.function(autograph=False)
    def step(x, y):
        return clip(pex.compute(x, y))

    x, y = _data(MODELS[name]().input_shape[-1])
    assert PATCHES in _top_level_ops(step, x, y)


def test_monitor_every_n_steps_computes_patches_only_when_monitoring():
    """``GradientMonitor.compute`` inside a step: its statistics sit in the ``every_n_steps``
    branch, so a skipped step computes no patches."""
    model = _conv()
    monitor = pergrad.keras.GradientMonitor(every_n_steps=10, track_examples=False)
    pex = pergrad.PerExample(model, LOSS)
    x, y = _data()

    @tf.function(autograph=False)
    def step(x, y):
        return monitor.compute(pex.compute(x, y))

    assert PATCHES not in _top_level_ops(step, x, y)
    assert PATCHES in _library_ops(step, x, y)


FILTER_GRADIENT = "Conv2DBackpropFilter"


def _top_level_branches(fn, *args) -> list[tuple[set[str], set[str]]]:
    """``(then ops, else ops)``: the op types of each top-level conditional's two branch
    functions (their own nodes; nested conditionals are functions of their own)."""
    graph = fn.get_concrete_function(*args).graph
    library = {f.signature.name: {node.op for node in f.node_def}
               for f in graph.as_graph_def().library.function}
    return [(library[op.get_attr("then_branch").name], library[op.get_attr("else_branch").name])
            for op in graph.get_operations() if op.type in ("If", "StatelessIf")]


@pytest.mark.parametrize("every_n_steps", [1, 10])
def test_a_monitored_mean_step_sums_from_the_statistics_matrices(every_n_steps):
    """``compute_alongside`` with the ``mean()`` aggregator's ``local`` (what
    ``PerExampleModel`` passes): the monitored branch, which builds the per-example matrices
    from the patches for its norms, reads its sum from them and runs no native filter gradient;
    the skipped branch runs the filter gradient (the control: that op is what a sum recomputed
    from the layer inputs would add). The aggregator's non-finite fallback, a conditional
    nested in both, may still recompute it: only the top-level branches are checked."""
    from pergrad.aggregate import Batch

    pex = pergrad.PerExample(_conv(), LOSS)
    monitor = pergrad.keras.GradientMonitor(every_n_steps=every_n_steps, track_examples=False)
    mean = pergrad.aggregate.mean()
    x, y = _data()

    @tf.function(autograph=False)
    def step(x, y):
        result = pex.compute(x, y)
        stats, local = monitor.compute_alongside(result, lambda r: mean.local(r, Batch.of(r)))
        return stats, mean.finalize(local, None)

    (monitored, skipped), = [(then, other) for then, other in _top_level_branches(step, x, y)
                             if PATCHES in then]  # the monitor's cond; the norms need patches
    assert FILTER_GRADIENT not in monitored
    assert FILTER_GRADIENT in skipped
    assert PATCHES not in _top_level_ops(step, x, y)


def _grouped() -> keras.Model:
    # 3x3 x 16 input channels, strides 2: neither the shifted nor the folded route, and patches
    # 144 wide, so on TensorFlow with oneDNN the products are one grouped filter gradient.
    return keras.Sequential([keras.Input((8, 8, 16)),
                             L.Conv2D(4, 3, strides=2, padding="same", activation="relu"),
                             L.Flatten(), L.Dense(3)])


def _grouped_filter_gradients(graph_def_nodes) -> int:
    """How many of ``graph_def_nodes`` (``NodeDef``s of one function) are a grouped filter
    gradient: a ``Conv2DBackpropFilter`` whose filter size is stacked from the batch size
    (``(*k, C, B O)``), where a batch filter gradient reads its kernel's shape."""
    by_name = {node.name: node for node in graph_def_nodes}
    return sum(1 for node in graph_def_nodes if node.op == FILTER_GRADIENT
               and by_name[node.input[1].split(":")[0].lstrip("^")].op == "Pack")


def _grouped_at_top_level(fn, *args) -> int:
    graph = fn.get_concrete_function(*args).graph
    pending = [t.op for t in graph.outputs] + list(graph.control_outputs)
    seen: set = set()
    while pending:
        op = pending.pop()
        if op not in seen:
            seen.add(op)
            pending.extend(t.op for t in op.inputs)
            pending.extend(op.control_inputs)
    return _grouped_filter_gradients([op.node_def for op in seen])


def _grouped_in_branches(fn, *args) -> int:
    library = fn.get_concrete_function(*args).graph.as_graph_def().library
    return sum(_grouped_filter_gradients(list(f.node_def)) for f in library.function)


def test_grouped_products_only_where_the_norms_are_needed():
    """The grouped route's per-example products: only in the non-finite branch of a ``mean()``
    step, at the top level of a ``clip_mean`` step (the control)."""
    from pergrad.rules.conv import grouped_filter_gradients_available

    if not grouped_filter_gradients_available("float32"):  # tests/test_rules_conv.py says when
        pytest.skip("TensorFlow without oneDNN kernels runs no grouped filter gradient")
    pex = pergrad.PerExample(_grouped(), LOSS)
    mean, clip = pergrad.aggregate.mean(), pergrad.aggregate.clip_mean(1.0)

    @tf.function(autograph=False)
    def mean_step(x, y):
        return mean(pex.compute(x, y))

    @tf.function(autograph=False)
    def clip_step(x, y):
        return clip(pex.compute(x, y))

    x, y = _data(16)
    assert _grouped_at_top_level(mean_step, x, y) == 0
    assert _grouped_in_branches(mean_step, x, y) >= 1
    assert _grouped_at_top_level(clip_step, x, y) >= 1
