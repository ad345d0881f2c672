"""Resizing a position-embedding grid the way the checkpoint's source does, in `keras.ops`: the one resize of the
loader, which fits a file's table to a model's grid once (`resize_grid`), and of `layers.PositionEmbedding`, which
fits a model's own table to each image's grid at run time (`resize_axis`, sizes that may be scalar tensors).

Three methods, each separable (one 1-D resampling per axis):

- `LINEAR_CORNERS`: the original vit_jax loader (`interpolate_posembed`): `scipy.ndimage.zoom(grid,
  (new_h / h, new_w / w, 1), order=1)`, linear with the corner samples aligned. For `.npz` files.
- `BICUBIC`: `torch.nn.functional.interpolate(..., size=new_hw, mode="bicubic", align_corners=False)`.
  Output index o samples input coordinate (o + 0.5) * in / out - 0.5 with Keys' cubic convolution kernel,
  A = -0.75, on taps floor - 1 .. floor + 2, indices clamped to the border (PyTorch's `upsample_bicubic2d`).
  What the Hugging Face models' `interpolate_pos_encoding` does (transformers 5.24.0,
  src/transformers/models/{vit,deit,clip,siglip,dinov2}/modeling_*.py: all `size=(new_height, new_width),
  mode="bicubic", align_corners=False`, no antialias; DINOv2 interpolates in float32). Older transformers
  releases (and the original DINO code) passed `scale_factor=((h + 0.1) / old_h, ...)` instead of `size`,
  which samples slightly different coordinates; this module follows the current `size=` form.
- `BICUBIC_ANTIALIAS`: the same with `antialias=True` (PyTorch's `_upsample_bicubic2d_aa`, PIL's rule): Keys'
  kernel with A = -0.5 stretched by max(in / out, 1), centered on (o + 0.5) * in / out, the window clipped to
  the input and the weights normalized to sum 1. What timm does (`timm.layers.resample_abs_pos_embed`,
  timm/layers/pos_embed.py, timm 1.0.29.dev0 at aa4b5850 and 1.0.31: `interpolation="bicubic", antialias=True`,
  the defaults `checkpoint_filter_fn` in timm/models/vision_transformer.py passes, in float32; only its FlexiViT
  models pass bilinear without antialias, which a file does not tell apart).

Precision: `resize_axis` computes in float64 for a float64 input, else with float32 weights (a model's run-time
fit). The loader's `resize_grid` computes in float64 where the Keras backend has it (TensorFlow, PyTorch; JAX with
`jax_enable_x64`) and rounds once to the table's dtype: against torch 2.13 `F.interpolate`
(tests/checkpoints/test_resample.py) float64 grids agree to 1e-14, and float32 grids give the exact resize
rounded to float32, while torch's own float32 run is up to ~4e-6 off it on unit-variance grids (its
interpolation weights are computed in float32). On JAX without x64 the loader computes in float32, as timm and
transformers do.
"""

from __future__ import annotations

from typing import Sequence

import keras
import numpy as np
from keras import ops

from keras_vit import variants

METHODS = variants.POSITION_RESAMPLINGS  # `ViTConfig.position_resampling`'s values
LINEAR_CORNERS, BICUBIC, BICUBIC_ANTIALIAS = METHODS


def zoom_axis(x, axis: int, size):
    """`x` resized along `axis` to `size` entries by corner-aligned linear interpolation (`scipy.ndimage.zoom`,
    order 1), in `x`'s dtype. `size` may be a scalar tensor.

    Output index o samples input coordinate o * (n - 1) / (size - 1) (0 when size is 1); the coordinate's
    integer part and fraction are computed in integers, so the only rounding is the fraction's and the blend's.
    """
    length = x.shape[axis]
    scaled = ops.arange(size) * (length - 1)  # o * (n - 1), over the denominator below
    denominator = ops.maximum(size - 1, 1)
    low = scaled // denominator
    high = ops.minimum(low + 1, length - 1)
    fraction = ops.cast(scaled - low * denominator, x.dtype) / ops.cast(denominator, x.dtype)
    fraction = ops.reshape(fraction, [-1 if i == axis else 1 for i in range(len(x.shape))])
    return ops.take(x, low, axis=axis) * (1.0 - fraction) + ops.take(x, high, axis=axis) * fraction


def _keys_kernel(x, a: float):
    """Keys' cubic convolution kernel with parameter `a`, zero beyond |x| = 2."""
    x = ops.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return ops.where(x <= 1, near, ops.where(x < 2, far, ops.zeros_like(x)))


def bicubic_matrix(length: int, size, antialias: bool, dtype: str = "float32"):
    """The (size, length) matrix M of PyTorch's bicubic resize of one axis (`align_corners=False`), `resized = M @
    signal`, computed in `dtype`. `size` may be a scalar tensor.

    Without antialias: Keys' kernel with a = -0.75 on the taps floor(s) - 1 .. floor(s) + 2 around
    s = (o + 0.5) * length / size - 0.5, indices clamped to the border. With antialias (PIL's rule): a = -0.5,
    stretched by max(length / size, 1), centred on (o + 0.5) * length / size, the window clipped to the input,
    each row normalized to sum 1.
    """
    scale = length / ops.cast(size, dtype)
    outputs = ops.cast(ops.arange(size), dtype)
    inputs = ops.cast(ops.arange(length), dtype)
    if not antialias:
        source = (outputs + 0.5) * scale - 0.5
        floor = ops.floor(source)
        matrix = 0.0
        for tap in (-1, 0, 1, 2):
            weights = _keys_kernel(source - (floor + tap), -0.75)
            columns = ops.cast(ops.clip(floor + tap, 0, length - 1), "int32")
            matrix = matrix + ops.one_hot(columns, length, dtype=dtype) * weights[:, None]
        return matrix
    stretch = 1.0 / ops.maximum(scale, 1.0)
    support = 2.0 / stretch
    center = (outputs + 0.5) * scale
    first = ops.maximum(ops.floor(center - support + 0.5), 0.0)  # trunc = floor where it matters (>= 0)
    stop = ops.minimum(ops.floor(center + support + 0.5), float(length))
    weights = _keys_kernel((inputs[None, :] - center[:, None] + 0.5) * stretch, -0.5)
    inside = ops.logical_and(inputs[None, :] >= first[:, None], inputs[None, :] < stop[:, None])
    weights = ops.where(inside, weights, ops.zeros_like(weights))
    return weights / ops.sum(weights, axis=1, keepdims=True)


def resize_axis(x, axis: int, size, method: str):
    """`x` resized along `axis` to `size` with one of `METHODS` (`size` may be a scalar tensor), in `x`'s dtype:
    float64 throughout for a float64 `x`, else with float32 weights."""
    if method == LINEAR_CORNERS:
        return zoom_axis(x, axis, size)
    dtype = "float64" if keras.backend.standardize_dtype(x.dtype) == "float64" else "float32"
    matrix = ops.cast(bicubic_matrix(x.shape[axis], size, method == BICUBIC_ANTIALIAS, dtype), x.dtype)
    moved = ops.moveaxis(x, axis, 0)
    resized = ops.tensordot(matrix, moved, axes=[[1], [0]])
    return ops.moveaxis(resized, 0, axis)


def resize_grid(grid: np.ndarray, new_hw: int | Sequence[int], method: str = LINEAR_CORNERS) -> np.ndarray:
    """Resizes a (rows, columns, D) NumPy grid to `new_hw` with one of `METHODS`, the loader's resize: in float64
    where the Keras backend has it (else float32: JAX without x64), returned in `grid`'s dtype."""
    grid = np.asarray(grid)
    if grid.ndim != 3:
        raise ValueError(f"`grid` must have shape (rows, columns, D). Received shape: {grid.shape}")
    if method not in METHODS:
        raise ValueError(f"Unknown resampling method {method!r}; expected one of {', '.join(METHODS)}.")
    new_h, new_w = (new_hw, new_hw) if isinstance(new_hw, int) else tuple(new_hw)
    values = ops.convert_to_tensor(grid.astype(np.float64))  # float32 where the backend has no float64
    resized = resize_axis(resize_axis(values, 0, new_h, method), 1, new_w, method)
    return ops.convert_to_numpy(resized).astype(grid.dtype)
