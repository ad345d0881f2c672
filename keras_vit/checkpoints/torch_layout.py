"""The PyTorch world's ViT layouts, timm and Hugging Face, translated into the original `.npz` layout.

A state dict's layout is detected from its keys:

- timm `VisionTransformer` (`patch_embed.proj.weight`, `cls_token`, `pos_embed`, `blocks.N.attn.qkv.weight`,
  `blocks.N.mlp.fc1.weight`, `norm.weight`, `head.weight`, `attn_pool.*`, ...): ViT, DeiT (distilled), DeiT-III,
  DINOv2 (with registers), CLIP and SigLIP image towers;
- timm `Eva` (timm/models/eva.py: `blocks.N.gamma_1`, `blocks.N.attn.q_bias`, `blocks.N.mlp.fc1_g.weight`, or a
  `config.json` naming one of its entry points), of which keras_vit implements the DINOv3 entry points
  (`vit_*_patch16_dinov3*`: rotary positions, registers, layer scale, the SwiGLU MLP) and, as `TIMM_EVA02`, the
  EVA-02 ones (`eva02_{tiny,small,base,large}_patch14_{224,336,448}`: EVA-02's rotary positions beside a position
  table, the packed or split SwiGLU MLP, its hidden-layer norm); the CLIP towers, the RoPE ViTs and Perception
  Encoder of that class are refused by name (`config_files.read_timm_eva_config`);
- Hugging Face, by model (`HF_LAYOUTS`): `ViTModel` / `ViTForImageClassification` and the DeiT models
  (`[vit.|deit.]embeddings...`, `encoder.layer.N.attention.attention.query...`), `Dinov2Model` and
  `Dinov2WithRegistersModel` (`encoder.layer.N.norm1`, `layer_scale1.lambda1`), `CLIPVisionModel`
  (`vision_model.embeddings.class_embedding`, `encoder.layers.N.self_attn.q_proj`, `pre_layrnorm`) and
  `SiglipVisionModel` (the same without a class token, with `head.probe`), `DINOv3ViTModel`
  (`layer.N.attention.q_proj`, `layer.N.mlp.up_proj` / `gate_proj`, no position table: rotary positions). The image
  tower of a whole `CLIPModel` / `SiglipModel` file is read; its text tower is ignored.

Its tensors are translated into the original `.npz` key layout (Linear (out, in) -> (in, out),
convolution (out, in, kh, kw) -> (kh, kw, in, out), fused or separate query/key/value -> (D,
heads, head_dim)); `keras_vit.checkpoints.loader` then checks, resamples and assigns them as for an
`.npz` file: all or nothing, every problem listed under the file's own key names. Pure NumPy.

The files store neither the LayerNorm epsilon nor the activation, nor the number of heads. `NUMERICS` holds
each layout's defaults (timm's and the Hugging Face model classes'), which a user's values replace; a Hugging
Face `config.json` beside the file (`config_files.read_hf_config`) fixes them, and then a contradicting value is an
error.

Not supported, and refused with an error naming the keys that show them (`check_supported`): timm's
`scale_attn_norm` / `scale_mlp_norm`, a patch-embedding norm, attention pooling with more than one latent or
its own position embedding; Hugging Face DINOv2's SwiGLU MLP and its classifier on [class token, mean patch
token], and a classifier on a DINOv3 backbone; timm Eva's normalized attention output, gated attention and
attention pooling. DINOv3's Linears without a bias (`key_bias=False`, and any other
`*_bias=False` its config sets) and timm Eva's key bias (a buffer of zeros, not saved) load as zero biases
(`translate`): the same function.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping, Sequence

import numpy as np

from keras_vit.checkpoints import npz, resample

TIMM = "timm"
TIMM_EVA = "timm-eva"  # timm's Eva class: DINOv3
TIMM_EVA02 = "timm-eva02"  # the same class's EVA-02 entry points (told apart by the config.json)
TIMM_LAYOUTS = (TIMM, TIMM_EVA, TIMM_EVA02)
HUGGING_FACE = "huggingface"  # ViT and DeiT
HF_DINOV2 = "huggingface-dinov2"
HF_CLIP = "huggingface-clip"
HF_SIGLIP = "huggingface-siglip"
HF_DINOV3 = "huggingface-dinov3"
HF_LAYOUTS = (HUGGING_FACE, HF_DINOV2, HF_CLIP, HF_SIGLIP, HF_DINOV3)
# How each source resizes its position table (`resample`'s docstring names the code): the loader, and the run-time
# fit of a model of any input size (`ViTConfig.position_resampling`), use it.
POSITION_RESAMPLING = {**{layout: resample.BICUBIC_ANTIALIAS for layout in TIMM_LAYOUTS},
                       **{layout: resample.BICUBIC for layout in HF_LAYOUTS}}
# The prefixes of the Hugging Face models' backbone keys (heads such as `classifier.` have none).
_HF_PREFIXES = ("vit.", "deit.", "dinov2.", "dinov2_with_registers.", "vision_model.")

# Each layout's numerics where the file does not say (the model classes' defaults; timm: its ViT's), and DINOv3's
# rotary positions (`DINOv3ViTConfig`'s defaults).
NUMERICS: dict[str, dict] = {
    TIMM: dict(layer_norm_epsilon=1e-6, gelu_approximate=False, activation="gelu"),
    TIMM_EVA: dict(layer_norm_epsilon=1e-6, gelu_approximate=False, activation="gelu"),
    TIMM_EVA02: dict(layer_norm_epsilon=1e-6, gelu_approximate=False, activation="silu"),
    HUGGING_FACE: dict(layer_norm_epsilon=1e-12, gelu_approximate=False, activation="gelu"),
    HF_DINOV2: dict(layer_norm_epsilon=1e-6, gelu_approximate=False, activation="gelu"),
    HF_CLIP: dict(layer_norm_epsilon=1e-5, gelu_approximate=False, activation="quick_gelu"),
    HF_SIGLIP: dict(layer_norm_epsilon=1e-6, gelu_approximate=True, activation="gelu"),
    HF_DINOV3: dict(layer_norm_epsilon=1e-5, gelu_approximate=False, activation="gelu", position_embedding="none",
                    rope="dinov3", rope_theta=100.0, rope_rescale=2.0),
}


def _plain_keys(keys) -> dict[str, str]:
    """Key without a Hugging Face backbone prefix (`vit.`, `vision_model.`, ...) -> the file's key."""
    plain = {}
    for key in keys:
        prefix = next((prefix for prefix in _HF_PREFIXES if key.startswith(prefix)), "")
        plain[key.removeprefix(prefix)] = key
    return plain


# Keys only timm's Eva class has (its layer scale, its query/value biases beside a bias-free fused projection, its
# SwiGLU MLP's split input projection, its unfused query/key/value).
_EVA_KEY = re.compile(r"blocks\.\d+\.(gamma_1|attn\.q_bias|mlp\.fc1_g\.weight|attn\.q_proj\.weight)")


def detect_layout(keys: Sequence[str]) -> str:
    """`TIMM`, `TIMM_EVA` or one of `HF_LAYOUTS`, from a state dict's keys; ValueError for anything else. (An Eva
    file whose keys look like timm's ViT is told apart by its config.json: `reader.read_checkpoint`.)"""
    keys = list(keys)
    if "patch_embed.proj.weight" in keys or any(key.startswith("blocks.") for key in keys):
        return TIMM_EVA if any(_EVA_KEY.fullmatch(key) for key in keys) else TIMM
    plain = _plain_keys(keys)
    if any(re.fullmatch(r"layer\.\d+\.attention\.q_proj\.weight", key) for key in plain):
        return HF_DINOV3
    if any(key.startswith("encoder.layers.") for key in plain):
        return HF_CLIP if "embeddings.class_embedding" in plain else HF_SIGLIP
    if any(re.fullmatch(r"encoder\.layer\.\d+\.norm1\.weight", key) for key in plain):
        return HF_DINOV2
    if any(key.startswith(("embeddings.", "encoder.layer.")) for key in plain):
        return HUGGING_FACE
    shown = ", ".join(repr(key) for key in keys[:8]) + (", ..." if len(keys) > 8 else "")
    raise ValueError(f"Not a timm or Hugging Face ViT state dict ({len(keys)} keys: {shown}). Recognized layouts: "
                     "timm VisionTransformer ('patch_embed.proj.weight', 'blocks.N.attn.qkv.weight', ...) and "
                     "Hugging Face ViT / DeiT ('[vit.]embeddings.patch_embeddings.projection.weight', "
                     "'[vit.]encoder.layer.N.attention.attention.query.weight', ...), DINOv2 "
                     "('encoder.layer.N.norm1.weight', ...), CLIP and SigLIP vision models "
                     "('vision_model.encoder.layers.N.self_attn.q_proj.weight', ...), DINOv3 "
                     "('layer.N.attention.q_proj.weight', ...).")


# Features whose numerics keras_vit does not implement: layout -> ((key regex, what it is), ...).
_UNSUPPORTED = {
    TIMM: ((r"blocks\.\d+\.(attn|mlp)\.norm\..*", "scale_attn_norm / scale_mlp_norm"),
           (r"patch_embed\.norm\..*", "a patch-embedding norm"),
           (r"attn_pool\.pos_embed", "attention pooling with its own position embedding")),
    **{layout: ((r"blocks\.\d+\.attn\.norm\..*", "the normalized attention output (scale_attn_inner: EVA-02's CLIP "
                                                    "towers)"),
                (r"blocks\.\d+\.attn\.gate\..*", "gated attention"),
                (r"patch_embed\.norm\..*", "a patch-embedding norm"),
                (r"attn_pool\..*", "attention pooling")) for layout in (TIMM_EVA, TIMM_EVA02)},
    HF_DINOV2: ((r"encoder\.layer\.\d+\.mlp\.weights_in\..*", "the SwiGLU MLP (use_swiglu_ffn)"),),
    HF_DINOV3: ((r"classifier\..*", "a classifier on a DINOv3 backbone (transformers has no DINOv3 classifier "
                                    "class, so which tokens a head of your own reads is in no file)"),),
}


def check_supported(shapes: dict[str, tuple[int, ...]], layout: str, origin: str = "checkpoint") -> None:
    """Raises ValueError naming the keys of model features keras_vit would compute wrongly."""
    found = {}
    for pattern, feature in _UNSUPPORTED.get(layout, ()):
        keys = [key for plain, key in _plain_keys(shapes).items() if re.fullmatch(pattern, plain)]
        if keys:
            found[feature] = keys
    latent = shapes.get("attn_pool.latent")
    if layout == TIMM and latent is not None and tuple(latent)[1:2] != (1,):
        found[f"attention pooling of {tuple(latent)[1]} latents"] = ["attn_pool.latent"]
    if found:
        listed = "; ".join(f"{feature} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
                           for feature, keys in found.items())
        raise ValueError(f"{origin!r} is a {layout} ViT with features keras_vit does not implement: {listed}. "
                         "Supported: timm's ViT, DeiT, DeiT-III, DINOv2, DINOv3, EVA-02, CLIP and SigLIP image towers "
                         "and Hugging Face's ViT, DeiT, DINOv2, DINOv3, CLIP and SigLIP vision models; nothing was "
                         "loaded.")


def position_resampling(layout: str, keys) -> tuple[str, str]:
    """How the source of a file of this layout resizes its position table (`resample.METHODS`), and that source's
    name: timm with antialiasing; transformers bicubically, except `Dinov2WithRegistersModel`, which adds
    antialiasing (transformers 4.48 to 5.24 alike; its files are the DINOv2 layout with
    `embeddings.register_tokens`)."""
    if layout == HF_DINOV2 and "embeddings.register_tokens" in _plain_keys(keys):
        return resample.BICUBIC_ANTIALIAS, "transformers' Dinov2WithRegistersModel"
    return POSITION_RESAMPLING[layout], "timm" if layout in TIMM_LAYOUTS else "transformers"


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


def _split(array: np.ndarray, heads: int, convert: Callable, parts: int) -> list[np.ndarray]:
    """A fused projection of `parts` * width rows (query/key/value, or key/value) split, each converted."""
    if array.shape[0] % parts or (array.ndim == 2 and array.shape[0] != parts * array.shape[1]):
        fused = {3: "query/key/value", 2: "key/value"}[parts]
        raise ValueError(f"expected a fused {fused} of {parts} * width rows, found shape {array.shape}")
    return [convert(part, heads)[0] for part in np.split(array, parts)]


def _qkv_kernel(array: np.ndarray, heads: int) -> list[np.ndarray]:
    return _split(array, heads, _heads_kernel, 3)


def _qkv_bias(array: np.ndarray, heads: int) -> list[np.ndarray]:
    return _split(array, heads, _heads_bias, 3)


def _kv_kernel(array: np.ndarray, heads: int) -> list[np.ndarray]:
    return _split(array, heads, _heads_kernel, 2)


def _kv_bias(array: np.ndarray, heads: int) -> list[np.ndarray]:
    return _split(array, heads, _heads_bias, 2)


def _token(array: np.ndarray, heads: int) -> list[np.ndarray]:
    """CLIP's class embedding (D,) -> a token (1, 1, D)."""
    _expect_ndim(array, 1)
    return [array.reshape(1, 1, -1)]


def _rows(array: np.ndarray, heads: int) -> list[np.ndarray]:
    """An `nn.Embedding` table (tokens, D) -> (1, tokens, D)."""
    _expect_ndim(array, 2)
    return [array[None]]


def _linear_no_bias(array: np.ndarray, heads: int) -> list[np.ndarray]:
    """A Linear without bias (CLIP's `visual_projection`) -> Dense kernel (in, out) and a zero bias."""
    _expect_ndim(array, 2)
    return [array.T, np.zeros(array.shape[:1], array.dtype)]


_B = "Transformer/encoderblock_{i}"
_ATTN = _B + "/MultiHeadDotProductAttention_1"
_QKV = ("query", "key", "value")
_POSEMB = npz.POSEMB_KEY
_MAP = "MAPHead_0"
_MAP_ATTN = _MAP + "/MultiHeadDotProductAttention_0"
_IGNORED = ()  # targets of tensors that are not weights of the model (training-only tokens, buffers, text towers)


def _norm(source: str, target: str) -> tuple:
    """Rows for a LayerNorm: `source.weight`/`.bias` -> `target/scale`/`/bias`."""
    return ((f"{source}.weight", (f"{target}/scale",), _same), (f"{source}.bias", (f"{target}/bias",), _same))


def _dense(source: str, target: str, kernel: Callable = _linear, bias: Callable = _same) -> tuple:
    """Rows for a Linear: `source.weight`/`.bias` -> `target/kernel`/`/bias`."""
    return ((f"{source}.weight", (f"{target}/kernel",), kernel), (f"{source}.bias", (f"{target}/bias",), bias))


def _separate_qkv(source: str, target: str) -> tuple:
    """Rows for separate query/key/value Linears, `source` formatted with each of `names`."""
    return tuple(row for name, own in zip(_QKV, source) for row in (
        (f"{own}.weight", (f"{target}/{name}/kernel",), _heads_kernel),
        (f"{own}.bias", (f"{target}/{name}/bias",), _heads_bias)))


def _mlp(source: str, target: str) -> tuple:
    return (*_dense(f"{source}.fc1", f"{target}/Dense_0"), *_dense(f"{source}.fc2", f"{target}/Dense_1"))


# (source key template, .npz key templates, transform); "{i}" stands for a block index.
_TIMM_TABLE = (
    ("patch_embed.proj.weight", ("embedding/kernel",), _conv),
    ("patch_embed.proj.bias", ("embedding/bias",), _same),
    ("cls_token", ("cls",), _same),
    ("pos_embed", (_POSEMB,), _same),
    *_norm("blocks.{i}.norm1", _B + "/LayerNorm_0"),
    ("blocks.{i}.attn.qkv.weight", tuple(f"{_ATTN}/{name}/kernel" for name in _QKV), _qkv_kernel),
    ("blocks.{i}.attn.qkv.bias", tuple(f"{_ATTN}/{name}/bias" for name in _QKV), _qkv_bias),
    *_dense("blocks.{i}.attn.proj", _ATTN + "/out", _out_kernel),
    *_norm("blocks.{i}.norm2", _B + "/LayerNorm_2"),
    *_mlp("blocks.{i}.mlp", _B + "/MlpBlock_3"),
    ("reg_token", ("registers",), _same),
    ("dist_token", ("dist_token",), _same),
    *_dense("head_dist", "head_dist"),
    ("blocks.{i}.ls1.gamma", (_B + "/ls1/scale",), _same),
    ("blocks.{i}.ls2.gamma", (_B + "/ls2/scale",), _same),
    *_norm("blocks.{i}.attn.q_norm", _ATTN + "/query_norm"),
    *_norm("blocks.{i}.attn.k_norm", _ATTN + "/key_norm"),
    *_norm("norm_pre", "norm_pre"),
    *_norm("fc_norm", "fc_norm"),
    *_norm("norm", "Transformer/encoder_norm"),
    ("attn_pool.latent", (_MAP + "/probe",), _same),
    *_dense("attn_pool.q", _MAP_ATTN + "/query", _heads_kernel, _heads_bias),
    ("attn_pool.kv.weight", tuple(f"{_MAP_ATTN}/{name}/kernel" for name in _QKV[1:]), _kv_kernel),
    ("attn_pool.kv.bias", tuple(f"{_MAP_ATTN}/{name}/bias" for name in _QKV[1:]), _kv_bias),
    *_dense("attn_pool.proj", _MAP_ATTN + "/out", _out_kernel),
    *_norm("attn_pool.norm", _MAP + "/LayerNorm_0"),
    *_mlp("attn_pool.mlp", _MAP + "/MlpBlock_0"),
    *_dense("head", "head"),
)

_L = "encoder.layer.{i}"
_HF_QKV = tuple(f"{_L}.attention.attention.{name}" for name in _QKV)
# ViTModel, ViTForImageClassification and the DeiT models.
_HF_TABLE = (
    *_dense("embeddings.patch_embeddings.projection", "embedding", _conv),
    ("embeddings.cls_token", ("cls",), _same),
    ("embeddings.distillation_token", ("dist_token",), _same),
    ("embeddings.position_embeddings", (_POSEMB,), _same),
    ("embeddings.mask_token", _IGNORED, _same),
    *_norm(_L + ".layernorm_before", _B + "/LayerNorm_0"),
    *_separate_qkv(_HF_QKV, _ATTN),
    *_dense(_L + ".attention.output.dense", _ATTN + "/out", _out_kernel),
    *_norm(_L + ".layernorm_after", _B + "/LayerNorm_2"),
    *_dense(_L + ".intermediate.dense", _B + "/MlpBlock_3/Dense_0"),
    *_dense(_L + ".output.dense", _B + "/MlpBlock_3/Dense_1"),
    *_norm("layernorm", "Transformer/encoder_norm"),
    *_dense("pooler.dense", "pre_logits"),
    *_dense("classifier", "head"),
    *_dense("cls_classifier", "head"),
    *_dense("distillation_classifier", "head_dist"),
)

# Dinov2Model and Dinov2WithRegistersModel: the class token has a position, the registers do not.
_HF_DINOV2_TABLE = (
    *_dense("embeddings.patch_embeddings.projection", "embedding", _conv),
    ("embeddings.cls_token", ("cls",), _same),
    ("embeddings.register_tokens", ("registers",), _same),
    ("embeddings.position_embeddings", (_POSEMB,), _same),
    ("embeddings.mask_token", _IGNORED, _same),
    *_norm(_L + ".norm1", _B + "/LayerNorm_0"),
    *_separate_qkv(_HF_QKV, _ATTN),
    *_dense(_L + ".attention.output.dense", _ATTN + "/out", _out_kernel),
    (_L + ".layer_scale1.lambda1", (_B + "/ls1/scale",), _same),
    *_norm(_L + ".norm2", _B + "/LayerNorm_2"),
    *_mlp(_L + ".mlp", _B + "/MlpBlock_3"),
    (_L + ".layer_scale2.lambda1", (_B + "/ls2/scale",), _same),
    *_norm("layernorm", "Transformer/encoder_norm"),
    *_dense("classifier", "head"),  # (Dinov2|Dinov2WithRegisters)ForImageClassification's, on 2 D inputs
)

_CL = "encoder.layers.{i}"
# CLIPVisionModel(WithProjection) and SiglipVisionModel, alone or as the image tower of CLIPModel / SiglipModel.
_HF_CLIP_TABLE = (
    ("embeddings.class_embedding", ("cls",), _token),
    *_dense("embeddings.patch_embedding", "embedding", _conv),
    ("embeddings.position_embedding.weight", (_POSEMB,), _rows),
    ("embeddings.position_ids", _IGNORED, _same),
    *_norm("pre_layrnorm", "norm_pre"),
    *_norm(_CL + ".layer_norm1", _B + "/LayerNorm_0"),
    *_separate_qkv(tuple(f"{_CL}.self_attn.{name}_proj" for name in "qkv"), _ATTN),
    *_dense(_CL + ".self_attn.out_proj", _ATTN + "/out", _out_kernel),
    *_norm(_CL + ".layer_norm2", _B + "/LayerNorm_2"),
    *_mlp(_CL + ".mlp", _B + "/MlpBlock_3"),
    *_norm("post_layernorm", "Transformer/encoder_norm"),
    ("head.probe", (_MAP + "/probe",), _same),
    ("head.attention.in_proj_weight", tuple(f"{_MAP_ATTN}/{name}/kernel" for name in _QKV), _qkv_kernel),
    ("head.attention.in_proj_bias", tuple(f"{_MAP_ATTN}/{name}/bias" for name in _QKV), _qkv_bias),
    *_dense("head.attention.out_proj", _MAP_ATTN + "/out", _out_kernel),
    *_norm("head.layernorm", _MAP + "/LayerNorm_0"),
    *_mlp("head.mlp", _MAP + "/MlpBlock_0"),
    ("visual_projection.weight", ("head/kernel", "head/bias"), _linear_no_bias),
    *((key, _IGNORED, _same) for key in ("text_model.{rest}", "text_projection.weight", "logit_scale",
                                         "logit_bias")),
)

_EB = "blocks.{i}"
# timm's Eva with its DINOv3 entry points: [class, registers, patches], no position table (rotary positions), a fused
# query/key/value without bias and separate query and value biases (the key's is zero), layer scale as `gamma_1/2`,
# the SwiGLU MLP as `fc1_g` (gate) and `fc1_x`.
_TIMM_EVA_TABLE = (
    *_dense("patch_embed.proj", "embedding", _conv),
    ("cls_token", ("cls",), _same),
    ("reg_token", ("registers",), _same),
    ("pos_embed", (_POSEMB,), _same),
    *_norm(_EB + ".norm1", _B + "/LayerNorm_0"),
    (_EB + ".attn.qkv.weight", tuple(f"{_ATTN}/{name}/kernel" for name in _QKV), _qkv_kernel),
    *((f"{_EB}.attn.{name[0]}_bias", (f"{_ATTN}/{name}/bias",), _heads_bias) for name in _QKV),
    *_separate_qkv(tuple(f"{_EB}.attn.{name}_proj" for name in "qkv"), _ATTN),
    *_dense(_EB + ".attn.proj", _ATTN + "/out", _out_kernel),
    *_norm(_EB + ".attn.q_norm", _ATTN + "/query_norm"),
    *_norm(_EB + ".attn.k_norm", _ATTN + "/key_norm"),
    (_EB + ".gamma_1", (_B + "/ls1/scale",), _same),
    *_norm(_EB + ".norm2", _B + "/LayerNorm_2"),
    *_mlp(_EB + ".mlp", _B + "/MlpBlock_3"),
    *_dense(_EB + ".mlp.fc1_x", _B + "/MlpBlock_3/Dense_0"),
    *_dense(_EB + ".mlp.fc1_g", _B + "/MlpBlock_3/Dense_gate"),
    *_norm(_EB + ".mlp.norm", _B + "/MlpBlock_3/norm"),
    (_EB + ".gamma_2", (_B + "/ls2/scale",), _same),
    *_norm("norm", "Transformer/encoder_norm"),
    *_norm("fc_norm", "fc_norm"),
    *_dense("head", "head"),
    ("rope.{rest}", _IGNORED, _same),  # buffers of the rotary positions, recomputed from the config
)



def _half_pairs(array: np.ndarray) -> np.ndarray:
    """A head's channels [0, 1, 2, 3, ...] -> [0, 2, 4, ..., 1, 3, 5, ...] (last axis): the interleaved rotary pairs
    (2i, 2i + 1) become the pairs (i, i + head_dim / 2) that `apply_rotary` rotates; q . k is unchanged."""
    return np.concatenate([array[..., 0::2], array[..., 1::2]], axis=-1)


def _rotated_pairs(row: tuple) -> tuple:
    """A key-table row whose query and key outputs get `_half_pairs` (EVA-02's interleaved rotary pairs)."""
    template, targets, transform = row
    rotated = [re.search(r"/(query|key)/", target) is not None for target in targets]
    if not any(rotated):
        return row

    def convert(array: np.ndarray, heads: int) -> list[np.ndarray]:
        return [_half_pairs(value) if turn else value for value, turn in zip(transform(array, heads), rotated)]
    return template, targets, convert


def _glu_kernel(array: np.ndarray, heads: int) -> list[np.ndarray]:
    """timm's packed SwiGLU input Linear (`GluMlp`, gate first) (2H, D) -> the gate's and the value's (D, H)."""
    _expect_ndim(array, 2)
    return [part.T for part in np.split(array, 2)]


def _glu_bias(array: np.ndarray, heads: int) -> list[np.ndarray]:
    _expect_ndim(array, 1)
    return np.split(array, 2)


_MLP3 = _B + "/MlpBlock_3"
# EVA-02 (timm's Eva with its eva02_* entry points): the Eva rows with the query and key columns in the half
# layout, a position table covering the class token, the packed SwiGLU input of Ti / S (`mlp.fc1`, gate first) and
# the split one with the hidden-layer norm of B / L (`mlp.fc1_g`, `mlp.fc1_x`, `mlp.norm`).
_TIMM_EVA02_TABLE = (
    (_EB + ".mlp.fc1.weight", (_MLP3 + "/Dense_gate/kernel", _MLP3 + "/Dense_0/kernel"), _glu_kernel),
    (_EB + ".mlp.fc1.bias", (_MLP3 + "/Dense_gate/bias", _MLP3 + "/Dense_0/bias"), _glu_bias),
    *(_rotated_pairs(row) for row in _TIMM_EVA_TABLE),
)

_DL = "layer.{i}"
# DINOv3ViTModel: [class, registers, patches], no position table (rotary positions), the gated MLP's `gate_proj`.
_HF_DINOV3_TABLE = (
    *_dense("embeddings.patch_embeddings", "embedding", _conv),
    ("embeddings.cls_token", ("cls",), _same),
    ("embeddings.register_tokens", ("registers",), _same),
    ("embeddings.mask_token", _IGNORED, _same),
    *_norm(_DL + ".norm1", _B + "/LayerNorm_0"),
    *_separate_qkv(tuple(f"{_DL}.attention.{name}_proj" for name in "qkv"), _ATTN),
    *_dense(_DL + ".attention.o_proj", _ATTN + "/out", _out_kernel),
    (_DL + ".layer_scale1.lambda1", (_B + "/ls1/scale",), _same),
    *_norm(_DL + ".norm2", _B + "/LayerNorm_2"),
    *_dense(_DL + ".mlp.up_proj", _B + "/MlpBlock_3/Dense_0"),
    *_dense(_DL + ".mlp.gate_proj", _B + "/MlpBlock_3/Dense_gate"),
    *_dense(_DL + ".mlp.down_proj", _B + "/MlpBlock_3/Dense_1"),
    (_DL + ".layer_scale2.lambda1", (_B + "/ls2/scale",), _same),
    *_norm("norm", "Transformer/encoder_norm"),
)
# The Linears of layouts whose biases a config may leave out (DINOv3's `key_bias=False`, ...): a weight without its
# bias gets a zero one.
_BIAS_OPTIONAL = {HF_DINOV3: re.compile(r"layer\.\d+\.(attention\.[qkvo]_proj|mlp\.(up|gate|down)_proj)\.weight"),
                  TIMM_EVA: re.compile(r"blocks\.\d+\.attn\.[qkv]_proj\.weight"),
                  TIMM_EVA02: re.compile(r"blocks\.\d+\.attn\.[qkv]_proj\.weight")}

_TABLES = {TIMM: _TIMM_TABLE, TIMM_EVA: _TIMM_EVA_TABLE, TIMM_EVA02: _TIMM_EVA02_TABLE, HUGGING_FACE: _HF_TABLE,
           HF_DINOV2: _HF_DINOV2_TABLE, HF_CLIP: _HF_CLIP_TABLE,
           HF_SIGLIP: _HF_CLIP_TABLE, HF_DINOV3: _HF_DINOV3_TABLE}


def _match(key: str, layout: str):
    """(block index or None, .npz templates, transform) for a key (without its backbone prefix), or None."""
    for template, targets, transform in _TABLES[layout]:
        pattern = re.escape(template).replace(r"\{i\}", r"(\d+)").replace(r"\{rest\}", r"(?:.+)")
        match = re.fullmatch(pattern, key)
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
    """Translates a timm or Hugging Face state dict into the original `.npz` layout (tensors that are not
    weights of the image model, `_IGNORED`, are left out; a Linear of `_BIAS_OPTIONAL` without a bias gets a zero
    one, which computes the same)."""
    arrays, source_keys, problems = {}, {}, []
    optional = _BIAS_OPTIONAL.get(layout)
    if optional is not None:
        tensors = {**{key.removesuffix("weight") + "bias": np.zeros(value.shape[:1], value.dtype)
                      for key, value in tensors.items() if optional.fullmatch(key)}, **tensors}
    if layout in (TIMM_EVA, TIMM_EVA02):  # a fused projection's biases: the key's is zero, all three without `qkv_bias`
        tensors = {**{key.removesuffix("qkv.weight") + f"{name}_bias": np.zeros(value.shape[:1], value.dtype)[
            :value.shape[0] // 3] for key, value in tensors.items() if key.endswith(".attn.qkv.weight")
            for name in "qkv"}, **tensors}
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
        if not targets:  # an ignored tensor feeds no weight
            continue
        for i in range(num_layers) if "{i}" in template else [None]:
            key = template.format(i=i)
            key = key if key.startswith(_UNPREFIXED) else prefix + key
            for target in targets:  # the first row feeding a weight names it (as `_match` takes the first)
                sources.setdefault(npz.keras_path(target.format(i=i))[0], key)
    return sources


# Hugging Face keys outside the backbone prefix: the heads of the task models.
_UNPREFIXED = ("pooler.", "classifier.", "cls_classifier.", "distillation_classifier.", "visual_projection.")


def hf_prefix(keys) -> str:
    """The backbone prefix of a Hugging Face state dict: `"vit."` for ViTForImageClassification,
    `"vision_model."` for CLIP and SigLIP, ..., `""` for ViTModel (and timm)."""
    return next((prefix for prefix in _HF_PREFIXES if any(key.startswith(prefix) for key in keys)), "")


def npz_shapes(shapes: Mapping[str, Sequence[int]], layout: str) -> dict[str, tuple[int, ...]]:
    """The shapes a state dict of these shapes has in the `.npz` layout, read without its data.

    The number of heads is not stored in these layouts: attention kernels come out as one head,
    (D, 1, D) and (1, D, D). Untranslatable tensors are left out (`translate` reports them).
    """
    empty = {key: np.broadcast_to(np.float32(0), tuple(shape)) for key, shape in shapes.items()}  # no memory
    return {key: array.shape for key, array in translate(empty, layout, num_heads=1).arrays.items()}
