"""Pretrained weights: the registry of public checkpoints, download, and the `.npz` loader.

The released checkpoints of google-research/vision_transformer (and of its AugReg
follow-up, "How to train your ViT?", arXiv:2106.10270) are flat `.npz` files whose keys
are the Flax parameter paths joined by `/`. Keras weights in this package carry the same
names (`keras_vit.layers`), so the loader is a table of key patterns (`KEY_TABLE`) plus
two transforms: GroupNorm parameters stored as (1, 1, 1, C) are squeezed, and position
embeddings are resampled to the model's patch grid like the original loader does.

The loader checks the *whole* checkpoint against the model before it assigns anything:
a missing or unexpected key, or a shape it cannot reconcile, is a `ValueError` and the
model is left untouched.

timm and Hugging Face `.safetensors` files (`keras_vit.torch_checkpoints`) are translated
into this key layout and then go through the same checks.
"""

from __future__ import annotations

import dataclasses
import math
import os
import posixpath
import re
import warnings
import zipfile
import zlib
from typing import Callable, Sequence

import keras
import numpy as np

from keras_vit import torch_checkpoints, variants

_BUCKET = "https://storage.googleapis.com/vit_models"
IMAGENET21K_CLASSES = 21843
IMAGENET_CLASSES = 1000


# ---------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One public checkpoint.

    Attributes:
        variant: str. Variant name in `keras_vit.VARIANTS`, e.g. `"B/16"`.
        tag: str. Weights name passed as `weights=`, e.g. `"imagenet21k"`.
        url: str. Download address.
        classes: int. Size of the checkpoint's head.
        image_size: int. Square input size it was trained or fine-tuned at.
        representation_size: int or None. Width of its `pre_logits` layer, if any.
    """

    variant: str
    tag: str
    url: str
    classes: int
    image_size: int
    representation_size: int | None = None

    @property
    def filename(self) -> str:
        return posixpath.basename(self.url)


def _original_checkpoints() -> list[Checkpoint]:
    """The checkpoints of the paper: `imagenet21k/` and `imagenet21k+imagenet2012/`."""
    pretrained = ["B/16", "B/32", "B/8", "L/16", "L/32", "H/14", "R50+B/16", "R50+L/32"]
    fine_tuned_384 = ["B/16", "B/32", "B/8", "L/16", "L/32", "R50+B/16"]
    fine_tuned_224 = ["B/16", "L/16"]

    def file_name(variant: str) -> str:  # "R50+B/16" -> "R50+ViT-B_16"
        backbone, _, vit = variant.rpartition("+")
        return (backbone + "+" if backbone else "") + "ViT-" + vit.replace("/", "_")

    entries = [Checkpoint(v, "imagenet21k", f"{_BUCKET}/imagenet21k/{file_name(v)}.npz", IMAGENET21K_CLASSES,
                          224, variants.VARIANTS[v]["hidden_dim"]) for v in pretrained]
    entries += [Checkpoint(v, "imagenet21k+imagenet2012", f"{_BUCKET}/imagenet21k+imagenet2012/{file_name(v)}.npz",
                           IMAGENET_CLASSES, 384) for v in fine_tuned_384]
    entries += [Checkpoint(v, "imagenet21k+imagenet2012",
                           f"{_BUCKET}/imagenet21k+imagenet2012/{file_name(v)}-224.npz", IMAGENET_CLASSES, 224)
                for v in fine_tuned_224]
    return entries


# AugReg (arXiv:2106.10270) checkpoints, one pre-training per model (the selection timm registers):
# variant -> (ImageNet-21k pre-training, {resolution: ImageNet-1k fine-tune}). Their ImageNet-21k
# heads are trained (not zeroed) and have no pre_logits layer; were one there, loading with the
# head would fail on the unexpected key rather than build a wrong model.
_AUGREG = {
    "Ti/16": ("Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0", {
        224: "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224",
        384: "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384"}),
    "S/16": ("S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0", {
        224: "S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224",
        384: "S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384"}),
    "S/32": ("S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0", {
        224: "S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224",
        384: "S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384"}),
    "B/8": ("B_8-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0", {
        224: "B_8-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_224"}),
    "B/16": ("B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0", {
        224: "B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_224",
        384: "B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_384"}),
    "B/32": ("B_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.03-do_0.0-sd_0.0", {
        224: "B_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224",
        384: "B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384"}),
    "L/16": ("L_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1", {
        224: "L_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.01-res_224",
        384: "L_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.01-res_384"}),
    "R26+S/32": ("R26_S_32-i21k-300ep-lr_0.001-aug_medium2-wd_0.03-do_0.0-sd_0.0", {
        224: "R26_S_32-i21k-300ep-lr_0.001-aug_light0-wd_0.03-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.03-res_224",
        384: "R26_S_32-i21k-300ep-lr_0.001-aug_medium2-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384"}),
    "R50+L/32": ("R50_L_32-i21k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.0-sd_0.0", {
        224: "R50_L_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.01-res_224",
        384: "R50_L_32-i21k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_384"}),
}


def _augreg_checkpoints() -> list[Checkpoint]:
    entries = []
    for variant, (pretrained, fine_tuned) in _AUGREG.items():
        entries.append(Checkpoint(variant, "augreg-imagenet21k", f"{_BUCKET}/augreg/{pretrained}.npz",
                                  IMAGENET21K_CLASSES, 224))
        entries += [Checkpoint(variant, "augreg-imagenet21k+imagenet2012", f"{_BUCKET}/augreg/{name}.npz",
                               IMAGENET_CLASSES, size) for size, name in fine_tuned.items()]
    return entries


REGISTRY: tuple[Checkpoint, ...] = tuple(_original_checkpoints() + _augreg_checkpoints())

# `weights="imagenet"` prefers, at equal resolution match, the paper's fine-tunes.
_IMAGENET_TAGS = ("imagenet21k+imagenet2012", "augreg-imagenet21k+imagenet2012")


def list_weights(variant: str) -> list[Checkpoint]:
    """Returns the registered checkpoints of a variant ("B/16", "ViT-B_16", "R50+B/16", ...).

    Each `tag` of the result is a valid `weights=` name for that variant's builder; a tag
    with several image sizes resolves to the one matching the input size, else the largest.
    """
    variant = variants.canonical_variant(variant)
    return [entry for entry in REGISTRY if entry.variant == variant]


def _pick(entries: Sequence[Checkpoint], image_size: tuple[int, int], tags: Sequence[str]) -> Checkpoint:
    """The entry trained at `image_size` if any, else the largest; ties go to earlier `tags`."""
    def rank(entry):
        return (entry.image_size != image_size[0] or image_size[0] != image_size[1],
                tags.index(entry.tag), -entry.image_size)
    return min(entries, key=rank)


# ---------------------------------------------------------------------------------------
# Resolving `weights=` before the model is built
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WeightsSource:
    """What `weights=` resolved to.

    Attributes:
        location: str. Local path, or the URL of a registered checkpoint (fetched on load).
        checkpoint: the registry entry, or None for a local file.
        representation_size: int or None. `pre_logits` width the model should be built with
            when the caller left `representation_size=None`: the checkpoint's, if its head is
            going to be loaded (`include_top=True`), else None.
        numerics: model options the checkpoint's model fixes (`layer_norm_epsilon`,
            `gelu_approximate`): set for timm / Hugging Face files, empty otherwise.
        head_classes: int or None. Width of the checkpoint's head; None when it has none or
            when the file does not say (`.weights.h5`).
    """

    location: str
    checkpoint: Checkpoint | None = None
    representation_size: int | None = None
    numerics: dict = dataclasses.field(default_factory=dict)
    head_classes: int | None = None


def resolve(weights: str | None, *, variant: str | None, image_size: tuple[int, int], include_top: bool,
            classes: int) -> WeightsSource | None:
    """Validates `weights=` without downloading anything.

    Args:
        weights: None, `"imagenet"`, a registered tag (see `list_weights`), or a path to an
            `.npz` checkpoint, a `.weights.h5` file or a timm / Hugging Face `.safetensors` file.
        variant: str or None. The model's variant; registered names need one.
        image_size: (int, int). The model's input height and width.
        include_top: bool. Whether the model has a head.
        classes: int. Size of the model's head.

    Returns:
        None for `weights=None`, else a `WeightsSource`.

    Raises:
        ValueError: unknown name or unreadable file; or, as `keras.applications`, pretrained weights
            with `include_top=True` and `classes` other than the checkpoint's head (a new head would be
            all zeros under softmax: every prediction uniform).
    """
    if weights is None:
        return None
    if not isinstance(weights, str):
        raise ValueError(f"`weights` must be None, a registered name or a file path. Received: {weights!r}")
    source = _resolve_file(weights) if os.path.isfile(weights) else _resolve_name(weights, variant, image_size)
    if not include_top:
        return dataclasses.replace(source, representation_size=None)
    if not source.location.endswith(".h5"):  # A Keras weights file does not say; Keras checks it on load.
        _check_head(weights, source.head_classes, classes)
    return source


def _resolve_name(weights: str, variant: str | None, image_size: tuple[int, int]) -> WeightsSource:
    """A registered name: the registry entry that fits the variant and input size."""
    if variant is None:
        raise ValueError(f"`weights={weights!r}` is not an existing file, and registered weights names need a "
                         "`variant` (e.g. variant='B/16').")
    entries = list_weights(variant)
    if weights == "imagenet":
        candidates = [entry for entry in entries if entry.tag in _IMAGENET_TAGS]
        tags = _IMAGENET_TAGS
    else:
        candidates = [entry for entry in entries if entry.tag == weights]
        tags = (weights,)
    if not candidates:
        names = sorted({entry.tag for entry in entries} | ({"imagenet"} if any(
            entry.tag in _IMAGENET_TAGS for entry in entries) else set()))
        raise ValueError(f"Unknown weights {weights!r} for variant {variant!r}: not a file, and not a registered "
                         f"name. Expected None, a path to a .npz, .weights.h5 or .safetensors file, or one of "
                         f"{names}.")
    entry = _pick(candidates, image_size, tags)
    return WeightsSource(entry.url, entry, entry.representation_size, head_classes=entry.classes)


def _check_file_kind(path: str) -> None:
    """Refuses pickle files (never opened) and whole-model `.keras` files, saying what to use."""
    torch_checkpoints.refuse_pickle(path)
    if path.endswith(".keras"):
        raise ValueError(f"{path!r} is a whole Keras model, not a weights file: load it with "
                         "`keras.saving.load_model(path)`. Weights files are `.npz` and `.safetensors` "
                         "checkpoints and `.weights.h5`.")


def _resolve_file(path: str) -> WeightsSource:
    """A local file; an `.npz` or `.safetensors` file is opened to read its head and pre-logits widths
    (and the layout, hence the numerics, of a `.safetensors` file)."""
    _check_file_kind(path)
    if path.endswith(".h5"):
        return WeightsSource(path)
    if path.endswith(".safetensors"):
        shapes = {name: info.shape for name, info in torch_checkpoints.read_header(path).items()}
        layout = torch_checkpoints.detect_layout(shapes)
        torch_checkpoints.check_supported(shapes, layout, origin=path)
        head, representation = torch_checkpoints.top_widths(shapes, layout)
        return WeightsSource(path, representation_size=representation,
                             numerics=dict(torch_checkpoints.NUMERICS[layout]), head_classes=head)
    arrays = read_npz(path, keys=("head/bias", "pre_logits/bias"))
    head = arrays["head/bias"].shape[0] if "head/bias" in arrays else None
    representation = arrays["pre_logits/bias"].shape[0] if "pre_logits/bias" in arrays else None
    return WeightsSource(path, representation_size=representation, head_classes=head)


def _check_head(weights: str, checkpoint_classes: int | None, classes: int) -> None:
    """With `include_top=True`, pretrained weights must bring the head: same `classes`."""
    if checkpoint_classes is None:
        raise ValueError(f"weights={weights!r} has no classification head, but the model was asked for "
                         "include_top=True: build it with include_top=False (and `pooling`) and add your head.")
    if checkpoint_classes != classes:
        raise ValueError(
            f"weights={weights!r} has a {checkpoint_classes}-class head, but the model was asked for include_top=True "
            f"and classes={classes}: its head would be a new all-zeros layer (uniform predictions). Pass "
            f"classes={checkpoint_classes} to use the checkpoint's head, or, to fine-tune for your classes, build the "
            "backbone with include_top=False and pooling='token' (pooling='avg' for classifier='gap') and add your "
            f"head: `keras_vit.ViTModel(backbone.input, keras.layers.Dense({classes})(backbone.output))`.")


# ---------------------------------------------------------------------------------------
# Download and reading
# ---------------------------------------------------------------------------------------

def fetch(checkpoint: Checkpoint, cache_dir: str | None = None) -> str:
    """Downloads a registered checkpoint into `<cache_dir>/models/` unless it is already there.

    No checksums are published for these files: a download is validated by its keys and
    shapes when it is loaded.

    Args:
        checkpoint: a registry entry.
        cache_dir: str. Cache root. Defaults to `$KERAS_HOME`, else `~/.keras`.

    Returns:
        The local path.
    """
    cache_dir = cache_dir or os.environ.get("KERAS_HOME")
    if cache_dir:
        # get_file falls back to /tmp/.keras when the cache root does not exist yet.
        os.makedirs(cache_dir, exist_ok=True)
    return keras.utils.get_file(checkpoint.filename, origin=checkpoint.url, cache_subdir="models",
                                cache_dir=cache_dir)


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
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise ValueError("it holds a single array, not an archive of named arrays")
            names = {name.removeprefix("params/"): name for name in archive.files}
            wanted = names if keys is None else [key for key in keys if key in names]
            return {key: archive[names[key]] for key in wanted}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as error:
        raise ValueError(f"Could not read {path!r} as an .npz checkpoint ({type(error).__name__}: {error}). "
                         "The file is truncated, corrupt or of another format; if it was downloaded, delete "
                         "it to download it again.") from error


# ---------------------------------------------------------------------------------------
# Position-embedding resampling
# ---------------------------------------------------------------------------------------

def _zoom_axis(array: np.ndarray, axis: int, size: int) -> np.ndarray:
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


def resample_position_embedding(posemb: np.ndarray, new_grid: int | Sequence[int],
                                old_grid: int | Sequence[int] | None = None,
                                num_prefix_tokens: int = 1) -> np.ndarray:
    """Resizes a (1, prefix + rows * columns, D) position embedding to another patch grid.

    The original loader's method (vit_jax `interpolate_posembed`): prefix (class-token)
    rows are kept, the grid is resized with `scipy.ndimage.zoom(grid, (new_h / old_h,
    new_w / old_w, 1), order=1)`, reimplemented here in NumPy (float64, cast back).

    Args:
        posemb: array (1, tokens, D).
        new_grid: int or (int, int). Target grid (rows, columns).
        old_grid: int or (int, int). Grid of `posemb`. Defaults to the square grid its
            token count implies.
        num_prefix_tokens: int. Rows before the grid (1 with a class token). Defaults to `1`.

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
    resized = grid.reshape(old_h, old_w, -1).astype(np.float64)
    resized = _zoom_axis(_zoom_axis(resized, 0, new_h), 1, new_w)
    resized = resized.reshape(1, new_h * new_w, -1).astype(posemb.dtype)
    return np.concatenate([prefix, resized], axis=1)


# ---------------------------------------------------------------------------------------
# Checkpoint keys -> Keras weight paths
# ---------------------------------------------------------------------------------------

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
    (_BLOCK + r"/MlpBlock_3/(Dense_[01])/(kernel|bias)", r"\1/MlpBlock_3/\2/\3", _as_is),
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

_TOP_LAYERS = ("pre_logits", "head")
_POSEMB_PATH = "posembed_input/pos_embedding"


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


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------

def load(model: keras.Model, source: WeightsSource | str) -> None:
    """Loads weights into a model built by `keras_vit`; all-or-nothing for `.npz` and `.safetensors` files.

    A timm / Hugging Face `.safetensors` file needs a model built with its numerics: build it
    with `weights=` that file (or with the options in `torch_checkpoints.NUMERICS`).

    Args:
        model: a `keras.Model` from `keras_vit.VisionTransformer` or a variant builder.
        source: a `WeightsSource` from `resolve`, or a path to an `.npz` checkpoint, a
            `.weights.h5` file or a `.safetensors` file.

    Raises:
        ValueError: unreadable file, or a checkpoint that does not fit the model (the error
            lists every missing key, unexpected key and shape mismatch); the model is unchanged.
    """
    if isinstance(source, str):
        source = WeightsSource(source)
    path = fetch(source.checkpoint) if source.checkpoint else source.location
    _check_file_kind(path)
    if path.endswith(".h5"):
        model.load_weights(path)
        return
    if path.endswith(".safetensors"):
        assignments = _plan_safetensors(model, path)
    else:
        assignments = plan_assignments(model, read_npz(path), origin=path)
    for variable, value in assignments:
        variable.assign(value)
    _warn_if_zero_head(model, assignments)


def _plan_safetensors(model: keras.Model, path: str) -> list[tuple[keras.Variable, np.ndarray]]:
    """`plan_assignments` for a timm / Hugging Face file, its problems named by the file's keys."""
    tensors = torch_checkpoints.read_safetensors(path)
    layout = torch_checkpoints.detect_layout(tensors)
    torch_checkpoints.check_supported({key: value.shape for key, value in tensors.items()}, layout, origin=path)
    queries = [variable for variable in model.weights
               if variable.path.endswith("MultiHeadDotProductAttention_1/query/kernel")]
    num_heads = queries[0].shape[1] if queries else 1
    translation = torch_checkpoints.translate(tensors, layout, num_heads)
    sources = torch_checkpoints.weight_sources(layout, len(queries), torch_checkpoints.hf_prefix(tensors))
    return plan_assignments(model, translation.arrays, origin=path, source_keys=translation.source_keys,
                            weight_sources=sources, problems=translation.problems)


def plan_assignments(model: keras.Model, arrays: dict[str, np.ndarray], origin: str = "checkpoint", *,
                     source_keys: dict[str, str] | None = None, weight_sources: dict[str, str] | None = None,
                     problems: Sequence[str] = ()) -> list[tuple[keras.Variable, np.ndarray]]:
    """Matches every checkpoint array to a model weight; assigns nothing.

    Backbone weights must match one-to-one (position embeddings are resampled to the
    model's grid). Top layers (`pre_logits`, `head`) follow the transfer rules: the head is
    loaded when its shape matches, else left at its initialization (with a warning); `pre_logits`
    is then loaded when the model has one and dropped otherwise.

    Args:
        model: the model.
        arrays: `.npz` key -> array.
        origin: str. The file, for messages.
        source_keys: optional `.npz` key -> the key of a translated file it came from, for messages.
        weight_sources: optional model weight path -> the translated file's key that would feed it,
            for messages about missing keys.
        problems: problems found before (e.g. in translation), listed with the others.

    Returns:
        (variable, value) pairs to assign.

    Raises:
        ValueError: listing every problem found.
    """
    source_keys, weight_sources = source_keys or {}, weight_sources or {}

    def name(key: str) -> str:
        source = source_keys.get(key, key)
        return repr(key) if source == key else f"{source!r} (as {key!r})"

    variables = {variable.path: variable for variable in model.weights}
    mapped, problems = {}, list(problems)
    for key, array in arrays.items():
        target = keras_path(key)
        if target is None:
            problems.append(f"unexpected key {name(key)} {array.shape}: no model weight corresponds to it")
            continue
        path, transform = target
        if path in mapped:
            problems.append(f"keys {name(mapped[path][0])} and {name(key)} both map to model weight {path!r}")
        mapped[path] = (key, transform(array))

    head_kept = _head_loads(variables, mapped)
    assignments, kept, resized = [], [], None
    for path, variable in variables.items():
        layer = path.split("/")[0]
        if path not in mapped or (layer == "head" and not head_kept):
            if head_kept or layer not in _TOP_LAYERS:
                source = f" {weight_sources[path]!r}" if path in weight_sources else ""
                problems.append(f"missing key{source} for model weight {path!r} (expected shape "
                                f"{tuple(variable.shape)})")
            kept.append(path)
            continue
        key, value = mapped.pop(path)
        if path == _POSEMB_PATH and value.shape != tuple(variable.shape):
            rows, columns = model.get_layer("posembed_input").grid_size
            resized = (f"{name(key)} resampled from {value.shape[1]} to {variable.shape[1]} tokens "
                       f"({rows}x{columns} grid)")
            value = _resample_for(model, value, variable, name(key), problems)
        if value is not None and value.shape != tuple(variable.shape):
            problems.append(f"shape mismatch for key {name(key)} -> {path!r}: expected {tuple(variable.shape)}, "
                            f"found {value.shape}")
        elif value is not None:
            assignments.append((variable, value))
    for path, (key, value) in mapped.items():
        if head_kept or path.split("/")[0] not in _TOP_LAYERS:
            problems.append(f"unexpected key {name(key)} {value.shape}: the model has no weight {path!r}")
    if problems:
        raise ValueError(_mismatch_message(model, arrays, variables, problems, origin))
    # Without a head (include_top=False) dropping the checkpoint's top layers is what was asked for.
    if "head/kernel" in variables:
        _warn_top_changes(kept, dropped=[source_keys.get(key, key) for key, _ in mapped.values()])
    if resized:
        warnings.warn(f"keras_vit: position embedding {resized}, as the original loader does.", stacklevel=3)
    return assignments


def _head_loads(variables: dict, mapped: dict) -> bool:
    """True if the checkpoint's head fits the model's head (then `pre_logits` must match too)."""
    if "head/kernel" not in variables or "head/kernel" not in mapped:
        return False
    return mapped["head/kernel"][1].shape == tuple(variables["head/kernel"].shape)


def _warn_top_changes(kept: list[str], dropped: list[str]) -> None:
    """Warns of the top-layer weights left at their initialization and the checkpoint keys not used."""
    if kept:
        warnings.warn("keras_vit: not in the checkpoint or of another shape, left at their initialization "
                      f"(zeros for the head): {', '.join(kept)}.", stacklevel=3)
    if dropped:
        warnings.warn(f"keras_vit: checkpoint keys not used by this model: {', '.join(dropped)}.", stacklevel=3)


def _resample_for(model: keras.Model, value: np.ndarray, variable, key: str, problems: list) -> np.ndarray | None:
    """Position embedding resampled to the model's grid, or None (with a problem) if impossible.

    `key` is the checkpoint key as messages show it (quoted)."""
    layer = model.get_layer("posembed_input")
    if value.ndim != 3 or value.shape[-1] != variable.shape[-1]:
        problems.append(f"shape mismatch for key {key}: expected {tuple(variable.shape)}, found {value.shape}")
        return None
    try:
        return resample_position_embedding(value, layer.grid_size, num_prefix_tokens=layer.num_prefix_tokens)
    except ValueError as error:
        problems.append(f"cannot resample key {key} {value.shape} to {tuple(variable.shape)}: {error}")
        return None


def _architecture_summary(widths: dict[str, tuple], block_keys) -> str:
    width = widths.get("embedding/bias", ("?",))[-1]
    blocks = {re.search(r"encoderblock_(\d+)", key).group(1) for key in block_keys if "encoderblock_" in key}
    return f"hidden size {width}, {len(blocks)} encoder blocks"


def _mismatch_message(model, arrays, variables, problems: list[str], origin: str) -> str:
    model_widths = {path: tuple(variable.shape) for path, variable in variables.items()}
    checkpoint_widths = {"embedding/bias": arrays["embedding/bias"].shape} if "embedding/bias" in arrays else {}
    # Key-set problems first: they tell a wrong variant apart from a resolution change.
    problems = sorted(problems, key=lambda problem: not problem.startswith(("missing", "unexpected")))
    shown = problems[:20]
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    return (f"{origin!r} does not fit model {model.name!r} ({len(problems)} problem(s); no weight was "
            f"changed).\n  checkpoint: {_architecture_summary(checkpoint_widths, arrays)}; model: "
            f"{_architecture_summary(model_widths, variables)}.\n  - " + "\n  - ".join(shown) + more)


def _warn_if_zero_head(model: keras.Model, assignments) -> None:
    for variable, value in assignments:
        if variable.path == "head/kernel" and not np.any(value):
            warnings.warn(f"keras_vit: the loaded head of model {model.name!r} is all zeros (an ImageNet-21k "
                          "pre-training checkpoint with its head zeroed): every logit equals the bias, whatever "
                          "the image. Build with include_top=False and add your head to fine-tune.", stacklevel=3)
