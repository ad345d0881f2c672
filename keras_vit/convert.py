"""Converts an original `.npz` checkpoint into a Keras `.weights.h5` file (`convert_npz`).

    keras-vit-convert ViT-B_16.npz vit_b16_384.weights.h5 --variant B/16 --image-size 384

Builds the model with the checkpoint loaded (position embeddings resampled to
`--image-size`), saves its weights, reloads them into a fresh model and prints the
largest absolute difference between the two models' logits on a fixed random input
(0 for a faithful conversion). Without `--variant` the architecture is read from the
checkpoint's shapes. Load the result with `weights="path.weights.h5"` and the same
arguments (variant, input size, classes, representation size).

A timm or Hugging Face ViT `.safetensors` file converts to `.weights.h5` or `.keras`
(`keras_vit.torch_checkpoints.convert_safetensors`); the printed difference is then against a
NumPy forward pass of the source model, on [-1, 1] inputs:

    keras-vit-convert vit_tiny.safetensors vit_tiny.keras

The command line is `keras_vit/cli/convert.py`.
"""

from __future__ import annotations

import math
import re

import keras
import numpy as np

from keras_vit import models, variants
from keras_vit import weights as weights_lib


def checkpoint_architecture(arrays: dict[str, np.ndarray]) -> dict:
    """Reads the architecture of a checkpoint from its key names and shapes.

    Returns:
        `VisionTransformer` keyword arguments: patch_size, hidden_dim, mlp_dim, num_heads,
        num_layers, resnet_stages (None for a plain ViT), classifier, representation_size.
    """
    if "embedding/kernel" not in arrays:
        raise ValueError(f"Not a ViT checkpoint: no 'embedding/kernel' among its {len(arrays)} keys.")
    patch, _, _, hidden = arrays["embedding/kernel"].shape
    blocks = {int(m.group(1)) for key in arrays for m in [re.match(r"Transformer/encoderblock_(\d+)/", key)] if m}
    paths = {target[0]: array for key, array in arrays.items() for target in [weights_lib.keras_path(key)] if target}
    mlp_path, query_path = ("encoderblock_0/MlpBlock_3/Dense_0/kernel",
                            "encoderblock_0/MultiHeadDotProductAttention_1/query/kernel")
    if mlp_path not in paths or query_path not in paths:
        raise ValueError(f"Not a ViT checkpoint: no keys for {mlp_path!r} and {query_path!r}.")
    mlp, query = paths[mlp_path], paths[query_path]
    units = [tuple(map(int, m.groups())) for key in arrays for m in [re.match(r"block(\d+)/unit(\d+)/conv1/", key)]
             if m]
    stages = tuple(max(u for s, u in units if s == stage) for stage in sorted({s for s, _ in units}))
    return dict(patch_size=patch, hidden_dim=hidden, mlp_dim=mlp.shape[1], num_heads=query.shape[1],
                num_layers=len(blocks), resnet_stages=stages or None,
                classifier="token" if "cls" in arrays else "gap",
                representation_size=arrays["pre_logits/bias"].shape[0] if "pre_logits/bias" in arrays else None)


def convert_npz(checkpoint: str, output: str, *, variant: str | None = None,
                image_size: tuple[int, int] | None = None) -> tuple[keras.Model, float]:
    """Writes an original `.npz` checkpoint as a Keras `.weights.h5` file, checked.

    The model (the checkpoint's head, or a backbone returning the pooled features if it has
    none) is built with the checkpoint loaded, saved, and read back into a fresh model.

    Args:
        checkpoint: path of the `.npz` file (either Flax naming).
        output: path ending in `.weights.h5`.
        variant: optional variant name. Defaults to the architecture read from the checkpoint.
        image_size: optional (height, width). Defaults to the checkpoint's.

    Returns:
        The model, and the max |difference| of the reloaded model's outputs from its outputs on
        two random images (0 for a faithful conversion).
    """
    if not output.endswith(".weights.h5"):
        raise ValueError(f"The output must end in .weights.h5. Received: {output!r}")
    arrays = weights_lib.read_npz(checkpoint)
    architecture = checkpoint_architecture(arrays)
    if image_size is None:
        tokens = arrays["Transformer/posembed_input/pos_embedding"].shape[1]
        side = math.isqrt(tokens - (architecture["classifier"] == "token"))
        image_size = (side * variants.total_stride(architecture),) * 2
    classes = arrays["head/bias"].shape[0] if "head/bias" in arrays else None
    kwargs = {} if variant else {key: value for key, value in architecture.items()
                                 if key not in ("classifier", "representation_size")}
    build = dict(kwargs, input_shape=(*image_size, 3), classifier=architecture["classifier"],
                 classifier_activation=None, include_top=classes is not None, classes=classes or 1000,
                 representation_size=architecture["representation_size"],
                 pooling=None if classes else ("token" if architecture["classifier"] == "token" else "avg"))
    reference = models.VisionTransformer(variant, weights=checkpoint, **build)
    reference.save_weights(output)
    converted = models.VisionTransformer(variant, weights=output, **build)
    images = np.random.default_rng(0).uniform(0, 255, (2, *image_size, 3)).astype("float32")
    return reference, float(np.abs(np.asarray(converted(images)) - np.asarray(reference(images))).max())
