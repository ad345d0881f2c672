"""NaFlex ViTs (SigLIP 2's native-aspect form, arXiv:2502.14786): each image keeps its aspect ratio, resized to the
largest grid of at most `max_num_patches` patches, cut into a row-major patch sequence padded to the budget with a
mask; the model resizes its position table to each image's grid and leaves the padding out of attention and
pooling. Follows transformers 4.57.6 (src/transformers/models/siglip2/: `Siglip2ImageProcessor`, the slow one,
which resizes with PIL, and `Siglip2VisionModel`).

- `naflex_image_size`, `resize_bilinear`, `naflex_inputs`: the processor's rule in NumPy, without PIL (PIL's
  fixed-point bilinear resize of uint8 images recomputed, horizontal pass first: Pillow 13 runs some resizes
  vertical pass first, by a rule not identified here, and its values then differ by one level in places).
- `NaFlexViT`: the Keras model (inputs `patches`, `patch_mask`, `spatial_shapes`; outputs `embedding`, the MAP
  head's pooled vector, and `tokens`, the final-norm tokens), from a `ViTConfig` or a transformers folder.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import keras
import numpy as np

from keras_vit import layers as vit_layers
from keras_vit.checkpoints import loader, naflex_file
from keras_vit.kernels.routed_layers import LayerNormalization
from keras_vit.layers.naflex import NaFlexPositionEmbedding
from keras_vit.variants import TRAINING_FIELDS, ViTConfig, pixel_normalization

_PRECISION_BITS = 32 - 8 - 2  # PIL's fixed-point coefficients for 8-bit images (libImaging/Resample.c)


def naflex_image_size(height: int, width: int, patch_size: int, max_num_patches: int,
                      eps: float = 1e-5) -> tuple[int, int]:
    """(height, width) an image is resized to: the largest scale (binary search to `eps`) whose sides, each rounded
    up to a multiple of `patch_size` (at least one patch), give at most `max_num_patches` patches (transformers'
    `get_image_size_for_max_num_patches`)."""

    def scaled(scale: float, size: int) -> int:
        return int(max(patch_size, math.ceil(size * scale / patch_size) * patch_size))

    low, high = eps / 10, 100.0
    while high - low >= eps:
        scale = (low + high) / 2
        if (scaled(scale, height) / patch_size) * (scaled(scale, width) / patch_size) <= max_num_patches:
            low = scale
        else:
            high = scale
    return scaled(low, height), scaled(low, width)


def _pil_bilinear_coefficients(length: int, size: int) -> np.ndarray:
    """(size, length) int64: PIL's bilinear resize of one axis (`precompute_coeffs` and `normalize_coeffs_8bpc`):
    the triangle stretched by max(length / size, 1), centred on (o + 0.5) * length / size, its window clipped to the
    input, normalized, then rounded to 22-bit fixed point."""
    scale = length / size
    support = max(scale, 1.0)
    matrix = np.zeros((size, length), np.float64)
    for o in range(size):
        center = (o + 0.5) * scale
        first, stop = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), length)
        taps = np.arange(first, stop)
        weights = np.maximum(1.0 - np.abs((taps - center + 0.5) / support), 0.0)
        if weights.sum() != 0.0:
            weights = weights / weights.sum()
        matrix[o, first:stop] = weights
    return np.floor(0.5 + matrix * (1 << _PRECISION_BITS)).astype(np.int64)


def resize_bilinear(image: np.ndarray, size: Sequence[int]) -> np.ndarray:
    """A (height, width, channels) uint8 image resized to `size` = (height, width) as PIL's
    `Image.resize(size, Image.BILINEAR)` computes it: a horizontal pass, then a vertical one, each in 22-bit fixed
    point, rounded and clipped to uint8 (libImaging/Resample.c up to Pillow 12's order; where Pillow 13 takes the
    vertical pass first, values differ from its by at most one level)."""
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3:
        raise ValueError(f"`image` must be a (height, width, channels) uint8 array. Received: {image.dtype} "
                         f"{image.shape}")
    height, width = (int(side) for side in size)
    x = image.astype(np.int64)
    half = 1 << (_PRECISION_BITS - 1)
    if width != x.shape[1]:
        x = np.einsum("ow,hwc->hoc", _pil_bilinear_coefficients(x.shape[1], width), x)
        x = np.clip((x + half) >> _PRECISION_BITS, 0, 255)
    if height != x.shape[0]:
        x = np.einsum("oh,hwc->owc", _pil_bilinear_coefficients(x.shape[0], height), x)
        x = np.clip((x + half) >> _PRECISION_BITS, 0, 255)
    return x.astype(np.uint8)


def naflex_inputs(images: Sequence[np.ndarray], patch_size: int, max_num_patches: int) -> dict[str, np.ndarray]:
    """The inputs of a `NaFlexViT` for RGB uint8 (height, width, 3) images, as `Siglip2ImageProcessor` makes them
    (before its rescale and normalization, which the model applies): each image resized (`naflex_image_size`,
    `resize_bilinear`), cut into row-major patches flattened as (row, column, channel), zero-padded to
    `max_num_patches`.

    Returns:
        `patches` (batch, max_num_patches, patch * patch * 3) float32 in [0, 255], `patch_mask` (batch,
        max_num_patches) int32 (1 on the image's patches), `spatial_shapes` (batch, 2) int32 (its grid).
    """
    if isinstance(images, np.ndarray) and images.ndim == 3:
        images = [images]
    patches, masks, shapes = [], [], []
    for image in images:
        image = np.asarray(image)
        if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
            raise ValueError(f"Each image must be an RGB (height, width, 3) uint8 array. Received: {image.dtype} "
                             f"{image.shape}")
        height, width = naflex_image_size(image.shape[0], image.shape[1], patch_size, max_num_patches)
        resized = resize_bilinear(image, (height, width))
        rows, columns = height // patch_size, width // patch_size
        sequence = resized.reshape(rows, patch_size, columns, patch_size, 3).transpose(0, 2, 1, 3, 4)
        sequence = sequence.reshape(rows * columns, -1).astype(np.float32)
        padded = np.zeros((max_num_patches, sequence.shape[1]), np.float32)
        padded[:len(sequence)] = sequence
        patches.append(padded)
        masks.append((np.arange(max_num_patches) < len(sequence)).astype(np.int32))
        shapes.append((rows, columns))
    return dict(patches=np.stack(patches), patch_mask=np.stack(masks),
                spatial_shapes=np.asarray(shapes, np.int32))


_UNSUPPORTED = dict(resnet_stages=None, position_embedding="learned", representation_size=None,
                    num_register_tokens=0, distillation_token=False, norm_pre=False, layer_scale_init=None,
                    fc_norm=False, gated_mlp=False, mlp_norm=False, no_embed_class=False, rope=None)


def _without_training_fields(config: ViTConfig) -> ViTConfig:
    return dataclasses.replace(config, **{name: getattr(ViTConfig, name) for name in TRAINING_FIELDS})


def NaFlexViT(config: ViTConfig | None = None, *, position_grid: int | Sequence[int] = 16,
              weights: str | naflex_file.NaFlexFile | None = None, include_preprocessing: bool = True,
              image_mean: Sequence[float] = (0.5, 0.5, 0.5), image_std: Sequence[float] = (0.5, 0.5, 0.5),
              name: str = "naflex_vit") -> keras.Model:
    """A NaFlex ViT (SigLIP 2 NaFlex): patch sequences of any grid, padded, to the MAP head's pooled embedding.

        x = patches E + b                             (batch, N, D): a Dense over each patch's pixels
        x = x + resize(T, h_b, w_b)                   `NaFlexPositionEmbedding`, per image
        x = Block_L(...Block_1(x, mask))              padded keys left out of every attention
        tokens = LN(x); embedding = MAPHead(tokens, mask)

    Args:
        config: `ViTConfig` of the encoder (`classifier="map"`; the options of SigLIP only). Defaults to the file's
            with `weights`; with `weights`, it may differ from the file's in its training fields only (dropouts,
            drop path, remat: `variants.TRAINING_FIELDS`), as a fine-tuning run sets them.
        position_grid: int or (rows, columns), the learned table's grid (`num_patches` = 256: 16). The file's with
            `weights`.
        weights: optional transformers `Siglip2VisionModel` folder (or its model.safetensors, or an `hf://` name,
            or the `NaFlexFile` read from it): config, table and normalization from its files.
        include_preprocessing: bool. The model takes patches of [0, 255] pixels and normalizes them
            ((x / 255 - image_mean) / image_std, the file's processor's); False: normalized patches (transformers'
            `pixel_values`). Defaults to `True`.
        image_mean, image_std: the normalization without `weights`. Default to SigLIP's 0.5, 0.5.
        name: str. The model's name.

    Inputs: `patches` (batch, N, patch * patch * 3) float, `patch_mask` (batch, N) int (1: a patch, 0: padding),
    `spatial_shapes` (batch, 2) int, each image's (rows, columns) grid; N any budget (`naflex_inputs` makes them).
    Outputs: a dict, `embedding` (batch, D) and `tokens` (batch, N, D) (the rows of padding are not meaningful).

    Raises:
        ValueError: a config with options NaFlex models do not have, or a file keras_vit cannot read.
    """
    file = weights if isinstance(weights, naflex_file.NaFlexFile) or weights is None else (
        naflex_file.read_naflex_checkpoint(weights))
    if file is not None:
        file_config = ViTConfig(**file.config)
        if config is not None and _without_training_fields(config) != _without_training_fields(file_config):
            raise ValueError(f"`config` differs from that of {file.path!r} beyond its training fields "
                             f"({', '.join(TRAINING_FIELDS)}): pass one or the other.")
        config, position_grid = config or file_config, file.position_grid
        image_mean = file.preprocessing.get("image_mean", image_mean)
        image_std = file.preprocessing.get("image_std", image_std)
    if config is None:
        raise ValueError("NaFlexViT needs a `config` (keras_vit.variants.ViTConfig) or `weights`.")
    wrong = [f"{key}={getattr(config, key)!r}" for key, value in _UNSUPPORTED.items() if getattr(config, key) != value]
    if config.classifier != "map":
        wrong.append(f"classifier={config.classifier!r}")
    if wrong:
        raise ValueError(f"A NaFlex ViT has no {', '.join(wrong)}: it is SigLIP's encoder (classifier='map', a "
                         "learned table, no prefix tokens).")
    width = config.patch_size * config.patch_size * 3
    patches = keras.Input((None, width), name="patches")
    mask = keras.Input((None,), dtype="int32", name="patch_mask")
    shapes = keras.Input((2,), dtype="int32", name="spatial_shapes")
    x = patches
    if include_preprocessing:
        scale, offset = (np.resize(np.asarray(values, np.float64), width).tolist()
                         for values in pixel_normalization(image_mean, image_std))  # per (row, column, channel)
        x = keras.layers.Rescaling(scale, offset=offset, name="preprocessing")(x)
    x = vit_layers.Dense(config.hidden_dim, name="embedding")(x)
    x = NaFlexPositionEmbedding(position_grid, name="posembed_input")(x, shapes)
    block_arguments = config.arguments_of(vit_layers.TransformerBlock)
    for i in range(config.num_layers):
        rate = config.drop_path_rate * i / max(config.num_layers - 1, 1)
        x = vit_layers.TransformerBlock(**dict(block_arguments, drop_path_rate=rate), name=f"encoderblock_{i}")(
            x, attention_mask=mask)
    tokens = LayerNormalization(epsilon=config.layer_norm_epsilon, name="encoder_norm")(x)
    embedding = vit_layers.MAPHead(**config.arguments_of(vit_layers.MAPHead), name="MAPHead_0")(tokens, token_mask=mask)
    model = keras.Model({"patches": patches, "patch_mask": mask, "spatial_shapes": shapes},
                        {"embedding": embedding, "tokens": tokens}, name=name)
    if file is not None:
        translation = naflex_file.naflex_arrays(file)
        assignments = loader.plan_assignments(model, translation.arrays, origin=file.path,
                                              source_keys=translation.source_keys, problems=translation.problems)
        for variable, value in assignments:
            variable.assign(value)
    return model


def from_checkpoint(weights: naflex_file.NaFlexFile, *, given: dict, pooling: str | None,
                    include_preprocessing: bool, name: str) -> keras.Model:
    """`keras_vit.VisionTransformer(weights=<SigLIP 2 NaFlex folder>)`: the file's `NaFlexViT` (headless: its
    pooled embedding and tokens). Arguments of image models (`given`, where not None) are refused by name."""
    refused = [f"{key}={value!r}" for key, value in given.items() if value is not None]
    if pooling not in (None, "map"):
        refused.append(f"pooling={pooling!r}")
    if refused:
        raise ValueError(f"{weights.path!r} is a SigLIP 2 NaFlex checkpoint: its model takes patch sequences of each "
                         f"image's own grid (keras_vit.naflex.NaFlexViT, inputs from keras_vit.naflex.naflex_inputs) "
                         f"and pools with its MAP head; {', '.join(refused)} does not apply to it.")
    return NaFlexViT(weights=weights, include_preprocessing=include_preprocessing,
                     name="naflex_vit" if name == "vision_transformer" else name)
