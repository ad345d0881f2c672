"""ViT checkpoints of the PyTorch world: timm and Hugging Face state dicts in `.safetensors` files.

A file's layout is detected from its keys:

- timm `VisionTransformer` (`patch_embed.proj.weight`, `cls_token`, `pos_embed`,
  `blocks.N.attn.qkv.weight`, `blocks.N.mlp.fc1.weight`, `norm.weight`, `head.weight`, ...);
- Hugging Face `ViTForImageClassification` (`vit.embeddings...`, `vit.encoder.layer.N...`,
  `vit.layernorm...`, `classifier...`) or `ViTModel` (the same without `vit.`, optionally
  `pooler.dense...`, which becomes the `pre_logits` Dense + tanh layer).

Its tensors are translated into the original `.npz` key layout (Linear (out, in) -> (in, out),
convolution (out, in, kh, kw) -> (kh, kw, in, out), fused or separate query/key/value -> (D,
heads, head_dim)), and `keras_vit.weights` then checks, resamples and assigns them as for an
`.npz` file: all or nothing, every problem listed under the file's own key names.

Both layouts compute with the exact erf GELU; timm's LayerNorm epsilon is 1e-6 and Hugging
Face's default 1e-12 (`NUMERICS`): the builders take these when `weights=` is such a file.

Supported: class-token models (timm `global_pool='token'`, Hugging Face ViT), with or without
their head. Not supported, and refused with an error naming the keys that show them: timm
models without a class token or with `no_embed_class`, `fc_norm` (`global_pool='avg'`),
register tokens, layer scale, `qk_norm`, `norm_pre`, attention pooling, a patch-embedding norm;
Hugging Face configs other than the defaults for `layer_norm_eps` and `hidden_act` (not stored
in the weights file, so not detectable). PyTorch pickle files (`.bin`, `.pth`, ...) are never
unpickled: convert them to `.safetensors` first (`PICKLE_HINT`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Callable, Sequence

import numpy as np

TIMM = "timm"
HUGGING_FACE = "huggingface"

NUMERICS: dict[str, dict] = {
    TIMM: dict(layer_norm_epsilon=1e-6, gelu_approximate=False),
    HUGGING_FACE: dict(layer_norm_epsilon=1e-12, gelu_approximate=False),
}

PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt", ".pkl")
PICKLE_HINT = ("python -c \"import sys, torch; from safetensors.torch import save_file; "
               "save_file({k: v.contiguous() for k, v in torch.load(sys.argv[1], weights_only=True).items()}, "
               "sys.argv[2])\" model.bin model.safetensors")

_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


# ---------------------------------------------------------------------------------------
# Reading .safetensors (no torch, no pickle)
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a `.safetensors` header; `begin`/`end` are absolute file offsets."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _corrupt(path: str, reason: str) -> ValueError:
    return ValueError(f"Could not read {path!r} as a .safetensors file: {reason}. Expected an 8-byte little-endian "
                      "header length, a JSON header of tensor dtypes, shapes and data offsets, then the tensor "
                      "data. The file is truncated, corrupt or of another format.")


def refuse_pickle(path: str) -> None:
    """Raises for a PyTorch pickle file: unpickling can run arbitrary code, so it is never read."""
    if path.endswith(PICKLE_SUFFIXES):
        raise ValueError(f"{path!r} is a PyTorch pickle file; keras_vit does not unpickle files (unpickling can "
                         "run arbitrary code). Convert it to .safetensors where you trust it, e.g.:\n  "
                         + PICKLE_HINT)


def read_header(path: str) -> dict[str, TensorInfo]:
    """Reads and checks a `.safetensors` header against the file's size; reads no tensor data.

    Raises:
        ValueError: truncated or corrupt file, or a dtype other than F64, F32, F16, BF16.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise _corrupt(path, f"it has {size} bytes, fewer than the 8-byte header length")
        length = int.from_bytes(prefix, "little")
        if length > size - 8:
            raise _corrupt(path, f"its header length is {length} bytes, but only {size - 8} bytes follow")
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _corrupt(path, f"its header is not JSON ({error})") from error
    if not isinstance(header, dict):
        raise _corrupt(path, f"its header is a JSON {type(header).__name__}, not an object")
    data_start, data_size = 8 + length, size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(n) for n in entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as error:
            raise _corrupt(path, f"the header entry of tensor {name!r} is malformed: {entry!r}") from error
        if dtype not in _DTYPES:
            raise ValueError(f"Tensor {name!r} of {path!r} has dtype {dtype}; expected one of {sorted(_DTYPES)} "
                             "(floating-point weights).")
        expected = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize
        if not 0 <= begin <= end or end - begin != expected:
            raise _corrupt(path, f"tensor {name!r} {dtype}{list(shape)} needs {expected} bytes, but its data "
                                 f"offsets are [{begin}, {end}]")
        if end > data_size:
            raise _corrupt(path, f"tensor {name!r} ends at byte {end} of the data, but the file holds only "
                                 f"{data_size} bytes of data (truncated?)")
        tensors[name] = TensorInfo(dtype, shape, data_start + begin, data_start + end)
    return tensors


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Reads every tensor of a `.safetensors` file as float32 NumPy arrays (no torch needed)."""
    header = read_header(path)
    arrays = {}
    with open(path, "rb") as file:
        for name, info in header.items():
            file.seek(info.begin)
            data = np.frombuffer(file.read(info.end - info.begin), _DTYPES[info.dtype])
            if info.dtype == "BF16":
                data = (data.astype(np.uint32) << 16).view(np.float32)
            arrays[name] = data.astype(np.float32).reshape(info.shape)
    return arrays


# ---------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------

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
    (r"reg_token", "register tokens"),
    (r"blocks\.\d+\.ls[12]\..*", "layer scale (init_values)"),
    (r"blocks\.\d+\.attn\.[qk]_norm\..*", "qk_norm"),
    (r"blocks\.\d+\.(attn|mlp)\.norm\..*", "scale_attn_norm / scale_mlp_norm"),
    (r"fc_norm\..*", "fc_norm (global_pool='avg' and kin)"),
    (r"norm_pre\..*", "pre-norm (pre_norm=True, as CLIP)"),
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
        elif "pos_embed" in shapes and len(shapes["pos_embed"]) == 3 \
                and math.isqrt(shapes["pos_embed"][1]) ** 2 == shapes["pos_embed"][1]:
            found["no_embed_class (position embedding without a class-token row)"] = ["pos_embed"]
    elif "embeddings.cls_token" not in plain:
        found["no class token"] = ["embeddings.cls_token (absent)"]
    if found:
        listed = "; ".join(f"{feature} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
                           for feature, keys in found.items())
        raise ValueError(f"{origin!r} is a {layout} ViT with features keras_vit does not implement: {listed}. "
                         "Supported: class-token ViTs as timm's vit_*_patch*_* and Hugging Face's ViT; nothing "
                         "was loaded.")


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
_POSEMB = "Transformer/posembed_input/pos_embedding"

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
    from keras_vit import weights as weights_lib

    sources = {}
    for template, targets, _ in _TABLES[layout]:
        for i in range(num_layers) if "{i}" in template else [None]:
            key = template.format(i=i)
            key = prefix + key if layout == HUGGING_FACE and not key.startswith(("pooler.", "classifier.")) else key
            for target in targets:
                sources[weights_lib.keras_path(target.format(i=i))[0]] = key
    return sources


def hf_prefix(keys) -> str:
    """`"vit."` for a ViTForImageClassification state dict, `""` for a ViTModel one."""
    return "vit." if any(key.startswith("vit.") for key in keys) else ""


# ---------------------------------------------------------------------------------------
# The source models' forward passes, in NumPy (float64)
# ---------------------------------------------------------------------------------------

_erf = np.frompyfunc(math.erf, 1, 1)


def _gelu_exact(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + eps) * weight + bias


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.exp(x - x.max(-1, keepdims=True))
    return x / x.sum(-1, keepdims=True)


def _embed(images: np.ndarray, weight: np.ndarray, bias: np.ndarray, cls_token: np.ndarray,
           pos_embed: np.ndarray) -> np.ndarray:
    """Patch Conv2d (kernel = stride = patch) of NHWC images by a torch (out, in, kh, kw) weight, class
    token prepended, position embedding added (resampled to the grid as keras_vit loads it: the
    original's bilinear, not timm's bicubic). Returns (B, 1 + N, D)."""
    from keras_vit import weights as weights_lib

    batch, height, width, channels = images.shape
    p = weight.shape[-1]
    grid = (height // p, width // p)
    patches = images.reshape(batch, grid[0], p, grid[1], p, channels).transpose(0, 1, 3, 5, 2, 4)
    x = patches.reshape(batch, grid[0] * grid[1], -1) @ weight.reshape(weight.shape[0], -1).T + bias
    x = np.concatenate([np.broadcast_to(cls_token, (batch, 1, x.shape[-1])), x], axis=1)
    if pos_embed.shape[1] != x.shape[1]:
        pos_embed = weights_lib.resample_position_embedding(pos_embed, grid)
    return x + pos_embed


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, heads: int) -> np.ndarray:
    """softmax(q k^T / sqrt(head_dim)) v per head; q, k, v and the result (B, N, D)."""
    batch, tokens, width = q.shape
    split = lambda t: t.reshape(batch, tokens, heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    probs = _softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(width // heads))
    return (probs @ v).transpose(0, 2, 1, 3).reshape(batch, tokens, width)


def _timm_forward(t: dict[str, np.ndarray], images: np.ndarray, heads: int) -> np.ndarray:
    """timm VisionTransformer (global_pool='token'): x = patch conv, cls, + pos_embed; per block
    x += proj(attn(norm1(x))); x += fc2(gelu_erf(fc1(norm2(x)))); norm; head on token 0. eps 1e-6."""
    eps = NUMERICS[TIMM]["layer_norm_epsilon"]
    x = _embed(images, t["patch_embed.proj.weight"], t["patch_embed.proj.bias"], t["cls_token"], t["pos_embed"])
    i = 0
    while f"blocks.{i}.norm1.weight" in t:
        b = f"blocks.{i}."
        h = _layer_norm(x, t[b + "norm1.weight"], t[b + "norm1.bias"], eps)
        q, k, v = np.split(h @ t[b + "attn.qkv.weight"].T + t[b + "attn.qkv.bias"], 3, axis=-1)
        x = x + _attention(q, k, v, heads) @ t[b + "attn.proj.weight"].T + t[b + "attn.proj.bias"]
        h = _layer_norm(x, t[b + "norm2.weight"], t[b + "norm2.bias"], eps)
        h = _gelu_exact(h @ t[b + "mlp.fc1.weight"].T + t[b + "mlp.fc1.bias"])
        x = x + h @ t[b + "mlp.fc2.weight"].T + t[b + "mlp.fc2.bias"]
        i += 1
    x = _layer_norm(x, t["norm.weight"], t["norm.bias"], eps)[:, 0]
    return x @ t["head.weight"].T + t["head.bias"] if "head.weight" in t else x


def _hf_forward(t: dict[str, np.ndarray], images: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face ViTForImageClassification / ViTModel: embeddings, per layer x += output.dense(
    self-attention(layernorm_before(x))); x += output.dense(gelu_erf(intermediate.dense(layernorm_after(x))));
    layernorm; classifier on token 0 (or the pooler's tanh(dense) of token 0, or token 0). eps 1e-12."""
    eps = NUMERICS[HUGGING_FACE]["layer_norm_epsilon"]
    t = {plain: t[key] for plain, key in _plain_keys(t).items()}
    e = "embeddings."
    x = _embed(images, t[e + "patch_embeddings.projection.weight"], t[e + "patch_embeddings.projection.bias"],
               t[e + "cls_token"], t[e + "position_embeddings"])
    i = 0
    while f"encoder.layer.{i}.layernorm_before.weight" in t:
        b = f"encoder.layer.{i}."
        h = _layer_norm(x, t[b + "layernorm_before.weight"], t[b + "layernorm_before.bias"], eps)
        q, k, v = (h @ t[f"{b}attention.attention.{n}.weight"].T + t[f"{b}attention.attention.{n}.bias"]
                   for n in _QKV)
        x = x + _attention(q, k, v, heads) @ t[b + "attention.output.dense.weight"].T \
            + t[b + "attention.output.dense.bias"]
        h = _layer_norm(x, t[b + "layernorm_after.weight"], t[b + "layernorm_after.bias"], eps)
        h = _gelu_exact(h @ t[b + "intermediate.dense.weight"].T + t[b + "intermediate.dense.bias"])
        x = x + h @ t[b + "output.dense.weight"].T + t[b + "output.dense.bias"]
        i += 1
    x = _layer_norm(x, t["layernorm.weight"], t["layernorm.bias"], eps)[:, 0]
    if "classifier.weight" in t:
        return x @ t["classifier.weight"].T + t["classifier.bias"]
    return np.tanh(x @ t["pooler.dense.weight"].T + t["pooler.dense.bias"]) if "pooler.dense.weight" in t else x


def reference_forward(tensors: dict[str, np.ndarray], images: np.ndarray, num_heads: int) -> np.ndarray:
    """The source model's output, from its own equations in NumPy float64 (no Keras, no translation).

    Args:
        tensors: a timm or Hugging Face state dict (`read_safetensors`).
        images: (batch, height, width, 3) in [-1, 1], NHWC.
        num_heads: int. Attention heads (not stored in the state dict).

    Returns:
        (batch, classes) logits; without a head, the pooler output or the class token after the norm.
    """
    t = {key: value.astype(np.float64) for key, value in tensors.items()}
    forward = _timm_forward if detect_layout(tensors) == TIMM else _hf_forward
    return forward(t, np.asarray(images, np.float64), num_heads)


# ---------------------------------------------------------------------------------------
# Architecture, and conversion to a Keras file
# ---------------------------------------------------------------------------------------

def top_widths(shapes: dict[str, tuple[int, ...]], layout: str) -> tuple[int | None, int | None]:
    """(head classes, pooler / pre-logits width) of a state dict; None where absent."""
    plain = {key: shapes[source] for key, source in _plain_keys(shapes).items()}
    head = plain.get("head.bias" if layout == TIMM else "classifier.bias")
    pooler = plain.get("pooler.dense.bias") if layout == HUGGING_FACE else None
    return (head[0] if head else None), (pooler[0] if pooler else None)


def architecture(shapes: dict[str, tuple[int, ...]], variant: str | None = None,
                 num_heads: int | None = None) -> dict:
    """`VisionTransformer` architecture arguments of a timm / Hugging Face state dict.

    The number of heads is not stored in the weights: it is `num_heads` if given, else the
    `variant`'s, else that of the variant with the same width, MLP width, depth and patch size.

    Returns:
        patch_size, hidden_dim, mlp_dim, num_heads, num_layers, and image_size (the square input
        size of its position embedding).
    """
    from keras_vit import variants

    layout = detect_layout(shapes)
    plain = {key: shapes[source] for key, source in _plain_keys(shapes).items()}
    names = dict(conv="patch_embed.proj.weight", pos="pos_embed", fc1="blocks.0.mlp.fc1.weight",
                 block=r"blocks\.(\d+)\..*")
    if layout == HUGGING_FACE:
        names = dict(conv="embeddings.patch_embeddings.projection.weight", pos="embeddings.position_embeddings",
                     fc1="encoder.layer.0.intermediate.dense.weight", block=r"encoder\.layer\.(\d+)\..*")
    missing = [names[name] for name in ("conv", "pos", "fc1") if names[name] not in plain]
    if missing:
        raise ValueError(f"Cannot read the architecture of this {layout} state dict: no key {missing}.")
    hidden, _, patch, _ = plain[names["conv"]]
    found = dict(patch_size=patch, hidden_dim=hidden, mlp_dim=plain[names["fc1"]][0],
                 num_layers=len({m.group(1) for key in plain for m in [re.fullmatch(names["block"], key)] if m}))
    found["image_size"] = math.isqrt(plain[names["pos"]][1] - 1) * patch
    if num_heads is not None or variant is not None:
        return dict(found, num_heads=num_heads or variants.decode_variant(variant)["num_heads"])
    for config in variants.VARIANTS.values():
        if all(config.get(key) == found[key] for key in ("patch_size", "hidden_dim", "mlp_dim", "num_layers")):
            return dict(found, num_heads=config["num_heads"])
    raise ValueError(f"No keras_vit variant has this checkpoint's architecture {found}, and the number of heads "
                     "is not stored in the weights: give the variant (or the number of heads).")


def convert_safetensors(checkpoint: str, output: str, *, variant: str | None = None,
                        num_heads: int | None = None, image_size: tuple[int, int] | None = None) -> float:
    """Writes a timm / Hugging Face `.safetensors` ViT as a Keras `.keras` model or `.weights.h5` file.

    The model takes [-1, 1] NHWC inputs (no preprocessing layer) and returns logits (or, without
    a head, the pooler output or the class token). The written file is read back into a fresh
    model and compared with `reference_forward` on two random images.

    Args:
        checkpoint: path of the `.safetensors` file.
        output: path ending in `.keras` or `.weights.h5`.
        variant: optional variant name; gives the number of heads.
        num_heads: optional number of heads, for architectures not in the variant table.
        image_size: optional (height, width). Defaults to the checkpoint's.

    Returns:
        The max |difference| between the reloaded Keras model and the NumPy forward pass.
    """
    import keras

    from keras_vit import models

    if not output.endswith((".keras", ".weights.h5")):
        raise ValueError(f"The output must end in .keras or .weights.h5. Received: {output!r}")
    refuse_pickle(checkpoint)
    shapes = {name: info.shape for name, info in read_header(checkpoint).items()}
    found = architecture(shapes, variant, num_heads)
    layout = detect_layout(shapes)
    head, pooler = top_widths(shapes, layout)
    checkpoint_size = found.pop("image_size")
    image_size = image_size or (checkpoint_size, checkpoint_size)
    build = dict(found, input_shape=(*image_size, 3), include_preprocessing=False, classifier_activation=None,
                 include_top=head is not None, classes=head or 1000, representation_size=pooler,
                 pooling=None if head else "token", **NUMERICS[layout])
    model = models.VisionTransformer(weights=checkpoint, **build)
    if output.endswith(".keras"):
        model.save(output)
        converted = keras.saving.load_model(output)
    else:
        model.save_weights(output)
        converted = models.VisionTransformer(weights=output, **build)
    images = np.random.default_rng(0).uniform(-1, 1, (2, *image_size, 3)).astype("float32")
    expected = reference_forward(read_safetensors(checkpoint), images, found["num_heads"])
    return float(np.abs(np.asarray(converted(images), np.float64) - expected).max())
