"""The demo behind ``pergrad analyze``: scikit-learn's bundled digits (no download), a small CNN,
label noise, and how well gradient conflict finds the flipped labels."""

from pergrad.demo.detection import detection_scores
from pergrad.demo.digits import digits_cnn, load_digits_images, load_digits_split
from pergrad.demo.label_noise import flip_classes, flip_labels
from pergrad.demo.progress import EpochTable

__all__ = ["EpochTable", "detection_scores", "digits_cnn", "flip_classes", "flip_labels",
           "load_digits_images", "load_digits_split"]
