"""The embedded dataset of keras_vit's tools and examples: scikit-learn's handwritten digits.

1,797 8x8 images that ship inside scikit-learn's wheel (no download). One loader, one scaling:
pixels 0-16 scaled to [0, 255], gray repeated to RGB, so the images are what a keras_vit model
with `include_preprocessing=True` takes once resized (`resize`).
"""

from __future__ import annotations

import re
from typing import Sequence

import keras
import numpy as np

NUM_CLASSES = 10
TEST_FRACTION = 0.2  # The training recipes' split: 1,437 training and 360 test digits.


def digits(split: str = "all", test_fraction: float = TEST_FRACTION, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The digits as `(images, labels)`: float32 (count, 8, 8, 3) pixels in [0, 255], int32 labels.

    Args:
        split: `"all"`, `"train"` or `"test"` (a stratified split, the same for the same
            `test_fraction` and `seed`), or e.g. `"train[:N%]"`: a stratified N% of that split.
        test_fraction: float. Share of each class in `"test"`. Defaults to `0.2` (360 images).
        seed: int. Seed of the splits. Defaults to `0`.
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as error:
        raise ImportError("The digits ship with scikit-learn: `pip install scikit-learn`.") from error
    match = re.fullmatch(r"all|(train|test)(?:\[:(\d+)%\])?", split)
    if not match or (match.group(2) is not None and not 0 < int(match.group(2)) <= 100):
        raise ValueError(f"Unknown digits split {split!r}. Expected 'all', 'train', 'test' or e.g. 'train[:10%]'.")
    data = load_digits()
    images = np.repeat((data.images * (255.0 / 16.0)).astype("float32")[..., None], 3, axis=-1)
    labels = data.target.astype("int32")
    if split == "all":
        return images, labels
    train_x, test_x, train_y, test_y = train_test_split(images, labels, test_size=test_fraction, stratify=labels,
                                                        random_state=seed)
    x, y = (train_x, train_y) if match.group(1) == "train" else (test_x, test_y)
    percent = int(match.group(2) or 100)
    if percent < 100:
        x, _, y, _ = train_test_split(x, y, train_size=percent / 100, stratify=y, random_state=seed)
    return x, y


def resize(images: np.ndarray, size: Sequence[int], channels: int = 3) -> np.ndarray:
    """(count, h, w, 1 or 3) pixels in [0, 255] -> float32 (count, height, width, `channels`):
    bilinear, antialiased when shrinking, clipped to [0, 255]; gray and RGB converted as needed."""
    images = np.asarray(images, dtype="float32")
    if images.shape[-1] != channels:
        images = images.mean(axis=-1, keepdims=True) if channels == 1 else np.repeat(images[..., :1], channels, -1)
    resized = keras.ops.image.resize(images, tuple(size), interpolation="bilinear", antialias=True)
    return np.clip(keras.ops.convert_to_numpy(resized), 0.0, 255.0).astype("float32")
