"""ImageNet-1k helpers: input scaling and decoding of predictions, as in `keras.applications`.

The class index (`data/imagenet_class_index.json`, Keras' format: index -> [WordNet id,
name]) lists the 1000 ILSVRC-2012 synsets in sorted WordNet-id order (the order of the
label ids of TFDS `imagenet2012` and of the fine-tuned checkpoints' heads), each named by
its first WordNet lemma.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
from keras import ops

CLASS_INDEX_PATH = os.path.join(os.path.dirname(__file__), "data", "imagenet_class_index.json")


def preprocess_input(x, config=None):
    """Maps pixels from [0, 255] to the input of a model built with `include_preprocessing=False`: `x / 127.5 - 1`
    ([-1, 1], the original weights' range), or with `config` (a model's `preprocessing_config`) its checkpoint's
    normalization, `(x / 255 - config.image_mean) / config.image_std` (e.g. CLIP's or DINOv2's statistics).

    Models built with the default `include_preprocessing=True` do this themselves and take raw [0, 255] pixels.

    Args:
        x: array or tensor of pixels in [0, 255], channels last.
        config: optional `keras_vit.PreprocessingConfig` (`model.preprocessing_config`). Defaults to `None`:
            mean = std = 0.5.

    Returns:
        A float32 tensor of the same shape.
    """
    if config is None:
        return ops.cast(x, "float32") / 127.5 - 1.0
    if not hasattr(config, "pixel_normalization"):
        raise TypeError(f"preprocess_input takes a model's `preprocessing_config` (a keras_vit.PreprocessingConfig, "
                        f"which holds image_mean and image_std). Received: {type(config).__name__}; since 0.3 the "
                        "mean and std are no longer fields of `vit_config`.")
    scale, offset = config.pixel_normalization()
    return ops.cast(x, "float32") * ops.convert_to_tensor(scale, "float32") + ops.convert_to_tensor(offset, "float32")


@functools.cache
def _class_index() -> dict[int, tuple[str, str]]:
    with open(CLASS_INDEX_PATH, encoding="utf-8") as file:
        return {int(index): tuple(entry) for index, entry in json.load(file).items()}


def decode_predictions(preds, top: int = 5) -> list[list[tuple[str, str, float]]]:
    """Decodes ImageNet-1k predictions into (WordNet id, class name, score) tuples.

    Args:
        preds: array (batch, 1000) of scores or probabilities.
        top: int. How many of the highest-scoring classes to return per example. Defaults to `5`.

    Returns:
        One list per example of `top` tuples `(wnid, name, score)`, highest score first.
    """
    preds = np.asarray(ops.convert_to_numpy(preds))
    if preds.ndim != 2 or preds.shape[1] != 1000:
        raise ValueError(f"`decode_predictions` expects a batch of ImageNet-1k predictions, shape (samples, 1000). "
                         f"Received shape: {preds.shape}")
    index = _class_index()
    results = []
    for row in preds:
        best = np.argsort(row)[::-1][:top]
        results.append([(*index[int(i)], float(row[i])) for i in best])
    return results
