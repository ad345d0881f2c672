"""The original `.npz` layout: reading, its keys as Keras weight paths, position-embedding resampling.

The released checkpoints are flat `.npz` files whose keys are the Flax parameter paths joined by `/`.
Keras weights in this package carry the same names (`keras_vit.layers`), so the mapping is a table of key
patterns (`KEY_TABLE`) plus one transform: GroupNorm parameters stored as (1, 1, 1, C) are squeezed.
Position embeddings are resampled to the model's patch grid as the original loader does. Pure NumPy.
"""

from __future__ import annotations

import contextlib
import math
import re
import zipfile
import zlib
from typing import Callable, Iterator, Sequence

import numpy as np

from keras_vit.checkpoints import resample

POSEMB_KEY = "Transformer/posembed_input/pos_embedding"


@contextlib.contextmanager
def _archive(path: str) -> Iterator[np.lib.npyio.NpzFile]:
    """The open `.npz` archive; a file that is not one is a ValueError saying what to do."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise ValueError("it holds a single array, not an archive of named arrays")
            yield archive
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as error:
        raise ValueError(f"Could not read {path!r} as an .npz checkpoint ({type(error).__name__}: {error}). "
                         "The file is truncated, corrupt or of another format; if it was downloaded, delete "
                         "it to download it again.") from error


def read_npz(path: str, keys: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Reads an `.npz` checkpoint into a dict, without the `params/` prefix of big_vision files.

    Args:
        path: str. File path.
        keys: optional keys (without prefix) to read; others are skipped. Defaults to all.

    Returns:
        Key -> array.

    Raises:
        ValueError: the file is not a readable `.npz` archive (e.g. truncated).
    """
    with _archive(path) as archive:
        names = {name.removeprefix("params/"): name for name in archive.files}
        wanted = names if keys is None else [key for key in keys if key in names]
        return {key: archive[names[key]] for key in wanted}


def read_npz_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Key (without `params/`) -> shape of an `.npz` checkpoint, from the arrays' headers alone."""
    with _archive(path) as archive:
        members, shapes = set(archive.zip.namelist()), {}
        for name in archive.files:
            with archive.zip.open(name + ".npy" if name + ".npy" in members else name) as file:
                version = np.lib.format.read_magic(file)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shapes[name.removeprefix("params/")] = tuple(read_header(file)[0])
        return shapes




def resample_position_embedding(posemb: np.ndarray, new_grid: int | Sequence[int],
                                old_grid: int | Sequence[int] | None = None,
                                num_prefix_tokens: int = 1, method: str = resample.LINEAR_CORNERS) -> np.ndarray:
    """Resizes a (1, prefix + rows * columns, D) position embedding to another patch grid.

    By default the original loader's method (vit_jax `interpolate_posembed`): prefix (class-token)
    rows are kept, the grid is resized with `scipy.ndimage.zoom(grid, (new_h / old_h,
    new_w / old_w, 1), order=1)`, reimplemented here in NumPy (float64, cast back). `method`
    picks another of `resample.METHODS` (timm's and Hugging Face's bicubic resizes).

    Args:
        posemb: array (1, tokens, D).
        new_grid: int or (int, int). Target grid (rows, columns).
        old_grid: int or (int, int). Grid of `posemb`. Defaults to the square grid its
            token count implies.
        num_prefix_tokens: int. Rows before the grid (1 with a class token). Defaults to `1`.
        method: str. One of `resample.METHODS`. Defaults to `resample.LINEAR_CORNERS`.

    Returns:
        Array (1, prefix + new_rows * new_columns, D) of `posemb`'s dtype.
    """
    posemb = np.asarray(posemb)
    if posemb.ndim != 3 or posemb.shape[0] != 1:
        raise ValueError(f"`posemb` must have shape (1, tokens, D). Received shape: {posemb.shape}")
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[0, num_prefix_tokens:]
    if old_grid is None:
        side = math.isqrt(len(grid))
        if side * side != len(grid):
            raise ValueError(f"Cannot infer the grid of a position embedding with {len(grid)} grid tokens "
                             f"(not a square); pass `old_grid`. Received shape: {posemb.shape}")
        old_grid = side
    old_h, old_w = (old_grid, old_grid) if isinstance(old_grid, int) else tuple(old_grid)
    new_h, new_w = (new_grid, new_grid) if isinstance(new_grid, int) else tuple(new_grid)
    if old_h * old_w != len(grid):
        raise ValueError(f"`old_grid` {old_h}x{old_w} does not match the {len(grid)} grid tokens of `posemb`.")
    resized = resample.resize_grid(grid.reshape(old_h, old_w, -1), (new_h, new_w), method)
    resized = resized.reshape(1, new_h * new_w, -1)
    return np.concatenate([prefix, resized], axis=1)


def _squeeze_group_norm(array: np.ndarray) -> np.ndarray:
    """GroupNorm scale/bias are stored as (1, 1, 1, C) in the released hybrid files."""
    return array.reshape(array.shape[-1:]) if array.ndim == 4 and array.shape[:3] == (1, 1, 1) else array


def _as_is(array: np.ndarray) -> np.ndarray:
    return array


# big_vision names the block's modules with per-type counters; the released files and the
# Keras layers use the old global counter.
_BIG_VISION_RENAMES = (("MultiHeadDotProductAttention_0", "MultiHeadDotProductAttention_1"),
                       ("LayerNorm_1", "LayerNorm_2"), ("MlpBlock_0", "MlpBlock_3"))

_BLOCK = r"Transformer/(encoderblock_\d+)"
_UNIT = r"block(\d+)/unit(\d+)"

# (checkpoint key regex, Keras weight path template, transform); keys match in full.
KEY_TABLE: tuple[tuple[str, str, Callable[[np.ndarray], np.ndarray]], ...] = (
    (r"embedding/(kernel|bias)", r"embedding/\1", _as_is),
    (r"cls", "cls/cls", _as_is),
    (r"Transformer/posembed_input/pos_embedding", "posembed_input/pos_embedding", _as_is),
    (_BLOCK + r"/(LayerNorm_[02])/scale", r"\1/\2/gamma", _as_is),
    (_BLOCK + r"/(LayerNorm_[02])/bias", r"\1/\2/beta", _as_is),
    (_BLOCK + r"/MultiHeadDotProductAttention_1/(query|key|value)/(kernel|bias)",
     r"\1/MultiHeadDotProductAttention_1/\2/\3", _as_is),
    (_BLOCK + r"/MultiHeadDotProductAttention_1/out/(kernel|bias)",
     r"\1/MultiHeadDotProductAttention_1/attention_output/\2", _as_is),
    (_BLOCK + r"/MlpBlock_3/(Dense_[01]|Dense_gate)/(kernel|bias)", r"\1/MlpBlock_3/\2/\3", _as_is),
    # The ViT family's options (keras_vit's names; the original has none of these):
    (_BLOCK + r"/(ls[12])/scale", r"\1/\2/gamma", _as_is),
    (_BLOCK + r"/MlpBlock_3/norm/scale", r"\1/MlpBlock_3/norm/gamma", _as_is),
    (_BLOCK + r"/MlpBlock_3/norm/bias", r"\1/MlpBlock_3/norm/beta", _as_is),
    (_BLOCK + r"/MultiHeadDotProductAttention_1/(query_norm|key_norm)/scale",
     r"\1/MultiHeadDotProductAttention_1/\2/gamma", _as_is),
    (_BLOCK + r"/MultiHeadDotProductAttention_1/(query_norm|key_norm)/bias",
     r"\1/MultiHeadDotProductAttention_1/\2/beta", _as_is),
    (r"registers", "registers/registers", _as_is),
    (r"dist_token", "dist_token/registers", _as_is),
    (r"head_dist/(kernel|bias)", r"head_dist/\1", _as_is),
    (r"(norm_pre|fc_norm)/scale", r"\1/gamma", _as_is),
    (r"(norm_pre|fc_norm)/bias", r"\1/beta", _as_is),
    # big_vision's attention-pooling head (SigLIP):
    (r"MAPHead_0/probe", "MAPHead_0/probe", _as_is),
    (r"MAPHead_0/MultiHeadDotProductAttention_0/(query|key|value)/(kernel|bias)",
     r"MAPHead_0/MultiHeadDotProductAttention_0/\1/\2", _as_is),
    (r"MAPHead_0/MultiHeadDotProductAttention_0/out/(kernel|bias)",
     r"MAPHead_0/MultiHeadDotProductAttention_0/attention_output/\1", _as_is),
    (r"MAPHead_0/LayerNorm_0/scale", "MAPHead_0/LayerNorm_0/gamma", _as_is),
    (r"MAPHead_0/LayerNorm_0/bias", "MAPHead_0/LayerNorm_0/beta", _as_is),
    (r"MAPHead_0/MlpBlock_0/(Dense_[01])/(kernel|bias)", r"MAPHead_0/MlpBlock_0/\1/\2", _as_is),
    (r"Transformer/encoder_norm/scale", "encoder_norm/gamma", _as_is),
    (r"Transformer/encoder_norm/bias", "encoder_norm/beta", _as_is),
    (r"(pre_logits|head)/(kernel|bias)", r"\1/\2", _as_is),
    (r"conv_root/kernel", "conv_root/kernel", _as_is),
    (r"gn_root/scale", "gn_root/gamma", _squeeze_group_norm),
    (r"gn_root/bias", "gn_root/beta", _squeeze_group_norm),
    (_UNIT + r"/(conv[123]|conv_proj)/kernel", r"block\1_unit\2/\3/kernel", _as_is),
    (_UNIT + r"/(gn[123]|gn_proj)/scale", r"block\1_unit\2/\3/gamma", _squeeze_group_norm),
    (_UNIT + r"/(gn[123]|gn_proj)/bias", r"block\1_unit\2/\3/beta", _squeeze_group_norm),
)


def keras_path(key: str) -> tuple[str, Callable[[np.ndarray], np.ndarray]] | None:
    """Maps a checkpoint key (either naming) to (Keras weight path, transform), or None."""
    if key.startswith("Transformer/encoderblock_"):
        for new, old in _BIG_VISION_RENAMES:
            key = key.replace(f"/{new}/", f"/{old}/")
    for pattern, template, transform in KEY_TABLE:
        match = re.fullmatch(pattern, key)
        if match:
            return match.expand(template), transform
    return None
