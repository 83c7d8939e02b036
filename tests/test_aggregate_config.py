"""Aggregator configs, serialization and argument checks: backend-independent (no tensors), so
they run on every Keras backend and without TensorFlow (the aggregators' math is in
tests/test_aggregate_backends.py, their TensorFlow graph route in tests/test_aggregate.py)."""

from __future__ import annotations

import json

import keras
import pytest

from pergrad import aggregate


@pytest.mark.parametrize("agg", [aggregate.mean(), aggregate.sum(), aggregate.clip_mean(2.0, True),
                                 aggregate.dp_mean(1.0, 1.1, seed=3, expected_batch_size=64),
                                 aggregate.normalized_mean(0.1), aggregate.median(),
                                 aggregate.trimmed_mean(0.1)], ids=lambda a: a.name)
def test_serialize_round_trip(agg):
    config = json.loads(json.dumps(aggregate.serialize(agg)))
    again = aggregate.deserialize(config)
    assert again.name == agg.name and again.config == agg.config
    assert again.gathers == agg.gathers


def test_custom_serializes_a_registered_function():
    @keras.saving.register_keras_serializable(package="pergrad_tests")
    def first_example(grads, norms):
        return [g[0] for g in grads]

    again = aggregate.deserialize(json.loads(json.dumps(aggregate.serialize(
        aggregate.custom(first_example)))))
    assert again.config["fn"] is first_example


@pytest.mark.parametrize("make, message", [
    (lambda: aggregate.clip_mean(0.0), "l2_norm_clip must be a finite number > 0"),
    (lambda: aggregate.clip_mean(-1), "l2_norm_clip"),
    (lambda: aggregate.dp_mean(0, 1.0), "l2_norm_clip"),
    (lambda: aggregate.dp_mean(1.0, -0.5), "noise_multiplier must be a finite number >= 0"),
    (lambda: aggregate.dp_mean(1.0, float("nan")), "noise_multiplier"),
    (lambda: aggregate.dp_mean(1.0, 1.0, expected_batch_size=0), "expected_batch_size"),
    (lambda: aggregate.trimmed_mean(0.5), r"fraction must be in \[0, 0.5\)"),
    (lambda: aggregate.trimmed_mean(-0.1), "fraction"),
    (lambda: aggregate.normalized_mean(0.0), "gamma"),
    (lambda: aggregate.deserialize({"name": "nope"}), "Unknown aggregator 'nope'"),
])
def test_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_custom_needs_a_callable():
    with pytest.raises(TypeError, match="callable"):
        aggregate.custom(3)
