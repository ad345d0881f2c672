"""The model a tool is pointed at: a `keras.Model`, a `.keras` file, or a variant to build with its weights
(`keras-vit-export`, `keras-vit-tflite`, `keras-vit-inspect`, ... and `keras_vit.export`)."""

from __future__ import annotations

import os
from typing import Sequence

import keras

from keras_vit import models
from keras_vit.checkpoints import loader as checkpoint_loader


def load_or_build(model_or_path: keras.Model | str | os.PathLike | None = None, *, variant: str | None = None,
                  weights: str | None = None, input_shape: Sequence[int] | None = None,
                  classes: int | None = None) -> keras.Model:
    """The model a tool was pointed at: a `keras.Model`, a `.keras` file, or a variant to build.

    Args:
        model_or_path: a `keras.Model`, or the path of a `.keras` file. Give this or `variant`.
        variant: a variant name ("B/16", "R50+B/16", ...) to build with `weights`.
        weights: the variant's weights: `None` (random), a path or a registered name.
        input_shape: the variant's input shape. Defaults to `(224, 224, 3)`.
        classes: the variant's number of classes. Defaults to the head of `weights` where it
            has one, else `1000`.
    """
    if (model_or_path is None) == (variant is None):
        raise ValueError("Give exactly one of a model (or `.keras` path) or a `variant`. "
                         f"Received: model={model_or_path!r}, variant={variant!r}")
    if isinstance(model_or_path, keras.Model):
        return model_or_path
    if model_or_path is not None:
        path = os.fspath(model_or_path)
        if not path.endswith(".keras") or not os.path.isfile(path):
            raise ValueError(f"Expected an existing `.keras` model file. Received: {path!r}")
        return keras.saving.load_model(path)
    weights = checkpoint_loader.local_file(weights) or weights  # a local file is read once, here
    if classes is None:
        size = tuple(input_shape or (224, 224, 3))[:2]
        source = checkpoint_loader.resolve(weights, variant=variant, image_size=size, include_top=False, classes=1)
        classes = source.head_classes if source is not None and source.head_classes else 1000
    return models.VisionTransformer(variant, weights=weights, input_shape=input_shape, classes=classes)
