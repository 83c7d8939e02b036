"""The one cost model that chooses, per layer, between the ghost (Gram) route and materializing
per-example gradients of a factored weight ``g_i = sum_t A_i[t]^T D_i[t]`` (``T`` positions,
``I`` inputs, ``O`` outputs per group).

Multiply-adds per example ``i``, for ``B`` examples:

* **materialize**: ``M_i = sum_t A_i[t]^T D_i[t]`` costs ``T I O``. Then
  ``||g_i||^2 = ||M_i||^2`` costs ``I O`` more, and the Gram matrix ``<g_i, g_j>`` = ``M M^T``
  costs ``B I O`` more per example.
* **ghost**: ``||g_i||^2 = sum_{t,s} (a_t . a_s)(d_t . d_s)`` costs ``T^2 (I + O)`` (two Gram
  matrices of the example's positions), and ``<g_i, g_j>`` the same for every pair: ``B T^2
  (I + O)`` per example (Li et al. 2022, "mixed ghost clipping": Bu et al. 2022).

The materialized product is one batched GEMM, which runs about ``GEMM_ADVANTAGE`` times faster
per multiply-add than the two small Gram einsums, so the ghost route is taken only when it needs
fewer than ``1 / GEMM_ADVANTAGE`` of the materialized multiply-adds. An unknown ``T`` (a
dynamic sequence length) materializes: its cost is bounded by the variable's size, the ghost
route's is not.

Every threshold below was set by timing the routes against each other on the benchmark models'
layers; the numbers are in docs/benchmarks.md, "Route measurements".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pergrad.backend import routes
from pergrad.rules.query import Query

GEMM_ADVANTAGE = 2.0

#: An embedding table's norms (``Rows``) on JAX: up to this many positions per example, the
#: pairwise form ``sum_{t,s} [ids_t = ids_s] (d_t . d_s)`` (``B T^2 (O + 1)`` work, ``B T^2``
#: floats) beats sorting each example's ids; beyond it the sort wins.
ROWS_PAIRWISE_MAX_POSITIONS = routes.JAX.embedding_pairwise_max_positions

#: The same on TensorFlow, where the alternative is ``tf.unique`` over the (example, id) keys
#: and two segment sums, which wins at the text CNN's 128 ids per example.
ROWS_PAIRWISE_MAX_POSITIONS_TENSORFLOW = routes.TENSORFLOW.embedding_pairwise_max_positions


def rows_pairwise_wins(positions: int | None, limit: int | None) -> bool:
    """Whether an embedding table's per-example norms take the pairwise form for ``positions``
    ids per example, up to a backend's measured ``limit``
    (``Routes.embedding_pairwise_max_positions``: :data:`ROWS_PAIRWISE_MAX_POSITIONS` on JAX,
    :data:`ROWS_PAIRWISE_MAX_POSITIONS_TENSORFLOW` on TensorFlow, against ``tf.unique``;
    ``None``: never)."""
    return positions is not None and limit is not None and positions <= limit


#: A weighted sum ``sum_i c_i g_i`` (clipping) of a factored weight whose norms were computed
#: from the per-example matrices ``M_i`` is read from them (``B I O`` reads) instead of
#: recomputed (``B T I O`` multiply-adds, or the native filter gradient) while they hold at most
#: this many elements: 128 MiB of float32 per layer kept alive between the norms and the sum.
#: Reading them was faster on every benchmark model, on TensorFlow and JAX.
SUM_FROM_MATRICES_MAX_ELEMENTS = 2**25


def sums_from_matrices(elements: int) -> bool:
    """Whether a weighted sum reads the already built per-example matrices of ``elements``
    entries (``B G O I``) rather than recomputing the sum: :data:`SUM_FROM_MATRICES_MAX_ELEMENTS`."""
    return elements <= SUM_FROM_MATRICES_MAX_ELEMENTS


#: A convolution's per-example kernel gradients are built from shifted slices of its input
#: (one batched product per kernel offset) instead of from patches when its strides are 1 and
#: it has at least this many input channels, or a 1x1 kernel. They lose with few channels and
#: with strides 2 (strided slices are slow).
SHIFTED_MIN_CHANNELS = 16


#: On JAX the per-example kernel gradients of a stride-1 convolution are computed over chunks
#: of examples whose patches hold about this many bytes (``lax.map``; each chunk gathers its own
#: patches from shifted slices and multiplies once), so that a chunk stays in cache: XLA's CPU
#: batched products over the whole batch ran slower.
CHUNK_BYTES = 4 * 2**20


def examples_per_chunk(bytes_per_example: int) -> int:
    """How many examples one chunk of :data:`CHUNK_BYTES` holds (at least 1)."""
    return max(1, CHUNK_BYTES // max(1, int(bytes_per_example)))


def folded_products_win(kernel_size, strides, dilation, channels: int) -> bool:
    """Whether a strided convolution's per-example kernel gradients come from its input folded
    by the strides (space to depth: stride 1 over ``s^n C`` channels, one batched product per
    offset of the ``k / s`` kernel) rather than from patches (TensorFlow): strides above 1,
    every kernel size a multiple of its stride, no dilation, and at least
    :data:`SHIFTED_MIN_CHANNELS` folded channels (with fewer, as the benchmark CNN's first
    layer, the patches won)."""
    if all(s == 1 for s in strides) or any(r != 1 for r in dilation):
        return False
    if any(k % s for k, s in zip(kernel_size, strides, strict=True)):
        return False
    return math.prod(strides) * channels >= SHIFTED_MIN_CHANNELS


#: On TensorFlow a convolution that would take the patch route (stride-1 layers under
#: :data:`SHIFTED_MIN_CHANNELS` channels, strided ones the folded route does not take) computes
#: its per-example kernel gradients with one grouped filter gradient instead (the batch folded
#: into the channels, one group per example: oneDNN's kernel), when its patches are at least
#: this wide (``K C``): below that width the patches won, and the folded products beat it
#: where they apply. It also replaces the shifted products (stride 1) under
#: ``GROUPED_MAX_CHANNELS + 1`` input channels: from 32 input channels on, and with 1x1
#: kernels, the other routes tied or won. (The limits live with TensorFlow's other route
#: choices: :data:`pergrad.backend.routes.TENSORFLOW`.)
GROUPED_MIN_PATCH_WIDTH = routes.TENSORFLOW.grouped_conv.min_patch_width
GROUPED_MAX_CHANNELS = routes.TENSORFLOW.grouped_conv.max_channels

#: On PyTorch the grouped filter gradient (``torch.nn.grad.conv2d_weight`` with ``groups=B``)
#: replaces the shifted products and patches at least this wide (``K C``) over at most
#: :data:`TORCH_GROUPED_MAX_CHANNELS` input channels, for 2-D kernels larger than 1x1
#: (measured with the patches deferred, built only where a route reads them:
#: ``KERAS_BACKEND=torch python benchmarks/ab_conv_routes.py --route-off``). In 1-D it lost, so
#: 1-D layers keep their routes. Patches wider than :data:`TORCH_GROUPED_MAX_PATCH_WIDTH` are
#: gathered by strided slices (``pergrad.rules.conv.patches_by_slices``), which beat the
#: grouped route there, so they keep their route (:data:`pergrad.backend.routes.TORCH`).
TORCH_GROUPED_MIN_PATCH_WIDTH = routes.TORCH.grouped_conv.min_patch_width
TORCH_GROUPED_MAX_PATCH_WIDTH = routes.TORCH.grouped_conv.max_patch_width
TORCH_GROUPED_MAX_CHANNELS = routes.TORCH.grouped_conv.max_channels


def grouped_filter_gradients_win(kernel_size, dilation, channels: int,
                                 over_shifted: bool = False,
                                 limits: routes.GroupedConv | None = routes.TENSORFLOW.grouped_conv
                                 ) -> bool:
    """Whether a convolution (groups of one) takes one grouped filter gradient with the batch
    as groups for its per-example products, within a backend's measured ``limits``
    (TensorFlow's unless given; ``None``: never): a spatial rank in ``limits.spatial_ranks``,
    no dilation (the CPU kernels have none), a kernel larger than 1x1, at most
    ``limits.max_channels`` input channels and (unless ``over_shifted``: where it would take the
    shifted products) patches ``K C`` from ``limits.min_patch_width`` to
    ``limits.max_patch_width`` wide."""
    if limits is None or len(kernel_size) not in limits.spatial_ranks:
        return False
    if any(r != 1 for r in dilation) or math.prod(kernel_size) == 1:
        return False
    if channels > limits.max_channels:
        return False
    width = math.prod(kernel_size) * channels
    return over_shifted or (width >= limits.min_patch_width and (
        limits.max_patch_width is None or width <= limits.max_patch_width))


def torch_grouped_filter_gradients_win(kernel_size, dilation, channels: int,
                                       over_shifted: bool = False) -> bool:
    """:func:`grouped_filter_gradients_win` within PyTorch's limits: 2-D, at most
    :data:`TORCH_GROUPED_MAX_CHANNELS` input channels and (unless ``over_shifted``) patches
    :data:`TORCH_GROUPED_MIN_PATCH_WIDTH` to :data:`TORCH_GROUPED_MAX_PATCH_WIDTH` wide."""
    return grouped_filter_gradients_win(kernel_size, dilation, channels, over_shifted,
                                        routes.TORCH.grouped_conv)


def shifted_products_win(kernel_size, strides, channels: int) -> bool:
    """Whether per-example kernel gradients come from shifted input slices rather than
    patches (:data:`SHIFTED_MIN_CHANNELS`)."""
    if any(s != 1 for s in strides):
        return False
    return all(k == 1 for k in kernel_size) or channels >= SHIFTED_MIN_CHANNELS


def shifted_ghost_cost(input_positions: int, output_positions: int, channels: int,
                       outputs: int, offsets: int) -> float:
    """Multiply-adds per example of a stride-1 convolution's ghost norm through the Gram of its
    (padded) input: ``T_in^2 C`` for ``X X^T``, ``T^2 O`` for ``D D^T`` and ``K T^2`` to sum
    the ``K`` shifted windows of ``X X^T`` into the Gram of the patches."""
    return float(input_positions ** 2 * channels + output_positions ** 2 * (outputs + offsets))


def shifted_ghost_wins(input_positions: int | None, output_positions: int | None,
                       channels: int, outputs: int, offsets: int) -> bool:
    """Whether a stride-1 convolution's per-example norms, computed alone, take the shifted
    ghost route (:func:`shifted_ghost_cost`) rather than the per-example products
    (``T K C O``).

    The patches' Gram ``P P^T`` is ``sum_k (X X^T)`` over windows shifted by each kernel
    offset, so the ghost route costs ``T_in^2 C`` instead of ``T^2 K C``. It is taken whenever
    it needs fewer multiply-adds: on both backends the Gram products ran at least as fast per
    multiply-add as the per-example products. Norms that a weighted sum follows (clipping)
    keep the products, which the sum reads: recomputing the sum (the filter gradient) cost
    more than the ghost route saved on TensorFlow. On JAX a 1-D convolution whose sum is XLA's
    filter gradient (:func:`xla_filter_gradient_wins`) takes the ghost norms before its sums
    too. Measured on the text CNN's Conv1D: docs/benchmarks.md, "Route measurements"."""
    if input_positions is None or output_positions is None:
        return False
    return shifted_ghost_cost(input_positions, output_positions, channels, outputs,
                              offsets) < output_positions * offsets * channels * outputs


#: On JAX the batch kernel gradient ``sum_i P_i^T D_i`` of a one-dimensional stride-1
#: convolution (``summed``) is XLA's own filter gradient from this many multiply-adds
#: (``B T K C O``) up; below, and for every 2-D and 3-D convolution, one GEMM per kernel offset
#: over the shifted input slices (:func:`pergrad.rules.conv._shifted_sum`), which won against
#: XLA's CPU filter gradient in 2-D and in small 1-D layers.
XLA_FILTER_GRADIENT_MIN_MULTIPLY_ADDS = 10**8


def xla_filter_gradient_wins(spatial_rank: int, multiply_adds: int | None) -> bool:
    """Whether a stride-1 convolution's batch kernel gradient on JAX is XLA's filter gradient
    rather than the GEMMs over shifted slices (:data:`XLA_FILTER_GRADIENT_MIN_MULTIPLY_ADDS`).

    Where it is, a clipped sum also takes the shifted ghost norms (:func:`shifted_ghost_wins`)
    and then the filter gradient of the clip-scaled output gradients, instead of building the
    per-example products that the sum would read."""
    return spatial_rank == 1 and multiply_adds is not None and (
        multiply_adds >= XLA_FILTER_GRADIENT_MIN_MULTIPLY_ADDS)


def materialized_cost(positions: int, inputs: int, outputs: int, batch: int | None = None,
                      pairs: bool = False) -> float:
    """Multiply-adds of the materialized route over a batch of ``batch`` examples (``None``:
    one): ``B T I O + B I O`` for the norms, ``B T I O + B^2 I O`` with ``pairs`` (Gram)."""
    b = batch or 1
    return float(b * positions * inputs * outputs + (b * b if pairs else b) * inputs * outputs)


def ghost_cost(positions: int, inputs: int, outputs: int, batch: int | None = None,
               pairs: bool = False) -> float:
    """Multiply-adds of the ghost route: ``B T^2 (I + O)`` for the norms, ``B^2 T^2 (I + O)``
    with ``pairs``."""
    b = batch or 1
    return float((b * b if pairs else b) * positions * positions * (inputs + outputs))


def prefers_ghost(positions: int | None, inputs: int, outputs: int, batch: int | None = None,
                  pairs: bool = False) -> bool:
    """Whether the ghost route is the cheaper one, by the model above.

    ``pairs=False``: for ``||g_i||^2``; ``pairs=True``: for the Gram matrix ``<g_i, g_j>`` (with
    ``batch`` examples; ``None`` with ``pairs`` compares the terms that grow as ``B^2``).
    """
    if positions is None or positions < 0:
        return False
    if pairs and batch is None:
        return GEMM_ADVANTAGE * positions * positions * (inputs + outputs) < inputs * outputs
    ghost = ghost_cost(positions, inputs, outputs, batch, pairs)
    return GEMM_ADVANTAGE * ghost < materialized_cost(positions, inputs, outputs, batch, pairs)


@dataclass(frozen=True)
class FactoredRoute:
    """The routes one factored weight ``g_i = sum_t A_i[t]^T D_i[t]`` takes for each quantity
    (:class:`pergrad.rules.forms.Factored`), chosen once per declared query by
    :func:`factored_route`; the form computes whatever it is asked by these routes and no
    other, whatever ran before.

    Attributes:
        norms: ``"outer"`` (one position: ``||a||^2 ||d||^2``), ``"gram"`` (the ghost route
            ``sum_{t,s} (a_t . a_s)(d_t . d_s)``), ``"rule_ghost"`` (the rule's own cheaper
            norms, a stride-1 convolution's shifted Gram) or ``"matrices"`` (``||M_i||^2`` of
            the per-example matrices ``M_i = sum_t D_i[t]^T A_i[t]``).
        dots: ``"matrices"`` (``<M_i, V>``) or ``"inputs"`` (``sum_t (a_t V) . d_t``).
        sums: ``"matrices"`` (``sum_i c_i M_i``, read from the matrices the norms built),
            ``"native"`` (the rule's native kernel, a convolution's filter gradient) or
            ``"inputs"`` (``A^T (c D)``, one GEMM).
        gradients: ``"blocks"`` (the matrices the norms built, transposed to the variable's
            layout) or ``"variable_order"`` (``A^T D`` multiplied in the variable's order).
    """

    norms: str
    dots: str
    sums: str
    gradients: str


#: How a factored weight's norms may be forced for A/B runs
#: (:attr:`pergrad.backend.routes.Routes.factored_norms`): by this cost model, or always by the
#: ghost routes (the rule's own where it has one, else the Gram form where the form has no
#: native per-example kernel), or always by the per-example matrices.
FACTORED_NORMS_CHOICES = ("cost", "ghost", "matrices")


def factored_route(*, positions: int | None, inputs: int | None, outputs: int | None,
                   matrix_elements: int | None, native_products: bool, rule_ghost: bool,
                   ghost_before_sums: bool, native_sums: bool, query: Query,
                   products_in_variable_order: bool = True, forced: str = "cost"
                   ) -> FactoredRoute:
    """The cheapest routes for what ``query`` declares will be asked of one factored weight.

    ``positions`` (``T``), ``inputs`` (``I``) and ``outputs`` (``O``) are static sizes or
    ``None``; ``matrix_elements`` the per-example matrices' size over the batch (``B G O I``,
    ``None`` when not static); ``native_products``, ``rule_ghost`` and ``native_sums`` whether
    the rule gave a native per-example kernel, its own ghost norms and a native weighted sum;
    ``ghost_before_sums`` the rule's word that its ghost norms and native sum beat the matrices
    when only sums follow. ``forced`` (:data:`FACTORED_NORMS_CHOICES`) overrides the norms'
    choice.

    * norms: one position (and no native products) ``"outer"``; the rule's ghost norms when
      nothing follows, or only sums and ``ghost_before_sums`` (sums or rows that follow read
      the matrices instead); the matrices with native products, else the cheaper of the Gram
      form and the matrices by :func:`prefers_ghost`.
    * dots: the matrices wherever the form materializes (native products, or the matrices
      cheaper than the Gram form), even after the rule's ghost norms, else the inputs.
    * sums: read from the matrices when the query declares sums after norms that build them and
      :func:`sums_from_matrices` allows keeping them, else the native sum, else the inputs.
    * gradients: transposed from the matrices when the norms build them and rows follow (or
      the rule gives native products, or ``products_in_variable_order`` is off), else ``A^T D``.
    """
    if forced not in FACTORED_NORMS_CHOICES:
        raise ValueError(f"factored_norms must be one of {FACTORED_NORMS_CHOICES}, got "
                         f"{forced!r}.")
    one_position = positions == 1 and not native_products
    if forced == "matrices":
        materializing = True
    elif forced == "ghost":
        materializing = native_products
    else:
        materializing = native_products or not prefers_ghost(positions, inputs, outputs)
    if one_position:
        norms = "outer"
    elif rule_ghost and forced != "matrices" and (
            forced == "ghost" or query.alone or not query.rows and ghost_before_sums):
        norms = "rule_ghost"
    else:
        norms = "matrices" if materializing else "gram"
    dots = "matrices" if positions != 1 and materializing else "inputs"
    if (query.sums and norms == "matrices" and matrix_elements is not None
            and sums_from_matrices(matrix_elements)):
        sums = "matrices"
    else:
        sums = "native" if native_sums else "inputs"
    built = norms == "matrices" and query.rows
    gradients = ("blocks" if native_products or built or not products_in_variable_order
                 else "variable_order")
    return FactoredRoute(norms, dots, sums, gradients)


__all__ = ["CHUNK_BYTES", "FACTORED_NORMS_CHOICES", "FactoredRoute", "GEMM_ADVANTAGE",
           "ROWS_PAIRWISE_MAX_POSITIONS", "factored_route",
           "ROWS_PAIRWISE_MAX_POSITIONS_TENSORFLOW", "SHIFTED_MIN_CHANNELS",
           "SUM_FROM_MATRICES_MAX_ELEMENTS", "examples_per_chunk", "folded_products_win",
           "ghost_cost", "materialized_cost", "prefers_ghost", "rows_pairwise_wins",
           "shifted_ghost_cost", "shifted_ghost_wins", "shifted_products_win", "sums_from_matrices",
           "XLA_FILTER_GRADIENT_MIN_MULTIPLY_ADDS", "xla_filter_gradient_wins",
           "GROUPED_MIN_PATCH_WIDTH", "GROUPED_MAX_CHANNELS",
           "grouped_filter_gradients_win", "TORCH_GROUPED_MAX_CHANNELS",
           "TORCH_GROUPED_MAX_PATCH_WIDTH", "TORCH_GROUPED_MIN_PATCH_WIDTH",
           "torch_grouped_filter_gradients_win"]
