"""One converter for every checkpoint format: an `.npz` or `.safetensors` file as a Keras file, checked.

    keras-vit-convert ViT-B_16.npz vit_b16_384.weights.h5 --variant B/16 --image-size 384
    keras-vit-convert vit_tiny.safetensors vit_tiny.keras

The architecture is read from the checkpoint (`keras_vit.checkpoints.architecture`), or taken from
`--variant`; the model is built with the checkpoint loaded by the all-or-nothing loader (position
embeddings resampled to the image size), written, and read back. The command line is
`keras_vit/cli/convert.py`.

It builds models, so it sits above them, outside `keras_vit.checkpoints` (which the models import):
the dependencies run convert -> models -> checkpoints, never back.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import keras
import numpy as np

from keras_vit import geometry, models, variants
from keras_vit.atomic import atomic_write, check_room, variables_bytes
from keras_vit.checkpoints.reader import read_checkpoint


def convert_checkpoint(checkpoint: str, output: str, *, variant: str | None = None, num_heads: int | None = None,
                       image_size: tuple[int, int] | None = None, layer_norm_epsilon: float | None = None,
                       gelu_approximate: bool | None = None,
                       activation: str | None = None) -> tuple[keras.Model, float]:
    """Writes an original `.npz` or a timm / Hugging Face `.safetensors` checkpoint as a Keras file.

    The model returns logits with the checkpoint's head or, if it has none, the pooled features (through
    its `pre_logits` / pooler layer if any). An `.npz` model, and one whose file declares its preprocessing
    (a `preprocessor_config.json` or timm `config.json` beside it), takes pixels in [0, 255]; another
    `.safetensors` one takes its normalized input (no preprocessing layer). It computes with its source's
    numerics.

    validate_output: the written file is read back into a fresh model (`keras.saving.load_model` for
    `.keras`; a new model built from the model's config for `.weights.h5`) and compared with the
    checkpoint-loaded model on two random images. Faithfulness of that model to the source is what the
    loader checks (every key and shape) and what the tests measure against NumPy forward passes. The file is
    written under a hidden name beside `output` and moved into place once read back, so an interrupted or
    failed conversion leaves no partial file and an older `output` whole.

    Args:
        checkpoint: path of the `.npz` (either Flax naming) or `.safetensors` file.
        output: path ending in `.keras` or `.weights.h5`.
        variant: optional variant name: the architecture to build (the checkpoint must fit it). Defaults
            to the architecture read from the checkpoint.
        num_heads: optional number of heads, for a `.safetensors` model not in the variant table (a Hugging
            Face `config.json` beside the file gives it).
        image_size: optional (height, width). Defaults to the size the files declare (the processor's crop or
            fixed size, timm's `input_size`, else the position table's), as `VisionTransformer(weights=...)` builds.
        layer_norm_epsilon, gelu_approximate, activation: the numerics no timm file records (a CLIP: 1e-5 and
            `"quick_gelu"`); as `keras_vit.VisionTransformer`.

    Returns:
        The checkpoint-loaded model, and the max |difference| of the reloaded file's outputs from its
        outputs (0 for a faithful conversion).
    """
    if not output.endswith((".keras", ".weights.h5")):
        raise ValueError(f"The output must end in .keras or .weights.h5. Received: {output!r}")
    file = read_checkpoint(checkpoint)  # once: the model and the loader take this summary
    file.check_image_model("keras-vit-convert")
    found = file.architecture(num_heads=1)  # the head, pooling and input size; the model reads the heads itself
    takes_pixels = file.layout is None or file.preprocessing is not None
    classes = found["classes"]
    model = models.VisionTransformer(  # without image_size, at the size the files declare (as the other commands)
        variant, weights=file, num_heads=num_heads, input_shape=(*image_size, 3) if image_size else None,
        classifier_activation=None,
        include_top=classes is not None, classes=classes or 1000, representation_size=found["representation_size"],
        pooling=None if classes else file.pooling,
        include_preprocessing=takes_pixels, layer_norm_epsilon=layer_norm_epsilon,
        gelu_approximate=gelu_approximate, activation=activation)
    converted = _write_read_back(model, output)
    low, high = (0.0, 255.0) if takes_pixels else (-1.0, 1.0)
    images = np.random.default_rng(0).uniform(low, high, (2, *model.inputs[0].shape[1:3], 3)).astype("float32")
    difference = np.abs(np.asarray(converted(images), np.float64) - np.asarray(model(images), np.float64)).max()
    return model, float(difference)


def load_call(model: keras.Model, weights: str, *, pooling: str | None = None) -> str:
    """The `keras_vit.VisionTransformer(...)` call that builds `model` again and loads `weights`, a `.weights.h5`
    file of it (which holds the weights alone): the fields of its `ViTConfig` (the architecture, and those that
    differ from the defaults: options a checkpoint's files give, such as DINOv3's rotary positions or timm's
    pooling), of its `PreprocessingConfig` that differ from the defaults, its input shape, and its head (or
    `pooling`, for a model without one)."""
    config, preprocessing = model.vit_config, model.preprocessing_config
    arguments = {name: getattr(config, name) for name in variants.ARCHITECTURE}
    arguments.update({field.name: getattr(config, field.name) for field in dataclasses.fields(config)
                      if getattr(config, field.name) != field.default and field.name not in arguments})
    arguments.update({field.name: getattr(preprocessing, field.name) for field in dataclasses.fields(preprocessing)
                      if getattr(preprocessing, field.name) != field.default})
    arguments["input_shape"] = tuple(model.inputs[0].shape[1:])
    model_geometry = geometry.model_geometry(model)
    arguments["include_preprocessing"] = model_geometry.pixel_input
    if model_geometry.head is None:
        arguments.update(include_top=False, pooling=pooling)
    else:
        arguments.update(classes=int(model.outputs[0].shape[-1]), classifier_activation=None)
    arguments["weights"] = weights
    return f"keras_vit.VisionTransformer({', '.join(f'{name}={value!r}' for name, value in arguments.items())})"


def _write_read_back(model: keras.Model, output: str) -> keras.Model:
    """Writes `model` to `output` (atomically, after checking the disk has room: h5py crashes the process on a disk
    that fills while it writes) and reads the file back into a new model."""
    weights = variables_bytes(model.weights, per_variable=4096)  # HDF5's overhead, a few KiB a variable
    check_room({os.path.dirname(os.path.abspath(output)): weights + 2 ** 20}, os.path.basename(output))
    with atomic_write(output) as partial:
        if output.endswith(".keras"):
            model.save(partial)
            return keras.saving.load_model(partial)
        model.save_weights(partial)
        converted = models.ViTModel.from_config(model.get_config())
        converted.load_weights(partial)
        return converted


def convert_npz(checkpoint: str, output: str, *, variant: str | None = None,
                image_size: tuple[int, int] | None = None) -> tuple[keras.Model, float]:
    """`convert_checkpoint` for an original `.npz` file (the 0.2 name, deprecated: 0.4 removes it): (the
    `.npz`-loaded model, max |difference|)."""
    warnings.warn("keras_vit.convert.convert_npz is deprecated: call convert_checkpoint (the same arguments); 0.4 "
                  "removes the old name.", DeprecationWarning, stacklevel=2)
    return convert_checkpoint(checkpoint, output, variant=variant, image_size=image_size)
