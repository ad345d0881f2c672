"""The JSON files beside a weights file (a `save_pretrained` folder, a hub snapshot): `config.json` (transformers'
model config, or timm's `save_for_hf` config) and `preprocessor_config.json` (transformers' image processor).
`Beside` reads each at most once per checkpoint, for every reader that needs it. What a `config.json` states of the
model is read here (`read_hf_config`, `read_timm_config`: numerics, heads, architecture); what it and the processor
state of the input, in `preprocessing`.
"""

from __future__ import annotations

import json
import os
import re

from keras_vit.checkpoints import torch_layout

CONFIG = "config.json"
PROCESSOR = "preprocessor_config.json"


class Beside:
    """The JSON files in the folder of `weights_path`, each read on first use and kept."""

    def __init__(self, weights_path: str):
        self.folder = os.path.dirname(os.path.abspath(weights_path))
        self._read: dict[str, dict | None] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def json(self, name: str) -> dict | None:
        """The file `name` as a dict; None where there is none. ValueError naming it when it is unreadable."""
        if name not in self._read:
            path = self.path(name)
            self._read[name] = read_json(path) if os.path.isfile(path) else None
        return self._read[name]

    @property
    def config(self) -> dict | None:
        return self.json(CONFIG)

    @property
    def processor(self) -> dict | None:
        return self.json(PROCESSOR)


def read_json(path: str) -> dict:
    """A JSON object from `path`; ValueError naming the file when it is unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError) as error:
        raise ValueError(f"Could not read {path!r}: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path!r}: expected a JSON object, found {type(config).__name__}.")
    return config


# Hugging Face `hidden_act` -> keras_vit's activation options.
HIDDEN_ACTIVATIONS = {"gelu": dict(activation="gelu", gelu_approximate=False),
                      "gelu_pytorch_tanh": dict(activation="gelu", gelu_approximate=True),
                      "gelu_new": dict(activation="gelu", gelu_approximate=True),
                      "quick_gelu": dict(activation="quick_gelu", gelu_approximate=False),
                      "silu": dict(activation="silu", gelu_approximate=False)}
# config.json keys that describe what the weights' shapes also say; a contradiction is an error (reader).
HF_ARCHITECTURE = {"hidden_size": "hidden_dim", "intermediate_size": "mlp_dim", "num_hidden_layers": "num_layers",
                   "patch_size": "patch_size"}
# `DINOv3ViTConfig` keys -> `ViTConfig` fields: its rotary positions (the pos_embed_* augmentations act in training
# only) and its MLP's form.
HF_DINOV3_OPTIONS = {"rope_theta": "rope_theta", "pos_embed_shift": "rope_shift", "pos_embed_jitter": "rope_jitter",
                     "pos_embed_rescale": "rope_rescale", "use_gated_mlp": "gated_mlp"}


def read_hf_config(files: Beside, layout: str | None = None) -> dict | None:
    """The numerics and number of heads of the Hugging Face `config.json` beside a weights file (`files`), or
    None.

    Returns `layer_norm_epsilon`, `activation`, `gelu_approximate`, `num_heads`, the architecture fields of
    `HF_ARCHITECTURE` and `image_size` (the model's input side, not a `ViTConfig` field) for the keys the file sets
    (a `CLIPModel` / `SiglipModel` config: those of its `vision_config`). For `layout` DINOv2, the MLP width is
    `mlp_ratio` times the width, as `Dinov2Config` builds it; for DINOv3, the fields of
    `HF_DINOV3_OPTIONS` too.

    Raises:
        ValueError: an unreadable file, or a `hidden_act` keras_vit does not implement.
    """
    config = files.config
    if config is None:
        return None
    config = config.get("vision_config", config)
    found = {}
    if "layer_norm_eps" in config:
        found["layer_norm_epsilon"] = float(config["layer_norm_eps"])
    if "hidden_act" in config:
        if config["hidden_act"] not in HIDDEN_ACTIVATIONS:
            raise ValueError(f"{files.path(CONFIG)!r}: hidden_act={config['hidden_act']!r} is not implemented by "
                             f"keras_vit. Supported: {sorted(HIDDEN_ACTIVATIONS)}.")
        found.update(HIDDEN_ACTIVATIONS[config["hidden_act"]])
    if "num_attention_heads" in config:
        found["num_heads"] = int(config["num_attention_heads"])
    found.update({field: int(config[key]) for key, field in HF_ARCHITECTURE.items()
                  if isinstance(config.get(key), int)})
    if layout == torch_layout.HF_DINOV2:  # Dinov2Config has no intermediate_size: its MLP is mlp_ratio (4) x width
        found.pop("mlp_dim", None)
        if isinstance(config.get("hidden_size"), int) and isinstance(config.get("mlp_ratio", 4), (int, float)):
            found["mlp_dim"] = int(config["hidden_size"] * config.get("mlp_ratio", 4))
    if layout == torch_layout.HF_DINOV3:
        found.update({field: config[key] for key, field in HF_DINOV3_OPTIONS.items() if key in config})
    size = config.get("image_size")
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        found["image_size"] = size
    return found


# timm's config.json (`save_for_hf`): `model_args` keys that describe what the weights' shapes also say.
TIMM_ARCHITECTURE = {"embed_dim": "hidden_dim", "depth": "num_layers", "patch_size": "patch_size"}
# The number of heads of timm's ViT entry points (timm/models/vision_transformer.py, deit.py; timm 1.0.31) by the
# size word of their name (`vit_<size>_patch...`, `deit3_<size>_...`) and width; `model_args` state it only where
# it was given. The exceptions to their size word's rule are listed by name.
TIMM_HEADS = {"tiny": {192: 3}, "small": {384: 6}, "medium": {512: 8}, "base": {768: 12}, "large": {1024: 16},
              "huge": {1280: 16}, "giant": {1408: 16, 1536: 24}, "gigantic": {1664: 16}, "so400m": {1152: 16},
              "so150m": {896: 14}}
TIMM_HEADS_BY_NAME = {"vit_base_patch16_gap_224": 16, "vit_huge_plus_patch16_dinov3": 20,
                      "vit_huge_plus_patch16_dinov3_qkvb": 20, "vit_7b_patch16_dinov3": 32}
# timm's Eva class (timm/models/eva.py) by its entry points' names: EVA and EVA-02, DINOv3, the RoPE ViTs, Perception
# Encoder. keras_vit implements the DINOv3 ones and EVA-02's image models (not its CLIP towers).
TIMM_EVA_NAME = re.compile(r"(eva02?|eva_giant|pe_core|pe_lang|pe_spatial)_.*|vit_.*_(dinov3(_qkvb)?|rope_.*)")
TIMM_DINOV3 = re.compile(r"vit_[a-z0-9_]+_patch16_dinov3(_qkvb)?")
TIMM_EVA02 = re.compile(r"eva02_(tiny|small|base|large)_patch14_(224|336|448)")
# What the entry points fix that no tensor shows: DINOv3's rotary positions of base period 100 (no table) and
# LayerNorm eps 1e-5; EVA-02's rotary positions of base period 10000 in patches of the 16 x 16 grid it was
# pre-trained on (`ref_feat_shape`), beside its position table. A SwiGLU MLP (`swiglu_mlp`, which the keys show:
# all of EVA-02's) computes with SiLU, DINOv3's plain one with exact GELU.
TIMM_EVA_FIELDS = {"dinov3": dict(position_embedding="none", rope="dinov3", rope_theta=100.0, layer_norm_epsilon=1e-5),
                   "eva02": dict(rope="eva02", rope_theta=10000.0, rope_reference_grid=(16, 16))}
# `model_args` keys -> `ViTConfig` fields (the coordinate augmentations act in training only).
TIMM_EVA_OPTIONS = {"rope_temperature": "rope_theta", "rope_shift_coords": "rope_shift",
                    "rope_jitter_coords": "rope_jitter", "rope_rescale_coords": "rope_rescale",
                    "ref_feat_shape": "rope_reference_grid"}
# `model_args` keys that make an Eva compute what keras_vit does not, and the only values it implements (each
# family's entry point default first).
_EVA_COMMON = {"use_rot_pos_emb": (True,), "rope_grid_offset": (0, 0.0), "rope_grid_indexing": ("ij",),
               "use_post_norm": (False,), "attn_type": ("eva",), "num_kv_heads": (None,),
               "use_pre_transformer_norm": (False,), "dynamic_img_pad": (False,), "scale_attn_inner": (False,)}
TIMM_EVA_IMPLEMENTED = {
    "dinov3": dict(_EVA_COMMON, rope_type=("dinov3",), rope_rotate_half=(True,), use_abs_pos_emb=(False,)),
    "eva02": dict(_EVA_COMMON, rope_type=("cat",), rope_rotate_half=(False,), use_abs_pos_emb=(True,),
                  swiglu_mlp=(True,)),
}


def timm_model_args(config: dict | None) -> dict:
    """The `model_args` of timm's `config.json` (`config`), {} where it has none."""
    model_args = (config or {}).get("model_args")
    return model_args if isinstance(model_args, dict) else {}


def read_timm_config(files: Beside, hidden_dim: int) -> dict:
    """What timm's `config.json` beside a weights file (`files`) states of the architecture: the `TIMM_ARCHITECTURE`
    fields `model_args` sets, and `num_heads`: `model_args["num_heads"]`, else the entry point's own, from its name
    (`architecture`) and the weights' width `hidden_dim` (left out where neither states it)."""
    config = files.config
    if config is None or not isinstance(config.get("model_args", {}), dict):
        return {}
    model_args = timm_model_args(config)
    found = {field: model_args[key] for key, field in TIMM_ARCHITECTURE.items()
             if isinstance(model_args.get(key), int) and not isinstance(model_args.get(key), bool)}
    heads = model_args.get("num_heads")
    if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0:
        return dict(found, num_heads=heads)
    name = timm_architecture(files)
    size = re.match(r"(?:vit|deit3?)_([a-z0-9]+)_", name)
    heads = TIMM_HEADS_BY_NAME.get(name) or (TIMM_HEADS.get(size.group(1), {}).get(hidden_dim) if size else None)
    return found if heads is None else dict(found, num_heads=heads)


def timm_architecture(files: Beside) -> str:
    """The entry point timm's `config.json` beside a weights file names (`architecture`, without a tag); "" where
    there is none."""
    return timm_architecture_of(files.config)


def timm_architecture_of(config: dict | None) -> str:
    """`timm_architecture` of a `config.json` already read (a dict, or None)."""
    name = (config or {}).get("architecture")
    return name.split(".")[0] if isinstance(name, str) else ""


def timm_pooling(files: Beside) -> str | None:
    """The `global_pool` timm's `config.json` beside a weights file gives its model (`"avg"`, `"token"`, `"map"`),
    or None."""
    config = files.config or {}
    pool = timm_model_args(config).get("global_pool", config.get("global_pool"))
    return pool if pool in ("avg", "token", "map") else None


def timm_eva_family(files: Beside) -> str | None:
    """`"dinov3"` or `"eva02"` for a timm `config.json` naming one of those Eva entry points, else None."""
    name = timm_architecture(files)
    return "dinov3" if TIMM_DINOV3.fullmatch(name) else "eva02" if TIMM_EVA02.fullmatch(name) else None


def read_timm_eva_config(files: Beside, gated: bool) -> dict:
    """The `ViTConfig` fields of a timm Eva file that its weights do not show: its family's (`TIMM_EVA_FIELDS`, the
    activation of its MLP, `gated` or not) with the `TIMM_EVA_OPTIONS` its `model_args` set.

    Raises:
        ValueError: no config.json (the rotary positions are in no tensor), an Eva that is neither DINOv3 nor
            EVA-02's image model (EVA-02's CLIP towers, the RoPE ViTs, Perception Encoder), or `model_args` of
            `TIMM_EVA_IMPLEMENTED` set to another value.
    """
    name = timm_architecture(files)
    if files.config is None:
        raise ValueError(f"{files.folder!r} holds a timm Eva checkpoint (DINOv3, EVA-02: keys 'blocks.N.gamma_1', "
                         "'blocks.N.attn.q_bias', ...) without its config.json: its rotary positions are stored in "
                         "no tensor. Keep the config.json timm's save_for_hf / push_to_hf_hub writes beside it.")
    family = timm_eva_family(files)
    if family is None:
        raise ValueError(f"{files.path(CONFIG)!r}: timm's {name or 'unnamed'!r} is an Eva model keras_vit does not "
                         "implement (EVA-02's CLIP towers with their normalized attention, the RoPE ViTs and "
                         "Perception Encoder are not). Supported from timm's eva.py: the DINOv3 entry points "
                         "(vit_small_patch16_dinov3, ..., *_qkvb) and EVA-02's image models (eva02_tiny_patch14_224, "
                         "..., eva02_large_patch14_448); nothing was loaded.")
    model_args = timm_model_args(files.config)
    for key, values in TIMM_EVA_IMPLEMENTED[family].items():
        if key in model_args and model_args[key] not in values:
            raise ValueError(f"{files.path(CONFIG)!r}: {name} with {key}={model_args[key]!r} computes what "
                             f"keras_vit does not implement (it implements {key}={values[0]!r}); nothing was "
                             "loaded.")
    found = dict(TIMM_EVA_FIELDS[family], **HIDDEN_ACTIVATIONS["silu" if gated else "gelu"], gated_mlp=gated)
    found.update({field: model_args[key] for key, field in TIMM_EVA_OPTIONS.items() if key in model_args})
    if found.get("rope_reference_grid") is not None:
        found["rope_reference_grid"] = tuple(found["rope_reference_grid"])
    return found
