"""Conv1D / Conv2D / Conv3D: any strides, dilation, ``valid``/``same``/``causal`` padding, groups,
``channels_last`` and ``channels_first``.

With ``P_i[t, G, K, c]`` the input patch that output position ``t`` of example ``i`` sees (kernel
offset ``K``, channel ``c`` of group ``G``) and ``D_i[t, G, o]`` the gradient at the pre-activation
output,

    dL_i/dW[K, c, G*o] = sum_t P_i[t, G, K, c] D_i[t, G, o]        dL_i/db = sum_t D_i[t]

a ``Factored`` form with ``A = P`` (patches gathered with strided slices, one per kernel offset,
so there is no ``Conv2DBackpropFilter`` to vectorize). The per-example products ``P_i^T D_i``
take the fastest exact route the geometry allows (:func:`_kernel_form`): one batched product
per kernel offset over shifted input slices (stride 1, many channels), the same over the input
folded by the strides, or on TensorFlow one grouped filter gradient with the batch as groups
(:func:`_grouped_products`); otherwise one product over the patches.
"""

from __future__ import annotations

import itertools
import math

import keras
from keras import ops

from pergrad.backend import native
from pergrad.backend.ops import (
    add_n,
    batch_size,
    dtype_of,
    map_in_chunks,
    matmul_ta,
    rank,
    static_or_none,
    vjp,
    zero_rows,
)
from pergrad.rules import LayerCall, plain_weights, register
from pergrad.rules.cost import (
    examples_per_chunk,
    folded_products_win,
    grouped_filter_gradients_win,
    prefers_ghost,
    shifted_ghost_wins,
    shifted_products_win,
    xla_filter_gradient_wins,
)
from pergrad.rules.forms import Deferred, Factored, Materialized, positions


def _padding_and_size(n, k: int, s: int, d: int, padding: str) -> tuple:
    """(pad_before, pad_after, output size) of one spatial axis, as TensorFlow computes them.

    ``n`` is an int, or a scalar tensor when the axis is dynamic (traced with
    ``reduce_retracing``); the results are then tensors too.
    """
    span = (k - 1) * d + 1
    if padding == "same":
        out = (n + s - 1) // s
        total = (out - 1) * s + span - n
        total = max(total, 0) if isinstance(total, int) else ops.maximum(total, 0)
        return total // 2, total - total // 2, out
    if padding == "causal":
        return span - 1, 0, (n - 1) // s + 1
    return 0, 0, (n - span) // s + 1


def pad_input(x, kernel_size, strides, dilation, padding: str) -> tuple:
    """``x`` (channels last) padded as the layer pads it, and the output size per axis; after
    this every padding mode is ``VALID``."""
    spatial = list(ops.shape(x)[1:-1])
    geometry = [_padding_and_size(n, k, s, d, padding)
                for n, k, s, d in zip(spatial, kernel_size, strides, dilation, strict=True)]
    if any(not isinstance(v, int) or v for before, after, _ in geometry for v in (before, after)):
        x = ops.pad(x, [[0, 0], *[[b, a] for b, a, _ in geometry], [0, 0]])
    return x, [out for _, _, out in geometry]


def native_padding(x, kernel_size, strides, dilation, padding: str) -> tuple:
    """``(input, padding)`` for a native kernel: ``x`` itself with ``"same"`` or ``"valid"``
    where the backend's kernels pad exactly as :func:`pad_input` does (``Routes.conv_kernels_pad``,
    TensorFlow: a separate ``Pad`` op costs a pass over the input); elsewhere, and for
    ``"causal"``, the padded input and ``"valid"``."""
    if native().ROUTES.conv_kernels_pad and padding in ("same", "valid"):
        return x, padding
    return pad_input(x, kernel_size, strides, dilation, padding)[0], "valid"


def extract_patches(x, kernel_size, strides, dilation, padding: str):
    """Patches of channels-last ``x``: ``(B, out_1, ..., out_n, K, C)``, ``K`` in kernel order.

    One one-hot convolution (or TensorFlow's ``extract_patches``) for 1D and 2D inputs;
    strided slices (one per kernel offset) for 3D, and on JAX and PyTorch for patches wider than
    ``_IDENTITY_CONV_MAX_WIDTH`` (``K C``): their one-hot convolution multiplies by every one of
    the ``K C x K C`` weights, which the slices do not (measured: docs/benchmarks.md, "Route
    measurements").
    """
    n_spatial = rank(x) - 2
    if n_spatial <= 2 and not patches_by_slices(math.prod(kernel_size) * x.shape[-1]):
        source, native = native_padding(x, kernel_size, strides, dilation, padding)
        return _image_patches(source, kernel_size, strides, dilation, native)
    x, sizes = pad_input(x, kernel_size, strides, dilation, padding)
    slices = []
    for offset in itertools.product(*[range(k) for k in kernel_size]):
        index = tuple(slice(o * d, o * d + (out - 1) * s + 1, s) for o, d, s, out
                      in zip(offset, dilation, strides, sizes, strict=True))
        slices.append(x[(slice(None), *index, slice(None))])
    return ops.stack(slices, axis=-2)


_IDENTITY_CONV_MAX_WIDTH = 128


def patches_by_slices(width: int) -> bool:
    """Whether 1-D and 2-D patches ``width`` (``K C``) wide are gathered by strided slices
    rather than a one-hot convolution: above ``_IDENTITY_CONV_MAX_WIDTH`` where the backend's
    routes say so (``Routes.wide_patches_by_slices``: JAX and PyTorch; TensorFlow has its own
    ``extract_patches`` kernel there). XLA does not turn the one-hot convolution into a gather
    on the CPU (docs/benchmarks.md, "Route measurements": 14x slower than the slices on a 5x5
    depthwise layer with 240 channels; measured on the CPU only)."""
    return native().ROUTES.wide_patches_by_slices and width > _IDENTITY_CONV_MAX_WIDTH


def _image_patches(x, kernel_size, strides, dilation, padding: str = "valid"):
    """Patches of a 1D or 2D input (1D as height 1), padded by ``padding`` (``"valid"`` for an
    already padded one; ``"same"`` only where the kernels pad, see :func:`native_padding`)."""
    one_d = rank(x) == 3
    if one_d:
        x = x[:, None]
        kernel_size, strides, dilation = (1, *kernel_size), (1, *strides), (1, *dilation)
    channels = x.shape[-1]
    width = kernel_size[0] * kernel_size[1] * channels
    # Many input channels: a native patch kernel (TensorFlow's extract_patches) beats the
    # one-hot convolution there (the one-hot one wins below this width, as for the 8x8x1 kernel
    # of the benchmark CNN).
    patches = (native().image_patches(x, kernel_size, strides, dilation, padding)
               if width > _IDENTITY_CONV_MAX_WIDTH else None)
    if patches is None:
        one_hot = ops.reshape(ops.eye(width, dtype=x.dtype), [*kernel_size, channels, width])
        patches = ops.conv(x, one_hot, strides=list(strides), padding=padding,
                           data_format="channels_last", dilation_rate=list(dilation))
    shape = ops.shape(patches)
    patches = ops.reshape(patches, [batch_size(x), shape[1], shape[2],
                                    kernel_size[0] * kernel_size[1], channels])
    return patches[:, 0] if one_d else patches


def _channels_last(t, data_format: str):
    if data_format == "channels_last":
        return t
    return ops.transpose(t, [0, *range(2, rank(t)), 1])


def channels_last_input_and_grad(layer, call: LayerCall, grad, dtype) -> tuple:
    """The recorded input and the output gradient of a convolution-like layer, both cast to
    ``dtype`` (its kernel's) and channels-last, whatever the layer's ``data_format``."""
    return (_channels_last(ops.cast(call.args[0], dtype), layer.data_format),
            _channels_last(ops.cast(grad, dtype), layer.data_format))


def conv_rule(layer, call: LayerCall, grad) -> list:
    x, d = channels_last_input_and_grad(layer, call, grad, layer.kernel.dtype)
    forms = [_kernel_form(layer, x, d)]
    if layer.use_bias:
        forms.append(Materialized(layer.bias, ops.sum(
            ops.reshape(d, [batch_size(d), -1, layer.filters]), 1)))
    return forms


def _kernel_form(layer, x, d) -> Factored:
    """The kernel's ``Factored`` form from the channels-last input ``x`` and output gradient
    ``d``, with the fastest native routes the layer's geometry allows."""
    routes = native().ROUTES
    groups = layer.groups
    static = all(n is not None for n in x.shape[1:-1])
    if routes.folded_conv_products and groups == 1 and static and folded_products_win(
            layer.kernel_size, layer.strides, layer.dilation_rate, x.shape[-1]):
        return _folded_kernel_form(layer, x, d)
    c_in, c_out = x.shape[-1], layer.filters
    batch, k = batch_size(x), math.prod(layer.kernel_size)
    t = positions(d.shape[1:-1])

    def patch_rows():  # (B, T, G, K C/G)
        patches = extract_patches(x, layer.kernel_size, layer.strides, layer.dilation_rate,
                                  layer.padding)
        if groups == 1:
            return ops.reshape(patches, [batch, t, 1, k * c_in])
        # (B, T, K, G, C/G) -> (B, T, G, K * C/G)
        a = ops.reshape(patches, [batch, t, k, groups, c_in // groups])
        return ops.reshape(ops.transpose(a, [0, 1, 3, 2, 4]),
                           [batch, t, groups, k * (c_in // groups)])

    # An eager backend runs each op as written: the patches are built only if a route reads them
    a = (Deferred(patch_rows, (batch, t, groups, k * (c_in // groups)), dtype_of(x))
         if routes.eager else patch_rows())
    dd = ops.reshape(d, [batch, t, groups, c_out // groups])
    natural = (*layer.kernel_size, c_in // groups, groups, c_out // groups)
    summed = per_example = None
    shifted = groups == 1 and shifted_products_win(layer.kernel_size, layer.strides, c_in)
    # XLA's filter gradient loses to the GEMMs over shifted slices on CPU, except in 1-D
    native_sum = groups == 1 and (routes.conv_filter_gradient_sums == "always" or (
        routes.conv_filter_gradient_sums == "when_xla_wins" and shifted and xla_filter_gradient_wins(
            len(layer.kernel_size), _multiply_adds(batch, t, k * c_in * c_out))))
    if native_sum:
        def summed(coefficients):
            return _filter_gradient(layer, x, d * ops.cast(coefficients, d.dtype)[
                (slice(None),) + (None,) * (rank(d) - 1)])
    if shifted and not prefers_ghost(static_or_none(t), k * c_in, c_out):
        def per_example():
            return _shifted_products(layer, x, d)
    ghost_norms = None
    if per_example is not None and static and routes.shifted_ghost_norms and shifted_ghost_wins(
            _read_positions(layer, x), static_or_none(t), c_in, c_out, k):
        def ghost_norms():  # norms alone (and, on JAX with its filter gradient, before sums)
            return _shifted_ghost_norms(layer, x, d)
    if (groups == 1 and not prefers_ghost(static_or_none(t), k * c_in, c_out)
            and grouped_filter_gradients_win(layer.kernel_size, layer.dilation_rate, c_in,
                                             over_shifted=shifted, limits=routes.grouped_conv)
            and grouped_filter_gradients_available(x.dtype)):
        def per_example():  # one grouped filter gradient, not patches or shifted products
            return _grouped_products(layer, x, d)
    if shifted and summed is None:  # the GEMM over shifted slices, not over patches
        def summed(coefficients):
            return _shifted_sum(layer, x, d * ops.cast(coefficients, d.dtype)[
                (slice(None),) + (None,) * (rank(d) - 1)])

    def remake(keep):  # patches of the masked input only where a masked route needs them
        return _kernel_form(layer, zero_rows(x, keep), zero_rows(d, keep))

    return Factored(layer.kernel, a, dd, natural, summed=summed, per_example=per_example,
                    remake=remake, ghost_norms=ghost_norms,
                    ghost_before_sums=native_sum and routes.ghost_norms_before_sums)


def _multiply_adds(batch, positions_per_example, per_position: int) -> int | None:
    """``B T K C O`` where the batch size and positions are static, else ``None``."""
    b, t = static_or_none(batch), static_or_none(positions_per_example)
    return None if b is None or t is None else b * t * per_position


def _folded_kernel_form(layer, x, d) -> Factored:
    """The kernel's form for a strided convolution whose kernel is a whole number of strides
    on every axis (:func:`pergrad.rules.cost.folded_products_win`), in the geometry of the
    input *folded* by the strides: ``z[i, n, (r, c)] = x_pad[i, n s + r, c]`` (space to depth).
    The convolution is then one of stride 1 over ``z`` with kernel ``k / s``, and kernel offset
    ``K = a s + r`` of the layer is offset ``a`` of that kernel, channel ``(r, c)`` of ``z``:

        dL_i/dW[a s + r, c, o] = sum_t z_i[t + a, (r, c)] D_i[t, o]

    The per-example products are one batched product per offset ``a`` over slices of ``z``
    (:func:`_folded_products`), kept as blocks; the form's layout is ``(a..., r..., c, 1, o)``,
    which ``perm`` interleaves into the kernel's ``(a r..., c, o)``. Patches are not built:
    ``a`` (the folded input's patches) is read only by routes a compiled step does not take.
    Faster than ``extract_patches`` on the benchmark CNN's second layer (docs/benchmarks.md,
    "Route measurements")."""
    strides, c_in, c_out = tuple(layer.strides), x.shape[-1], layer.filters
    z = _folded_input(layer, x)
    blocks = tuple(k // st for k, st in zip(layer.kernel_size, strides, strict=True))
    batch, t = batch_size(x), positions(d.shape[1:-1])
    width = math.prod(strides) * c_in
    ones = (1,) * len(blocks)
    a = ops.reshape(extract_patches(z, blocks, ones, ones, "valid"),
                    [batch, t, 1, math.prod(blocks) * width])
    dd = ops.reshape(d, [batch, t, 1, c_out])
    n = len(blocks)
    natural = (*blocks, *strides, c_in, 1, c_out)
    # (a_1..a_n, r_1..r_n, c, G, o) -> (a_1, r_1, ..., a_n, r_n, c, G, o)
    perm = (*[axis for j in range(n) for axis in (j, n + j)], 2 * n, 2 * n + 1, 2 * n + 2)

    def summed(coefficients):
        return _filter_gradient(layer, x, d * ops.cast(coefficients, d.dtype)[
            (slice(None),) + (None,) * (rank(d) - 1)])

    def remake(keep):
        return _folded_kernel_form(layer, zero_rows(x, keep), zero_rows(d, keep))

    return Factored(layer.kernel, a, dd, natural, perm, summed=summed,
                    per_example=lambda: _folded_products(z, d, blocks), remake=remake)


def _folded_input(layer, x):
    """``x`` padded as the layer pads it, cut to the span the outputs read and folded by the
    strides: ``(B, n_1, ..., n_k, s_1 ... s_k C)``, channel ``(r_1, ..., r_k, c)`` of cell
    ``n`` holding ``x_pad[n s + r, c]``."""
    padded, sizes = pad_input(x, layer.kernel_size, layer.strides, layer.dilation_rate,
                              layer.padding)
    strides, c_in, batch = tuple(layer.strides), x.shape[-1], batch_size(x)
    spans = [(out - 1) * st + k for out, st, k in zip(sizes, strides, layer.kernel_size,
                                                       strict=True)]
    padded = padded[(slice(None), *[slice(0, span) for span in spans], slice(None))]
    cells = [span // st for span, st in zip(spans, strides, strict=True)]
    n = len(strides)
    split = ops.reshape(padded, [batch, *[v for pair in zip(cells, strides, strict=True)
                                          for v in pair], c_in])
    order = [0, *[1 + 2 * j for j in range(n)], *[2 + 2 * j for j in range(n)], 2 * n + 1]
    return ops.reshape(ops.transpose(split, order), [batch, *cells, math.prod(strides) * c_in])


def _folded_products(z, d, blocks) -> list:
    """``[(B, 1, O, s C) for each offset a of the folded kernel]``, in kernel order:
    ``sum_t D_i[t]^T z_i[t + a]`` (see :func:`_folded_kernel_form`)."""
    ones = (1,) * len(blocks)
    return _products_by_offset(_offset_slices(z, blocks, ones, d.shape[1:-1]), d)


def _products_by_offset(slices, d) -> list:
    """``[(B, 1, O, C) for each (offset, slice)]``: ``D_i^T`` times each slice of the input,
    one batched product per kernel offset."""
    batch, c_out = batch_size(d), d.shape[-1]
    dd = ops.reshape(d, [batch, -1, c_out])
    return [matmul_ta(dd, ops.reshape(part, [batch, -1, part.shape[-1]]))[:, None]
            for _, part in slices]


def _shifted_products(layer, x, d):
    """``(B, 1, O, K C)``: each example's kernel gradient as one batched ``a^T b`` per kernel
    offset, between the output gradient and the input shifted by that offset (stride 1):

        M_i[o, (K, c)] = sum_t D_i[t, o] X_i[t + K dilation, c]

    Slices of the padded input are read in place of patches, which are ``K`` times the input's
    size. The patches' order of ``(K, c)`` is kept.

    Except on JAX the result is the list of the ``K`` blocks ``(B, 1, O, C)``, one per offset
    (see :class:`pergrad.rules.forms.Factored`): stacking them would write and read the whole
    ``B x P`` tensor once more.

    On JAX the examples go in chunks of about :data:`pergrad.rules.cost.CHUNK_BYTES` of
    patches, and each chunk gathers its patches from the slices and multiplies once
    (:func:`_chunk_patch_products`). Each choice was timed: docs/benchmarks.md, "Route
    measurements"."""
    if native().ROUTES.chunks_examples:
        kernel = math.prod(layer.kernel_size)
        per_example = positions(d.shape[1:-1]) * kernel * x.shape[-1] * x.dtype.itemsize
        return map_in_chunks(lambda xc, dc: _chunk_patch_products(layer, xc, dc), (x, d),
                             examples_per_chunk(per_example))
    return _products_by_offset(_shifted_offsets(layer, x), d)


def _read_input(layer, x):
    """``x`` padded as the layer pads it and cut to the span its outputs read (stride 1)."""
    padded, sizes = pad_input(x, layer.kernel_size, layer.strides, layer.dilation_rate,
                              layer.padding)
    spans = [n + (k - 1) * r for n, k, r in zip(sizes, layer.kernel_size,
                                                 layer.dilation_rate, strict=True)]
    return padded[(slice(None), *[slice(0, span) for span in spans], slice(None))], sizes


def _read_positions(layer, x) -> int:
    """Positions per example of :func:`_read_input` (static spatial sizes)."""
    spans = []
    for n, k, r in zip(x.shape[1:-1], layer.kernel_size, layer.dilation_rate, strict=True):
        out = _padding_and_size(n, k, 1, r, layer.padding)[2]
        spans.append(out + (k - 1) * r)
    return math.prod(spans)


def _shifted_ghost_norms(layer, x, d):
    """``||g_i||^2`` of a stride-1 convolution's kernel without its per-example products:

        ||sum_t p_t d_t^T||^2 = sum_{t,s} (p_t . p_s)(d_t . d_s),
        p_t . p_s = sum_K x[t + K r] . x[s + K r]

    so the patches' Gram is the sum, over the kernel offsets ``K``, of windows of the input's
    own Gram ``X X^T`` shifted by ``K r`` along both position axes (:func:`pergrad.rules.cost.
    shifted_ghost_cost`). On JAX the examples go in chunks (``lax.map``) of about
    :data:`pergrad.rules.cost.CHUNK_BYTES` of Gram matrices."""
    padded, sizes = _read_input(layer, x)
    spans = list(padded.shape[1:-1])
    t_in, t_out = math.prod(spans), math.prod(sizes)
    c_in, c_out = x.shape[-1], d.shape[-1]

    def norms(xc, dc):
        b = batch_size(xc)
        flat = ops.reshape(xc, [b, t_in, c_in])
        gram_x = ops.reshape(ops.einsum("btc,bsc->bts", flat, flat), [b, *spans, *spans])
        windows = []
        for offset in itertools.product(*[range(k) for k in layer.kernel_size]):
            cut = [slice(o * r, o * r + n) for o, r, n in zip(offset, layer.dilation_rate,
                                                              sizes, strict=True)]
            windows.append(gram_x[(slice(None), *cut, *cut)])
        gram_p = ops.reshape(add_n(windows), [b, t_out, t_out])
        flat_d = ops.reshape(dc, [b, t_out, c_out])
        gram_d = ops.einsum("bto,bso->bts", flat_d, flat_d)
        return ops.sum(gram_p * gram_d, axis=[1, 2])

    if not native().ROUTES.chunks_examples:
        return norms(padded, d)
    per_example = (t_in * t_in + 2 * t_out * t_out) * x.dtype.itemsize
    return map_in_chunks(norms, (padded, d), examples_per_chunk(per_example))


def _chunk_patch_products(layer, x, d):
    """:func:`_shifted_products` of a few examples: their patches (the shifted slices side by
    side, ``(K, c)`` in kernel order) and one batched ``D^T P``."""
    batch, c_in, c_out = batch_size(x), x.shape[-1], d.shape[-1]
    parts = [ops.reshape(part, [batch, -1, c_in]) for _, part in _shifted_offsets(layer, x)]
    patches = parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=-1)
    m = matmul_ta(ops.reshape(d, [batch, -1, c_out]), patches)  # (B, O, K C)
    return ops.reshape(m, [batch, 1, c_out, len(parts) * c_in])


def _shifted_offsets(layer, x):
    """``(offset, slice of the padded input it reads)`` for every kernel offset (stride 1), in
    kernel order: output position ``t`` of offset ``K`` reads input ``t + K dilation``."""
    padded, sizes = pad_input(x, layer.kernel_size, layer.strides, layer.dilation_rate,
                              layer.padding)
    yield from _offset_slices(padded, layer.kernel_size, layer.dilation_rate, sizes)


def _offset_slices(padded, kernel_size, dilation, sizes):
    """``(offset, slice)`` for every offset of a stride-1 kernel, in kernel order: the slice
    holds ``padded[t + offset * dilation]`` for the output positions ``t < sizes``."""
    for offset in itertools.product(*[range(k) for k in kernel_size]):
        index = tuple(slice(o * r, o * r + n) for o, r, n
                      in zip(offset, dilation, sizes, strict=True))
        yield offset, padded[(slice(None), *index, slice(None))]


def _shifted_sum(layer, x, d):
    """``sum_i P_i^T D_i`` as one GEMM over all ``B T`` rows per kernel offset, on the shifted
    input slices: the batch kernel gradient without patches (where the native filter
    gradient loses on CPU: XLA's, in 2-D and 3-D and for small 1-D layers,
    :func:`pergrad.rules.cost.xla_filter_gradient_wins`)."""
    c_in, c_out = x.shape[-1], d.shape[-1]
    flat_d = ops.reshape(d, [-1, c_out])
    sums = [matmul_ta(ops.reshape(part, [-1, c_in]), flat_d)
            for _, part in _shifted_offsets(layer, x)]  # each (C, O)
    return ops.stack(sums, axis=0)


def grouped_filter_gradients_available(dtype) -> bool:
    """Whether the backend's native grouped filter gradient runs for ``dtype`` in the
    computation being built (:func:`pergrad.backend.native`: on TensorFlow oneDNN's kernel, not
    Eigen's or XLA's; on PyTorch always; never on JAX)."""
    return native().grouped_filter_gradients_available(dtype)


def _grouped_products(layer, x, d):
    """``(B, 1, O, K C)``: every example's kernel gradient from one native grouped filter
    gradient, the batch folded into the channels
    (:func:`pergrad.backend.protocol.Backend.grouped_filter_gradients`). It does the
    per-example products' ``B T K C O`` multiply-adds without writing the ``K``-times larger
    patches (:func:`pergrad.rules.cost.grouped_filter_gradients_win`)."""
    source, padding = native_padding(x, layer.kernel_size, layer.strides, layer.dilation_rate,
                                     layer.padding)
    return native().grouped_filter_gradients(source, d, tuple(layer.kernel_size),
                                             tuple(layer.strides), padding)


def _filter_gradient(layer, x, d):
    """``sum_i P_i^T D_i``: the ordinary (batch) kernel gradient of ``<conv(x, W), d>``, which
    the backend's own filter-gradient kernel computes far faster than a GEMM over patches."""
    source, padding = native_padding(x, layer.kernel_size, layer.strides, layer.dilation_rate,
                                     layer.padding)
    kernel = ops.zeros(layer.kernel.shape, x.dtype)
    return vjp(lambda w: ops.conv(source, w, strides=list(layer.strides), padding=padding,
                                  data_format="channels_last",
                                  dilation_rate=list(layer.dilation_rate)), kernel, d)


register(keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D, splits_activation=True,
         applies=plain_weights)(conv_rule)
