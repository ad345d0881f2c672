"""Vision Transformer layers (Dosovitskiy et al., ICLR 2021, arXiv:2010.11929).

Ported from the original implementation, google-research/vision_transformer
(`vit_jax/models_vit.py`). Sublayers and weights are named after the modules of the
released checkpoints (`embedding`, `cls`, `pos_embedding`, `LayerNorm_0`,
`MultiHeadDotProductAttention_1`, `LayerNorm_2`, `MlpBlock_3/Dense_0`, ...), so that a
checkpoint maps onto a model by a table of names.

Numerics follow the original: LayerNorm epsilon 1e-6, tanh-approximate GELU (Flax
`nn.gelu`), attention scaled by 1/sqrt(head_dim), pre-norm residual blocks.
"""

from __future__ import annotations

import math
from typing import Sequence

import keras
import numpy as np
from keras import ops

from keras_vit import fused

LAYER_NORM_EPSILON = 1e-6
POSITION_EMBEDDINGS = ("learned", "learned_2d", "sincos_2d", "none")
POOLINGS = ("token", "avg")

_register = keras.saving.register_keras_serializable(package="keras_vit")

# The fused inference/training path of TransformerBlock and MlpBlock (same weights, same
# numerics in float32); a module switch so benchmarks and tests can compare both paths.
FUSED_CALL = True


def _pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    """Returns `value` as an (height, width) pair of positive ints."""
    pair = (value, value) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, (int, np.integer)) and v > 0 for v in pair):
        raise ValueError(f"`{name}` must be a positive int or a pair of them. Received: {name}={value!r}")
    return int(pair[0]), int(pair[1])


def extract_patches(images, patch_size: tuple[int, int]):
    """(B, H, W, C) -> (B, H/ph * W/pw, ph * pw * C), patches in row-major order.

    Each patch is flattened in (row, column, channel) order: the order of a Conv2D
    kernel of shape (ph, pw, C, D) reshaped to (ph * pw * C, D).
    """
    ph, pw = patch_size
    _, height, width, channels = images.shape
    gh, gw = height // ph, width // pw
    x = ops.reshape(images, (-1, gh, ph, gw, pw, channels))
    x = ops.transpose(x, (0, 1, 3, 2, 4, 5))
    return ops.reshape(x, (-1, gh * gw, ph * pw * channels))


def _check_divisible(shape, patch_size: tuple[int, int], layer_name: str) -> tuple[int, int]:
    """Returns the patch grid of a (B, H, W, C) shape, or raises a ValueError."""
    if len(shape) != 4:
        raise ValueError(f"{layer_name} expects images of shape (batch, height, width, channels). "
                         f"Received shape: {tuple(shape)}")
    height, width = shape[1], shape[2]
    if height is None or width is None:
        raise ValueError(f"{layer_name} needs a static image height and width. Received shape: {tuple(shape)}")
    for size, patch, axis in ((height, patch_size[0], "height"), (width, patch_size[1], "width")):
        if size % patch:
            raise ValueError(f"Image {axis} {size} is not divisible by the patch size {patch}. "
                             f"Expected a multiple of {patch}.")
    return height // patch_size[0], width // patch_size[1]


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
        return (input_shape[0], gh * gw, ph * pw * input_shape[3])

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

    Call arguments:
        images: (batch, height, width, channels).

    Returns:
        (batch, num_patches, hidden_dim).
    """

    def __init__(self, hidden_dim: int, patch_size: int | Sequence[int],
                 kernel_initializer="lecun_normal", bias_initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        self.hidden_dim = hidden_dim
        self.patch_size = _pair(patch_size, "patch_size")
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape):
        _check_divisible(input_shape, self.patch_size, "PatchEncoder")
        channels = input_shape[-1]
        self.kernel = self.add_weight(name="kernel", shape=(*self.patch_size, channels, self.hidden_dim),
                                      initializer=self.kernel_initializer)
        self.bias = self.add_weight(name="bias", shape=(self.hidden_dim,), initializer=self.bias_initializer)

    def call(self, images):
        patches = extract_patches(images, self.patch_size)
        kernel = ops.reshape(self.kernel, (-1, self.hidden_dim))
        return ops.matmul(patches, kernel) + self.bias

    def compute_output_shape(self, input_shape):
        gh, gw = _check_divisible(input_shape, self.patch_size, "PatchEncoder")
        return (input_shape[0], gh * gw, self.hidden_dim)

    def get_config(self):
        config = super().get_config()
        config.update({
            "hidden_dim": self.hidden_dim,
            "patch_size": self.patch_size,
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


@_register
class PositionEmbedding(keras.layers.Layer):
    """Adds position embeddings to a token sequence (prefix tokens first, then the patch grid).

    The original ViT adds its embedding *after* the class token is prepended, so the
    learned table has a row for each prefix token (paper Eq. 1).

    Args:
        grid_size: (int, int). Patch grid (rows, columns) of the sequence.
        num_prefix_tokens: int. Tokens before the grid (1 with a class token). Defaults to `1`.
        kind: str. `"learned"` (one learned row per token; weight `pos_embedding`,
            the checkpoints' layout), `"learned_2d"` (learned row and column
            embeddings of width D/2, concatenated; paper App. D.4), `"sincos_2d"` (fixed
            sine-cosine, zero for prefix tokens) or `"none"`. Defaults to `"learned"`.

    Call arguments:
        tokens: (batch, num_prefix_tokens + rows * columns, hidden_dim).
    """

    def __init__(self, grid_size: Sequence[int], num_prefix_tokens: int = 1, kind: str = "learned", **kwargs):
        super().__init__(**kwargs)
        if kind not in POSITION_EMBEDDINGS:
            raise ValueError(f"Unknown position embedding {kind!r}. Expected one of {POSITION_EMBEDDINGS}.")
        if num_prefix_tokens < 0:
            raise ValueError(f"`num_prefix_tokens` must be >= 0. Received: {num_prefix_tokens}")
        self.grid_size = _pair(grid_size, "grid_size")
        self.num_prefix_tokens = num_prefix_tokens
        self.kind = kind

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

    def embedding(self):
        """The (1, num_tokens, hidden_dim) table added to the tokens, or None for `"none"`."""
        if self.kind == "learned":
            return self.pos_embedding
        if self.kind == "sincos_2d":
            return ops.convert_to_tensor(self.sincos_table)
        if self.kind == "learned_2d":
            (rows, columns), half = self.grid_size, self.row_embedding.shape[-1]
            row = ops.broadcast_to(self.row_embedding[:, None, :], (rows, columns, half))
            column = ops.broadcast_to(self.column_embedding[None, :, :], (rows, columns, half))
            grid = ops.reshape(ops.concatenate([row, column], axis=-1), (rows * columns, 2 * half))
            if self.num_prefix_tokens:
                grid = ops.concatenate([self.prefix_embedding, grid], axis=0)
            return grid[None]
        return None

    def call(self, tokens):
        table = self.embedding()
        if table is None:
            return tokens
        return tokens + ops.cast(table, tokens.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"grid_size": self.grid_size, "num_prefix_tokens": self.num_prefix_tokens,
                       "kind": self.kind})
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
        self.seed_generator = keras.random.SeedGenerator(seed)

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
class MlpBlock(keras.layers.Layer):
    """Dense(mlp_dim) -> GELU (tanh approximation) -> Dropout -> Dense(D) -> Dropout.

    Args:
        mlp_dim: int. Hidden width.
        dropout_rate: float. Dropout after each Dense. Defaults to `0.0`.
    """

    def __init__(self, mlp_dim: int, dropout_rate: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.mlp_dim = mlp_dim
        self.dropout_rate = dropout_rate

    def build(self, input_shape):
        width = input_shape[-1]
        dense = dict(kernel_initializer="glorot_uniform",
                     bias_initializer=keras.initializers.RandomNormal(stddev=1e-6), dtype=self.dtype_policy)
        self.dense_0 = keras.layers.Dense(self.mlp_dim, name="Dense_0", **dense)
        self.dense_1 = keras.layers.Dense(width, name="Dense_1", **dense)
        self.dropout = keras.layers.Dropout(self.dropout_rate, dtype=self.dtype_policy)
        self.dense_0.build(input_shape)
        self.dense_1.build((*input_shape[:-1], self.mlp_dim))

    def call(self, x, training=None):
        if FUSED_CALL and len(x.shape) == 3:
            shape = ops.shape(x)
            h = self.call_2d(ops.reshape(x, (-1, x.shape[-1])), training)
            return ops.reshape(h, (shape[0], shape[1], x.shape[-1]))
        x = keras.activations.gelu(self.dense_0(x), approximate=True)
        x = self.dropout(x, training=training)
        return self.dropout(self.dense_1(x), training=training)

    def call_2d(self, x, training=None, residual=None):
        """The same map on (N, D) rows: MatMul + BiasAdd + GELU fuse into one oneDNN op. Adds
        `residual` (N, D) when given; with no dropout active, that add fuses into the last matmul."""
        if training:  # the GELU's input is kept for the backward pass, so it cannot fuse into the matmul
            h = fused.gelu_tanh(fused.dense_2d(x, self.dense_0.kernel, self.dense_0.bias))
        else:
            h = fused.dense_2d(x, self.dense_0.kernel, self.dense_0.bias, gelu=True)
        h = self.dropout(h, training=training)
        if residual is not None and not (training and self.dropout_rate):
            return fused.dense_2d(h, self.dense_1.kernel, self.dense_1.bias, residual=residual)
        out = self.dropout(fused.dense_2d(h, self.dense_1.kernel, self.dense_1.bias), training=training)
        return out if residual is None else residual + out

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"mlp_dim": self.mlp_dim, "dropout_rate": self.dropout_rate})
        return config


@_register
class TransformerBlock(keras.layers.Layer):
    """Pre-norm Transformer encoder block of ViT (paper Eq. 2-3).

        y = x + DropPath(Dropout(MHA(LN(x))))
        out = y + DropPath(MLP(LN(y)))

    Sublayers carry the original checkpoint names: `LayerNorm_0`,
    `MultiHeadDotProductAttention_1`, `LayerNorm_2`, `MlpBlock_3`.

    Args:
        num_heads: int. Attention heads; the hidden size must be divisible by it.
        mlp_dim: int. MLP hidden width.
        dropout_rate: float. Dropout after attention and inside the MLP. Defaults to `0.0`.
        attention_dropout_rate: float. Dropout on the attention weights. Defaults to `0.0`.
        drop_path_rate: float. Stochastic-depth rate of both residual branches. Defaults to `0.0`.
        layer_norm_epsilon: float. Defaults to `1e-6`, as the original.

    Call arguments:
        x: (batch, tokens, hidden_dim).
        training: bool, dropout and drop path on when True.
        return_attention_scores: bool. Also return the attention weights,
            (batch, heads, tokens, tokens). Takes the slower explicit-softmax path; the
            default path uses the fused dot-product attention.
    """

    def __init__(self, num_heads: int, mlp_dim: int, dropout_rate: float = 0.0,
                 attention_dropout_rate: float = 0.0, drop_path_rate: float = 0.0,
                 layer_norm_epsilon: float = LAYER_NORM_EPSILON, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.dropout_rate = dropout_rate
        self.attention_dropout_rate = attention_dropout_rate
        self.drop_path_rate = drop_path_rate
        self.layer_norm_epsilon = layer_norm_epsilon

    def build(self, input_shape):
        width = input_shape[-1]
        if width % self.num_heads:
            raise ValueError(f"Hidden size {width} is not divisible by num_heads={self.num_heads}.")
        policy = self.dtype_policy
        self.norm_attention = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, name="LayerNorm_0", dtype=policy)
        self.attention = keras.layers.MultiHeadAttention(
            num_heads=self.num_heads, key_dim=width // self.num_heads, dropout=self.attention_dropout_rate,
            kernel_initializer="glorot_uniform", name="MultiHeadDotProductAttention_1", dtype=policy)
        self.norm_mlp = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, name="LayerNorm_2", dtype=policy)
        self.mlp = MlpBlock(self.mlp_dim, self.dropout_rate, name="MlpBlock_3", dtype=policy)
        self.dropout = keras.layers.Dropout(self.dropout_rate, dtype=policy)
        self.drop_path = StochasticDepth(self.drop_path_rate, dtype=policy)
        self.norm_attention.build(input_shape)
        self.attention.build(input_shape, input_shape)
        self.norm_mlp.build(input_shape)
        self.mlp.build(input_shape)

    def call(self, x, training=None, return_attention_scores=False):
        if FUSED_CALL and not return_attention_scores and not (training and self.attention_dropout_rate):
            return self._fused_call(x, training)
        y = self.norm_attention(x)
        attended = self.attention(y, y, training=training, return_attention_scores=return_attention_scores)
        if return_attention_scores:
            attended, scores = attended
        x = x + self.drop_path(self.dropout(attended, training=training), training=training)
        x = x + self.drop_path(self.mlp(self.norm_mlp(x), training=training), training=training)
        return (x, scores) if return_attention_scores else x

    def _fused_call(self, x, training):
        """The same block on (B*T, D) rows: each residual add directly follows a 2-D MatMul +
        BiasAdd, so oneDNN fuses it into that matmul (no separate add over the activations)."""
        batch, tokens, width = ops.shape(x)[0], ops.shape(x)[1], x.shape[-1]
        eps = self.layer_norm_epsilon
        h = ops.reshape(x, (-1, width))
        y = fused.layer_norm(h, self.norm_attention, eps)
        if not training or not (self.dropout_rate or self.drop_path_rate):  # identity branches
            h = self._fused_attention(y, batch, tokens, residual=h)
            h = self.mlp.call_2d(fused.layer_norm(h, self.norm_mlp, eps), training, residual=h)
            return ops.reshape(h, (batch, tokens, width))
        attended = self._fused_attention(y, batch, tokens)
        h = h + self._residual_branch(self.dropout(attended, training=training), batch, tokens, training)
        mlp_out = self.mlp.call_2d(fused.layer_norm(h, self.norm_mlp, eps), training)
        h = h + self._residual_branch(mlp_out, batch, tokens, training)
        return ops.reshape(h, (batch, tokens, width))

    def _residual_branch(self, branch, batch, tokens, training):
        """Drop path of a (B*T, D) branch, per example; the identity at inference."""
        if not training or not self.drop_path_rate:
            return branch
        per_example = self.drop_path(ops.reshape(branch, (batch, tokens, branch.shape[-1])), training=training)
        return ops.reshape(per_example, (-1, branch.shape[-1]))

    def _fused_attention(self, y, batch, tokens, residual=None):
        """Multi-head self-attention of (B*T, D) rows with the MultiHeadAttention layer's
        weights: one QKV matmul (kernels concatenated at call time, the query's
        1/sqrt(head_dim) folded into its kernel and bias), one transpose into
        (3, B, H, T, hd), batched matmuls, softmax in the compute dtype. Returns (B*T, D), plus
        `residual` when given (the add fuses into the output projection)."""
        attention = self.attention
        width = y.shape[-1]
        heads, head_dim = self.num_heads, width // self.num_heads
        # D^2 multiplies for the scale instead of B*T*D; exact for head_dim 64 (a power of two).
        scale = ops.cast(1.0 / math.sqrt(head_dim), y.dtype)
        query_dense, key_dense, value_dense = attention.query_dense, attention.key_dense, attention.value_dense
        kernel = ops.concatenate([ops.reshape(query_dense.kernel, (width, width)) * scale,
                                  ops.reshape(key_dense.kernel, (width, width)),
                                  ops.reshape(value_dense.kernel, (width, width))], axis=1)
        bias = ops.concatenate([ops.reshape(query_dense.bias, (width,)) * scale,
                                ops.reshape(key_dense.bias, (width,)), ops.reshape(value_dense.bias, (width,))],
                               axis=0)
        qkv = fused.dense_2d(y, kernel, bias)
        qkv = ops.transpose(ops.reshape(qkv, (batch, tokens, 3, heads, head_dim)), (2, 0, 3, 1, 4))
        # unstack, not qkv[i]: its gradient is one stack, where strided slices each
        # scatter into a zero-filled copy of the whole tensor.
        query, key, value = ops.unstack(qkv, 3, axis=0)
        logits = fused.matmul_transposed(query, key)
        # Softmax in the compute dtype: in bfloat16 oneDNN's softmax accumulates in float32
        # internally; the probabilities were cast back to bfloat16 for the next matmul anyway.
        probs = ops.softmax(logits, axis=-1)
        context = ops.matmul(probs, value)  # (B, H, T, hd)
        context = ops.reshape(ops.transpose(context, (0, 2, 1, 3)), (-1, width))
        out = attention.output_dense
        return fused.dense_2d(context, ops.reshape(out.kernel, (width, width)), out.bias, residual=residual)

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
        })
        return config


@_register
class TokenPooling(keras.layers.Layer):
    """Pools a token sequence to one vector: `"token"` takes row 0 (the class token),
    `"avg"` averages all rows (the original's `"gap"` classifier).

    Args:
        method: str. `"token"` or `"avg"`.
    """

    def __init__(self, method: str, **kwargs):
        super().__init__(**kwargs)
        if method not in POOLINGS:
            raise ValueError(f"Unknown pooling {method!r}. Expected one of {POOLINGS}.")
        self.method = method

    def call(self, tokens):
        if self.method == "token":
            return tokens[:, 0]
        return ops.mean(tokens, axis=1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[2])

    def get_config(self):
        config = super().get_config()
        config.update({"method": self.method})
        return config


def num_patches(image_size: Sequence[int], stride: Sequence[int]) -> int:
    """Number of tokens a (height, width) image yields at a total stride."""
    return math.prod(s // p for s, p in zip(image_size, stride))
