"""The layers of NaFlex ViTs (SigLIP 2's native-aspect form, arXiv:2502.14786): each image is a sequence of
patches at its own (rows, columns) grid, padded to a budget, and the learned position table is resized to each
image's grid, as transformers' `Siglip2VisionEmbeddings.resize_positional_embeddings` computes it
(`F.interpolate(mode="bilinear", align_corners=False, antialias=True)` in float32; transformers 4.57.6,
src/transformers/models/siglip2/modeling_siglip2.py). The padding is left out of the attention and of the
pooling by the blocks' `attention_mask` and `MAPHead`'s `token_mask` (`keras_vit.layers.encoder`)."""

from __future__ import annotations

from typing import Sequence

import keras
from keras import ops

from keras_vit.layers.tokens import to_pair

_register = keras.saving.register_keras_serializable(package="keras_vit")


def antialiased_bilinear_weights(outputs, sizes, length: int):
    """The rows of PyTorch's antialiased bilinear resize of one axis (`align_corners=False`, `antialias=True`,
    PIL's rule) of `length` entries to `sizes` entries, for output indices `outputs`: (..., length) float32,
    `resized[o] = weights[o] @ signal`. `outputs` and `sizes` are integer tensors of one shape (each output
    index with the size of its own image's axis).

    With scale = length / size and support = max(scale, 1) (the triangle stretched when shrinking):
    w_j = max(0, 1 - |j + 0.5 - c| / support) around c = (o + 0.5) * scale, on the window
    int(c - support + 0.5) <= j < int(c + support + 0.5) clipped to [0, length), normalized to sum 1.
    """
    outputs = ops.cast(outputs, "float32")[..., None]
    scale = float(length) / ops.cast(sizes, "float32")[..., None]
    support = ops.maximum(scale, 1.0)
    center = (outputs + 0.5) * scale
    first = ops.maximum(ops.floor(center - support + 0.5), 0.0)  # trunc = floor where it matters (>= 0)
    stop = ops.minimum(ops.floor(center + support + 0.5), float(length))
    inputs = ops.cast(ops.arange(length), "float32")
    weights = ops.maximum(1.0 - ops.abs((inputs - center + 0.5) / support), 0.0)
    weights = ops.where(ops.logical_and(inputs >= first, inputs < stop), weights, ops.zeros_like(weights))
    return weights / ops.sum(weights, axis=-1, keepdims=True)


@_register
class NaFlexPositionEmbedding(keras.layers.Layer):
    """Adds a learned (rows x columns) position table, resized to each image's own patch grid:

        E_b = A_h(b) T A_w(b)^T         T: (rows, columns, D); A_h(b): (h_b, rows), A_w(b): (w_b, columns), the
                                        antialiased bilinear matrices (`antialiased_bilinear_weights`)
        out[b, n] = x[b, n] + E_b[n // w_b, n % w_b]     n < h_b w_b; padding tokens take E_b[0, 0]
                                                         (transformers' fill)

    computed per token (its row's and its column's weights), so one batch holds images of any grids.

    Args:
        grid_size: int or (rows, columns). The table's grid (SigLIP 2: `num_patches` = 16 x 16).

    Call arguments:
        x: (batch, tokens, D), the patch tokens in row-major order, padded.
        spatial_shapes: (batch, 2) int, each image's (h, w) patch grid.

    The weight `pos_embedding`, (1, rows * columns, D), is the table in row-major order (the checkpoints' shape).
    """

    def __init__(self, grid_size: int | Sequence[int], **kwargs):
        super().__init__(**kwargs)
        self.grid_size = to_pair(grid_size, "grid_size")
        self.num_prefix_tokens = 0  # the loader's view of a position table

    def build(self, x_shape, spatial_shapes_shape=None):
        rows, columns = self.grid_size
        self.pos_embedding = self.add_weight(name="pos_embedding", shape=(1, rows * columns, x_shape[-1]),
                                             initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x, spatial_shapes):
        rows, columns = self.grid_size
        shapes = ops.cast(spatial_shapes, "int32")
        height, width = shapes[:, :1], shapes[:, 1:]  # (batch, 1)
        token = ops.arange(ops.shape(x)[1], dtype="int32")[None, :]  # (1, tokens)
        valid = token < height * width
        row = ops.where(valid, token // width, 0)  # (batch, tokens)
        column = ops.where(valid, token % width, 0)
        row_weights = antialiased_bilinear_weights(row, ops.broadcast_to(height, ops.shape(row)), rows)
        column_weights = antialiased_bilinear_weights(column, ops.broadcast_to(width, ops.shape(column)), columns)
        table = ops.reshape(ops.cast(self.pos_embedding, "float32"), (rows, columns * x.shape[-1]))
        by_row = ops.reshape(ops.matmul(row_weights, table), (ops.shape(x)[0], ops.shape(x)[1], columns, x.shape[-1]))
        embedding = ops.sum(by_row * column_weights[..., None], axis=2)  # (batch, tokens, D)
        return x + ops.cast(embedding, x.dtype)

    def compute_output_shape(self, x_shape, spatial_shapes_shape=None):
        return x_shape

    def get_config(self):
        config = super().get_config()
        config.update({"grid_size": list(self.grid_size)})
        return config
