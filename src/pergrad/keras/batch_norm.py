"""Make a model DP-ready: replace every BatchNormalization with GroupNormalization.

BatchNormalization in training mode normalizes each example with the statistics of the whole
batch, so one example's output (and gradient) depends on every other example: per-example
gradients do not exist and pergrad refuses it (:class:`pergrad.MixesExamplesError`). The usual
fix for DP-SGD from scratch is GroupNormalization (De et al. 2022, "Unlocking high-accuracy
differentially private image classification through scale"; Opacus's ``ModuleValidator.fix``),
which normalizes each example over groups of its own channels.

:func:`replace_batch_normalization` copies a Sequential or Functional model (nested ones too),
swapping each BatchNormalization for a GroupNormalization over the same channel axis:

* **groups**: ``groups`` when given and it divides the channel count; otherwise the largest of
  32, 16, 8, 4, 2 that divides the channels (and, when ``groups`` is given, is below it);
  where none does (an odd channel count), a LayerNormalization over the channel axis.
* **weights**: the BatchNormalization's ``gamma`` and ``beta`` (where it has ``scale`` and
  ``center``) become the new layer's; its moving mean and variance are dropped (the new layer
  has none). Every other layer keeps its weights exactly.
* **kept**: each layer's name, ``epsilon``, ``center``, ``scale``, initializers,
  regularizers, constraints, ``trainable`` flag and dtype policy; ``momentum`` and the
  renormalization options have no counterpart and are dropped.

The input model is not changed, and the copy is not compiled.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import keras

from pergrad._compat import sublayers
from pergrad.engine.arguments import positive_integer

#: The group counts tried, largest first, when ``groups`` is not given or does not divide.
DEFAULT_GROUPS = (32, 16, 8, 4, 2)

# What GroupNormalization and LayerNormalization share with BatchNormalization's config.
_SHARED_CONFIG = ("name", "trainable", "dtype", "axis", "epsilon", "center", "scale",
                  "beta_initializer", "gamma_initializer", "beta_regularizer",
                  "gamma_regularizer", "beta_constraint", "gamma_constraint")


@dataclass(frozen=True)
class Replacement:
    """One replaced layer: its name, the new class, its channel count and groups (``None`` for
    a LayerNormalization)."""

    name: str
    new_class: str
    channels: int
    groups: int | None

    def describe(self) -> str:
        groups = "no group count > 1 divides them" if self.groups is None \
            else f"{self.groups} groups"
        return (f"  {self.name}: BatchNormalization -> {self.new_class}, {self.channels} "
                f"channels, {groups}")


def group_count(channels: int, groups: int | None = None) -> int | None:
    """The number of groups for ``channels`` channels (module docstring): ``groups`` if it
    divides ``channels``, else the largest of :data:`DEFAULT_GROUPS` (below ``groups`` when
    given) that does, else ``None`` (use a LayerNormalization)."""
    if groups is not None and channels % groups == 0:
        return groups
    for candidate in DEFAULT_GROUPS:
        if (groups is None or candidate < groups) and channels % candidate == 0:
            return candidate
    return None


def _is_graph_model(layer: Any) -> bool:
    """A Sequential or Functional model: the kinds ``keras.models.clone_model`` rebuilds from
    their layers (a Functional model is a ``keras.Function``; a subclassed one is not)."""
    return isinstance(layer, keras.Sequential) or (
        isinstance(layer, keras.Model) and isinstance(layer, keras.Function))


def _check_replaceable(model: Any) -> None:
    """Raise a ``ValueError`` naming the layer for what cannot be replaced: a subclassed model,
    an unbuilt model, a BatchNormalization inside a layer that is not a Sequential or Functional
    model (its ``call`` is the user's code, which this cannot rewrite)."""
    if not _is_graph_model(model):
        raise ValueError(
            f"replace_batch_normalization copies Sequential and Functional models (every "
            f"keras.applications model is one); {model.name!r} is a subclassed "
            f"{type(model).__name__}, whose call is Python code it cannot rewrite. Build that "
            "model with keras.layers.GroupNormalization in place of BatchNormalization.")
    if not model.built:
        raise ValueError(f"Model {model.name!r} is not built: call it on a batch (or give it a "
                         "keras.Input) before replace_batch_normalization.")
    for layer in model.layers:
        if _is_graph_model(layer):
            _check_replaceable(layer)
        elif isinstance(layer, keras.layers.BatchNormalization):
            _check_batch_normalization(layer)
        else:
            hidden = [s for s in sublayers(layer)
                      if isinstance(s, keras.layers.BatchNormalization)]
            if hidden:
                raise ValueError(
                    f"BatchNormalization {hidden[0].name!r} is inside layer {layer.name!r} "
                    f"({type(layer).__name__}), whose call is Python code that "
                    "replace_batch_normalization cannot rewrite. Use "
                    "keras.layers.GroupNormalization in that layer's code instead.")


def _channels(layer) -> int:
    """The channel count of a built BatchNormalization (its moving statistics' length)."""
    return int(layer.moving_mean.shape[0])


def _check_batch_normalization(layer) -> None:
    """Refuse, by name, a BatchNormalization with no per-example replacement: one over a
    single channel (normalizing one value per position over itself gives ``beta``)."""
    if not layer.built:
        raise ValueError(f"BatchNormalization {layer.name!r} is not built: call the model on a "
                         "batch first.")
    if _channels(layer) == 1:
        raise ValueError(
            f"BatchNormalization {layer.name!r} normalizes 1 channel: a per-example "
            "normalization over that one channel would set every value to beta. Remove the "
            "layer, or freeze it (layer.trainable = False) to keep its moving statistics.")


def _normalization_for(layer, groups: int | None) -> tuple[keras.layers.Layer, Replacement]:
    """The GroupNormalization (or LayerNormalization) replacing BatchNormalization ``layer``."""
    channels = _channels(layer)
    config = {key: value for key, value in layer.get_config().items() if key in _SHARED_CONFIG}
    count = group_count(channels, groups)
    if count is None:
        new = keras.layers.LayerNormalization.from_config(config)
    else:
        new = keras.layers.GroupNormalization.from_config({**config, "groups": count})
    return new, Replacement(layer.name, type(new).__name__, channels, count)


def _copy_lambda(layer: keras.layers.Lambda) -> keras.layers.Lambda:
    """A new Lambda calling the same Python function: Keras's ``from_config`` cannot find a
    function defined in a script by its name, and rebuilds a Python lambda from bytecode
    without its globals. A callable ``output_shape`` has no public attribute
    (``Lambda._output_shape``)."""
    config = layer.get_config()
    output_shape = config.get("output_shape")
    if isinstance(output_shape, dict):  # a serialized function: take the original
        output_shape = getattr(layer, "_output_shape", None)
    return keras.layers.Lambda(layer.function, output_shape=output_shape, mask=layer.mask,
                               arguments=layer.arguments, name=layer.name,
                               trainable=layer.trainable, dtype=layer.dtype_policy)


def _copy_layer(layer) -> keras.layers.Layer:
    """A new, unbuilt layer with ``layer``'s config (its weights are copied afterwards)."""
    if isinstance(layer, keras.layers.Lambda):
        return _copy_lambda(layer)
    try:
        return layer.__class__.from_config(layer.get_config())
    except Exception as error:  # noqa: BLE001 - re-raised with the layer's name
        raise ValueError(
            f"Layer {layer.name!r} ({type(layer).__name__}) could not be copied from its config "
            f"({type(error).__name__}: {error}). Give it a get_config that from_config accepts, "
            "and register a custom class with keras.saving.register_keras_serializable.") from error


def _call_layer(layer, *args, **kwargs):
    """Call a layer of the copy with the arguments its original was called with, less those
    its ``call`` does not take: a BatchNormalization's node records ``mask=`` (and may record
    ``training=``), which GroupNormalization and LayerNormalization do not accept."""
    parameters = inspect.signature(layer.call).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in parameters}
    return layer(*args, **kwargs)


def _clone_model(model, clone_layer):
    """``keras.models.clone_model`` with ``clone_layer`` for every layer; nested models go
    through ``clone_layer`` too, which clones them by this function, so a Functional model
    nested in a Sequential one also gets :func:`_call_layer` (Keras's ``recursive=True`` drops
    ``call_function`` below a Sequential model, which does not take one)."""
    if isinstance(model, keras.Sequential):
        return keras.models.clone_model(model, clone_function=clone_layer)
    return keras.models.clone_model(model, clone_function=clone_layer, call_function=_call_layer)


def _layer_pairs(original, copy):
    """``(original layer, copied layer)`` for every layer, matched by name level by level and
    descending into nested models (names are unique within a model, not across nested ones)."""
    copies = {layer.name: layer for layer in copy.layers}
    for layer in original.layers:
        if isinstance(layer, keras.layers.InputLayer):  # no weights; renamed by clone_model
            continue
        twin = copies[layer.name]
        if _is_graph_model(layer):
            yield from _layer_pairs(layer, twin)
        else:
            yield layer, twin


def _copy_weights(original, copy) -> None:
    """Every layer's weights into its copy; a BatchNormalization's gamma and beta into its
    replacement (moving statistics dropped)."""
    for layer, twin in _layer_pairs(original, copy):
        if isinstance(layer, keras.layers.BatchNormalization):
            for name in ("gamma", "beta"):
                source, target = getattr(layer, name, None), getattr(twin, name, None)
                if source is not None and target is not None:
                    target.assign(source)
        elif layer.weights:
            twin.set_weights(layer.get_weights())


def replace_batch_normalization(model: keras.Model, groups: int | None = None,
                                verbose: bool = True) -> keras.Model:
    """A copy of ``model`` with every ``BatchNormalization`` replaced by a
    ``GroupNormalization`` over the same channel axis, for per-example gradients and DP-SGD.

    Args:
        model: a built Sequential or Functional model (nested Sequential and Functional models
            are handled too); any ``keras.applications`` model.
        groups: the group count wanted; used where it divides a layer's channels, else that
            layer gets the largest of 32, 16, 8, 4, 2 below it that divides them. ``None``
            (default): the largest of 32, 16, 8, 4, 2 that divides the channels. Where no
            count > 1 divides (an odd channel count), a ``LayerNormalization`` over the channel
            axis is used.
        verbose: print one line per replaced layer (name, old -> new, channels, groups).

    Returns:
        A new, uncompiled model: ``gamma`` and ``beta`` of each BatchNormalization copied into
        its replacement (moving statistics dropped, so its outputs differ from the original's),
        every other layer's weights copied exactly, layer names kept. ``model`` is unchanged.

    Raises:
        ValueError: naming the layer, for a subclassed model, an unbuilt model, a
            BatchNormalization inside a custom layer's code or over a single channel, or a layer
            that cannot be copied from its config.
    """
    if groups is not None:
        groups = positive_integer(groups, "groups")
    if not isinstance(model, keras.Model):
        raise ValueError(f"model must be a Keras model, got {type(model).__name__}.")
    _check_replaceable(model)
    replaced: list[Replacement] = []

    def clone(layer):
        if _is_graph_model(layer):
            return _clone_model(layer, clone)
        if isinstance(layer, keras.layers.BatchNormalization):
            new, replacement = _normalization_for(layer, groups)
            replaced.append(replacement)
            return new
        return _copy_layer(layer)

    copy = _clone_model(model, clone)
    _copy_weights(model, copy)
    if verbose:
        print(f"replace_batch_normalization({model.name!r}): {len(replaced)} BatchNormalization "
              f"layer(s) replaced{':' if replaced else '.'}")
        for replacement in replaced:
            print(replacement.describe())
    return copy
