"""One route of the rules against another, in one process.

Two ``PerExample`` objects over the same model and batch: one traced as usual, one traced with
a route switched off (``--switch``; each switch is a field of the backend's route profile,
:class:`pergrad.backend.routes.Routes`, forced with ``pergrad.backend.routes.forced``; nothing
is patched):

* ``folded``: no folded products (``Routes.folded_conv_products``), so strided convolutions
  take the patch route;
* ``one_pass_norms``: TensorFlow's per-example squared norms of built per-example matrices sum
  the squares (``Square`` then ``Sum``) instead of squaring one ``EuclideanNorm`` reduction
  (``Routes.one_pass_row_norms``);
* ``pairwise_rows``: an embedding table's per-example norms take ``tf.unique`` and two segment
  sums rather than the pairwise form (``Routes.embedding_pairwise_max_positions``);
* ``shifted_ghost``: a stride-1 convolution's norms alone take its per-example products
  rather than the shifted Gram of its input (``Routes.shifted_ghost_norms``);
* ``xla_filter_sum``: on JAX, a one-dimensional stride-1 convolution's batch kernel gradient
  takes the GEMMs over shifted slices rather than XLA's filter gradient, and a clipped sum's
  norms the per-example products rather than the shifted ghost route
  (``Routes.conv_filter_gradient_sums="never"`` instead of ``"when_xla_wins"``);
* ``lazy_patches``: on PyTorch, a convolution's patches are built as its rule starts, read or
  not, as before they were deferred (``Routes.eager``, ``pergrad.rules.forms.Deferred``);
* ``torch_grouped``: on PyTorch, the grouped filter gradient's route
  (``Routes.grouped_conv``) refused;
* ``torch_slices``: on PyTorch, wide 1-D and 2-D patches gathered by a one-hot convolution
  rather than strided slices (``Routes.wide_patches_by_slices``);
* ``torch_depthwise``: on PyTorch, depthwise kernels' per-example products by the einsum over
  their patches rather than one grouped filter gradient (``Routes.depthwise_products``, as on
  JAX);
* ``xla_outer``: on TensorFlow, a one-position layer's per-example kernel gradients (a Dense
  layer's outer products) written by TensorFlow's broadcasting ``Mul`` rather than one nested
  XLA computation (``Routes.nested_xla_outer_products``);
* ``xla_rows``: on TensorFlow, an embedding's per-example tables and its weighted sums (clipped
  and DP sums) added by ``UnsortedSegmentSum`` rather than one nested XLA computation
  (``Routes.native_segment_sums``; on PyTorch Keras's ``segment_sum``, which adds float64 in
  float32, rather than ``index_add_``);
* ``direct_products``: materialized per-example gradients (``gradients``) transposed from the
  ``D^T A`` products the norms use rather than multiplied as ``A^T D`` in the variable's order
  (``Routes.products_in_variable_order``);
* ``grouped``: on TensorFlow, a convolution that takes one grouped filter gradient with the
  batch as groups for its per-example products (wide enough patches, or the shifted route's
  geometry with few channels) takes the patches or the shifted products instead
  (``Routes.grouped_conv``).

``folded``, ``one_pass_norms``, ``pairwise_rows``, ``grouped`` and ``xla_outer`` are TensorFlow
routes; ``xla_rows`` runs on TensorFlow and PyTorch; ``direct_products`` runs everywhere;
``shifted_ghost`` runs on JAX too (``KERAS_BACKEND=jax``, against JAX's jitted batch gradient),
and ``xla_filter_sum`` is a JAX route; ``lazy_patches``, ``torch_grouped``, ``torch_slices`` and
``torch_depthwise`` are PyTorch ones
(``KERAS_BACKEND=torch``, against ``torch.autograd.grad`` of the summed loss through one eager
call). Several switches separated by commas are switched off together. On PyTorch nothing is
traced, so the switches are held around every call of the route they switch off.

Their norms and clipped sums and the batch gradient are timed alternately, so that both routes
see the same machine state; medians are printed as ratios to the batch gradient. With
``--dp-step``, a ``PerExampleModel(dp_mean)`` training step traced with each route and the
plain Keras step on the same weights join the rotation (ratios to the Keras step); with
``--gradients``, each route's per-example gradients and the ``vmap`` strategy's (in a rotation
of their own with the batch gradient: writing ``B x P`` numbers slows the calls after them); with
``--monitor``, a ``PerExampleModel(mean())`` step with a ``GradientMonitor`` at every step traced
with each route and the same step without the monitor (ratios to the latter). Nothing here
asserts on timings.

    python benchmarks/ab_routes.py                        # folded, the benchmark CNN, batch 256
    python benchmarks/ab_routes.py --model cnn --batch 64 --rounds 40
    python benchmarks/ab_routes.py --switch one_pass_norms --model text_cnn
    python benchmarks/ab_routes.py --switch grouped --model cnn --dp-step --monitor
    python benchmarks/ab_routes.py --switch xla_outer,xla_rows,direct_products --gradients --model mlp
    KERAS_BACKEND=jax python benchmarks/ab_routes.py --switch shifted_ghost --model text_cnn
    KERAS_BACKEND=jax python benchmarks/ab_routes.py --switch xla_filter_sum --model text_cnn --dp-step
    KERAS_BACKEND=torch python benchmarks/ab_routes.py \
        --switch lazy_patches,torch_grouped,torch_slices,torch_depthwise --dp-step
"""

from __future__ import annotations

import argparse
import contextlib

import keras

import pergrad
from pergrad.backend import routes
from pergrad.bench.engine import LOSS
from pergrad.bench.models import MODELS, batch, twin
from pergrad.bench.timing import alternating_medians, print_ratios

#: ``--switch`` name: (label with the route, label without it, context that switches it off).
SWITCHES = {
    "folded": ("folded", "patches",
               lambda: routes.forced(folded_conv_products=False)),
    "one_pass_norms": ("one pass", "square+sum",
                       lambda: routes.forced(one_pass_row_norms=False)),
    "pairwise_rows": ("pairwise", "unique",
                      lambda: routes.forced(embedding_pairwise_max_positions=None)),
    "shifted_ghost": ("shifted ghost", "products",
                      lambda: routes.forced(shifted_ghost_norms=False)),
    "grouped": ("grouped", "patches",
                lambda: routes.forced(grouped_conv=None)),
    "lazy_patches": ("deferred patches", "patches first",
                     lambda: routes.forced(eager=False)),
    "torch_grouped": ("grouped", "patches",
                      lambda: routes.forced(grouped_conv=None)),
    "torch_slices": ("slices", "one-hot",
                     lambda: routes.forced(wide_patches_by_slices=False)),
    "torch_depthwise": ("native depthwise", "depthwise einsum",
                        lambda: routes.forced(depthwise_products="einsum")),
    "xla_filter_sum": ("filter+ghost", "products",
                       lambda: routes.forced(conv_filter_gradient_sums="never")),
    "xla_outer": ("xla outer", "broadcast mul",
                  lambda: routes.forced(nested_xla_outer_products=False)),
    "xla_rows": ("xla rows", "segment sum",
                 lambda: routes.forced(native_segment_sums=False)),
    "direct_products": ("A^T D", "D^T A+transpose",
                        lambda: routes.forced(products_in_variable_order=False)),
}


def _switched_off(names: str):
    """A context that switches off every route of the comma-separated ``names``."""
    contexts = [SWITCHES[name][2] for name in names.split(",")]

    @contextlib.contextmanager
    def off():
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context())
            yield

    return off


def _eager() -> bool:
    return keras.backend.backend() == "torch"


def _held(call, off):
    """``call``, run inside ``off()`` every time on PyTorch (nothing is traced there)."""
    if off is None or not _eager():
        return call

    def held():
        with off():
            return call()

    return held


def _batch_gradient(model, x, y):
    """The batch gradient as a call of no arguments: TensorFlow's ``tf.function``, JAX's
    jitted ``grad`` of the summed loss or ``torch.autograd.grad`` of it through one eager
    call."""
    if _eager():
        import torch

        weights = [v.value for v in model.trainable_variables]

        def torch_gradient():
            loss = torch.sum(LOSS.call(y, model(x)))
            return torch.autograd.grad(loss, weights)

        return torch_gradient
    if keras.backend.backend() == "jax":
        from pergrad.bench.jax_engine import _baselines

        values = [v.value for v in model.trainable_variables]
        frozen = [v.value for v in model.non_trainable_variables]
        grad = _baselines(model)[0]
        return lambda: grad(values, frozen, x, y)
    from pergrad.bench.engine import batch_gradient_fn

    step = batch_gradient_fn(model)
    return lambda: step(x, y)


def _traced(model, x, y, switched_off, gradients: bool = False):
    with switched_off() if switched_off else contextlib.nullcontext():
        pex = pergrad.PerExample(model, LOSS)
        pex.norms(x, y)
        pex.clipped_sum(x, y, 1.0)
        if gradients:
            pex.gradients(x, y)
    return pex


def _dp_steps(model, x, y, switched_off) -> dict:
    """A ``dp_mean`` training step traced with the route switched off and one with it, and the
    plain Keras step, each on its own copy of ``model``'s weights (plain SGD)."""
    steps = {"keras step": twin(model, LOSS)}
    for label, off in switched_off:
        private = pergrad.keras.PerExampleModel(
            twin(model), pergrad.aggregate.dp_mean(1.0, 1.0, expected_batch_size=int(x.shape[0])))
        private.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS)
        with off() if off else contextlib.nullcontext():
            private.train_on_batch(x, y)  # traced with this route
        steps[f"{label} dp_mean step"] = private
    offs = {f"{label} dp_mean step": off for label, off in switched_off}
    return {label: _held(lambda m=m: m.train_on_batch(x, y), offs.get(label))
            for label, m in steps.items()}


def _monitored_steps(name: str, size: int, switched_off) -> dict:
    """A ``PerExampleModel(mean())`` step with a ``GradientMonitor`` at every step, traced with
    each route, and the same step without the monitor (TensorFlow)."""
    from pergrad.bench.monitor import _step_fn
    from pergrad.keras import GradientMonitor

    steps = {"unmonitored step": _step_fn(name, None, size)}
    for label, off in switched_off:
        with off() if off else contextlib.nullcontext():
            step = _step_fn(name, GradientMonitor(num_examples=size), size)  # traced here
        steps[f"{label} monitored step"] = step
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", default="folded",
                        help="one of " + ", ".join(sorted(SWITCHES)) + ", or several of them "
                             "separated by commas")
    parser.add_argument("--model", default="cnn", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--dp-step", action="store_true",
                        help="also time a dp_mean training step per route against Keras's")
    parser.add_argument("--gradients", action="store_true",
                        help="also time the per-example gradients per route, and the vmap "
                             "strategy's")
    parser.add_argument("--monitor", action="store_true",
                        help="also time a step with a GradientMonitor at every step per route "
                             "against the step without it (TensorFlow)")
    args = parser.parse_args()
    if args.dp_step and keras.backend.backend() == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)  # DP noise keys are 64-bit
    keras.utils.set_random_seed(0)
    model = MODELS[args.model]()
    x, y = (keras.ops.convert_to_tensor(t) for t in batch(args.model, args.batch))
    calls = {"batch gradient": _batch_gradient(model, x, y)}
    names = args.switch.split(",")
    unknown = [name for name in names if name not in SWITCHES]
    if unknown:
        parser.error(f"unknown --switch {unknown}; choose from {sorted(SWITCHES)}")
    with_route = "+".join(SWITCHES[name][0] for name in names)
    without_route = "+".join(SWITCHES[name][1] for name in names)
    switch_off = _switched_off(args.switch)
    if args.monitor and _eager():
        parser.error("--monitor times TensorFlow steps")
    # The gradients write B x P numbers (hundreds of MB): timed in a rotation of their own,
    # since they slow whatever follows them (the Embedding bag's norms by 20-30%).
    gradient_calls = {"batch gradient": calls["batch gradient"]}
    for label, off in ((without_route, switch_off), (with_route, None)):
        pex = _traced(model, x, y, off, args.gradients)
        calls[f"{label} norms"] = _held(lambda p=pex: p.norms(x, y), off)
        calls[f"{label} clipped_sum"] = _held(lambda p=pex: p.clipped_sum(x, y, 1.0), off)
        gradient_calls[f"{label} gradients"] = _held(lambda p=pex: p.gradients(x, y), off)
    vmap = pergrad.PerExample(model, LOSS, strategy="vmap")
    gradient_calls["vmap gradients"] = lambda: vmap.gradients(x, y)
    routes = ((without_route, switch_off), (with_route, None))
    steps = _dp_steps(model, x, y, routes) if args.dp_step else {}
    monitored = _monitored_steps(args.model, args.batch, routes) if args.monitor else {}
    medians = alternating_medians({**calls, **steps, **monitored}, args.rounds)
    title = f"{args.model}, batch {args.batch}, {args.rounds} rounds (medians)"
    print_ratios(title, {k: v for k, v in medians.items() if k in calls}, "batch gradient")
    if args.gradients:
        print_ratios(title, alternating_medians(gradient_calls, args.rounds), "batch gradient")
    if steps:
        print_ratios(title, {k: medians[k] for k in steps}, "keras step")
    if monitored:
        print_ratios(title, {k: medians[k] for k in monitored}, "unmonitored step")


if __name__ == "__main__":
    main()
