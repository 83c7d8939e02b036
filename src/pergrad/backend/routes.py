"""Each backend's route choices, side by side: which of a rule's equivalent routes it takes.

The math is the same on every route; the speed is not. Each choice below was timed on the
project's CPU (docs/benchmarks.md, "Route measurements"). A backend package exports its own
profile as ``ROUTES`` (:func:`pergrad.backend.native`); :func:`forced` swaps fields of it for
an A/B run without patching any module.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupedConv:
    """When a convolution (groups of one) takes one native grouped filter gradient, the batch
    as groups, for its per-example products: ``spatial_ranks`` it applies to, no dilation, a
    kernel larger than 1x1, at most ``max_channels`` input channels and (unless it would
    replace the shifted products) patches ``K C`` from ``min_patch_width`` to
    ``max_patch_width`` (``None``: no upper bound) wide
    (:func:`pergrad.rules.cost.grouped_filter_gradients_win`)."""

    spatial_ranks: tuple[int, ...]
    min_patch_width: int
    max_patch_width: int | None
    max_channels: int


@dataclass(frozen=True)
class Routes:
    """Which of a rule's equivalent routes a backend takes (the math is the same; the speed is
    not). Each choice was timed on the project's CPU: docs/benchmarks.md, "Route measurements".

    Attributes:
        eager: ops run one by one as written (PyTorch): a form builds an intermediate only
            when a route reads it (:class:`pergrad.rules.forms.Deferred`).
        conv_kernels_pad: the native convolution kernels pad ``"same"`` and ``"valid"``
            exactly as :func:`pergrad.rules.conv.pad_input` does, so no separate ``Pad`` op is
            needed (TensorFlow).
        wide_patches_by_slices: patches wider than 128 values (``K C``) are gathered by
            strided slices rather than a one-hot convolution (XLA and PyTorch do not turn that
            convolution into a gather); where false, :func:`Backend.image_patches` gathers them.
        folded_conv_products: a strided convolution whose kernel is a whole number of strides
            gets its per-example products by folding the strides into channels (TensorFlow).
        conv_filter_gradient_sums: how a convolution's weighted sum ``sum_i c_i g_i`` is
            computed: ``"always"`` by the native batch filter gradient of ``c_i``-scaled output
            gradients (TensorFlow), ``"when_xla_wins"`` only where
            :func:`pergrad.rules.cost.xla_filter_gradient_wins` says so and the shifted route
            applies (JAX), ``"never"`` (GEMMs over shifted slices or patches; PyTorch).
        ghost_norms_before_sums: with a native filter-gradient sum, norms come from the ghost
            Gram route even when the sums follow (JAX: XLA merges the shared work).
        depthwise_products: a depthwise convolution's per-example products by a native
            kernel (``"native"``: :func:`Backend.depthwise_filter_gradients`, TensorFlow and
            PyTorch) or by the einsum over its patches (``"einsum"``: XLA's depthwise filter
            gradients lose to it on the CPU).
        depthwise_filter_gradient_sums: a depthwise convolution's weighted sum by the native
            depthwise filter gradient (TensorFlow).
        depthwise_forward_conv: the per-example depthwise products may come from one forward
            depthwise convolution instead, where
            :func:`pergrad.rules.depthwise.forward_conv_products_win` says so (TensorFlow,
            off oneDNN's fast path).
        depthwise_dilation: the native per-example depthwise kernel takes a dilation
            (PyTorch; TensorFlow's CPU kernel has none).
        transpose_filter_gradient_sums: likewise for a transposed convolution (TensorFlow).
        cond_compiles_both_branches: a traced conditional compiles both of its branches
            (XLA), so a rarely taken branch costs compile time: where true, a computation that
            is cheap to run unconditionally is not put under a conditional (JAX).
        chunks_examples: large intermediates are computed over chunks of examples
            (:func:`Backend.map_in_chunks`, JAX's ``lax.map``).
        embedding_norms: the route an embedding's per-example squared norms take when the
            pairwise one loses: ``"unique"`` (:func:`Backend.unique_row_squared_norms`,
            TensorFlow's ``unique`` over the (example, id) keys) or ``"sorted"`` (sorted ids,
            segments of equal ids).
        embedding_pairwise_max_positions: up to this many ids per example an embedding's
            norms take the pairwise form ``sum_{t,s} [ids_t = ids_s] (d_t . d_s)``
            (:func:`pergrad.rules.cost.rows_pairwise_wins`); ``None``: never (PyTorch, where
            it never won).
        grouped_conv: where a convolution's per-example products come from one native
            grouped filter gradient (:class:`GroupedConv`), ``None`` where the backend has no
            such kernel worth taking (XLA).
        shifted_ghost_norms: a stride-1 convolution's norms alone may take the shifted ghost
            route, where :func:`pergrad.rules.cost.shifted_ghost_wins` says so (every backend).
        products_in_variable_order: materialized per-example gradients of a factored weight
            are multiplied as ``A^T D`` in the variable's order rather than transposed from the
            ``D^T A`` products the norms use, unless those were built already (every backend).
        one_pass_row_norms: per-example squared norms of built per-example matrices square
            one ``EuclideanNorm`` reduction instead of summing the squares
            (:func:`Backend.row_squared_norms`; TensorFlow).
        nested_xla_outer_products: a one-position layer's per-example kernel gradients (outer
            products) are one nested XLA computation instead of a broadcasting ``Mul``
            (:func:`Backend.outer_products`; TensorFlow).
        native_segment_sums: segment sums (an embedding's per-example tables and weighted
            sums) take the backend's fastest kernel (TensorFlow: a nested XLA computation;
            PyTorch: ``index_add_``, which also keeps float64) instead of Keras's
            ``ops.segment_sum`` (:func:`Backend.segment_sum`).
        per_example_forward_mode: a batched forward-mode Jacobian in inference maps over the
            examples, each a batch of one with its own one-hot tangents, rather than pushing one
            tangent shared by the whole batch (:mod:`pergrad.jacobian._modes`): the vectorized
            products of what does not depend on the example (a first layer's JVP) then run once,
            not once per example (the benchmark CNN: 3x faster on JAX, 1.5x-1.7x on
            TensorFlow; PyTorch's vmap gained nothing). Taken only where every batch size is
            known at trace time.
        factored_norms: how a factored weight's norms are chosen
            (:func:`pergrad.rules.cost.factored_route`): ``"cost"`` by the cost model (every
            backend), or forced for an A/B run: ``"ghost"`` (the rule's own ghost norms where it
            has them, else the Gram form where the rule gave no native per-example products,
            else the matrices) or ``"matrices"`` (the per-example matrices); a one-position
            weight keeps its outer products either way.
    """

    eager: bool
    conv_kernels_pad: bool
    wide_patches_by_slices: bool
    folded_conv_products: bool
    conv_filter_gradient_sums: str
    ghost_norms_before_sums: bool
    depthwise_products: str
    depthwise_filter_gradient_sums: bool
    depthwise_forward_conv: bool
    depthwise_dilation: bool
    transpose_filter_gradient_sums: bool
    cond_compiles_both_branches: bool
    chunks_examples: bool
    embedding_norms: str
    embedding_pairwise_max_positions: int | None
    grouped_conv: GroupedConv | None
    shifted_ghost_norms: bool = True
    products_in_variable_order: bool = True
    one_pass_row_norms: bool = False
    nested_xla_outer_products: bool = False
    native_segment_sums: bool = True
    per_example_forward_mode: bool = False
    factored_norms: str = "cost"


#: TensorFlow: native kernels for padding, patches, filter gradients (folded, grouped,
#: depthwise) and ``unique``. Grouped: oneDNN's kernel beat the patches from 36 values wide
#: and the shifted products under 32 input channels.
TENSORFLOW = Routes(
    eager=False,
    conv_kernels_pad=True,
    wide_patches_by_slices=False,
    folded_conv_products=True,
    conv_filter_gradient_sums="always",
    ghost_norms_before_sums=False,
    depthwise_products="native",
    depthwise_filter_gradient_sums=True,
    depthwise_forward_conv=True,
    depthwise_dilation=False,
    transpose_filter_gradient_sums=True,
    cond_compiles_both_branches=False,
    chunks_examples=False,
    embedding_norms="unique",
    embedding_pairwise_max_positions=64,
    grouped_conv=GroupedConv(spatial_ranks=(1, 2), min_patch_width=36, max_patch_width=None,
                             max_channels=31),
    one_pass_row_norms=True,
    nested_xla_outer_products=True,
    per_example_forward_mode=True,
)

#: JAX (XLA): GEMMs and einsums over patches or shifted slices, chunks of examples under
#: ``lax.map``; XLA's filter gradient only where it wins (large 2-D layers).
JAX = Routes(
    eager=False,
    conv_kernels_pad=False,
    wide_patches_by_slices=True,
    folded_conv_products=False,
    conv_filter_gradient_sums="when_xla_wins",
    ghost_norms_before_sums=True,
    depthwise_products="einsum",
    depthwise_filter_gradient_sums=False,
    depthwise_forward_conv=False,
    depthwise_dilation=False,
    transpose_filter_gradient_sums=False,
    cond_compiles_both_branches=True,
    chunks_examples=True,
    embedding_norms="sorted",
    embedding_pairwise_max_positions=128,
    grouped_conv=None,
    per_example_forward_mode=True,
)

#: PyTorch (eager): intermediates built only when read; ``torch.nn.grad.conv2d_weight`` with
#: the batch as groups for 2-D layers 64 to 128 values wide (in 1-D it lost; wider patches are
#: gathered by slices, which beat it), over at most 32 input channels.
TORCH = Routes(
    eager=True,
    conv_kernels_pad=False,
    wide_patches_by_slices=True,
    folded_conv_products=False,
    conv_filter_gradient_sums="never",
    ghost_norms_before_sums=False,
    depthwise_products="native",
    depthwise_filter_gradient_sums=False,
    depthwise_forward_conv=False,
    depthwise_dilation=True,
    transpose_filter_gradient_sums=False,
    cond_compiles_both_branches=False,
    chunks_examples=False,
    embedding_norms="sorted",
    embedding_pairwise_max_positions=None,
    grouped_conv=GroupedConv(spatial_ranks=(2,), min_patch_width=64, max_patch_width=128,
                             max_channels=32),
)


@contextlib.contextmanager
def forced(**changes) -> Iterator[None]:
    """Inside the block the running backend takes the routes ``changes`` names (fields of
    :class:`Routes`), for A/B runs: ``with forced(folded_conv_products=False): ...``. Only what
    is traced or run inside the block is affected (a compiled function keeps the routes it was
    traced with)."""
    from pergrad.backend import native

    package = native()
    saved = package.ROUTES
    package.ROUTES = dataclasses.replace(saved, **changes)
    try:
        yield
    finally:
        package.ROUTES = saved


__all__ = ["JAX", "TENSORFLOW", "TORCH", "GroupedConv", "Routes", "forced"]
