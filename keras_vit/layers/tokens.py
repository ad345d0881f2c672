"""The token layers of ViT: images to patch tokens, the prefix tokens (class, distillation, registers), position
embeddings (tables fitted to any patch grid, or rotary angles of each grid) and the pooling of tokens to one
vector (paper Eq. 1; vit_jax's `models_vit.py`). Weights carry the names of the released checkpoints
(`embedding`, `cls`, `pos_embedding`)."""

from __future__ import annotations

import math
from typing import Sequence

import keras
import numpy as np
from keras import ops

from keras_vit import kernels
from keras_vit.checkpoints.resample import resize_axis
from keras_vit.variants import POSITION_EMBEDDINGS, POSITION_RESAMPLINGS

POOLINGS = ("token", "avg", "token_avg")

_register = keras.saving.register_keras_serializable(package="keras_vit")


def to_pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
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
    # (B gh, ph, gw, pw C) -> (B gh, gw, ph, pw C): tensors of rank 4 at most, which every LiteRT delegate takes
    # (the GPU delegate refuses rank 5 and over).
    x = ops.reshape(images, (-1, ph, gw, pw * channels))
    x = ops.transpose(x, (0, 2, 1, 3))
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
        self.patch_size = to_pair(patch_size, "patch_size")

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
        self.patch_size = to_pair(patch_size, "patch_size")
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


def _check_sincos_width(width: int) -> None:
    if width % 4:
        raise ValueError(f"sincos_2d position embeddings need a hidden size divisible by 4. Received: {width}")


def sincos_2d_position_embedding(grid_size, width: int, temperature: float = 10_000.0):
    """Fixed 2-D sine-cosine embedding of a (rows, columns) grid, (rows * columns, width) float32, as in big_vision
    (`posemb_sincos_2d`): [sin(x w), cos(x w), sin(y w), cos(y w)] with w_d = temperature ** -(d / (width / 4 - 1))."""
    _check_sincos_width(width)
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
    `"learned"` grid rows resampled by `resampling` (the original's: bilinear, corner-aligned, `scipy.ndimage.zoom`
    order 1; timm's and transformers' files: bicubic; prefix rows kept),
    `"learned_2d"` row and column embeddings resampled the same way (the same as resampling their 2-D
    table), `"sincos_2d"` recomputed for the grid. On the stored grid the table is used as it is.

    Args:
        grid_size: (int, int). Patch grid (rows, columns) of the sequence; with `patch_stride`, the grid the
            table is stored for (the checkpoint's).
        num_prefix_tokens: int. Tokens before the grid (1 with a class token). Defaults to `1`.
        kind: str. `"learned"` (one learned row per token; weight `pos_embedding`,
            the checkpoints' layout), `"learned_2d"` (learned row and column
            embeddings of width D/2, concatenated; paper App. D.4), `"sincos_2d"` (fixed
            sine-cosine, zero for prefix tokens) or `"none"` (none added: DINOv3's positions are rotations of q
            and k in its attention, `RotaryPositionEmbedding`). Defaults to `"learned"`.
        patch_stride: optional int or (int, int). Pixels per patch of the images given to `call` (the
            model's total stride). Defaults to `None`: the tokens are always on `grid_size`.
        resampling: how the learned table is fitted to another grid: `"linear_corners"` (the original's),
            `"bicubic"` (PyTorch's, as transformers) or `"bicubic_antialias"` (as timm), as the loader resizes
            the checkpoint's table (`keras_vit.checkpoints.resample`). Defaults to `"linear_corners"`.

    Call arguments:
        tokens: (batch, num_prefix_tokens + rows * columns, hidden_dim).
        images: with `patch_stride`, the (batch, height, width, channels) images the tokens come from, height
            and width multiples of the stride. Defaults to `None`: the tokens are on `grid_size`.
    """

    def __init__(self, grid_size: Sequence[int], num_prefix_tokens: int = 1, kind: str = "learned",
                 patch_stride: int | Sequence[int] | None = None, resampling: str = "linear_corners", **kwargs):
        super().__init__(**kwargs)
        if kind not in POSITION_EMBEDDINGS:
            raise ValueError(f"Unknown position embedding {kind!r}. Expected one of {POSITION_EMBEDDINGS}.")
        if resampling not in POSITION_RESAMPLINGS:
            raise ValueError(f"Unknown resampling {resampling!r}. Expected one of {POSITION_RESAMPLINGS}.")
        self.resampling = resampling
        if num_prefix_tokens < 0:
            raise ValueError(f"`num_prefix_tokens` must be >= 0. Received: {num_prefix_tokens}")
        self.grid_size = to_pair(grid_size, "grid_size")
        self.num_prefix_tokens = num_prefix_tokens
        self.kind = kind
        self.patch_stride = None if patch_stride is None else to_pair(patch_stride, "patch_stride")

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]

    def build(self, input_shape):
        if input_shape[1] is not None and input_shape[1] != self.num_tokens:
            raise ValueError(self._token_count_message().format(input_shape[1]))
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
            _check_sincos_width(width)  # at build, not at the first call
            self.sincos_width = width

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
            table = resize_axis(resize_axis(table, 0, rows, self.resampling), 1, columns, self.resampling)
            return ops.concatenate([prefix, ops.reshape(table, (1, -1, table.shape[-1]))], axis=1)
        if self.kind == "sincos_2d":
            table = sincos_2d_position_embedding(grid, self.sincos_width)
            return ops.concatenate([ops.zeros((self.num_prefix_tokens, self.sincos_width)), table], axis=0)[None]
        if self.kind == "learned_2d":
            row_embedding = self.row_embedding if stored else resize_axis(self.row_embedding, 0, rows,
                                                                          self.resampling)
            column_embedding = self.column_embedding if stored else resize_axis(self.column_embedding, 0, columns,
                                                                                self.resampling)
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
        elif self.kind != "none":
            tokens = kernels.expect_size(tokens, 1, self.num_tokens, self._token_count_message())
        table = self.embedding(grid)
        return tokens if table is None else tokens + ops.cast(table, tokens.dtype)

    def _token_count_message(self) -> str:
        rows, columns = self.grid_size
        return (f"{self.name} expects {self.num_tokens} tokens ({self.num_prefix_tokens} prefix + {rows}x{columns} "
                "grid), from images of the size the model was built for. Received: {} tokens. Resize the images, or "
                "build the model with input_shape=(None, None, 3) to take images of any size.")

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"grid_size": self.grid_size, "num_prefix_tokens": self.num_prefix_tokens,
                       "kind": self.kind, "patch_stride": self.patch_stride, "resampling": self.resampling})
        return config


@_register
class TokenPooling(keras.layers.Layer):
    """Pools a token sequence to one vector: `"token"` takes row 0 (the class token), `"distillation"` row 1
    (DeiT's distillation token),
    `"avg"` averages the rows after the first `num_prefix_tokens` (all rows by default: the original's
    `"gap"` classifier; the patch tokens only with `num_prefix_tokens`, as timm's `global_pool="avg"`),
    `"token_avg"` concatenates the two, [row 0; mean of the rows after `num_prefix_tokens`] (twice the width: what
    DINOv2's and DINOv3's linear classifiers read, transformers' `Dinov2ForImageClassification`).

    Args:
        method: str. `"token"`, `"avg"`, `"token_avg"` or `"distillation"`.
        num_prefix_tokens: int. Rows `"avg"` and `"token_avg"` leave out of the mean (class and register tokens).
            Defaults to `0`.
    """

    def __init__(self, method: str, num_prefix_tokens: int = 0, **kwargs):
        super().__init__(**kwargs)
        if method not in (*POOLINGS, "distillation"):
            raise ValueError(f"Unknown pooling {method!r}. Expected one of {POOLINGS} (or 'distillation').")
        self.method = method
        self.num_prefix_tokens = num_prefix_tokens

    def call(self, tokens):
        if self.method in ("token", "distillation"):
            return kernels.token_row(tokens, 0 if self.method == "token" else 1)
        mean = ops.mean(tokens[:, self.num_prefix_tokens:], axis=1)
        return ops.concatenate([kernels.token_row(tokens, 0), mean], axis=-1) if self.method == "token_avg" else mean

    def compute_output_shape(self, input_shape):
        width = input_shape[2]
        return (input_shape[0], 2 * width if self.method == "token_avg" and width is not None else width)

    def get_config(self):
        config = super().get_config()
        config.update({"method": self.method, "num_prefix_tokens": self.num_prefix_tokens})
        return config

# === Rotary positions (RoPE; Su et al. 2021), as DINOv3 uses them (Simeoni et al. 2025; transformers'
# `DINOv3ViTRopePositionEmbedding` and `apply_rotary_pos_emb`): no table is added to the tokens; the attention
# rotates each patch token's query and key by angles of its position, from the image's own grid at run time, so a
# model takes any image size with nothing to resample. ===


def rotate_half(x):
    """[a, b] -> [-b, a] over the last axis, split in halves (the pairs (i, i + d/2) rotate together)."""
    first, second = ops.split(x, 2, axis=-1)
    return ops.concatenate([-second, first], axis=-1)


def apply_rotary(x, cos, sin):
    """x cos(theta) + rotate_half(x) sin(theta): x (batch, tokens, heads, head_dim), cos and sin (tokens, head_dim)
    of `RotaryPositionEmbedding` (x may hold the first rows of the sequence only: they take the first rows)."""
    rows = ops.shape(x)[1] if x.shape[1] is None else x.shape[1]
    cos, sin = (ops.cast(table[:rows, None, :], x.dtype) for table in (cos, sin))
    return x * cos + rotate_half(x) * sin


@_register
class RotaryPositionEmbedding(keras.layers.Layer):
    """The angles of a 2-D axial rotary position embedding (DINOv3's or EVA-02's), for images of any size.

    Token t of the patch grid (row r, column c of `rows` x `columns`) is at

        (y_t, x_t) = 2 pi (2 ((r + 1/2) / rows, (c + 1/2) / columns) - 1)   DINOv3: its centre in [-1, 1]^2, or
        (y_t, x_t) = (r R / rows, c C / columns)                            EVA-02: in patches of the R x C
                                                                             `reference_grid` (r, c without one)
        omega_j = theta ** (-4 j / head_dim),  j = 0 .. head_dim / 4 - 1
        angles_t = [y_t omega, x_t omega, y_t omega, x_t omega]             (head_dim,)

    and the attention computes with q_t cos(angles_t) + rotate_half(q_t) sin(angles_t) (`apply_rotary`; k the
    same), rotate_half([a, b]) = [-b, a]. The prefix tokens (class, registers) have angle 0: cos 1, sin 0, their
    q and k unchanged, exactly. In training (only), DINOv3's augmentations of the coordinates, each drawn once
    per call for the whole batch: `shift` adds U(-shift, shift) per axis, `jitter` multiplies each axis by
    exp(U(-ln jitter, ln jitter)), `rescale` both axes by one exp(U(-ln rescale, ln rescale)).

    EVA-02 (timm's `RotaryEmbeddingCat`) rotates interleaved pairs (2i, 2i + 1) with these angles; its loader
    permutes each head's query and key columns to [0, 2, 4, ..., 1, 3, 5, ...], which makes them the pairs
    (i, i + head_dim / 2) rotated here and leaves every q . k, hence the attention, unchanged.

    Args:
        head_dim: int. Width of each attention head; a multiple of 4.
        patch_stride: int or (int, int). Pixels per patch of the images given to `call`.
        num_prefix_tokens: int. Tokens before the patch grid (class and register tokens). Defaults to `0`.
        theta: float. The base period. Defaults to `100.0` (DINOv3's `rope_theta`; EVA-02's is 10000).
        shift, jitter, rescale: optional floats; None (the default) leaves that augmentation off.
        form: `"dinov3"` or `"eva02"`: the coordinates above. Defaults to `"dinov3"`.
        reference_grid: optional (rows, columns), with `form="eva02"`: the grid its positions are measured in.
        seed: optional int seed of the augmentations.

    Call arguments:
        images: (batch, height, width, channels), height and width multiples of the stride; only their shape is
            read.
        training: bool. The augmentations apply when True.

    Returns:
        (cos, sin), each (num_prefix_tokens + rows * columns, head_dim), in the layer's compute dtype (computed in
        float32).
    """

    def __init__(self, head_dim: int, patch_stride, num_prefix_tokens: int = 0, theta: float = 100.0,
                 shift: float | None = None, jitter: float | None = None, rescale: float | None = None,
                 seed: int | None = None, form: str = "dinov3", reference_grid: tuple[int, int] | None = None,
                 **kwargs):
        super().__init__(**kwargs)
        if head_dim % 4:
            raise ValueError(f"RotaryPositionEmbedding needs head_dim divisible by 4. Received: head_dim={head_dim}")
        if form not in ("dinov3", "eva02") or (reference_grid is not None and form != "eva02"):
            raise ValueError(f"form must be 'dinov3' or 'eva02' (reference_grid with 'eva02' only). Received: "
                             f"form={form!r}, reference_grid={reference_grid!r}")
        self.form = form
        self.reference_grid = None if reference_grid is None else to_pair(reference_grid, "reference_grid")
        self.head_dim = head_dim
        self.patch_stride = to_pair(patch_stride, "patch_stride")
        self.num_prefix_tokens = num_prefix_tokens
        self.theta = theta
        self.shift, self.jitter, self.rescale = shift, jitter, rescale
        self.seed = seed
        augmented = any(value is not None for value in (shift, jitter, rescale))
        self.seed_generator = keras.random.SeedGenerator(seed) if augmented else None

    @property
    def frequencies(self) -> np.ndarray:
        """omega_j = theta ** (-4 j / head_dim), (head_dim / 4,) float32."""
        return (1.0 / self.theta ** (np.arange(0, self.head_dim // 4) * 4 / self.head_dim)).astype("float32")

    def call(self, images, training=None):
        rows, columns = patch_grid(images, self.patch_stride, unit="patch stride")
        y, x = self._axis(rows, 0), self._axis(columns, 1)
        y, x = ops.meshgrid(y, x, indexing="ij")
        coordinates = ops.stack([ops.reshape(y, (-1,)), ops.reshape(x, (-1,))], axis=-1)  # (rows * columns, 2)
        if training and self.seed_generator is not None:
            coordinates = self._augment(coordinates)
        if self.form == "dinov3":
            coordinates = 2 * math.pi * coordinates
        angles = coordinates[:, :, None] * ops.convert_to_tensor(self.frequencies)  # (P, 2, d / 4)
        angles = ops.reshape(angles, (-1, self.head_dim // 2))
        angles = ops.concatenate([ops.zeros((self.num_prefix_tokens, self.head_dim // 2)), angles], axis=0)
        angles = ops.concatenate([angles, angles], axis=-1)  # (tokens, head_dim)
        return ops.cast(ops.cos(angles), self.compute_dtype), ops.cast(ops.sin(angles), self.compute_dtype)

    def _axis(self, size, axis: int):
        """The positions along one axis of `size` patches: DINOv3's centres in [-1, 1], EVA-02's indices (in patches
        of the reference grid)."""
        index = ops.cast(ops.arange(size), "float32")
        if self.form == "dinov3":
            return (index + 0.5) / ops.cast(size, "float32") * 2.0 - 1.0
        if self.reference_grid is None:
            return index
        return index / ops.cast(size, "float32") * float(self.reference_grid[axis])

    def _augment(self, coordinates):
        """DINOv3's train-time shift, jitter and rescale of the (P, 2) coordinates."""
        def uniform(shape, bound):
            return keras.random.uniform(shape, -bound, bound, seed=self.seed_generator)

        if self.shift is not None:
            coordinates = coordinates + uniform((1, 2), self.shift)
        if self.jitter is not None:
            coordinates = coordinates * ops.exp(uniform((1, 2), math.log(self.jitter)))
        if self.rescale is not None:
            coordinates = coordinates * ops.exp(uniform((1, 1), math.log(self.rescale)))
        return coordinates

    def compute_output_spec(self, images, training=None):
        grid = [None if side is None else side // stride for side, stride in zip(images.shape[1:3],
                                                                               self.patch_stride)]
        tokens = None if None in grid else self.num_prefix_tokens + grid[0] * grid[1]
        spec = keras.KerasTensor((tokens, self.head_dim), dtype=self.compute_dtype)
        return spec, keras.KerasTensor((tokens, self.head_dim), dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update({"head_dim": self.head_dim, "patch_stride": self.patch_stride,
                       "num_prefix_tokens": self.num_prefix_tokens, "theta": self.theta, "shift": self.shift,
                       "jitter": self.jitter, "rescale": self.rescale, "seed": self.seed, "form": self.form,
                       "reference_grid": self.reference_grid})
        return config
