"""The PyTorch world's ViT layouts, timm and Hugging Face, translated into the original `.npz` layout.

A state dict's layout is detected from its keys:

- timm `VisionTransformer` (`patch_embed.proj.weight`, `cls_token`, `pos_embed`,
  `blocks.N.attn.qkv.weight`, `blocks.N.mlp.fc1.weight`, `norm.weight`, `head.weight`, ...);
- Hugging Face `ViTForImageClassification` (`vit.embeddings...`, `vit.encoder.layer.N...`,
  `vit.layernorm...`, `classifier...`) or `ViTModel` (the same without `vit.`, optionally
  `pooler.dense...`, which becomes the `pre_logits` Dense + tanh layer).

Its tensors are translated into the original `.npz` key layout (Linear (out, in) -> (in, out),
convolution (out, in, kh, kw) -> (kh, kw, in, out), fused or separate query/key/value -> (D,
heads, head_dim)); `keras_vit.checkpoints.loader` then checks, resamples and assigns them as for an
`.npz` file: all or nothing, every problem listed under the file's own key names. Pure NumPy.

Both layouts compute with the exact erf GELU; timm's LayerNorm epsilon is 1e-6 and Hugging
Face's default 1e-12 (`NUMERICS`): the builders take these when `weights=` is such a file.

Supported: class-token models (timm `global_pool='token'`, Hugging Face ViT), with or without
their head; in timm files also register tokens, layer scale, `no_embed_class`, `qk_norm`, `norm_pre` and
`fc_norm` (DeiT-III, timm's DINOv2) and the distillation token (DeiT distilled), built with the matching
`VisionTransformer` options. Not supported, and refused with an error naming the keys that show them: timm
models without a class token, with attention pooling, a patch-embedding norm or a patch embedding without bias (CLIP);
Hugging Face configs other than the defaults for `layer_norm_eps` and `hidden_act` (not stored
in the weights file, so not detectable).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping, Sequence

import numpy as np

from keras_vit.checkpoints import npz

TIMM = "timm"
HUGGING_FACE = "huggingface"

NUMERICS: dict[str, dict] = {
    TIMM: dict(layer_norm_epsilon=1e-6, gelu_approximate=False),
    HUGGING_FACE: dict(layer_norm_epsilon=1e-12, gelu_approximate=False),
}


def _plain_keys(keys) -> dict[str, str]:
    """Key without Hugging Face's `vit.` prefix -> the file's key."""
    return {key.removeprefix("vit."): key for key in keys}


def detect_layout(keys: Sequence[str]) -> str:
    """`TIMM` or `HUGGING_FACE`, from a state dict's keys; ValueError for anything else."""
    keys = list(keys)
    if "patch_embed.proj.weight" in keys or any(key.startswith("blocks.") for key in keys):
        return TIMM
    if any(key.startswith(("embeddings.", "encoder.layer.")) for key in _plain_keys(keys)):
        return HUGGING_FACE
    shown = ", ".join(repr(key) for key in keys[:8]) + (", ..." if len(keys) > 8 else "")
    raise ValueError(f"Not a timm or Hugging Face ViT state dict ({len(keys)} keys: {shown}). Recognized layouts: "
                     "timm VisionTransformer ('patch_embed.proj.weight', 'blocks.N.attn.qkv.weight', ...) and "
                     "Hugging Face ViTModel / ViTForImageClassification ('[vit.]embeddings.patch_embeddings."
                     "projection.weight', '[vit.]encoder.layer.N.attention.attention.query.weight', ...).")


# timm features whose numerics keras_vit does not implement: (key regex, what it is).
_TIMM_UNSUPPORTED = (
    (r"blocks\.\d+\.(attn|mlp)\.norm\..*", "scale_attn_norm / scale_mlp_norm"),
    (r"attn_pool\..*", "attention pooling (global_pool='map')"),
    (r"patch_embed\.norm\..*", "a patch-embedding norm"),
)


def check_supported(shapes: dict[str, tuple[int, ...]], layout: str, origin: str = "checkpoint") -> None:
    """Raises ValueError naming the keys of model features keras_vit would compute wrongly."""
    found = {}
    plain = _plain_keys(shapes)
    if layout == TIMM:
        for pattern, feature in _TIMM_UNSUPPORTED:
            keys = [key for key in shapes if re.fullmatch(pattern, key)]
            if keys:
                found[feature] = keys
        if "cls_token" not in shapes:
            found["no class token (class_token=False, global_pool other than 'token')"] = ["cls_token (absent)"]
        if "patch_embed.proj.weight" in shapes and "patch_embed.proj.bias" not in shapes:
            found["a patch embedding without bias (CLIP)"] = ["patch_embed.proj.bias (absent)"]
    elif "embeddings.cls_token" not in plain:
        found["no class token"] = ["embeddings.cls_token (absent)"]
    if found:
        listed = "; ".join(f"{feature} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
                           for feature, keys in found.items())
        raise ValueError(f"{origin!r} is a {layout} ViT with features keras_vit does not implement: {listed}. "
                         "Supported: class-token ViTs as timm's vit_*_patch*_* (also with registers, layer scale, "
                         "no_embed_class, qk_norm, norm_pre, fc_norm, a distillation token) and Hugging Face's "
                         "ViT; nothing was loaded.")


# ---------------------------------------------------------------------------------------
# Translation into the original .npz layout
# ---------------------------------------------------------------------------------------

def _same(array: np.ndarray, heads: int) -> list[np.ndarray]:
    return [array]


def _linear(array: np.ndarray, heads: int) -> list[np.ndarray]:
    """torch Linear (out, in) -> Dense (in, out)."""
    _expect_ndim(array, 2)
    return [array.T]


def _conv(array: np.ndarray, heads: int) -> list[np.ndarray]:
    """torch Conv2d (out, in, kh, kw) -> (kh, kw, in, out)."""
    _expect_ndim(array, 4)
    return [array.transpose(2, 3, 1, 0)]


def _expect_ndim(array: np.ndarray, ndim: int) -> None:
    if array.ndim != ndim:
        raise ValueError(f"expected a {ndim}-D array, found shape {array.shape}")


def _by_heads(width: int, heads: int) -> int:
    if width % heads:
        raise ValueError(f"width {width} is not divisible by the model's {heads} heads")
    return width // heads


def _heads_kernel(array: np.ndarray, heads: int) -> list[np.ndarray]:
    """Query/key/value Linear (D_out, D_in) -> (D_in, heads, head_dim)."""
    _expect_ndim(array, 2)
    return [array.T.reshape(array.shape[1], heads, _by_heads(array.shape[0], heads))]


def _heads_bias(array: np.ndarray, heads: int) -> list[np.ndarray]:
    """Query/key/value bias (D,) -> (heads, head_dim)."""
    _expect_ndim(array, 1)
    return [array.reshape(heads, _by_heads(array.shape[0], heads))]


def _out_kernel(array: np.ndarray, heads: int) -> list[np.ndarray]:
    """Attention output Linear (D_out, D_in) -> (heads, head_dim, D_out)."""
    _expect_ndim(array, 2)
    return [array.T.reshape(heads, _by_heads(array.shape[1], heads), array.shape[0])]


def _split_qkv(array: np.ndarray, heads: int, convert: Callable) -> list[np.ndarray]:
    if array.shape[0] % 3 or (array.ndim == 2 and array.shape[0] != 3 * array.shape[1]):
        raise ValueError(f"expected a fused query/key/value of 3 * width rows, found shape {array.shape}")
    return [convert(part, heads)[0] for part in np.split(array, 3)]


def _qkv_kernel(array: np.ndarray, heads: int) -> list[np.ndarray]:
    return _split_qkv(array, heads, _heads_kernel)


def _qkv_bias(array: np.ndarray, heads: int) -> list[np.ndarray]:
    return _split_qkv(array, heads, _heads_bias)


_B = "Transformer/encoderblock_{i}"
_ATTN = _B + "/MultiHeadDotProductAttention_1"
_QKV = ("query", "key", "value")
_POSEMB = npz.POSEMB_KEY

# (source key template, .npz key templates, transform); "{i}" stands for a block index.
_TIMM_TABLE = (
    ("patch_embed.proj.weight", ("embedding/kernel",), _conv),
    ("patch_embed.proj.bias", ("embedding/bias",), _same),
    ("cls_token", ("cls",), _same),
    ("pos_embed", (_POSEMB,), _same),
    ("blocks.{i}.norm1.weight", (_B + "/LayerNorm_0/scale",), _same),
    ("blocks.{i}.norm1.bias", (_B + "/LayerNorm_0/bias",), _same),
    ("blocks.{i}.attn.qkv.weight", tuple(f"{_ATTN}/{name}/kernel" for name in _QKV), _qkv_kernel),
    ("blocks.{i}.attn.qkv.bias", tuple(f"{_ATTN}/{name}/bias" for name in _QKV), _qkv_bias),
    ("blocks.{i}.attn.proj.weight", (_ATTN + "/out/kernel",), _out_kernel),
    ("blocks.{i}.attn.proj.bias", (_ATTN + "/out/bias",), _same),
    ("blocks.{i}.norm2.weight", (_B + "/LayerNorm_2/scale",), _same),
    ("blocks.{i}.norm2.bias", (_B + "/LayerNorm_2/bias",), _same),
    ("blocks.{i}.mlp.fc1.weight", (_B + "/MlpBlock_3/Dense_0/kernel",), _linear),
    ("blocks.{i}.mlp.fc1.bias", (_B + "/MlpBlock_3/Dense_0/bias",), _same),
    ("blocks.{i}.mlp.fc2.weight", (_B + "/MlpBlock_3/Dense_1/kernel",), _linear),
    ("blocks.{i}.mlp.fc2.bias", (_B + "/MlpBlock_3/Dense_1/bias",), _same),
    ("reg_token", ("registers",), _same),
    ("dist_token", ("dist_token",), _same),
    ("head_dist.weight", ("head_dist/kernel",), _linear),
    ("head_dist.bias", ("head_dist/bias",), _same),
    ("blocks.{i}.ls1.gamma", (_B + "/ls1/scale",), _same),
    ("blocks.{i}.ls2.gamma", (_B + "/ls2/scale",), _same),
    *((f"blocks.{{i}}.attn.{name[0]}_norm.{weight}", (f"{_ATTN}/{name}_norm/{released}",), _same)
      for name in ("query", "key") for weight, released in (("weight", "scale"), ("bias", "bias"))),
    *((f"{norm}.{weight}", (f"{norm}/{released}",), _same)
      for norm in ("norm_pre", "fc_norm") for weight, released in (("weight", "scale"), ("bias", "bias"))),
    ("norm.weight", ("Transformer/encoder_norm/scale",), _same),
    ("norm.bias", ("Transformer/encoder_norm/bias",), _same),
    ("head.weight", ("head/kernel",), _linear),
    ("head.bias", ("head/bias",), _same),
)

_L = "encoder.layer.{i}"
_HF_TABLE = (
    ("embeddings.patch_embeddings.projection.weight", ("embedding/kernel",), _conv),
    ("embeddings.patch_embeddings.projection.bias", ("embedding/bias",), _same),
    ("embeddings.cls_token", ("cls",), _same),
    ("embeddings.position_embeddings", (_POSEMB,), _same),
    (_L + ".layernorm_before.weight", (_B + "/LayerNorm_0/scale",), _same),
    (_L + ".layernorm_before.bias", (_B + "/LayerNorm_0/bias",), _same),
    *((f"{_L}.attention.attention.{name}.weight", (f"{_ATTN}/{name}/kernel",), _heads_kernel) for name in _QKV),
    *((f"{_L}.attention.attention.{name}.bias", (f"{_ATTN}/{name}/bias",), _heads_bias) for name in _QKV),
    (_L + ".attention.output.dense.weight", (_ATTN + "/out/kernel",), _out_kernel),
    (_L + ".attention.output.dense.bias", (_ATTN + "/out/bias",), _same),
    (_L + ".layernorm_after.weight", (_B + "/LayerNorm_2/scale",), _same),
    (_L + ".layernorm_after.bias", (_B + "/LayerNorm_2/bias",), _same),
    (_L + ".intermediate.dense.weight", (_B + "/MlpBlock_3/Dense_0/kernel",), _linear),
    (_L + ".intermediate.dense.bias", (_B + "/MlpBlock_3/Dense_0/bias",), _same),
    (_L + ".output.dense.weight", (_B + "/MlpBlock_3/Dense_1/kernel",), _linear),
    (_L + ".output.dense.bias", (_B + "/MlpBlock_3/Dense_1/bias",), _same),
    ("layernorm.weight", ("Transformer/encoder_norm/scale",), _same),
    ("layernorm.bias", ("Transformer/encoder_norm/bias",), _same),
    ("pooler.dense.weight", ("pre_logits/kernel",), _linear),
    ("pooler.dense.bias", ("pre_logits/bias",), _same),
    ("classifier.weight", ("head/kernel",), _linear),
    ("classifier.bias", ("head/bias",), _same),
)

_TABLES = {TIMM: _TIMM_TABLE, HUGGING_FACE: _HF_TABLE}


def _match(key: str, layout: str):
    """(block index or None, .npz templates, transform) for a key (without `vit.`), or None."""
    for template, targets, transform in _TABLES[layout]:
        match = re.fullmatch(re.escape(template).replace(r"\{i\}", r"(\d+)"), key)
        if match:
            return (match.group(1) if match.groups() else None), targets, transform
    return None


@dataclasses.dataclass(frozen=True)
class Translation:
    """A state dict in the original `.npz` layout.

    Attributes:
        arrays: `.npz` key -> array; keys of no known meaning are kept under their own name
            (the loader reports them as unexpected).
        source_keys: `.npz` key -> the file's key it came from.
        problems: tensors that could not be converted (e.g. a width the heads do not divide).
    """

    arrays: dict[str, np.ndarray]
    source_keys: dict[str, str]
    problems: list[str]


def translate(tensors: dict[str, np.ndarray], layout: str, num_heads: int) -> Translation:
    """Translates a timm or Hugging Face state dict into the original `.npz` layout."""
    arrays, source_keys, problems = {}, {}, []
    for plain, key in _plain_keys(tensors).items():
        found = _match(plain, layout)
        if found is None:
            arrays[key], source_keys[key] = tensors[key], key
            continue
        block, targets, transform = found
        try:
            values = transform(tensors[key], num_heads)
        except ValueError as error:
            problems.append(f"cannot convert key {key!r} {tensors[key].shape}: {error}")
            continue
        for target, value in zip(targets, values):
            target = target.format(i=block)
            arrays[target], source_keys[target] = value, key
    return Translation(arrays, source_keys, problems)


def weight_sources(layout: str, num_layers: int, prefix: str = "") -> dict[str, str]:
    """Keras weight path -> the source key that feeds it, for a model of `num_layers` blocks."""
    sources = {}
    for template, targets, _ in _TABLES[layout]:
        for i in range(num_layers) if "{i}" in template else [None]:
            key = template.format(i=i)
            key = prefix + key if layout == HUGGING_FACE and not key.startswith(("pooler.", "classifier.")) else key
            for target in targets:
                sources[npz.keras_path(target.format(i=i))[0]] = key
    return sources


def hf_prefix(keys) -> str:
    """`"vit."` for a ViTForImageClassification state dict, `""` for a ViTModel one."""
    return "vit." if any(key.startswith("vit.") for key in keys) else ""


def npz_shapes(shapes: Mapping[str, Sequence[int]], layout: str) -> dict[str, tuple[int, ...]]:
    """The shapes a state dict of these shapes has in the `.npz` layout, read without its data.

    The number of heads is not stored in these layouts: attention kernels come out as one head,
    (D, 1, D) and (1, D, D). Untranslatable tensors are left out (`translate` reports them).
    """
    empty = {key: np.broadcast_to(np.float32(0), tuple(shape)) for key, shape in shapes.items()}  # no memory
    return {key: array.shape for key, array in translate(empty, layout, num_heads=1).arrays.items()}
