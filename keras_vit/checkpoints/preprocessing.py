"""A checkpoint's own input preprocessing, read from the files beside its weights.

Two formats carry it:
- Hugging Face's `preprocessor_config.json` (the image processor that transformers pairs with the weights:
  `image_mean`, `image_std`, `size`, `crop_size`, `do_center_crop`, `resample`);
- timm's `config.json` (`pretrained_cfg`: `mean`, `std`, `interpolation`, `crop_pct`, `crop_mode`), which is
  what `timm.data.resolve_data_config` + `create_transform` use in evaluation.

The rule, where both are present: `preprocessor_config.json` wins (it is the processor written for those
weights; for CLIP and SigLIP the two disagree, timm cropping at 0.9 where transformers does not crop). Either is
turned into a `Declared` record: the `ViTConfig` input fields, `image_mean`, `image_std` (on [0, 1] pixels),
`resize_mode` (`"squash"`: both sides to the resize size; `"shortest_edge"`: the short side, keeping the aspect
ratio), `crop_fraction` (centre crop / resize size, timm's `crop_pct`; 1 = no crop), `resize_size` (the integer
resize size a processor declares, kept as it is), `interpolation` and `crop_offset` (the crop's top-left corner:
`"floor"`, `(resized - size) // 2` as transformers' `center_crop`; `"round"`, rounded half to even as
torchvision's `CenterCrop`, which timm uses); and the image size the transform produces (the checkpoint's own
input size). At that size the resize is the declared integer; at another size it is `floor(size /
crop_fraction)`, as timm computes it, so a model built at another size keeps the checkpoint's proportions.

Every value is checked where the file is read: means and standard deviations finite (std > 0), sizes positive
integers; an error names the file, the key and the value.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from keras_vit.checkpoints import config_files


# transformers' image processors of the ViT family, and whether a plain int `size` means a square (True) or the
# shortest edge (False), as each processor's `get_size_dict(size, default_to_square=...)` reads it.
PROCESSOR_TYPES = {
    "ViTImageProcessor": True, "ViTFeatureExtractor": True,
    "DeiTImageProcessor": True, "DeiTFeatureExtractor": True,
    "CLIPImageProcessor": False, "CLIPFeatureExtractor": False,
    "SiglipImageProcessor": True,
    "BitImageProcessor": False,  # DINOv2
    "DINOv3ViTImageProcessor": True,  # Fast only: it rescales to [0, 1] before its resize, in float as keras_vit's
}
# PIL's resampling codes, as `resample` stores them, -> tf.image.resize methods (4 BOX and 5 HAMMING: none).
PIL_RESAMPLE = {0: "nearest", 1: "lanczos3", 2: "bilinear", 3: "bicubic"}
TIMM_INTERPOLATION = {"nearest": "nearest", "bilinear": "bilinear", "bicubic": "bicubic", "lanczos": "lanczos3"}
TIMM_CROP_MODES = {"center": "shortest_edge", "squash": "squash"}


@dataclasses.dataclass(frozen=True)
class Declared:
    """What the files beside a checkpoint declare about its input.

    Attributes:
        fields: the `PreprocessingConfig` fields (`variants.PREPROCESSING_FIELDS`).
        source: the file they were read from.
        image_size: (height, width) of the images the transform produces, the checkpoint's own input size: a
            processor's crop (or its fixed resize), timm's `input_size`; None where the output size varies (a
            shortest-edge resize without a crop).
    """

    fields: dict[str, Any]
    source: str
    image_size: tuple[int, int] | None


def read_preprocessing(files: config_files.Beside) -> Declared | None:
    """What the files beside a checkpoint (`files`) declare; None without any.

    Raises:
        ValueError: an unreadable file, an unknown processor type, resample code, interpolation or crop mode, a
            mean or std that is not finite (or a std <= 0), a size that is not a positive integer, or values
            keras_vit cannot reproduce (named, with the file and the key).
    """
    if files.processor is not None:
        return from_processor_config(files.processor, files.path(config_files.PROCESSOR))
    if files.config is not None and isinstance(files.config.get("pretrained_cfg"), dict):
        return from_timm_config(files.config["pretrained_cfg"], files.path(config_files.CONFIG))
    return None


def from_processor_config(config: dict, origin: str) -> Declared:
    """What a transformers `preprocessor_config.json` declares."""
    kind = config.get("image_processor_type") or config.get("feature_extractor_type")
    kind_name = kind.removesuffix("Fast") if isinstance(kind, str) else kind
    if kind_name not in PROCESSOR_TYPES:
        raise ValueError(f"{origin!r}: unknown image processor type {kind!r}. keras_vit reads those of the ViT "
                         f"family: {', '.join(sorted(PROCESSOR_TYPES))} (and their Fast versions).")
    if config.get("do_rescale", True) and not math.isclose(config.get("rescale_factor", 1 / 255), 1 / 255):
        raise ValueError(f"{origin!r}: rescale_factor={config['rescale_factor']!r}; keras_vit's models take "
                         "[0, 255] pixels and reproduce rescale_factor=1/255 only.")
    fields: dict[str, Any] = {}
    if config.get("do_normalize", True):
        fields["image_mean"] = _channels(config.get("image_mean"), "image_mean", origin)
        fields["image_std"] = _channels(config.get("image_std"), "image_std", origin)
    else:
        fields["image_mean"], fields["image_std"] = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    resample = config.get("resample", 2)
    if resample not in PIL_RESAMPLE:
        raise ValueError(f"{origin!r}: resample={resample!r} is not a resampling keras_vit reproduces. Supported "
                         f"PIL codes: {', '.join(f'{code} ({name})' for code, name in PIL_RESAMPLE.items())}.")
    fields["interpolation"] = PIL_RESAMPLE[resample]
    mode, resize = _size(config.get("size", 224), PROCESSOR_TYPES[kind_name], "size", origin)
    fields.update(resize_mode=mode, crop_fraction=1.0, resize_size=resize[0], crop_offset="floor")
    image_size = resize if mode == "squash" else None
    if config.get("do_center_crop", False) and config.get("crop_size") is not None:
        _, crop = _size(config["crop_size"], True, "crop_size", origin)
        if crop[0] != crop[1] or (mode == "squash" and resize[0] != resize[1]):
            raise ValueError(f"{origin!r}: a non-square resize or crop (size={config.get('size')!r}, crop_size="
                             f"{config['crop_size']!r}); keras_vit reproduces square ones.")
        if crop[0] > resize[0]:
            raise ValueError(f"{origin!r}: crop_size {crop[0]} is larger than the resize size {resize[0]} (a padded "
                             "crop); keras_vit reproduces crops inside the image.")
        fields["crop_fraction"] = crop[0] / resize[0]
        image_size = crop
    elif mode == "squash" and resize[0] != resize[1]:
        fields["resize_size"] = None  # both sides are the image size: floor(side / 1.0) gives them exactly
    return Declared(fields, origin, image_size)


def _size(size, default_to_square: bool, key: str, origin: str) -> tuple[str, tuple[int, int]]:
    """("squash" | "shortest_edge", (height, width)) of a processor's `size` / `crop_size` entry."""
    if isinstance(size, dict) and set(size) == {"height", "width"}:
        return "squash", (_positive_int(size["height"], f"{key}['height']", origin),
                          _positive_int(size["width"], f"{key}['width']", origin))
    if isinstance(size, dict) and set(size) == {"shortest_edge"}:
        return "shortest_edge", (_positive_int(size["shortest_edge"], f"{key}['shortest_edge']", origin),) * 2
    if isinstance(size, dict) or isinstance(size, (list, tuple)):
        raise ValueError(f"{origin!r}: {key}={size!r} is not a size keras_vit reproduces. Expected an int, "
                         "{'height': H, 'width': W} or {'shortest_edge': S}.")
    side = _positive_int(size, key, origin)
    return ("squash", (side, side)) if default_to_square else ("shortest_edge", (side, side))


def _positive_int(value, key: str, origin: str) -> int:
    """`value` if it is a positive int (a float with an integer value, as JSON may hold it, is taken)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{origin!r}: {key}={value!r}; expected a positive integer number of pixels.")
    return value


def from_timm_config(config: dict, origin: str) -> Declared:
    """What timm's `pretrained_cfg` (in a hub `config.json`) declares."""
    interpolation = config.get("interpolation", "bicubic")
    if interpolation not in TIMM_INTERPOLATION:
        raise ValueError(f"{origin!r}: interpolation={interpolation!r} is not one keras_vit reproduces. Supported: "
                         f"{', '.join(TIMM_INTERPOLATION)}.")
    crop_mode = config.get("crop_mode", "center")
    if crop_mode not in TIMM_CROP_MODES:
        raise ValueError(f"{origin!r}: crop_mode={crop_mode!r} is not one keras_vit reproduces. Supported: "
                         f"{', '.join(TIMM_CROP_MODES)}.")
    crop_pct = config.get("crop_pct", 0.875)
    if isinstance(crop_pct, bool) or not isinstance(crop_pct, (int, float)) or not 0 < crop_pct <= 1:
        raise ValueError(f"{origin!r}: crop_pct={crop_pct!r}; expected a number in (0, 1].")
    input_size = config.get("input_size")
    image_size = None
    if input_size is not None:
        if not isinstance(input_size, (list, tuple)) or len(input_size) != 3:
            raise ValueError(f"{origin!r}: input_size={input_size!r}; expected [channels, height, width].")
        image_size = tuple(_positive_int(side, "input_size", origin) for side in input_size[1:])
    # timm's rule at every size: floor(size / crop_pct) in floating point (`resize_size` None).
    fields = {**timm_normalization(config, origin),
              "resize_mode": TIMM_CROP_MODES[crop_mode], "crop_fraction": float(crop_pct), "resize_size": None,
              "interpolation": TIMM_INTERPOLATION[interpolation], "crop_offset": "round"}
    return Declared(fields, origin, image_size)


def timm_normalization(config: dict, origin: str) -> dict[str, tuple[float, float, float]]:
    """`image_mean` and `image_std` of timm's `pretrained_cfg` (its `mean` and `std`); ValueError unless each is 3
    numbers (or one, for every channel)."""
    return {"image_mean": _channels(config.get("mean"), "mean", origin),
            "image_std": _channels(config.get("std"), "std", origin)}


def _channels(values, key: str, origin: str) -> tuple[float, float, float]:
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        values = [values] * 3
    if not isinstance(values, (list, tuple)) or len(values) != 3 or \
            not all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values):
        raise ValueError(f"{origin!r}: {key}={values!r}; expected 3 numbers, one per RGB channel.")
    if not all(math.isfinite(value) for value in values):
        raise ValueError(f"{origin!r}: {key}={values!r}; every value must be a finite number.")
    if key in ("std", "image_std") and min(values) <= 0:
        raise ValueError(f"{origin!r}: {key}={values!r}; every standard deviation must be positive.")
    return tuple(float(value) for value in values)
