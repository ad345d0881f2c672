"""Resizing a position-embedding grid the way the checkpoint's source does. Pure NumPy, float64 inside.

Three methods, each separable (one 1-D resampling matrix per axis):

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

Against torch 2.13 `F.interpolate` (tests/test_resample.py): float64 grids agree to 1e-14; float32 grids give the
exact resize rounded to float32, while torch's own float32 run is up to ~4e-6 off it on unit-variance grids (its
interpolation weights are computed in float32).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from keras_vit import variants

METHODS = variants.POSITION_RESAMPLINGS  # `ViTConfig.position_resampling`'s values
LINEAR_CORNERS, BICUBIC, BICUBIC_ANTIALIAS = METHODS


def zoom_axis(array: np.ndarray, axis: int, size: int) -> np.ndarray:
    """Linear resize of one axis with corner-aligned sampling (`scipy.ndimage.zoom`, order 1).

    Output index o samples input coordinate o * (n_in - 1) / (n_out - 1) (0 when n_out is 1).
    """
    length = array.shape[axis]
    step = (length - 1) / (size - 1) if size > 1 else 0.0
    coordinates = np.arange(size) * step
    low = np.clip(np.floor(coordinates).astype(int), 0, length - 1)
    high = np.minimum(low + 1, length - 1)
    shape = [1] * array.ndim
    shape[axis] = size
    fraction = (coordinates - low).reshape(shape)
    return np.take(array, low, axis=axis) * (1.0 - fraction) + np.take(array, high, axis=axis) * fraction


def _keys_kernel(x: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel with parameter `a`, zero beyond |x| = 2."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def torch_bicubic_matrix(in_size: int, out_size: int, antialias: bool = False) -> np.ndarray:
    """The (out_size, in_size) float64 matrix of PyTorch's bicubic resize of one axis (`align_corners=False`).

    Args:
        in_size: int. Input length.
        out_size: int. Output length.
        antialias: bool. `antialias=True` (PIL's rule, A = -0.5, the kernel widened when downsampling) or
            not (A = -0.75, four taps clamped to the border).

    Returns:
        Array M with `resized = M @ signal` along that axis.
    """
    if in_size < 1 or out_size < 1:
        raise ValueError(f"Sizes must be positive. Received in_size={in_size}, out_size={out_size}")
    scale = in_size / out_size
    matrix = np.zeros((out_size, in_size))
    if not antialias:
        source = (np.arange(out_size) + 0.5) * scale - 0.5
        floor = np.floor(source)
        for tap in range(-1, 3):
            weights = _keys_kernel(source - (floor + tap), -0.75)
            columns = np.clip(floor + tap, 0, in_size - 1).astype(int)
            np.add.at(matrix, (np.arange(out_size), columns), weights)
        return matrix
    support = 2.0 * max(scale, 1.0)
    stretch = 1.0 / max(scale, 1.0)
    for row in range(out_size):
        center = (row + 0.5) * scale
        first = max(math.trunc(center - support + 0.5), 0)
        stop = min(math.trunc(center + support + 0.5), in_size)
        weights = _keys_kernel((np.arange(first, stop) - center + 0.5) * stretch, -0.5)
        total = weights.sum()
        matrix[row, first:stop] = weights / total if total != 0 else weights
    return matrix


def resize_grid(grid: np.ndarray, new_hw: int | Sequence[int], method: str = LINEAR_CORNERS) -> np.ndarray:
    """Resizes a (rows, columns, D) grid to `new_hw` with one of `METHODS`; float64 inside, `grid`'s dtype out."""
    grid = np.asarray(grid)
    if grid.ndim != 3:
        raise ValueError(f"`grid` must have shape (rows, columns, D). Received shape: {grid.shape}")
    if method not in METHODS:
        raise ValueError(f"Unknown resampling method {method!r}; expected one of {', '.join(METHODS)}.")
    new_h, new_w = (new_hw, new_hw) if isinstance(new_hw, int) else tuple(new_hw)
    (old_h, old_w, depth), values = grid.shape, grid.astype(np.float64)
    if method == LINEAR_CORNERS:
        resized = zoom_axis(zoom_axis(values, 0, new_h), 1, new_w)
    else:
        antialias = method == BICUBIC_ANTIALIAS
        rows = torch_bicubic_matrix(old_h, new_h, antialias)
        columns = torch_bicubic_matrix(old_w, new_w, antialias)
        resized = columns @ (rows @ values.reshape(old_h, -1)).reshape(new_h, old_w, depth)
    return resized.astype(grid.dtype)
