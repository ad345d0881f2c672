"""The one table of ViT variants (paper Table 1, plus Ti/S and B/8, and the hybrids), and `ViTConfig`, the one
description of a ViT's forward pass that the builders, the checkpoint reader and the layers share.

Keys are the paper's names without the "ViT-" prefix; hybrids take patch size 1 on the
ResNet feature map, whose stride is 2 ** (1 + number of stages): (3, 4, 9) gives 16,
(2, 2, 2, 2) and (3, 4, 6, 3) give 32.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Iterator, Mapping

_TINY = dict(hidden_dim=192, mlp_dim=768, num_heads=3, num_layers=12)
_SMALL = dict(hidden_dim=384, mlp_dim=1536, num_heads=6, num_layers=12)
_BASE = dict(hidden_dim=768, mlp_dim=3072, num_heads=12, num_layers=12)
_LARGE = dict(hidden_dim=1024, mlp_dim=4096, num_heads=16, num_layers=24)
_HUGE = dict(hidden_dim=1280, mlp_dim=5120, num_heads=16, num_layers=32)

VARIANTS: dict[str, dict[str, Any]] = {
    "Ti/16": dict(_TINY, patch_size=16),
    "S/16": dict(_SMALL, patch_size=16),
    "S/32": dict(_SMALL, patch_size=32),
    "B/8": dict(_BASE, patch_size=8),
    "B/16": dict(_BASE, patch_size=16),
    "B/32": dict(_BASE, patch_size=32),
    "L/16": dict(_LARGE, patch_size=16),
    "L/32": dict(_LARGE, patch_size=32),
    "H/14": dict(_HUGE, patch_size=14),
    "R50+B/16": dict(_BASE, patch_size=1, resnet_stages=(3, 4, 9)),
    "R26+S/32": dict(_SMALL, patch_size=1, resnet_stages=(2, 2, 2, 2)),
    "R50+L/32": dict(_LARGE, patch_size=1, resnet_stages=(3, 4, 6, 3)),
}

ARCHITECTURE = ("patch_size", "hidden_dim", "mlp_dim", "num_heads", "num_layers")
TRAINING_FIELDS = ("dropout_rate", "attention_dropout_rate", "drop_path_rate", "remat")  # not the function computed
CLASSIFIERS = ("token", "gap", "map", "token_gap", "patch_gap")
CLASS_TOKEN_CLASSIFIERS = ("token", "token_gap", "patch_gap")  # those with a class token
POSITION_EMBEDDINGS = ("learned", "learned_2d", "sincos_2d", "none")
ROPE_FORMS = ("dinov3", "eva02")  # the coordinates of `RotaryPositionEmbedding`
ACTIVATIONS = ("gelu", "quick_gelu", "silu")
RESIZE_MODES = ("squash", "shortest_edge")
# How a position table is resized to another grid (`keras_vit.checkpoints.resample`): the original's linear rule
# (.npz), PyTorch's bicubic (transformers), bicubic with antialiasing (timm).
POSITION_RESAMPLINGS = ("linear_corners", "bicubic", "bicubic_antialias")
CROP_OFFSETS = ("floor", "round")
INTERPOLATIONS = ("bilinear", "bicubic", "nearest", "lanczos3")


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """A ViT's forward pass: its architecture, the ViT family's options, its numerics and its regularization.

    `decode_variant` returns one for a row of the variant table; a checkpoint file gives the fields it fixes
    (`keras_vit.checkpoints.reader`); every field is a keyword of `VisionTransformer` and of the builders
    (`keras_vit.ViTB16(qk_norm=True)`), and `TransformerBlock` takes the fields its `__init__` names. It reads
    like a mapping too (`config["num_heads"]`, `dict(config)`, `VisionTransformer(**config)`).

    Adding an option: a field here (with the default that leaves today's models unchanged), its use in a
    layer or in `models._forward`, its rows in the checkpoint key tables, a row in the tests' family harness
    (docs/architecture.md has the checklist).
    """

    # Architecture (paper Table 1). patch_size is on the image, or on the ResNet feature map for hybrids.
    patch_size: int
    hidden_dim: int
    mlp_dim: int
    num_heads: int
    num_layers: int
    resnet_stages: tuple[int, ...] | None = None
    # Tokens, pooling and head.
    classifier: str = "token"  # "token_gap": the head reads [class token; mean patch token] (DINOv2's classifiers);
    # "patch_gap": a class token, the head reads the mean patch token (timm's global_pool="avg" without fc_norm)
    position_embedding: str = "learned"  # the table added to the tokens ("none": DINOv3)
    rope: str | None = None  # rotary positions of q and k (`RotaryPositionEmbedding`): "dinov3" or "eva02"
    rope_theta: float = 100.0  # RoPE's base period (DINOv3's; EVA-02's is 10000)
    rope_reference_grid: tuple[int, int] | None = None  # "eva02": positions in patches of this grid (its pre-training)
    rope_shift: float | None = None  # RoPE's train-time augmentations of the patch coordinates (DINOv3's
    rope_jitter: float | None = None  # pos_embed_shift, _jitter, _rescale); training only
    rope_rescale: float | None = None
    position_resampling: str = "linear_corners"  # the checkpoint's source's: a model of any size fits it so
    representation_size: int | None = None
    # Options of the ViT family (timm's names in brackets).
    patch_bias: bool = True
    num_register_tokens: int = 0  # [reg_tokens] DINOv2: 4
    no_embed_class: bool = False  # [no_embed_class] DeiT-III
    distillation_token: bool = False  # DeiT distilled
    norm_pre: bool = False  # [norm_pre] CLIP
    layer_scale_init: float | None = None  # [init_values] DeiT-III, DINOv2
    qk_norm: bool = False  # [qk_norm]
    fc_norm: bool = False  # [fc_norm]
    gated_mlp: bool = False  # SwiGLU form: Dense_1(act(Dense_gate(x)) * Dense_0(x)) (DINOv3 H+ / 7B, EVA-02)
    mlp_norm: bool = False  # [scale_mlp] a LayerNorm on the MLP's hidden layer (EVA-02 B / L)
    # Numerics: the original's (vit_jax) by default.
    layer_norm_epsilon: float = 1e-6
    gelu_approximate: bool = True
    activation: str = "gelu"
    # Regularization and memory.
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    drop_path_rate: float = 0.0
    remat: bool = False

    def __post_init__(self):
        stages = self.resnet_stages
        if stages is not None and not isinstance(stages, tuple):
            object.__setattr__(self, "resnet_stages", tuple(stages) or None)
        grid = self.rope_reference_grid
        if isinstance(grid, list):
            object.__setattr__(self, "rope_reference_grid", tuple(grid))
        self._check()

    def _check(self) -> None:
        _check_choices(self, (("classifier", CLASSIFIERS), ("position_embedding", POSITION_EMBEDDINGS),
                              ("activation", ACTIVATIONS), ("position_resampling", POSITION_RESAMPLINGS)))
        for field in ARCHITECTURE:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be a positive int. Received: {field}={value!r}")
        if self.distillation_token and (self.classifier != "token" or self.num_register_tokens
                                        or self.no_embed_class or self.fc_norm):
            raise ValueError("distillation_token=True needs classifier='token' and no register tokens, "
                             f"no_embed_class or fc_norm. Received: classifier={self.classifier!r}, "
                             f"num_register_tokens={self.num_register_tokens}, no_embed_class="
                             f"{self.no_embed_class}, fc_norm={self.fc_norm}")
        if self.rope not in (None, *ROPE_FORMS):
            raise ValueError(f"rope must be None (no rotary positions) or one of {ROPE_FORMS}. Received: "
                             f"rope={self.rope!r}")
        if self.rope is not None and (self.hidden_dim // self.num_heads) % 4:
            raise ValueError(f"rope={self.rope!r} needs a head size (hidden_dim / num_heads) divisible by 4 "
                             f"(two axes, sine and cosine). Received: hidden_dim={self.hidden_dim}, "
                             f"num_heads={self.num_heads}")
        grid = self.rope_reference_grid
        if grid is not None and (self.rope != "eva02" or not isinstance(grid, tuple) or len(grid) != 2 or not all(
                isinstance(side, int) and not isinstance(side, bool) and side > 0 for side in grid)):
            raise ValueError(f"rope_reference_grid must be None or (rows, columns), positive ints, with rope='eva02'. "
                             f"Received: rope_reference_grid={grid!r}, rope={self.rope!r}")
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise ValueError(f"rope_theta must be a positive number. Received: rope_theta={theta!r}")
        for field, low in (("rope_shift", 0), ("rope_jitter", 1), ("rope_rescale", 1)):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < low):
                raise ValueError(f"{field} must be None (off) or a number >= {low}. Received: {field}={value!r}")

    # --- derived quantities ---
    @property
    def stride(self) -> int:
        """Pixels per token along each axis: patch size times the ResNet stem's stride."""
        return total_stride(self)

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patches: class token, distillation token, registers."""
        return self.class_token + self.distillation_token + self.num_register_tokens

    @property
    def class_token(self) -> bool:
        """Whether the model has a class token (`classifier` "token", "token_gap" or "patch_gap")."""
        return self.classifier in CLASS_TOKEN_CLASSIFIERS

    def replace(self, **changes) -> ViTConfig:
        """A copy with `changes` (checked like the builders' keywords)."""
        check_options(changes)
        return dataclasses.replace(self, **changes)

    def arguments_of(self, function) -> dict[str, Any]:
        """The fields that `function` (e.g. `TransformerBlock`) takes as keyword arguments of the same name."""
        import inspect

        parameters = inspect.signature(function).parameters
        return {name: getattr(self, name) for name in OPTIONS if name in parameters}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (`ViTConfig.from_dict` reverses it)."""
        fields = dataclasses.asdict(self)
        if fields["resnet_stages"] is not None:
            fields["resnet_stages"] = list(fields["resnet_stages"])
        return fields

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> ViTConfig:
        check_options(fields)
        return cls(**fields)

    # --- read-only mapping view ---
    def __getitem__(self, name: str) -> Any:
        if name not in OPTIONS:
            raise KeyError(name)
        return getattr(self, name)

    def keys(self) -> tuple[str, ...]:
        return OPTIONS

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name) if name in OPTIONS else default

    def __iter__(self) -> Iterator[str]:
        return iter(OPTIONS)


OPTIONS: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(ViTConfig))


@dataclasses.dataclass(frozen=True)
class PreprocessingConfig:
    """How a checkpoint's images are prepared for its model: the normalization of [0, 255] pixels that the
    model's `preprocessing` layer applies, `(x / 255 - image_mean) / image_std`, and the resize and centre crop
    that the exports apply to an image of another size (`keras_vit.image_io.fit_to_model`).

    Read from the files beside a checkpoint (`keras_vit.checkpoints.preprocessing`: a `preprocessor_config.json`,
    or timm's `pretrained_cfg`), or given as the builders' input keywords (`ViTB16(image_mean=...)`); carried by
    the model (`model.preprocessing_config`) and by its `.keras` file. The forward (`ViTConfig`) never reads it:
    timm keeps the same record in `pretrained_cfg`, outside its model's arguments.
    """

    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)  # on [0, 1] pixels; the original's [-1, 1] range
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    resize_mode: str = "squash"  # "squash": both sides to the resize size; "shortest_edge": the short side
    crop_fraction: float = 1.0  # centre crop / resize size (timm's crop_pct); 1: no crop
    resize_size: int | None = None  # the declared resize size at the model's size; None: floor(size / crop_fraction)
    interpolation: str = "bilinear"  # of the resize, antialiased when shrinking
    crop_offset: str = "floor"  # the crop's top-left: (resized - size) // 2 (transformers) or rounded (torchvision)

    def __post_init__(self):
        for field in ("image_mean", "image_std"):
            values = getattr(self, field)
            if not isinstance(values, (list, tuple)) or len(values) != 3:
                raise ValueError(f"{field} must be 3 numbers, one per RGB channel. Received: {field}={values!r}")
            object.__setattr__(self, field, tuple(float(value) for value in values))
        _check_choices(self, (("resize_mode", RESIZE_MODES), ("interpolation", INTERPOLATIONS),
                              ("crop_offset", CROP_OFFSETS)))
        for field in ("image_mean", "image_std"):
            if not all(math.isfinite(value) for value in getattr(self, field)):
                raise ValueError(f"Every {field} must be a finite number. Received: {field}={getattr(self, field)}")
        if min(self.image_std) <= 0:
            raise ValueError(f"Every image_std must be positive. Received: image_std={self.image_std}")
        size = self.resize_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"resize_size must be a positive int (pixels) or None. Received: resize_size={size!r}")
        if not isinstance(self.crop_fraction, (int, float)) or not 0 < self.crop_fraction <= 1:
            raise ValueError(f"crop_fraction must be in (0, 1] (the centre crop's share of the resized image; 1: no "
                             f"crop). Received: crop_fraction={self.crop_fraction!r}")

    def pixel_normalization(self) -> tuple[float | tuple[float, ...], float | tuple[float, ...]]:
        """`pixel_normalization(self.image_mean, self.image_std)`."""
        return pixel_normalization(self.image_mean, self.image_std)

    @property
    def resize_arguments(self) -> dict[str, Any]:
        """The resize and crop keywords of `keras_vit.image_io.fit_to_model`."""
        return {name: getattr(self, name) for name in RESIZE_FIELDS}

    def replace(self, **changes) -> PreprocessingConfig:
        """A copy with `changes` (checked like the builders' keywords)."""
        check_options(changes, "PreprocessingConfig", PREPROCESSING_FIELDS)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (`PreprocessingConfig.from_dict` reverses it)."""
        fields = dataclasses.asdict(self)
        fields["image_mean"], fields["image_std"] = list(self.image_mean), list(self.image_std)
        return fields

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> PreprocessingConfig:
        check_options(fields, "PreprocessingConfig", PREPROCESSING_FIELDS)
        return cls(**fields)


PREPROCESSING_FIELDS: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(PreprocessingConfig))
# `image_io.fit_to_model`'s keywords.
RESIZE_FIELDS = ("resize_mode", "crop_fraction", "resize_size", "interpolation", "crop_offset")
# The builders' keywords: the forward's fields, then the input's.
BUILDER_OPTIONS: tuple[str, ...] = (*OPTIONS, *PREPROCESSING_FIELDS)


def _check_choices(config, choices) -> None:
    """Raises ValueError for a field of `config` whose value is not among its allowed ones."""
    for field, allowed in choices:
        value = getattr(config, field)
        if value not in allowed:
            hint = (" (the model's own pooling is spelled classifier='gap'; pooling='avg' is the output "
                    "pooling)") if (field, value) == ("classifier", "avg") else ""
            raise ValueError(f"Unknown {field} {value!r}. Expected one of {allowed}{hint}.")


def split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The builders' keywords split into the forward's (`ViTConfig`) and the input's (`PreprocessingConfig`)."""
    return ({name: value for name, value in options.items() if name not in PREPROCESSING_FIELDS},
            {name: value for name, value in options.items() if name in PREPROCESSING_FIELDS})


def make_preprocessing(declared: Mapping[str, Any] | None = None,
                       options: Mapping[str, Any] | None = None) -> PreprocessingConfig:
    """The preprocessing of a model: what a checkpoint's files declare (`declared`), then the user's input
    keywords (`options`; a `None` value means "not given")."""
    given = {name: value for name, value in (options or {}).items() if value is not None}
    check_options(given, "PreprocessingConfig", PREPROCESSING_FIELDS)
    return PreprocessingConfig(**{**(declared or {}), **given})


def pixel_normalization(image_mean, image_std) -> tuple[float | tuple[float, ...], float | tuple[float, ...]]:
    """(scale, offset) with `pixels * scale + offset == (pixels / 255 - image_mean) / image_std`, per channel
    (one number where the channels agree: mean = std = 0.5 gives 1 / 127.5 and -1, the original's [-1, 1])."""
    scale = tuple(1.0 / (255.0 * std) for std in image_std)
    offset = tuple(-mean / std for mean, std in zip(image_mean, image_std))
    return tuple(values[0] if len(set(values)) == 1 else values for values in (scale, offset))


def check_options(options: Mapping[str, Any], where: str = "ViTConfig", valid: tuple[str, ...] = OPTIONS) -> None:
    """Raises TypeError for a name not in `valid` (default: the `ViTConfig` fields), naming the closest one and
    every valid name (and, for an input field given to `ViTConfig`, where it belongs)."""
    unknown = [name for name in options if name not in valid]
    if not unknown:
        return
    name = unknown[0]
    if name in PREPROCESSING_FIELDS:
        raise TypeError(f"{where} got {name!r}, a field of the model's preprocessing, not of its forward: it is in "
                        "keras_vit.PreprocessingConfig (`model.preprocessing_config`), and the builders take it as "
                        f"a keyword (e.g. VisionTransformer({name}=...)).")
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise TypeError(f"{where} got an unknown option {name!r}.{hint} Valid options: {', '.join(valid)}.")


def make_config(variant: str | None = None, checkpoint: Mapping[str, Any] | None = None,
                options: Mapping[str, Any] | None = None, where: str = "VisionTransformer") -> ViTConfig:
    """The config of a model: the fields a checkpoint file fixes, then the variant's row, then `options` (the
    user's keywords; a `None` value means "not given"), each overriding the one before.

    Raises:
        TypeError: an unknown option (with the closest valid name).
        ValueError: architecture fields missing, or an invalid value.
    """
    options = {name: value for name, value in (options or {}).items() if value is not None}
    check_options(options, where)
    fields = {**(checkpoint or {}), **(variant_row(variant) if variant else {}), **options}
    missing = [name for name in ARCHITECTURE if name not in fields]
    if missing:
        raise ValueError(f"{where} needs `variant`, the architecture arguments {missing}, or `weights=` an .npz "
                         "or .safetensors file that holds them.")
    return ViTConfig(**fields)


def variant_row(variant: str) -> dict[str, Any]:
    """A copy of the variant's row of `VARIANTS` (its architecture fields only)."""
    key = canonical_variant(variant)
    return dict(VARIANTS[key])


def decode_variant(variant: str) -> ViTConfig:
    """The config of a variant ("B/16", "ViT-B/16", "ViT-B_16", "R50+ViT-B/16", ...)."""
    return ViTConfig(**variant_row(variant))


def canonical_variant(variant: str) -> str:
    """"ViT-B_16" -> "B/16"; raises ValueError for unknown names."""
    key = variant.replace("ViT-", "").replace("_", "/")
    if key not in VARIANTS:
        raise ValueError(f"Unknown variant {variant!r}. Expected one of {sorted(VARIANTS)}.")
    return key


def total_stride(config: Mapping[str, Any]) -> int:
    """Pixels per token along each axis: patch size times the ResNet stem's stride."""
    stages = config.get("resnet_stages")
    return config["patch_size"] * (2 ** (1 + len(stages)) if stages else 1)
