"""The fixed 2-D sine-cosine position table, in `keras.ops` for grids whose sides may be scalar tensors (a model
of any input size). Learned tables are resized by `keras_vit.checkpoints.resample`, the loader's code."""

from __future__ import annotations

import numpy as np
from keras import ops


def sincos_2d_position_embedding(grid_size, width: int, temperature: float = 10_000.0):
    """Fixed 2-D sine-cosine embedding of a (rows, columns) grid, (rows * columns, width) float32, as in big_vision
    (`posemb_sincos_2d`): [sin(x w), cos(x w), sin(y w), cos(y w)] with w_d = temperature ** -(d / (width / 4 - 1))."""
    if width % 4:
        raise ValueError(f"sincos_2d position embeddings need a hidden size divisible by 4. Received: {width}")
    rows, columns = grid_size
    quarter = width // 4
    omega = ops.convert_to_tensor(1.0 / temperature ** (np.arange(quarter) / max(quarter - 1, 1)), "float32")
    y, x = ops.meshgrid(ops.arange(rows, dtype="float32"), ops.arange(columns, dtype="float32"), indexing="ij")
    y, x = ops.reshape(y, (-1, 1)) * omega, ops.reshape(x, (-1, 1)) * omega
    return ops.concatenate([ops.sin(x), ops.cos(x), ops.sin(y), ops.cos(y)], axis=1)
