"""pergrad.plot: the training report and the conflicting-examples grid are written as PNGs."""

from __future__ import annotations

import struct

import keras
import numpy as np
import pytest
from matplotlib.figure import Figure
from test_monitor import SCCE, MeanStep

from pergrad.keras.monitor import GradientMonitor
from pergrad.plot import conflicting_examples, load_history, training_report

TRAINED = pytest.mark.tensorflow_only(reason=(
    "the trained fixture fits test_monitor.MeanStep, a hand-written TensorFlow train_step "
    "(tf.cast and tf.fill on the step's tensors)"))

N, BATCH = 32, 8


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny image classifier trained for a few steps with the monitor (two mislabeled)."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, N)
    images = rng.normal(size=(N, 6, 6, 1)).astype("float32") * 0.3
    images[np.arange(N), labels, labels] += 2.0  # a class-specific bright pixel
    labels[[5, 17]] = (labels[[5, 17]] + 1) % 3
    csv_path = tmp_path_factory.mktemp("report") / "stats.csv"
    monitor = GradientMonitor(csv_path=str(csv_path), num_examples=N)
    inner = keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(2, 3),
                              keras.layers.Flatten(), keras.layers.Dense(3)])
    model = MeanStep(inner, SCCE, monitor)
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    with pytest.warns(UserWarning, match="sample order"):
        model.fit(images, labels, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                  callbacks=[monitor])
    return monitor, csv_path, images, labels


@TRAINED
def test_training_report_from_csv_and_monitor(trained, tmp_path):
    monitor, csv_path, _, _ = trained
    from_csv = load_history(csv_path)
    from_monitor = load_history(monitor)
    assert set(from_csv) == set(from_monitor)
    for key in from_csv:
        np.testing.assert_allclose(from_csv[key], from_monitor[key], rtol=1e-12, err_msg=key)

    png = tmp_path / "report.png"
    figure = training_report(str(csv_path), path=png)
    assert isinstance(figure, Figure) and len(figure.axes) >= 6
    for ax in figure.axes:  # a person can read every panel: a title and both axes labelled
        assert ax.get_title() and ax.get_xlabel() == "step" and ax.get_ylabel(), ax.get_title()
    width, height = _png_size(png)
    assert 1000 <= width <= 2400 and 500 <= height <= 1200
    assert 10_000 < png.stat().st_size < 1_000_000
    assert isinstance(training_report(monitor), Figure)  # no path: nothing written


@TRAINED
def test_conflicting_examples_grid(trained, tmp_path):
    monitor, _, images, labels = trained
    png = tmp_path / "conflicting.png"
    figure = conflicting_examples(monitor, images, labels, k=6, path=png)
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    expected = monitor.most_conflicting(6)
    assert [int(t.split()[0][1:]) for t in titles] == expected.tolist()
    assert f"given {labels[expected[0]]}" in titles[0] and "true" not in titles[0]
    width, height = _png_size(png)
    assert width > 200 and height > 200


@TRAINED
def test_conflicting_examples_marks_the_injected_flips(trained):
    monitor, _, images, labels = trained
    clean = labels.copy()
    clean[[5, 17]] = (labels[[5, 17]] - 1) % 3  # the fixture flipped these two
    figure = conflicting_examples(monitor, images, labels, k=N, true_labels=clean)
    for ax in figure.axes:
        if not ax.get_title():
            continue
        index = int(ax.get_title().split()[0][1:])
        marked = f"true {clean[index]}" in ax.get_title()
        assert marked == (index in (5, 17)), ax.get_title()
        assert ax.get_frame_on() == marked
        if marked:
            assert tuple(ax.spines["top"].get_edgecolor()[:3]) == (1.0, 0.0, 0.0)
    assert figure.get_suptitle().endswith("2 of 32)")


def test_smooth_is_a_moving_average_ignoring_gaps():
    from pergrad.plot.report import smooth
    values = np.array([1.0, 2.0, np.nan, 4.0, 5.0])
    np.testing.assert_allclose(smooth(values, 3), [1.5, 1.5, 3.0, 4.5, 4.5])
    np.testing.assert_allclose(smooth(values, 1)[[0, 1, 3, 4]], [1, 2, 4, 5])


@TRAINED
def test_errors(trained):
    with pytest.raises(TypeError, match="CSV path"):
        training_report(42)
    with pytest.raises(ValueError, match="no rows"):
        training_report(GradientMonitor())
    with pytest.raises(ValueError, match="not seen any example"):
        conflicting_examples(GradientMonitor(), np.zeros((4, 2, 2)), np.zeros(4))
    monitor, _, images, labels = trained
    with pytest.raises(ValueError, match="whole training set"):
        conflicting_examples(monitor, images[:2], labels[:2])
