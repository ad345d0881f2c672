"""Position tables in `keras.ops`: the fixed sine-cosine table, and a learned table's grid resized to another grid
the way its checkpoint's source resizes it (`PositionEmbedding` of a model of any input size).

The NumPy twins, which the loader uses and the tests compare with, are in `keras_vit.checkpoints.resample`
(`zoom_axis`, `torch_bicubic_matrix`).
"""

from __future__ import annotations

import numpy as np
from keras import ops


def sincos_2d_position_embedding(grid_size: tuple[int, int], width: int,
                                 temperature: float = 10_000.0) -> np.ndarray:
    """Fixed 2-D sine-cosine embedding of a grid, (gh * gw, width), as in big_vision."""
    if width % 4:
        raise ValueError(f"sincos_2d position embeddings need a hidden size divisible by 4. Received: {width}")
    y, x = np.mgrid[: grid_size[0], : grid_size[1]]
    quarter = width // 4
    omega = 1.0 / temperature ** (np.arange(quarter) / max(quarter - 1, 1))
    y = np.einsum("m,d->md", y.flatten(), omega)
    x = np.einsum("m,d->md", x.flatten(), omega)
    return np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1).astype("float32")


def zoom_axis(x, axis: int, size):
    """`x` resized along `axis` to `size` entries by corner-aligned linear interpolation: `keras.ops` twin of
    `checkpoints.resample.zoom_axis` (`scipy.ndimage.zoom`, order 1). `size` may be a scalar tensor.

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
    """Keys' cubic convolution kernel with parameter `a`, zero beyond |x| = 2 (`checkpoints.resample`'s twin)."""
    x = ops.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return ops.where(x <= 1, near, ops.where(x < 2, far, ops.zeros_like(x)))


def bicubic_matrix(length: int, size, antialias: bool):
    """The (size, length) float32 matrix of PyTorch's bicubic resize of one axis (`align_corners=False`):
    `keras.ops` twin of `checkpoints.resample.torch_bicubic_matrix`, for a `size` that may be a scalar tensor.

    Without antialias: Keys' kernel with a = -0.75 on the taps floor(s) - 1 .. floor(s) + 2 around
    s = (o + 0.5) * length / size - 0.5, indices clamped to the border. With antialias (PIL's rule): a = -0.5,
    stretched by max(length / size, 1), centred on (o + 0.5) * length / size, the window clipped to the input,
    each row normalized to sum 1.
    """
    size_float = ops.cast(size, "float32")
    scale = length / size_float
    outputs = ops.cast(ops.arange(size), "float32")
    inputs = ops.cast(ops.arange(length), "float32")
    if not antialias:
        source = (outputs + 0.5) * scale - 0.5
        floor = ops.floor(source)
        matrix = 0.0
        for tap in (-1, 0, 1, 2):
            weights = _keys_kernel(source - (floor + tap), -0.75)
            columns = ops.cast(ops.clip(floor + tap, 0, length - 1), "int32")
            matrix = matrix + ops.one_hot(columns, length) * weights[:, None]
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
    """`x` resized along `axis` to `size` with a `POSITION_RESAMPLINGS` method (`size` may be a scalar tensor)."""
    if method == "linear_corners":
        return zoom_axis(x, axis, size)
    matrix = ops.cast(bicubic_matrix(x.shape[axis], size, method == "bicubic_antialias"), x.dtype)
    moved = ops.moveaxis(x, axis, 0)
    resized = ops.tensordot(matrix, moved, axes=[[1], [0]])
    return ops.moveaxis(resized, 0, axis)


def sincos_2d_grid(grid_size, width: int, temperature: float = 10_000.0):
    """`sincos_2d_position_embedding` in `keras.ops` (float32), for a grid whose sides may be scalar tensors."""
    rows, columns = grid_size
    quarter = width // 4
    omega = ops.convert_to_tensor(1.0 / temperature ** (np.arange(quarter) / max(quarter - 1, 1)), "float32")
    y, x = ops.meshgrid(ops.arange(rows, dtype="float32"), ops.arange(columns, dtype="float32"), indexing="ij")
    y, x = ops.reshape(y, (-1, 1)) * omega, ops.reshape(x, (-1, 1)) * omega
    return ops.concatenate([ops.sin(x), ops.cos(x), ops.sin(y), ops.cos(y)], axis=1)
