"""SigLIP 2 NaFlex checkpoints: from transformers, a `Siglip2VisionModel` (or the image tower of a `Siglip2Model`)
saved with `save_pretrained`, its `config.json` (model_type `siglip2_vision_model` or `siglip2`) and its
`Siglip2ImageProcessor`'s `preprocessor_config.json` (transformers 4.57.6, src/transformers/models/siglip2/); from
timm, a `NaFlexVit` of a SigLIP entry point (`TIMM_ARCHITECTURES`; timm 1.0.31, timm/models/naflexvit.py) with its
hub `config.json`, the same weights under timm's names.

The weights are SigLIP's (`torch_layout.HF_SIGLIP`'s key table, timm's `torch_layout.TIMM`) but for the patch
embedding, a Linear over the flattened (row, column, channel) pixels of a patch instead of a convolution, and a
position table resized to each image's grid at run time (bilinear, antialiased: transformers' rule, and timm's for
its SigLIP entry points). Pure NumPy."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from keras_vit.checkpoints import config_files, locate, preprocessing, safetensors_file, torch_layout

MODEL_TYPES = ("siglip2_vision_model", "siglip2")
LAYOUT = "huggingface-siglip2-naflex"  # `CheckpointFile.layout` of such a file
PROCESSOR_TYPES = ("Siglip2ImageProcessor", "Siglip2ImageProcessorFast")
_PATCH_KEY = "embeddings.patch_embedding.weight"
_POSITION_KEY = "embeddings.position_embedding.weight"
# timm's NaFlexVit entry points of SigLIP 2 (their heads), whose position tables are resized as transformers does.
TIMM_ARCHITECTURES = {"naflexvit_base_patch16_siglip": 12, "naflexvit_so400m_patch16_siglip": 16}
# `model_args` of a timm NaFlexVit that change its maths, with the values keras_vit computes (tuples: any of them);
# the sizes (embed_dim, depth, mlp_ratio, patch_size, pos_embed_grid_size) are read from the weights.
_TIMM_FIXED = {"pos_embed": ("learned",), "pos_embed_interp_mode": ("bilinear",), "pos_embed_antialias": (True,),
               "pos_embed_ar_preserving": (False,), "pos_embed_align_corners": (False,),
               "pos_embed_use_grid_sample": (False,), "class_token": (False,), "reg_tokens": (0,),
               "global_pool": ("map",), "qk_norm": (False,), "init_values": (None,), "pre_norm": (False,),
               "final_norm": (True,), "fc_norm": (None, False), "act_layer": ("gelu_tanh",),
               "patchify_channels_last": (True,), "qkv_bias": (True,), "proj_bias": (True,),
               "scale_mlp_norm": (False,), "scale_attn_inner_norm": (False,), "num_kv_heads": (None,),
               "pool_include_prefix": (False,), "dynamic_img_pad": (False,), "in_chans": (3,), "rope_type": ("",)}
_TIMM_SIZES = ("embed_dim", "depth", "num_heads", "mlp_ratio", "patch_size", "pos_embed_grid_size", "img_size",
               "num_classes", "attn_pool_num_heads", "drop_rate", "pos_drop_rate", "patch_drop_rate",
               "proj_drop_rate", "attn_drop_rate", "drop_path_rate")


@dataclasses.dataclass(frozen=True)
class NaFlexFile:
    """What a SigLIP 2 NaFlex file states.

    Attributes:
        path: the weights file.
        config: `ViTConfig` fields (architecture, numerics, `classifier="map"`).
        position_grid: (rows, columns) of the position table (`num_patches` = rows * columns, a square).
        preprocessing: `image_mean`, `image_std`, `max_num_patches` of its processor (empty without one).
        header: its safetensors header (`naflex_arrays` reads the tensors with it).
        source: `"transformers"` or `"timm"`, whose names the weights have.
    """

    path: str
    config: dict[str, Any]
    position_grid: tuple[int, int]
    preprocessing: dict[str, Any]
    header: dict[str, safetensors_file.TensorInfo] = dataclasses.field(default_factory=dict, repr=False)
    source: str = "transformers"


def _weights_file(weights) -> str | None:
    """The local weights file of `weights` (a file, folder or `hf://` name), else None."""
    if not isinstance(weights, (str, os.PathLike)):
        return None
    weights = os.fspath(weights)
    if not (os.path.exists(weights) or locate.is_hub_name(weights)):
        return None
    path = locate.locate(weights)
    return path if os.path.isfile(path) else None


def is_naflex_config(config: dict | None) -> bool:
    """Whether a `config.json` (as a dict, or None) is a SigLIP 2 (NaFlex) transformers model's or a timm NaFlexVit's
    (any entry point: those keras_vit does not implement are refused by name when read)."""
    return bool(config) and (config.get("model_type") in MODEL_TYPES or
                             config_files.timm_architecture_of(config).startswith("naflexvit"))


def is_naflex_checkpoint(weights) -> bool:
    """Whether `weights` (a local file, folder or `hf://` name; anything else is not) is a SigLIP 2 NaFlex
    checkpoint: its config.json is read, not its tensors."""
    path = _weights_file(weights)
    return path is not None and is_naflex_config(config_files.Beside(path).config)


def naflex_checkpoint(weights) -> NaFlexFile | None:
    """`read_naflex_checkpoint(weights)` where `weights` is a SigLIP 2 NaFlex checkpoint, else None; its config.json
    read once for both answers (the export command's test and read)."""
    path = _weights_file(weights)
    if path is None:
        return None
    files = config_files.Beside(path)
    return naflex_file_of(path, files) if is_naflex_config(files.config) else None


def read_naflex_checkpoint(weights: str) -> NaFlexFile:
    """Reads a SigLIP 2 NaFlex checkpoint's configs (no tensor data).

    Raises:
        ValueError: not such a checkpoint, or what keras_vit does not implement (named): another number of channels,
            a non-square position table, a tower without its attention-pooling head, a `hidden_act` not
            implemented, a processor that does not resize bilinearly, rescale by 1 / 255 and normalize, or whose
            patch size differs from the model's.
    """
    file = naflex_checkpoint(weights)
    if file is None:
        raise ValueError(f"{weights!r} is not a SigLIP 2 checkpoint: its config.json must have model_type "
                         f"{' or '.join(map(repr, MODEL_TYPES))}, or name a timm NaFlexVit architecture.")
    return file


def naflex_file_of(path: str, files: config_files.Beside) -> NaFlexFile:
    """`read_naflex_checkpoint` of the weights file `path` whose config.json is a SigLIP 2 one, from the JSON files
    beside it as `files` has read them (the checkpoint reader's, so that each is read once)."""
    if config_files.timm_architecture(files):
        return _timm_naflex_file(path, files)
    config = files.config
    config = config.get("vision_config", config) if config["model_type"] == "siglip2" else config
    origin = os.path.join(os.path.dirname(path), config_files.CONFIG)
    header = safetensors_file.read_header(path) if path.endswith(".safetensors") else None
    if header is None:
        raise ValueError(f"{path!r}: a SigLIP 2 checkpoint is read from its model.safetensors.")
    shapes = {key: info.shape for key, info in header.items()}
    prefix = torch_layout.hf_prefix(shapes)
    patch, position = (shapes.get(prefix + key) for key in (_PATCH_KEY, _POSITION_KEY))
    if patch is None or position is None or len(patch) != 2:
        raise ValueError(f"{path!r}: no NaFlex patch embedding {prefix + _PATCH_KEY!r} (out, patch * patch * "
                         f"channels) and position table {prefix + _POSITION_KEY!r}; found {len(shapes)} keys.")
    if not any(key.startswith(prefix + "head.probe") for key in shapes):
        raise ValueError(f"{path!r}: a tower without its attention-pooling head (vision_use_head=False) is not "
                         "implemented; keras_vit builds SigLIP 2 with its MAP head.")
    channels, patch_size = int(config.get("num_channels", 3)), int(config.get("patch_size", 16))
    if channels != 3 or patch[1] != patch_size * patch_size * channels:
        raise ValueError(f"{origin!r}: num_channels={channels}, patch_size={patch_size} do not give the patch "
                         f"embedding's {patch[1]} inputs, or the images are not RGB (keras_vit takes 3 channels).")
    side = math.isqrt(position[0])
    if side * side != position[0]:
        raise ValueError(f"{path!r}: a position table of {position[0]} rows, not a square grid, as "
                         "Siglip2VisionEmbeddings needs.")
    numerics = config_files.read_hf_config(files) or {}
    fields = dict(patch_size=patch_size, hidden_dim=int(patch[0]), mlp_dim=int(config.get("intermediate_size", 0)),
                  num_heads=int(config["num_attention_heads"]), num_layers=int(config["num_hidden_layers"]),
                  classifier="map", layer_norm_epsilon=numerics.get("layer_norm_epsilon", 1e-6),
                  activation=numerics.get("activation", "gelu"),
                  gelu_approximate=numerics.get("gelu_approximate", True))
    processor = files.processor
    declared = read_processor(processor, os.path.join(os.path.dirname(path), config_files.PROCESSOR),
                              patch_size) if processor is not None else {}
    return NaFlexFile(path, fields, (side, side), declared, header)


def _timm_naflex_file(path: str, files: config_files.Beside) -> NaFlexFile:
    """`naflex_file_of` for a timm NaFlexVit: the architecture from the weights, the heads from `model_args` or the
    entry point, the normalization from `pretrained_cfg`; ValueError for an entry point or option not implemented."""
    config, origin = files.config, os.path.join(os.path.dirname(path), config_files.CONFIG)
    name = config_files.timm_architecture_of(config)
    if name not in TIMM_ARCHITECTURES:
        raise ValueError(f"{origin!r}: timm's {name} is not implemented; keras_vit reads timm's SigLIP 2 NaFlexVit "
                         f"entry points ({', '.join(TIMM_ARCHITECTURES)}).")
    model_args = config_files.timm_model_args(config)
    unsupported = [f"{key}={value!r}" for key, value in model_args.items()
                   if key not in _TIMM_SIZES and value not in _TIMM_FIXED.get(key, ())]
    if unsupported:
        raise ValueError(f"{origin!r}: model_args {', '.join(unsupported)} is not implemented; keras_vit computes "
                         "timm's SigLIP NaFlexVit (learned table resized bilinearly with antialiasing, MAP head, no "
                         "prefix tokens, tanh GELU).")
    header = safetensors_file.read_header(path) if path.endswith(".safetensors") else None
    if header is None:
        raise ValueError(f"{path!r}: a timm NaFlexVit is read from its model.safetensors.")
    shapes = {key: info.shape for key, info in header.items()}
    patch, position = shapes.get("embeds.proj.weight"), shapes.get("embeds.pos_embed")
    if patch is None or position is None or len(patch) != 2 or len(position) != 4 or "attn_pool.latent" not in shapes:
        raise ValueError(f"{path!r}: no NaFlexVit patch embedding 'embeds.proj.weight' (out, patch * patch * 3), "
                         "position table 'embeds.pos_embed' (1, rows, columns, out) and attention pooling "
                         f"'attn_pool.latent'; found {len(shapes)} keys.")
    patch_size = math.isqrt(patch[1] // 3)
    if patch_size * patch_size * 3 != patch[1]:
        raise ValueError(f"{path!r}: a patch embedding of {patch[1]} inputs is not square patches of 3 channels.")
    heads = model_args.get("num_heads", TIMM_ARCHITECTURES[name])
    if model_args.get("attn_pool_num_heads") not in (None, heads):
        raise ValueError(f"{origin!r}: attn_pool_num_heads={model_args['attn_pool_num_heads']!r} is not implemented; "
                         f"keras_vit's MAP head has the encoder's {heads} heads.")
    fields = dict(patch_size=patch_size, hidden_dim=int(patch[0]), mlp_dim=int(shapes["blocks.0.mlp.fc1.weight"][0]),
                  num_heads=int(heads), num_layers=sum(key.endswith(".norm1.weight") for key in shapes),
                  classifier="map", layer_norm_epsilon=1e-6, activation="gelu", gelu_approximate=True)
    pretrained = config.get("pretrained_cfg")
    normalization = preprocessing.timm_normalization(pretrained, origin) if isinstance(pretrained, dict) else {}
    return NaFlexFile(path, fields, (int(position[1]), int(position[2])), normalization, header, source="timm")


def read_processor(config: dict, origin: str, patch_size: int) -> dict[str, Any]:
    """`image_mean`, `image_std`, `max_num_patches` of a `Siglip2ImageProcessor` config (its defaults where
    unset); ValueError for a rule keras_vit does not compute."""
    kind = config.get("image_processor_type")
    if kind not in PROCESSOR_TYPES:
        raise ValueError(f"{origin!r}: image_processor_type={kind!r}; a SigLIP 2 NaFlex model reads "
                         f"{' or '.join(PROCESSOR_TYPES)}.")
    unsupported = [f"{key}={config[key]!r}" for key, expected in
                   (("do_resize", True), ("resample", 2), ("do_rescale", True), ("do_normalize", True))
                   if key in config and config[key] != expected]
    factor = config.get("rescale_factor", 1 / 255)
    if not math.isclose(factor, 1 / 255, rel_tol=1e-9):
        unsupported.append(f"rescale_factor={factor!r}")
    if config.get("patch_size", 16) != patch_size:
        unsupported.append(f"patch_size={config.get('patch_size', 16)!r} (the model's is {patch_size})")
    if unsupported:
        raise ValueError(f"{origin!r}: {', '.join(unsupported)} is not implemented: keras_vit's NaFlex rule resizes "
                         "bilinearly (resample=2), rescales by 1 / 255 and normalizes, at the model's patch size.")
    budget = config.get("max_num_patches", 256)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"{origin!r}: max_num_patches={budget!r}; expected a positive int.")
    mean, std = (config.get(key, [0.5, 0.5, 0.5]) for key in ("image_mean", "image_std"))
    mean, std = ([float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
                 for value in (mean, std))
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise ValueError(f"{origin!r}: image_mean={mean}, image_std={std}; expected 3 values each, std > 0.")
    return dict(image_mean=tuple(mean), image_std=tuple(std), max_num_patches=budget)


def naflex_arrays(file: NaFlexFile) -> torch_layout.Translation:
    """The file's tensors in the `.npz` layout (`torch_layout.translate` with SigLIP's table, or timm's): the patch
    embedding's Linear as a (patch * patch * 3, D) Dense kernel, the position table as (1, rows * columns, D)."""
    tensors = safetensors_file.read_safetensors(file.path, file.header or None)
    patch = file.config["patch_size"]
    if file.source == "timm":  # timm's names: the embedding's Linear as its ViT's convolution, the table flattened
        patch_key, layout = "patch_embed.proj.weight", torch_layout.TIMM
        tensors[patch_key], tensors["patch_embed.proj.bias"] = (tensors.pop(f"embeds.proj.{name}")
                                                                 for name in ("weight", "bias"))
        table = tensors.pop("embeds.pos_embed")
        tensors["pos_embed"] = table.reshape(1, -1, table.shape[-1])
    else:
        patch_key, layout = torch_layout.hf_prefix(tensors) + _PATCH_KEY, torch_layout.HF_SIGLIP
    linear = tensors[patch_key]
    # (out, row * column * channel) as a convolution's (out, channel, row, column), which the table transposes.
    tensors[patch_key] = linear.reshape(linear.shape[0], patch, patch, 3).transpose(0, 3, 1, 2)
    translation = torch_layout.translate(tensors, layout, file.config["num_heads"])
    kernel = translation.arrays.get("embedding/kernel")
    if kernel is not None:
        translation.arrays["embedding/kernel"] = kernel.reshape(-1, kernel.shape[-1])
    return translation
