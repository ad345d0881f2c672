"""Keras' own projection and norm layers, computed through `keras_vit.kernels` (the CPU kernels that the machine
supports, inside a `ViTModel`'s Keras steps; the portable `keras.ops` elsewhere). Same weights, configs, LoRA
and quantization as Keras' layers: only where they compute differs. The encoder layers
(`keras_vit.layers.encoder`) use them for their projections and norms, so the equations there read as the paper's.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_vit import kernels

_register = keras.saving.register_keras_serializable(package="keras_vit")


@_register
class LayerNorm(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` of the last axis that computes through `keras_vit.kernels`
    (oneDNN's fused kernel inside Keras steps on CPUs where it pays). Same weights (`gamma`,
    `beta`), config and numerics; only `axis=-1` with scale and center."""

    def build(self, input_shape):
        if self.axis not in (-1, [-1], len(input_shape) - 1, [len(input_shape) - 1]) \
                or not (self.scale and self.center):
            raise ValueError("keras_vit LayerNorm normalizes the last axis with scale and center. "
                             f"Received: axis={self.axis}, scale={self.scale}, center={self.center}")
        super().build(input_shape)

    def call(self, x):
        return kernels.layer_norm(x, self.gamma, self.beta, self.epsilon)


@_register
class LayerNormalization(LayerNorm):
    """`LayerNorm` under Keras' class name, for a model's own norms (`norm_pre`, `encoder_norm`, `fc_norm`):
    Keras names a model's layers in weight files by their class, so these keep the entries that Keras'
    LayerNormalization had in files of earlier releases."""


@_register
class Dense(keras.layers.Dense):
    """`keras.layers.Dense` (no activation) computed by `keras_vit.kernels.dense` on (rows, in).

    Same weights, config, LoRA (`enable_lora`) and quantization (`quantize`) as Keras' Dense; a
    quantized layer computes on Keras' own quantized path.
    """

    def call(self, inputs, training=None):
        if len(inputs.shape) == 2:  # no reshape op between the matmul and what follows, so TensorFlow can fuse them
            return kernels.dense(inputs, self.kernel, self.bias)
        rows = ops.reshape(inputs, (-1, inputs.shape[-1]))
        out = kernels.dense(rows, self.kernel, self.bias)
        return ops.reshape(out, (*ops.shape(inputs)[:-1], self.units))

    def quantize(self, mode=None, type_check=True, **kwargs):
        """Keras' quantization (`keras.layers.Dense.quantize`): this subclass adds no weights."""
        super().quantize(mode, type_check=False, **kwargs)


@_register
class HeadProjection(keras.layers.EinsumDense):
    """`keras.layers.EinsumDense` of `keras.layers.MultiHeadAttention`'s projections, (B, T, ...in) ->
    (B, T, ...out), computed by `keras_vit.kernels.dense` on (B * T, in) rows.

    Kernels in the checkpoints' shapes: (D, heads, head_dim) for the query, key and value, (heads,
    head_dim, D) for the output. LoRA and quantization are Keras'; a quantized layer computes on Keras'
    own quantized path.
    """

    def call(self, inputs, training=None):
        in_axes = len(inputs.shape) - 2
        kernel, bias = self.kernel, self.bias
        in_width = math.prod(kernel.shape[:in_axes])
        out_shape = tuple(kernel.shape[in_axes:])
        rows = ops.reshape(inputs, (-1, in_width))
        out = kernels.dense(rows, ops.reshape(kernel, (in_width, -1)), ops.reshape(bias, (-1,)))
        return ops.reshape(out, (ops.shape(inputs)[0], ops.shape(inputs)[1], *out_shape))

    def quantize(self, mode=None, type_check=True, **kwargs):
        """Keras' quantization (`keras.layers.EinsumDense.quantize`): this subclass adds no weights."""
        super().quantize(mode, type_check=False, **kwargs)
