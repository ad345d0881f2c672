"""The architecture of a checkpoint, read from its key names and shapes: one reader for every format.

Every format is first seen in the original `.npz` layout (`reader.read_checkpoint`: an `.npz` file as it is,
a timm / Hugging Face `.safetensors` file through `torch_layout.npz_shapes`), then `read_architecture`
reads the `ViTConfig` fields from those shapes. Pure Python on shapes: opens no file.
"""

from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

from keras_vit import variants
from keras_vit.checkpoints import npz

_MLP = "encoderblock_0/MlpBlock_3/Dense_0/kernel"
_QUERY = "encoderblock_0/MultiHeadDotProductAttention_1/query/kernel"


def read_architecture(shapes: Mapping[str, Sequence[int]], *, variant: str | None = None,
                      num_heads: int | None = None, heads_stored: bool = True) -> dict:
    """`VisionTransformer` architecture of a checkpoint in the `.npz` layout (key -> shape).

    Args:
        shapes: `.npz` key (either Flax naming) -> shape.
        variant: optional variant name; its number of heads is taken.
        num_heads: optional number of heads.
        heads_stored: whether the query kernels are (D, heads, head_dim), as in `.npz` files. The
            PyTorch layouts do not store it: without `num_heads` or `variant`, it is that of the variant
            with the same patch size, widths and depth.

    Returns:
        patch_size, hidden_dim, mlp_dim, num_heads, num_layers, resnet_stages (None for a plain ViT),
        classifier, representation_size, classes (None without a head), options (the ViT family's
        `VisionTransformer` options: layer scale, registers, no_embed_class, qk_norm, norm_pre, fc_norm, distillation
        token, patch bias, gated MLP, MLP norm) and
        image_size (the square input side of its position embedding).
    """
    if "embedding/kernel" not in shapes:
        raise ValueError(f"Not a ViT checkpoint: no 'embedding/kernel' among its {len(shapes)} keys.")
    paths = {target[0]: tuple(shape) for key, shape in shapes.items() for target in [npz.keras_path(key)] if target}
    if _MLP not in paths or _QUERY not in paths:
        raise ValueError(f"Not a ViT checkpoint: no keys for {_MLP!r} and {_QUERY!r}.")
    patch, _, _, hidden = shapes["embedding/kernel"]
    blocks = {m.group(1) for key in shapes for m in [re.match(r"Transformer/encoderblock_(\d+)/", key)] if m}
    units = [tuple(map(int, m.groups())) for key in shapes for m in [re.match(r"block(\d+)/unit(\d+)/conv1/", key)]
             if m]
    stages = tuple(max(u for s, u in units if s == stage) for stage in sorted({s for s, _ in units}))
    # A head twice the width on a class token, with no pre-logits layer between, reads [class token; mean patch
    # token] (DINOv2's classifiers).
    wide_head = tuple(shapes.get("head/kernel", (0,)))[0] == 2 * hidden and "pre_logits/kernel" not in shapes
    token = "token_gap" if wide_head else "token"
    found = dict(patch_size=patch, hidden_dim=hidden, mlp_dim=paths[_MLP][1], num_heads=paths[_QUERY][1],
                 num_layers=len(blocks), resnet_stages=stages or None,
                 classifier=token if "cls" in shapes else "map" if "MAPHead_0/probe" in shapes else "gap",
                 representation_size=_width(shapes, "pre_logits/bias"), classes=_width(shapes, "head/bias"))
    found["options"] = _family_options(shapes, paths, "cls" in shapes)
    if npz.POSEMB_KEY in shapes:
        embedded = 0 if found["options"]["no_embed_class"] else (
            ("cls" in shapes) + found["options"]["distillation_token"])
        side = math.isqrt(shapes[npz.POSEMB_KEY][1] - embedded)
        found["image_size"] = side * variants.total_stride(found)
    if num_heads is not None or variant is not None:
        return dict(found, num_heads=num_heads or variants.decode_variant(variant).num_heads)
    if heads_stored:
        return found
    for config in variants.VARIANTS.values():
        if all(config.get(key) == found[key] for key in ("patch_size", "hidden_dim", "mlp_dim", "num_layers")):
            return dict(found, num_heads=config["num_heads"])
    shown = {key: found[key] for key in ("patch_size", "hidden_dim", "mlp_dim", "num_layers")}
    raise ValueError(f"No keras_vit variant has this checkpoint's architecture {shown}, and the number of heads "
                     "is not stored in the weights: give the variant (or the number of heads).")


def _family_options(shapes: Mapping[str, Sequence[int]], paths: Mapping[str, tuple], class_token: bool) -> dict:
    """The `VisionTransformer` options of the ViT family that the keys show (`layer_scale_init`: the value
    the model starts from, which the loaded `gamma`s replace)."""
    posemb = shapes.get(npz.POSEMB_KEY)
    tokens = posemb[1] if posemb is not None and len(posemb) == 3 else None
    return dict(layer_scale_init=1e-5 if any(path.endswith("/ls1/gamma") for path in paths) else None,
                num_register_tokens=shapes["registers"][1] if "registers" in shapes else 0,
                no_embed_class=bool(class_token and tokens and math.isqrt(tokens) ** 2 == tokens),
                qk_norm=any(path.endswith("/query_norm/gamma") for path in paths),
                norm_pre="norm_pre/scale" in shapes, fc_norm="fc_norm/scale" in shapes,
                distillation_token="dist_token" in shapes, patch_bias="embedding/bias" in shapes,
                gated_mlp=any(path.endswith("/MlpBlock_3/Dense_gate/kernel") for path in paths),
                mlp_norm=any(path.endswith("/MlpBlock_3/norm/gamma") for path in paths))


def _width(shapes: Mapping[str, Sequence[int]], key: str) -> int | None:
    return shapes[key][0] if key in shapes else None
