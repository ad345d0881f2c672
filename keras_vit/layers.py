"""Vision Transformer layers (Dosovitskiy et al., ICLR 2021, arXiv:2010.11929).

Ported from the original implementation, google-research/vision_transformer
(`vit_jax/models_vit.py`). Sublayers and weights are named after the modules of the
released checkpoints (`embedding`, `cls`, `pos_embedding`, `LayerNorm_0`,
`MultiHeadDotProductAttention_1`, `LayerNorm_2`, `MlpBlock_3/Dense_0`, ...), so that a
checkpoint maps onto a model by a table of names.

Numerics follow the original by default: LayerNorm epsilon 1e-6, tanh-approximate GELU (Flax
`nn.gelu`), attention scaled by 1/sqrt(head_dim), pre-norm residual blocks. The epsilon and the
GELU are options (`layer_norm_epsilon`, `gelu_approximate`) for checkpoints of PyTorch models
(timm, Hugging Face), which use the exact erf GELU.
"""

from __future__ import annotations

import math
from typing import Sequence

import keras
import numpy as np
from keras import ops

from keras_vit import kernels

LAYER_NORM_EPSILON = 1e-6
POSITION_EMBEDDINGS = ("learned", "learned_2d", "sincos_2d", "none")
POOLINGS = ("token", "avg")
ACTIVATIONS = ("gelu", "quick_gelu")

_register = keras.saving.register_keras_serializable(package="keras_vit")


def _pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    """Returns `value` as an (height, width) pair of positive ints."""
    pair = (value, value) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, (int, np.integer)) and v > 0 for v in pair):
        raise ValueError(f"`{name}` must be a positive int or a pair of them. Received: {name}={value!r}")
    return int(pair[0]), int(pair[1])


def patch_grid(images, patch_size: tuple[int, int], unit: str = "patch size"):
    """(rows, columns) of the patch grid of (B, H, W, ...) `images`: ints where H and W are static, else (a
    TensorFlow graph of any image size) scalar tensors. H and W must be multiples of the patch size
    (`kernels.exact_quotient`: a ValueError, or an InvalidArgumentError at run time); `unit` names it in the message.
    """
    return tuple(kernels.exact_quotient(
        images.shape[axis] if images.shape[axis] is not None else ops.shape(images)[axis], patch,
        f"Image {side} {{}} is not divisible by the {unit} {patch}. Expected a multiple of {patch}.")
        for axis, side, patch in ((1, "height", patch_size[0]), (2, "width", patch_size[1])))


def extract_patches(images, patch_size: tuple[int, int]):
    """(B, H, W, C) -> (B, H/ph * W/pw, ph * pw * C), patches in row-major order.

    Each patch is flattened in (row, column, channel) order: the order of a Conv2D
    kernel of shape (ph, pw, C, D) reshaped to (ph * pw * C, D).
    """
    (ph, pw), channels = patch_size, images.shape[-1]
    gh, gw = patch_grid(images, patch_size)
    x = ops.reshape(images, (-1, gh, ph, gw, pw, channels))
    x = ops.transpose(x, (0, 1, 3, 2, 4, 5))
    return ops.reshape(x, (-1, gh * gw, ph * pw * channels))


def _check_divisible(shape, patch_size: tuple[int, int], layer_name: str) -> tuple[int | None, int | None]:
    """Returns the patch grid of a (B, H, W, C) shape (None for a side of any size), or raises a ValueError."""
    if len(shape) != 4:
        raise ValueError(f"{layer_name} expects images of shape (batch, height, width, channels). "
                         f"Received shape: {tuple(shape)}")
    for size, patch, axis in ((shape[1], patch_size[0], "height"), (shape[2], patch_size[1], "width")):
        if size is not None and size % patch:
            raise ValueError(f"Image {axis} {size} is not divisible by the patch size {patch}. "
                             f"Expected a multiple of {patch}.")
    return tuple(None if size is None else size // patch for size, patch in zip(shape[1:3], patch_size))


@_register
class Patches(keras.layers.Layer):
    """Splits images into flattened, non-overlapping patches.

    Args:
        patch_size: int or (int, int). Patch height and width.

    Call arguments:
        images: (batch, height, width, channels); height and width divisible by the patch size.

    Returns:
        (batch, num_patches, patch_height * patch_width * channels), patches in row-major
        order, each flattened in (row, column, channel) order.
    """

    def __init__(self, patch_size: int | Sequence[int], **kwargs):
        super().__init__(**kwargs)
        self.patch_size = _pair(patch_size, "patch_size")

    def build(self, input_shape):
        _check_divisible(input_shape, self.patch_size, "Patches")

    def call(self, images):
        return extract_patches(images, self.patch_size)

    def compute_output_shape(self, input_shape):
        gh, gw = _check_divisible(input_shape, self.patch_size, "Patches")
        ph, pw = self.patch_size
        return (input_shape[0], None if gh is None or gw is None else gh * gw, ph * pw * input_shape[3])

    def get_config(self):
        config = super().get_config()
        config.update({"patch_size": self.patch_size})
        return config


@_register
class PatchEncoder(keras.layers.Layer):
    """Linear projection of image patches to `hidden_dim`-dimensional tokens.

    The same map as the original's patch-embedding convolution (kernel = stride = patch
    size, VALID padding, with bias); the kernel is stored in that Conv2D layout,
    (patch_h, patch_w, channels, hidden_dim), as the checkpoints store it. With patch
    size 1 it projects each position of a feature map (hybrid models).

    Args:
        hidden_dim: int. Token width D.
        patch_size: int or (int, int). Patch height and width.
        kernel_initializer: initializer of the kernel. Defaults to `"lecun_normal"` (Flax's default).
        bias_initializer: initializer of the bias. Defaults to `"zeros"`.
        use_bias: bool. Add the bias (`False`: CLIP's projection, which has none). Defaults to `True`.

    Call arguments:
        images: (batch, height, width, channels); height and width multiples of the patch size, static or
            known only at run time.

    Returns:
        (batch, num_patches, hidden_dim).
    """

    def __init__(self, hidden_dim: int, patch_size: int | Sequence[int], kernel_initializer="lecun_normal",
                 bias_initializer="zeros", use_bias: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.hidden_dim = hidden_dim
        self.patch_size = _pair(patch_size, "patch_size")
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape):
        _check_divisible(input_shape, self.patch_size, "PatchEncoder")
        channels = input_shape[-1]
        self.kernel = self.add_weight(name="kernel", shape=(*self.patch_size, channels, self.hidden_dim),
                                      initializer=self.kernel_initializer)
        self.bias = self.add_weight(name="bias", shape=(self.hidden_dim,), initializer=self.bias_initializer) \
            if self.use_bias else None

    def call(self, images):
        patches = extract_patches(images, self.patch_size)
        tokens = ops.matmul(patches, ops.reshape(self.kernel, (-1, self.hidden_dim)))
        return tokens + self.bias if self.use_bias else tokens

    def compute_output_shape(self, input_shape):
        gh, gw = _check_divisible(input_shape, self.patch_size, "PatchEncoder")
        return (input_shape[0], None if gh is None or gw is None else gh * gw, self.hidden_dim)

    def get_config(self):
        config = super().get_config()
        config.update({
            "hidden_dim": self.hidden_dim,
            "patch_size": self.patch_size,
            "use_bias": self.use_bias,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
        })
        return config


@_register
class ClassToken(keras.layers.Layer):
    """Prepends a learned class token (weight `cls`, zeros at init) to a token sequence.

    Call arguments:
        tokens: (batch, num_tokens, hidden_dim).

    Returns:
        (batch, num_tokens + 1, hidden_dim).
    """

    def build(self, input_shape):
        self.cls = self.add_weight(name="cls", shape=(1, 1, input_shape[-1]), initializer="zeros")

    def call(self, tokens):
        batch = ops.shape(tokens)[0]
        cls = ops.cast(ops.broadcast_to(self.cls, (batch, 1, tokens.shape[-1])), tokens.dtype)
        return ops.concatenate([cls, tokens], axis=1)

    def compute_output_shape(self, input_shape):
        num_tokens = None if input_shape[1] is None else input_shape[1] + 1
        return (input_shape[0], num_tokens, input_shape[2])


@_register
class RegisterTokens(keras.layers.Layer):
    """Inserts `num_tokens` learned register tokens (weight `registers`, zeros at init; Darcet et al. 2024,
    "Vision Transformers Need Registers") into a token sequence at index `position`: after the class
    token (`position=1`) or in front (`0`). They take no position embedding.

    Args:
        num_tokens: int. Number of registers (DINOv2: 4).
        position: int. Index of the first register in the output. Defaults to `0`.

    Call arguments:
        tokens: (batch, num_tokens_in, hidden_dim).

    Returns:
        (batch, num_tokens_in + num_tokens, hidden_dim).
    """

    def __init__(self, num_tokens: int, position: int = 0, **kwargs):
        super().__init__(**kwargs)
        if num_tokens < 1 or position < 0:
            raise ValueError(f"RegisterTokens needs num_tokens >= 1 and position >= 0. Received: "
                             f"num_tokens={num_tokens}, position={position}")
        self.num_tokens = num_tokens
        self.position = position

    def build(self, input_shape):
        self.registers = self.add_weight(name="registers", shape=(1, self.num_tokens, input_shape[-1]),
                                         initializer="zeros")

    def call(self, tokens):
        registers = ops.broadcast_to(self.registers, (ops.shape(tokens)[0], self.num_tokens, tokens.shape[-1]))
        registers = ops.cast(registers, tokens.dtype)
        return ops.concatenate([tokens[:, :self.position], registers, tokens[:, self.position:]], axis=1)

    def compute_output_shape(self, input_shape):
        num_tokens = None if input_shape[1] is None else input_shape[1] + self.num_tokens
        return (input_shape[0], num_tokens, input_shape[2])

    def get_config(self):
        config = super().get_config()
        config.update({"num_tokens": self.num_tokens, "position": self.position})
        return config


@_register
class LayerScale(keras.layers.Layer):
    """x * gamma: a learned per-channel scale of a residual branch (CaiT; DeiT-III, DINOv2), weight `gamma`.

    Args:
        init_value: float. Initial value of every channel's scale. Defaults to `1e-5`.
    """

    def __init__(self, init_value: float = 1e-5, **kwargs):
        super().__init__(**kwargs)
        self.init_value = init_value

    def build(self, input_shape):
        self.gamma = self.add_weight(name="gamma", shape=(input_shape[-1],),
                                     initializer=keras.initializers.Constant(self.init_value))

    def call(self, x):
        return x * ops.cast(self.gamma, x.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"init_value": self.init_value})
        return config


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
    `checkpoints.npz._zoom_axis` (`scipy.ndimage.zoom`, order 1). `size` may be a scalar tensor.

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


def sincos_2d_grid(grid_size, width: int, temperature: float = 10_000.0):
    """`sincos_2d_position_embedding` in `keras.ops` (float32), for a grid whose sides may be scalar tensors."""
    rows, columns = grid_size
    quarter = width // 4
    omega = ops.convert_to_tensor(1.0 / temperature ** (np.arange(quarter) / max(quarter - 1, 1)), "float32")
    y, x = ops.meshgrid(ops.arange(rows, dtype="float32"), ops.arange(columns, dtype="float32"), indexing="ij")
    y, x = ops.reshape(y, (-1, 1)) * omega, ops.reshape(x, (-1, 1)) * omega
    return ops.concatenate([ops.sin(x), ops.cos(x), ops.sin(y), ops.cos(y)], axis=1)


@_register
class PositionEmbedding(keras.layers.Layer):
    """Adds position embeddings to a token sequence (prefix tokens first, then the patch grid).

    The original ViT adds its embedding *after* the class token is prepended, so the
    learned table has a row for each prefix token (paper Eq. 1).

    With `patch_stride`, the layer serves a model that takes images of any size: `call` is given the images
    too, and the table stored for `grid_size` is fitted to their grid (height / stride, width / stride) as
    the original loader fits a checkpoint to a new resolution (`checkpoints.npz.resample_position_embedding`):
    `"learned"` grid rows resampled bilinearly (corner-aligned, `scipy.ndimage.zoom` order 1; prefix rows kept),
    `"learned_2d"` row and column embeddings resampled the same way (the same as resampling their 2-D
    table), `"sincos_2d"` recomputed for the grid. On the stored grid the table is used as it is.

    Args:
        grid_size: (int, int). Patch grid (rows, columns) of the sequence; with `patch_stride`, the grid the
            table is stored for (the checkpoint's).
        num_prefix_tokens: int. Tokens before the grid (1 with a class token). Defaults to `1`.
        kind: str. `"learned"` (one learned row per token; weight `pos_embedding`,
            the checkpoints' layout), `"learned_2d"` (learned row and column
            embeddings of width D/2, concatenated; paper App. D.4), `"sincos_2d"` (fixed
            sine-cosine, zero for prefix tokens) or `"none"`. Defaults to `"learned"`.
        patch_stride: optional int or (int, int). Pixels per patch of the images given to `call` (the
            model's total stride). Defaults to `None`: the tokens are always on `grid_size`.

    Call arguments:
        tokens: (batch, num_prefix_tokens + rows * columns, hidden_dim).
        images: with `patch_stride`, the (batch, height, width, channels) images the tokens come from, height
            and width multiples of the stride. Defaults to `None`: the tokens are on `grid_size`.
    """

    def __init__(self, grid_size: Sequence[int], num_prefix_tokens: int = 1, kind: str = "learned",
                 patch_stride: int | Sequence[int] | None = None, **kwargs):
        super().__init__(**kwargs)
        if kind not in POSITION_EMBEDDINGS:
            raise ValueError(f"Unknown position embedding {kind!r}. Expected one of {POSITION_EMBEDDINGS}.")
        if num_prefix_tokens < 0:
            raise ValueError(f"`num_prefix_tokens` must be >= 0. Received: {num_prefix_tokens}")
        self.grid_size = _pair(grid_size, "grid_size")
        self.num_prefix_tokens = num_prefix_tokens
        self.kind = kind
        self.patch_stride = None if patch_stride is None else _pair(patch_stride, "patch_stride")

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]

    def build(self, input_shape):
        if input_shape[1] is not None and input_shape[1] != self.num_tokens:
            raise ValueError(
                f"PositionEmbedding expects {self.num_tokens} tokens ({self.num_prefix_tokens} prefix + "
                f"{self.grid_size[0]}x{self.grid_size[1]} grid). Received shape: {tuple(input_shape)}")
        width = input_shape[-1]
        init = keras.initializers.RandomNormal(stddev=0.02)
        if self.kind == "learned":
            self.pos_embedding = self.add_weight(name="pos_embedding", shape=(1, self.num_tokens, width),
                                                 initializer=init)
        elif self.kind == "learned_2d":
            if width % 2:
                raise ValueError(f"learned_2d position embeddings need an even hidden size. Received: {width}")
            self.row_embedding = self.add_weight(name="row_embedding", shape=(self.grid_size[0], width // 2),
                                                 initializer=init)
            self.column_embedding = self.add_weight(name="column_embedding",
                                                    shape=(self.grid_size[1], width // 2), initializer=init)
            if self.num_prefix_tokens:
                self.prefix_embedding = self.add_weight(name="prefix_embedding",
                                                        shape=(self.num_prefix_tokens, width), initializer=init)
        elif self.kind == "sincos_2d":
            grid = sincos_2d_position_embedding(self.grid_size, width)
            prefix = np.zeros((self.num_prefix_tokens, width), "float32")
            self.sincos_table = np.concatenate([prefix, grid])[None]

    def embedding(self, grid_size=None):
        """The (1, num_prefix_tokens + rows * columns, hidden_dim) table added to tokens on the grid `grid_size`
        ((rows, columns), ints or scalar tensors; defaults to the stored grid), or None for `"none"`."""
        rows, columns = grid = self.grid_size if grid_size is None else tuple(grid_size)
        stored = all(isinstance(side, int) for side in grid) and grid == self.grid_size
        if self.kind == "learned":
            if stored:
                return self.pos_embedding
            prefix = self.pos_embedding[:, :self.num_prefix_tokens]
            table = ops.reshape(self.pos_embedding[0, self.num_prefix_tokens:], (*self.grid_size, -1))
            table = zoom_axis(zoom_axis(table, 0, rows), 1, columns)
            return ops.concatenate([prefix, ops.reshape(table, (1, -1, table.shape[-1]))], axis=1)
        if self.kind == "sincos_2d":
            if stored:
                return ops.convert_to_tensor(self.sincos_table)
            width = self.sincos_table.shape[-1]
            table = sincos_2d_grid(grid, width)
            return ops.concatenate([ops.zeros((self.num_prefix_tokens, width)), table], axis=0)[None]
        if self.kind == "learned_2d":
            row_embedding = self.row_embedding if stored else zoom_axis(self.row_embedding, 0, rows)
            column_embedding = self.column_embedding if stored else zoom_axis(self.column_embedding, 0, columns)
            half = row_embedding.shape[-1]
            row = ops.broadcast_to(row_embedding[:, None, :], (rows, columns, half))
            column = ops.broadcast_to(column_embedding[None, :, :], (rows, columns, half))
            table = ops.reshape(ops.concatenate([row, column], axis=-1), (-1, 2 * half))
            if self.num_prefix_tokens:
                table = ops.concatenate([self.prefix_embedding, table], axis=0)
            return table[None]
        return None

    def call(self, tokens, images=None):
        grid = None
        if images is not None:
            if self.patch_stride is None:
                raise ValueError("PositionEmbedding was given images but has no `patch_stride` to find their patch "
                                 "grid. Build it with patch_stride=<the model's stride>.")
            grid = patch_grid(images, self.patch_stride, unit="patch stride")
        table = self.embedding(grid)
        return tokens if table is None else tokens + ops.cast(table, tokens.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"grid_size": self.grid_size, "num_prefix_tokens": self.num_prefix_tokens,
                       "kind": self.kind, "patch_stride": self.patch_stride})
        return config


@_register
class StochasticDepth(keras.layers.Layer):
    """Drops a whole residual branch per example with probability `rate` during training.

    Kept examples are scaled by 1 / (1 - rate) (Huang et al. 2016, "drop path").

    Args:
        rate: float in [0, 1). Drop probability.
        seed: optional int seed.
    """

    def __init__(self, rate: float, seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"`rate` must be in [0, 1). Received: rate={rate}")
        self.rate = rate
        self.seed = seed
        # Only when it can drop, as keras.layers.Dropout: no non-trainable state where nothing is random.
        self.seed_generator = keras.random.SeedGenerator(seed) if rate > 0 else None

    def call(self, x, training=None):
        if not training or self.rate == 0.0:
            return x
        keep = 1.0 - self.rate
        shape = (ops.shape(x)[0],) + (1,) * (len(x.shape) - 1)
        mask = keras.random.uniform(shape, seed=self.seed_generator, dtype=x.dtype) < keep
        return x * ops.cast(mask, x.dtype) / ops.cast(keep, x.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"rate": self.rate, "seed": self.seed})
        return config


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
class Dense(keras.layers.Dense):
    """`keras.layers.Dense` (no activation) computed by `keras_vit.kernels.dense` on (rows, in).

    Same weights, config, LoRA (`enable_lora`) and quantization (`quantize`) as Keras' Dense; a
    quantized layer computes on Keras' own quantized path.
    """

    def call(self, inputs, training=None):
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


@_register
class MultiHeadDotProductAttention(keras.layers.Layer):
    """Multi-head self-attention of ViT, with the original's weights (paper App. A, Eq. 5-8).

        q, k, v = x W_q, x W_k, x W_v                  (batch, tokens, heads, head_dim)
        A = softmax(q k^T / sqrt(head_dim))            (batch, heads, tokens, tokens)
        out = (A v) W_o                                (batch, tokens, D)

    The projections are the sublayers `query`, `key`, `value` (kernels (D, heads, head_dim), biases
    (heads, head_dim)) and `attention_output` ((heads, head_dim, D), (D,)): the checkpoints' shapes and
    those of `keras.layers.MultiHeadAttention`, whose weight files load here unchanged.

    Where it pays (`kernels.fused_attention_pays`: JAX and PyTorch on GPUs and TPUs, PyTorch inference on
    CPUs) and A is neither returned nor dropped out, (A v) is one fused op (`keras.ops.dot_product_attention`).

    Args:
        num_heads: int. Attention heads; the hidden size must be divisible by it.
        dropout_rate: float. Dropout on the attention weights in training. Defaults to `0.0`.
        kernel_initializer: initializer of the four kernels. Defaults to `"glorot_uniform"`.
        qk_norm: bool. LayerNorm each head's q and k (over head_dim; sublayers `query_norm`, `key_norm`)
            before the logits, as timm's `qk_norm`. Defaults to `False`.
        layer_norm_epsilon: float. Epsilon of those norms. Defaults to `1e-6`.

    Call arguments:
        x: (batch, tokens, hidden_dim).
        context: optional (batch, context_tokens, hidden_dim): the keys and values come from it instead of x
            (cross-attention: the probe of `MAPHead`).
        training: bool. Attention dropout on when True.
        return_attention_scores: bool. Also return the attention weights A, (batch, heads,
            tokens, context_tokens).
    """

    def __init__(self, num_heads: int, dropout_rate: float = 0.0, kernel_initializer="glorot_uniform",
                 qk_norm: bool = False, layer_norm_epsilon: float = LAYER_NORM_EPSILON, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.dropout_rate = dropout_rate
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.qk_norm = qk_norm
        self.layer_norm_epsilon = layer_norm_epsilon

    def build(self, input_shape):
        width = input_shape[-1]
        if width % self.num_heads:
            raise ValueError(f"Hidden size {width} is not divisible by num_heads={self.num_heads}.")
        heads, head_dim = self.num_heads, width // self.num_heads
        # Attribute names are those of keras.layers.MultiHeadAttention: `.weights.h5` files key on them.
        self.query_dense, self.key_dense, self.value_dense = (
            HeadProjection("btd,dnh->btnh", (None, heads, head_dim), bias_axes="nh", name=name,
                           kernel_initializer=self._new_kernel_initializer(), dtype=self.dtype_policy)
            for name in ("query", "key", "value"))
        self.output_dense = HeadProjection("btnh,nhd->btd", (None, width), bias_axes="d", name="attention_output",
                                           kernel_initializer=self._new_kernel_initializer(), dtype=self.dtype_policy)
        for sublayer in (self.query_dense, self.key_dense, self.value_dense):
            sublayer.build(input_shape)
        self.output_dense.build((*input_shape[:-1], heads, head_dim))
        self.dropout = keras.layers.Dropout(self.dropout_rate, dtype=self.dtype_policy)
        self.dropout.build((input_shape[0], heads, input_shape[1], input_shape[1]))
        self.query_norm, self.key_norm = (
            LayerNorm(epsilon=self.layer_norm_epsilon, name=name, dtype=self.dtype_policy) if self.qk_norm
            else keras.layers.Identity(name=name, dtype=self.dtype_policy) for name in ("query_norm", "key_norm"))
        for norm in (self.query_norm, self.key_norm):
            norm.build((*input_shape[:-1], heads, head_dim))

    def _new_kernel_initializer(self):
        """A copy of the kernel initializer per projection: an unseeded Keras initializer instance draws the
        same values at every call, which would start the query, key and value kernels equal."""
        return self.kernel_initializer.__class__.from_config(self.kernel_initializer.get_config())

    def call(self, x, context=None, training=None, return_attention_scores=False):
        # unstack, not qkv[i]: its gradient is one stack, where strided slices each scatter into a zero-filled copy
        # of the whole tensor.
        query, key, value = ops.unstack(self._project_qkv(x), 3, axis=2) if context is None else (
            self.query_dense(x), self.key_dense(context), self.value_dense(context))  # (batch, tokens, heads, hd)
        scale = 1.0 / math.sqrt(x.shape[-1] // self.num_heads)
        dropout_active = training and self.dropout_rate > 0
        if not return_attention_scores and not dropout_active and kernels.fused_attention_pays(training):
            attended = kernels.fused_attention(self.query_norm(query), self.key_norm(key), value, scale)  # as below
        else:
            query, key, value = (ops.transpose(t, (0, 2, 1, 3)) for t in (query, key, value))  # (batch, heads, ...)
            query, key = self.query_norm(query), self.key_norm(key)
            logits = kernels.batch_matmul(query * ops.cast(scale, query.dtype), key, transpose_b=True)
            scores = ops.softmax(logits, axis=-1)  # in the compute dtype, as the original
            attended = ops.transpose(kernels.batch_matmul(self.dropout(scores, training=training), value),
                                     (0, 2, 1, 3))
        out = self.output_dense(attended)
        return (out, scores) if return_attention_scores else out

    def _project_qkv(self, x):
        """x W_q, x W_k, x W_v side by side, (batch, tokens, 3, heads, head_dim): one matmul of the three kernels
        concatenated (LoRA kernels merged), a third of the ops of three projections. Quantized projections each
        take Keras' quantized call instead."""
        projections = (self.query_dense, self.key_dense, self.value_dense)
        if any(projection.quantization_mode for projection in projections):
            return ops.stack([projection(x) for projection in projections], axis=2)
        width, heads = x.shape[-1], self.num_heads
        kernel = ops.concatenate([ops.reshape(p.kernel, (width, width)) for p in projections], axis=1)
        bias = ops.concatenate([ops.reshape(p.bias, (width,)) for p in projections], axis=0)
        qkv = kernels.dense(ops.reshape(x, (-1, width)), kernel, bias)
        return ops.reshape(qkv, (ops.shape(x)[0], ops.shape(x)[1], 3, heads, width // heads))

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(self, x, context=None, training=None, return_attention_scores=False):
        output = keras.KerasTensor(x.shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return output
        keys = x.shape[1] if context is None else context.shape[1]
        return output, keras.KerasTensor((x.shape[0], self.num_heads, x.shape[1], keys), dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update({"num_heads": self.num_heads, "dropout_rate": self.dropout_rate,
                       "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                       "qk_norm": self.qk_norm, "layer_norm_epsilon": self.layer_norm_epsilon})
        return config


@_register
class MlpBlock(keras.layers.Layer):
    """The encoder's MLP: Dense(mlp_dim) -> GELU -> Dropout -> Dense(D) -> Dropout.

    Args:
        mlp_dim: int. Hidden width.
        dropout_rate: float. Dropout after the GELU and after the second Dense. Defaults to `0.0`.
        gelu_approximate: bool. `True`: tanh-approximate GELU (the original's Flax `nn.gelu`);
            `False`: exact erf GELU (PyTorch's `nn.GELU()`, timm and Hugging Face). Defaults to `True`.
        activation: `"gelu"` (as `gelu_approximate` says) or `"quick_gelu"`, x * sigmoid(1.702 x) (OpenAI
            CLIP). Defaults to `"gelu"`.

    Call arguments:
        x: (..., D).
        training: bool. Dropout on when True.
    """

    def __init__(self, mlp_dim: int, dropout_rate: float = 0.0, gelu_approximate: bool = True,
                 activation: str = "gelu", **kwargs):
        super().__init__(**kwargs)
        if activation not in ACTIVATIONS:
            raise ValueError(f"Unknown activation {activation!r}. Expected one of {ACTIVATIONS}.")
        self.mlp_dim = mlp_dim
        self.dropout_rate = dropout_rate
        self.gelu_approximate = gelu_approximate
        self.activation = activation

    def build(self, input_shape):
        width = input_shape[-1]
        dense = dict(kernel_initializer="glorot_uniform",
                     bias_initializer=keras.initializers.RandomNormal(stddev=1e-6), dtype=self.dtype_policy)
        self.dense_0 = Dense(self.mlp_dim, name="Dense_0", **dense)  # checkpoint names Dense_0, Dense_1
        self.dense_1 = Dense(width, name="Dense_1", **dense)
        self.dropout = keras.layers.Dropout(self.dropout_rate, dtype=self.dtype_policy)
        self.dense_0.build(input_shape)
        self.dense_1.build((*input_shape[:-1], self.mlp_dim))
        self.dropout.build((*input_shape[:-1], self.mlp_dim))

    def call(self, x, training=None):
        h = self.dropout(self._activation(self.dense_0(x)), training=training)
        return self.dropout(self.dense_1(h), training=training)

    def _activation(self, h):
        if self.activation == "quick_gelu":
            return h * ops.sigmoid(ops.cast(1.702, h.dtype) * h)
        return kernels.gelu(h, self.gelu_approximate)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"mlp_dim": self.mlp_dim, "dropout_rate": self.dropout_rate,
                       "gelu_approximate": self.gelu_approximate, "activation": self.activation})
        return config


@_register
class TransformerBlock(keras.layers.Layer):
    """Pre-norm Transformer encoder block of ViT (paper Eq. 2-3):

        y = x + DropPath(LS1(Dropout(MHA(LN(x)))))
        out = y + DropPath(LS2(MLP(LN(y))))

    LS1, LS2 are the identity unless `layer_scale_init` is set (then x * gamma, per channel).

    Sublayers carry the original checkpoint names: `LayerNorm_0`, `MultiHeadDotProductAttention_1`,
    `LayerNorm_2`, `MlpBlock_3`. Dropout and drop path act in training only. On CPUs where it pays,
    float32 inference runs this same `call` XLA-compiled (`keras_vit.kernels.compiled_inference`).

    Args:
        num_heads: int. Attention heads; the hidden size must be divisible by it.
        mlp_dim: int. MLP hidden width.
        dropout_rate: float. Dropout after attention and inside the MLP. Defaults to `0.0`.
        attention_dropout_rate: float. Dropout on the attention weights. Defaults to `0.0`.
        drop_path_rate: float. Stochastic-depth rate of both residual branches. Defaults to `0.0`.
        layer_norm_epsilon: float. Defaults to `1e-6`, as the original.
        gelu_approximate: bool. The MLP's GELU: tanh approximation (`True`, the original's) or
            exact erf (`False`, PyTorch's). Defaults to `True`.
        activation: the MLP's `"gelu"` or `"quick_gelu"` (`MlpBlock`). Defaults to `"gelu"`.
        layer_scale_init: optional float. Scale each residual branch by a learned per-channel `gamma`
            (sublayers `ls1`, `ls2`: DeiT-III, DINOv2) starting at this value. Defaults to `None`: no scale.
        qk_norm: bool. LayerNorm the attention's q and k per head. Defaults to `False`.
        remat: bool. Rematerialize the block in training (`kernels.rematerialized`: the backend's gradient
            checkpointing): its activations are recomputed in the backward pass instead of kept, for the
            memory of the large variants; same gradients. Needs the three rates at 0. Defaults to `False`.

    Call arguments:
        x: (batch, tokens, hidden_dim).
        training: bool, dropout and drop path on when True.
        return_attention_scores: bool. Also return the attention weights,
            (batch, heads, tokens, tokens).
    """

    def __init__(self, num_heads: int, mlp_dim: int, dropout_rate: float = 0.0,
                 attention_dropout_rate: float = 0.0, drop_path_rate: float = 0.0,
                 layer_norm_epsilon: float = LAYER_NORM_EPSILON, gelu_approximate: bool = True,
                 activation: str = "gelu", layer_scale_init: float | None = None, qk_norm: bool = False,
                 remat: bool = False, **kwargs):
        super().__init__(**kwargs)
        if remat and (dropout_rate or attention_dropout_rate or drop_path_rate):
            raise ValueError(f"remat=True needs a block without random masks (the backward pass would recompute "
                             f"new ones). Received: dropout_rate={dropout_rate}, attention_dropout_rate="
                             f"{attention_dropout_rate}, drop_path_rate={drop_path_rate}; expected 0.")
        self.remat = remat
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.dropout_rate = dropout_rate
        self.attention_dropout_rate = attention_dropout_rate
        self.drop_path_rate = drop_path_rate
        self.layer_norm_epsilon = layer_norm_epsilon
        self.gelu_approximate = gelu_approximate
        self.activation = activation
        self.layer_scale_init = layer_scale_init
        self.qk_norm = qk_norm

    def build(self, input_shape):
        policy = self.dtype_policy  # the attention layer's build checks that num_heads divides the width
        kernels.warn_if_bfloat16_is_emulated(self.compute_dtype)
        self.norm_attention = LayerNorm(epsilon=self.layer_norm_epsilon, name="LayerNorm_0", dtype=policy)
        self.attention = MultiHeadDotProductAttention(
            self.num_heads, self.attention_dropout_rate, qk_norm=self.qk_norm,
            layer_norm_epsilon=self.layer_norm_epsilon, name="MultiHeadDotProductAttention_1", dtype=policy)
        self.norm_mlp = LayerNorm(epsilon=self.layer_norm_epsilon, name="LayerNorm_2", dtype=policy)
        self.mlp = MlpBlock(self.mlp_dim, self.dropout_rate, self.gelu_approximate, self.activation,
                            name="MlpBlock_3", dtype=policy)
        self.scale_attention, self.scale_mlp = (
            keras.layers.Identity(name=name, dtype=policy) if self.layer_scale_init is None
            else LayerScale(self.layer_scale_init, name=name, dtype=policy) for name in ("ls1", "ls2"))
        self.dropout = keras.layers.Dropout(self.dropout_rate, dtype=policy)
        self.drop_path = StochasticDepth(self.drop_path_rate, dtype=policy)
        for sublayer in (self.norm_attention, self.attention, self.norm_mlp, self.mlp, self.scale_attention,
                         self.scale_mlp, self.dropout, self.drop_path):
            sublayer.build(input_shape)

    @kernels.compiled_inference
    @kernels.rematerialized
    def call(self, x, training=None, return_attention_scores=False):
        attention = self.attention(self.norm_attention(x), training=training,
                                   return_attention_scores=return_attention_scores)
        attended, scores = attention if return_attention_scores else (attention, None)
        y = x + self.drop_path(self.scale_attention(self.dropout(attended, training=training)), training=training)
        out = y + self.drop_path(self.scale_mlp(self.mlp(self.norm_mlp(y), training=training)), training=training)
        return (out, scores) if return_attention_scores else out

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(self, x, training=None, return_attention_scores=False):
        output = keras.KerasTensor(x.shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return output
        scores_shape = (x.shape[0], self.num_heads, x.shape[1], x.shape[1])
        return output, keras.KerasTensor(scores_shape, dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update({
            "num_heads": self.num_heads,
            "mlp_dim": self.mlp_dim,
            "dropout_rate": self.dropout_rate,
            "attention_dropout_rate": self.attention_dropout_rate,
            "drop_path_rate": self.drop_path_rate,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "gelu_approximate": self.gelu_approximate,
            "activation": self.activation,
            "layer_scale_init": self.layer_scale_init,
            "qk_norm": self.qk_norm,
            "remat": self.remat,
        })
        return config


@_register
class TokenPooling(keras.layers.Layer):
    """Pools a token sequence to one vector: `"token"` takes row 0 (the class token), `"distillation"` row 1
    (DeiT's distillation token),
    `"avg"` averages the rows after the first `num_prefix_tokens` (all rows by default: the original's
    `"gap"` classifier; the patch tokens only with `num_prefix_tokens`, as timm's `global_pool="avg"`).

    Args:
        method: str. `"token"`, `"avg"` or `"distillation"`.
        num_prefix_tokens: int. Rows `"avg"` leaves out (class and register tokens). Defaults to `0`.
    """

    def __init__(self, method: str, num_prefix_tokens: int = 0, **kwargs):
        super().__init__(**kwargs)
        if method not in (*POOLINGS, "distillation"):
            raise ValueError(f"Unknown pooling {method!r}. Expected one of {POOLINGS} (or 'distillation').")
        self.method = method
        self.num_prefix_tokens = num_prefix_tokens

    def call(self, tokens):
        if self.method in ("token", "distillation"):
            return tokens[:, 0 if self.method == "token" else 1]
        return ops.mean(tokens[:, self.num_prefix_tokens:], axis=1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[2])

    def get_config(self):
        config = super().get_config()
        config.update({"method": self.method, "num_prefix_tokens": self.num_prefix_tokens})
        return config


@_register
class MAPHead(keras.layers.Layer):
    """Multihead attention pooling (big_vision's `MAPHead`; SigLIP, timm's `global_pool='map'`): a learned probe
    attends over the tokens, then a residual MLP:

        x = MHA(probe, tokens)              (batch, 1, D)
        out = (x + MLP(LN(x)))[:, 0]        (batch, D)

    Sublayers carry big_vision's names: `probe`, `MultiHeadDotProductAttention_0`, `LayerNorm_0`, `MlpBlock_0`.

    Args:
        num_heads: int. Attention heads (the encoder's).
        mlp_dim: int. MLP hidden width (the encoder's).
        layer_norm_epsilon: float. Defaults to `1e-6`.
        gelu_approximate: bool. The MLP's GELU (`MlpBlock`). Defaults to `True`.
        activation: the MLP's `"gelu"` or `"quick_gelu"`. Defaults to `"gelu"`.

    Call arguments:
        tokens: (batch, tokens, D).
    """

    def __init__(self, num_heads: int, mlp_dim: int, layer_norm_epsilon: float = LAYER_NORM_EPSILON,
                 gelu_approximate: bool = True, activation: str = "gelu", **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.layer_norm_epsilon = layer_norm_epsilon
        self.gelu_approximate = gelu_approximate
        self.activation = activation

    def build(self, input_shape):
        width, policy = input_shape[-1], self.dtype_policy
        self.probe = self.add_weight(name="probe", shape=(1, 1, width), initializer="glorot_uniform")
        self.attention = MultiHeadDotProductAttention(self.num_heads, name="MultiHeadDotProductAttention_0",
                                                      dtype=policy)
        self.norm = LayerNorm(epsilon=self.layer_norm_epsilon, name="LayerNorm_0", dtype=policy)
        self.mlp = MlpBlock(self.mlp_dim, gelu_approximate=self.gelu_approximate, activation=self.activation,
                            name="MlpBlock_0", dtype=policy)
        probe_shape = (input_shape[0], 1, width)
        self.attention.build(probe_shape)
        self.norm.build(probe_shape)
        self.mlp.build(probe_shape)

    def call(self, tokens):
        probe = ops.broadcast_to(ops.cast(self.probe, tokens.dtype), (ops.shape(tokens)[0], 1, tokens.shape[-1]))
        x = self.attention(probe, context=tokens)
        return (x + self.mlp(self.norm(x)))[:, 0]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])

    def get_config(self):
        config = super().get_config()
        config.update({"num_heads": self.num_heads, "mlp_dim": self.mlp_dim,
                       "layer_norm_epsilon": self.layer_norm_epsilon, "gelu_approximate": self.gelu_approximate,
                       "activation": self.activation})
        return config
