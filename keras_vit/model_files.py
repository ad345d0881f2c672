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
                  classes: int | None = None, pooling: str | None = None) -> keras.Model:
    """The model a tool was pointed at: a `keras.Model`, a `.keras` file, or a variant or weights file to build.

    Args:
        model_or_path: a `keras.Model`, or the path of a `.keras` file. Give this, a `variant`, or `weights` a file.
        variant: a variant name ("B/16", "R50+B/16", ...) to build with `weights`.
        weights: `None` (random), a registered name (with `variant`), or a weights file, `save_pretrained`
            directory or `hf://` name, whose architecture is read from it when `variant` is not given.
        input_shape: the input shape. Defaults to the size the weights' files declare (`VisionTransformer`), else
            `(224, 224, 3)`.
        classes: the number of classes. Defaults to the head of `weights` where it has one, else `1000`.
        pooling: build without the head, returning this pooling (`"token"`, `"avg"`, `"map"`). Defaults to
            `None`: with the head, except for weights without one, which pool as their model does.
    """
    if model_or_path is not None and (variant is not None or weights is not None):
        raise ValueError("Give a model (or `.keras` path), or a `variant` / `weights` to build, not both. "
                         f"Received: model={model_or_path!r}, variant={variant!r}, weights={weights!r}")
    if isinstance(model_or_path, keras.Model):
        return model_or_path
    if model_or_path is not None:
        path = os.fspath(model_or_path)
        if not path.endswith(".keras") or not os.path.isfile(path):
            raise ValueError(f"Expected an existing `.keras` model file. Received: {path!r}")
        return keras.saving.load_model(path)
    file = checkpoint_loader.local_file(weights)  # a local file is read once, here
    if variant is None and file is None:
        raise ValueError("Give a model (or `.keras` path), a `variant`, or weights= a local weights file, directory "
                         f"or hf:// name whose architecture keras_vit reads. Received: weights={weights!r}")
    if file is not None:
        file.check_image_model("the command-line tools (keras-vit-tflite, keras-vit-inspect, ...; keras-vit-export "
                               "serves it as a SavedModel)")
    weights = file or weights
    if pooling is None and classes is None and file is not None and file.layout is not None \
            and file.head_classes is None:  # a headless tower (DINOv2, CLIP without projection): its pooling
        pooling = file.pooling
    if classes is None and pooling is None:
        size = tuple(input_shape or (224, 224, 3))[:2]
        source = checkpoint_loader.resolve(weights, variant=variant, image_size=size, include_top=False, classes=1)
        classes = source.head_classes if source is not None and source.head_classes else 1000
    return models.VisionTransformer(variant, weights=weights, input_shape=input_shape, classes=classes or 1000,
                                    include_top=pooling is None, pooling=pooling)
