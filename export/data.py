"""Real images for calibrating and checking TFLite models: a directory, or data shipped in scikit-learn.

Every source returns float32 (count, height, width, 3) arrays of raw pixels in [0, 255] at the
model's size, the input the exported models take.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import tensorflow as tf

from keras_vit import datasets, image_io

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
DATASETS = ("digits", "photos")


def digits(size: tuple[int, int]) -> np.ndarray:
    """The 1,797 embedded handwritten digits (`keras_vit.datasets.digits`) at `size`."""
    return datasets.resize(datasets.digits("all")[0], size)


def photos(size: tuple[int, int], count: int = 300, seed: int = 0) -> np.ndarray:
    """`count` random square crops (a quarter to all of the short side) of sklearn's two sample photos."""
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(seed)
    sources = load_sample_images().images
    crops = []
    for i in range(count):
        photo = sources[i % len(sources)]
        side = int(rng.integers(min(photo.shape[:2]) // 4, min(photo.shape[:2]) + 1))
        top = int(rng.integers(0, photo.shape[0] - side + 1))
        left = int(rng.integers(0, photo.shape[1] - side + 1))
        crops.append(datasets.resize(photo[np.newaxis, top:top + side, left:left + side], size)[0])
    return np.stack(crops)


def directory(path: str | os.PathLike, size: tuple[int, int], transform: dict | None = None) -> np.ndarray:
    """Every image file (jpg, png, bmp, gif) in `path`, sorted by name, decoded as RGB and resized and cropped as
    the serving signature does (`image_io.fit_to_model` with `transform`, the model's resize fields; default a
    bilinear squash); a corrupt or oversized file raises InvalidArgumentError."""
    files = sorted(p for p in Path(path).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"Expected image files ({', '.join(IMAGE_SUFFIXES)}) in {path}. Found none.")
    return np.stack([image_io.fit_to_model(image_io.decode_rgb(tf.constant(p.read_bytes()))[None], size,
                                           **(transform or {}))[0].numpy() for p in files])


def load(source: str | os.PathLike, size: tuple[int, int], transform: dict | None = None) -> np.ndarray:
    """Images from `source`: "digits", "photos", or a directory of image files (fitted with `transform`)."""
    if source == "digits":
        return digits(size)
    if source == "photos":
        return photos(size)
    if os.path.isdir(source):
        return directory(source, size, transform)
    raise ValueError(f"Unknown image source {source!r}. Expected one of {DATASETS} or a directory of images.")
