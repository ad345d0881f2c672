"""The registry of public ViT checkpoints (`weights=` names) and their download.

The released checkpoints of google-research/vision_transformer (and of its AugReg follow-up, "How to
train your ViT?", arXiv:2106.10270) are flat `.npz` files in a Google Cloud Storage bucket; `fetch`
caches one under `$KERAS_HOME/models/`.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from typing import Sequence

import keras

from keras_vit import variants

_BUCKET = "https://storage.googleapis.com/vit_models"
IMAGENET21K_CLASSES = 21843
IMAGENET_CLASSES = 1000


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
IMAGENET_TAGS = ("imagenet21k+imagenet2012", "augreg-imagenet21k+imagenet2012")


def list_weights(variant: str) -> list[Checkpoint]:
    """Returns the registered checkpoints of a variant ("B/16", "ViT-B_16", "R50+B/16", ...).

    Each `tag` of the result is a valid `weights=` name for that variant's builder; a tag
    with several image sizes resolves to the one matching the input size, else the largest.
    """
    variant = variants.canonical_variant(variant)
    return [entry for entry in REGISTRY if entry.variant == variant]


def pick(entries: Sequence[Checkpoint], image_size: tuple[int, int], tags: Sequence[str]) -> Checkpoint:
    """The entry trained at `image_size` if any, else the largest; ties go to earlier `tags`."""
    def rank(entry):
        return (entry.image_size != image_size[0] or image_size[0] != image_size[1],
                tags.index(entry.tag), -entry.image_size)
    return min(entries, key=rank)


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
