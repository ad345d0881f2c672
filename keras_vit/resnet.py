"""ResNet stem of the hybrid ViT models (R50+ViT-B/16, R26+ViT-S/32, R50+ViT-L/32).

Port of `vit_jax/models_resnet.py`: a BiT-style ResNet (v1.5 bottleneck units, no
pre-activation) with weight-standardized convolutions and GroupNorm(32). Layers carry
the checkpoint names: `conv_root`, `gn_root`, `block{s}_unit{u}` (checkpoint
`block{s}/unit{u}`) with `conv1..3`, `gn1..3`, `conv_proj`, `gn_proj`.
"""

from __future__ import annotations

from typing import Sequence

import keras
from keras import ops

from keras_vit.kernels import scope

STD_CONV_EPSILON = 1e-5
GROUP_NORM_EPSILON = 1e-6  # Flax nn.GroupNorm default.
GROUP_NORM_GROUPS = 32

_register = keras.saving.register_keras_serializable(package="keras_vit")


def standardize_kernel(kernel, epsilon: float = STD_CONV_EPSILON):
    """(kernel - mean) / (std + eps) over (height, width, in_channels), population std."""
    mean = ops.mean(kernel, axis=(0, 1, 2), keepdims=True)
    centered = kernel - mean
    std = ops.sqrt(ops.mean(ops.square(centered), axis=(0, 1, 2), keepdims=True))
    return centered / (std + epsilon)


@_register
class StdConv2D(keras.layers.Conv2D):
    """Conv2D whose stored kernel is standardized at every call (Qiao et al. 2019).

    Takes the arguments of `keras.layers.Conv2D`; the standardization is done in
    float32 on the stored (float32) kernel, like the original.
    """

    def convolution_op(self, inputs, kernel):
        kernel = ops.cast(standardize_kernel(ops.cast(self.kernel, "float32")), inputs.dtype)
        return super().convolution_op(inputs, kernel)


@_register
class GroupNormalization(keras.layers.GroupNormalization):
    """Keras' `GroupNormalization`, traced for LiteRT's GPU delegate (`keras_vit.kernels.scope.for_gpu_delegate`)
    with tensors of rank 4: Keras' layer groups the channels as (batch, height, width, groups, channels / group),
    a rank-5 tensor the delegate refuses (LiteRT issue 2540). Inside that scope, the same maths over
    (batch, height * width, groups, channels / group):

        y = (x - mean) / sqrt(var + eps) * gamma + beta,  mean and var over (positions, channels of the group)
    """

    def call(self, inputs):
        if not (scope.gpu_delegate() and len(inputs.shape) == 4 and None not in inputs.shape[1:3]
                and self.axis in (-1, 3) and self.scale and self.center):
            return super().call(inputs)
        height, width, channels = inputs.shape[1:]
        grouped = (-1, height * width, self.groups, channels // self.groups)
        x = ops.reshape(ops.cast(inputs, "float32"), grouped)
        mean, variance = ops.moments(x, axes=(1, 3), keepdims=True)
        scale = ops.rsqrt(variance + self.epsilon) * ops.reshape(ops.cast(self.gamma, "float32"), (1, 1, *grouped[2:]))
        y = (x - mean) * scale + ops.reshape(ops.cast(self.beta, "float32"), (1, 1, *grouped[2:]))
        return ops.cast(ops.reshape(y, ops.shape(inputs)), self.compute_dtype)


def _group_norm(name: str, dtype, gamma_initializer="ones") -> GroupNormalization:
    return GroupNormalization(groups=GROUP_NORM_GROUPS, epsilon=GROUP_NORM_EPSILON,
                              gamma_initializer=gamma_initializer, name=name, dtype=dtype)


def _std_conv(filters: int, kernel_size: int, strides: int, name: str, dtype) -> StdConv2D:
    return StdConv2D(filters, kernel_size, strides=strides, padding="same", use_bias=False,
                     kernel_initializer="lecun_normal", name=name, dtype=dtype)


@_register
class BottleneckUnit(keras.layers.Layer):
    """ResNet v1.5 bottleneck with StdConv and GroupNorm (`ResidualUnit` of vit_jax).

        y = relu(gn1(conv1 1x1 x)); y = relu(gn2(conv2 3x3/stride y)); y = gn3(conv3 1x1 y)
        out = relu(shortcut(x) + y), shortcut = gn_proj(conv_proj 1x1/stride x) when the
        shape changes, else x.

    Args:
        filters: int. Bottleneck width; the output has 4 * filters channels.
        strides: int. Stride of conv2 and of the projection. Defaults to `1`.
    """

    def __init__(self, filters: int, strides: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters
        self.strides = strides

    def build(self, input_shape):
        out_channels = 4 * self.filters
        policy = self.dtype_policy
        self.needs_projection = input_shape[-1] != out_channels or self.strides != 1
        self.conv1 = _std_conv(self.filters, 1, 1, "conv1", policy)
        self.gn1 = _group_norm("gn1", policy)
        self.conv2 = _std_conv(self.filters, 3, self.strides, "conv2", policy)
        self.gn2 = _group_norm("gn2", policy)
        self.conv3 = _std_conv(out_channels, 1, 1, "conv3", policy)
        self.gn3 = _group_norm("gn3", policy, gamma_initializer="zeros")
        inner = (*input_shape[:-1], self.filters)
        strided = (*self.compute_output_shape(input_shape)[:-1], self.filters)
        self.conv1.build(input_shape)
        self.gn1.build(inner)
        self.conv2.build(inner)
        self.gn2.build(strided)
        self.conv3.build(strided)
        self.gn3.build((*strided[:-1], out_channels))
        if self.needs_projection:
            self.conv_proj = _std_conv(out_channels, 1, self.strides, "conv_proj", policy)
            self.gn_proj = _group_norm("gn_proj", policy)
            self.conv_proj.build(input_shape)
            self.gn_proj.build((*strided[:-1], out_channels))

    def call(self, x):
        shortcut = self.gn_proj(self.conv_proj(x)) if self.needs_projection else x
        y = ops.relu(self.gn1(self.conv1(x)))
        y = ops.relu(self.gn2(self.conv2(y)))
        y = self.gn3(self.conv3(y))
        return ops.relu(shortcut + y)

    def compute_output_shape(self, input_shape):
        def same_padding_size(size):
            return None if size is None else -(-size // self.strides)

        height, width = input_shape[1], input_shape[2]
        return (input_shape[0], same_padding_size(height), same_padding_size(width), 4 * self.filters)

    def get_config(self):
        config = super().get_config()
        config.update({"filters": self.filters, "strides": self.strides})
        return config


ROOT_WIDTH = 64  # channels of the stem's root convolution (BiT's ResNet-50), as many as its first stage's


def resnet_stem(x, stage_sizes: Sequence[int], width: int = ROOT_WIDTH, dtype=None):
    """Applies the hybrid's ResNet stem to `x`; total stride 2 ** (1 + len(stage_sizes)).

    Root: StdConv 7x7/2 `conv_root` -> `gn_root` -> ReLU -> MaxPool 3x3/2 SAME; then stage
    s (1-based) has `stage_sizes[s-1]` units of width `width * 2**(s-1)`, stride 2 on the
    first unit of every stage after the first.
    """
    x = _std_conv(width, 7, 2, "conv_root", dtype)(x)
    x = _group_norm("gn_root", dtype)(x)
    x = keras.layers.ReLU(name="root_relu", dtype=dtype)(x)
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same", name="root_pool", dtype=dtype)(x)
    for stage, num_units in enumerate(stage_sizes, start=1):
        for unit in range(1, num_units + 1):
            strides = 2 if stage > 1 and unit == 1 else 1
            x = BottleneckUnit(width * 2 ** (stage - 1), strides, name=f"block{stage}_unit{unit}", dtype=dtype)(x)
    return x
