"""Writes tiny checkpoints in the layout of the released ViT `.npz` files (random values).

Every key and shape follows the public files (REFERENCE.md section 3): `Transformer/` prefix,
old Flax module names, attention kernels (D, heads, head_dim), GroupNorm scale/bias as
(1, 1, 1, C) in hybrids. `big_vision_names` rewrites a checkpoint with the newer naming.
"""

from __future__ import annotations

import numpy as np

TINY = dict(patch=8, hidden=48, mlp=96, heads=3, layers=2)


def _normal(rng, shape, scale):
    return (rng.standard_normal(shape) * scale).astype("float32")


def _norm(rng, prefix, width, shape=None):
    shape = shape or (width,)
    return {f"{prefix}/scale": (1 + _normal(rng, shape, 0.1)), f"{prefix}/bias": _normal(rng, shape, 0.1)}


def _resnet(rng, stages, width=64) -> tuple[dict, int]:
    """Hybrid stem keys; returns (arrays, output channels)."""
    arrays = {"conv_root/kernel": _normal(rng, (7, 7, 3, width), 1.0),
              **_norm(rng, "gn_root", width, (1, 1, 1, width))}
    channels = width
    for stage, units in enumerate(stages, start=1):
        filters = width * 2 ** (stage - 1)
        for unit in range(1, units + 1):
            p = f"block{stage}/unit{unit}"
            arrays.update({f"{p}/conv1/kernel": _normal(rng, (1, 1, channels, filters), 1.0),
                           f"{p}/conv2/kernel": _normal(rng, (3, 3, filters, filters), 1.0),
                           f"{p}/conv3/kernel": _normal(rng, (1, 1, filters, 4 * filters), 1.0)})
            for gn, size in (("gn1", filters), ("gn2", filters), ("gn3", 4 * filters)):
                arrays.update(_norm(rng, f"{p}/{gn}", size, (1, 1, 1, size)))
            if unit == 1:  # channel count (and, after stage 1, stride) changes: projection
                arrays[f"{p}/conv_proj/kernel"] = _normal(rng, (1, 1, channels, 4 * filters), 1.0)
                arrays.update(_norm(rng, f"{p}/gn_proj", 4 * filters, (1, 1, 1, 4 * filters)))
            channels = 4 * filters
    return arrays, channels


def vit_checkpoint(*, grid: int = 4, classes: int = 10, classifier: str = "token",
                   representation_size: int | None = None, zero_head: bool = False,
                   resnet_stages: tuple[int, ...] | None = None, seed: int = 0, **arch) -> dict[str, np.ndarray]:
    """Arrays of a released-layout checkpoint for a square `grid` x `grid` patch grid."""
    a = {**TINY, **arch}
    rng = np.random.default_rng(seed)
    d, heads = a["hidden"], a["heads"]
    arrays, channels = _resnet(rng, resnet_stages) if resnet_stages else ({}, 3)
    patch = 1 if resnet_stages else a["patch"]
    fan_in = patch * patch * channels
    arrays["embedding/kernel"] = _normal(rng, (patch, patch, channels, d), fan_in ** -0.5)
    arrays["embedding/bias"] = _normal(rng, (d,), 0.1)
    prefix = 1 if classifier == "token" else 0
    if prefix:
        arrays["cls"] = _normal(rng, (1, 1, d), 0.5)
    arrays["Transformer/posembed_input/pos_embedding"] = _normal(rng, (1, prefix + grid * grid, d), 0.5)
    for i in range(a["layers"]):
        b = f"Transformer/encoderblock_{i}"
        arrays.update(_norm(rng, f"{b}/LayerNorm_0", d))
        for name in ("query", "key", "value"):
            kernel = _normal(rng, (d, heads, d // heads), d ** -0.5)
            arrays[f"{b}/MultiHeadDotProductAttention_1/{name}/kernel"] = kernel
            arrays[f"{b}/MultiHeadDotProductAttention_1/{name}/bias"] = _normal(rng, (heads, d // heads), 0.1)
        arrays[f"{b}/MultiHeadDotProductAttention_1/out/kernel"] = _normal(rng, (heads, d // heads, d), d ** -0.5)
        arrays[f"{b}/MultiHeadDotProductAttention_1/out/bias"] = _normal(rng, (d,), 0.1)
        arrays.update(_norm(rng, f"{b}/LayerNorm_2", d))
        arrays[f"{b}/MlpBlock_3/Dense_0/kernel"] = _normal(rng, (d, a["mlp"]), d ** -0.5)
        arrays[f"{b}/MlpBlock_3/Dense_0/bias"] = _normal(rng, (a["mlp"],), 0.1)
        arrays[f"{b}/MlpBlock_3/Dense_1/kernel"] = _normal(rng, (a["mlp"], d), a["mlp"] ** -0.5)
        arrays[f"{b}/MlpBlock_3/Dense_1/bias"] = _normal(rng, (d,), 0.1)
    arrays.update(_norm(rng, "Transformer/encoder_norm", d))
    width = d
    if representation_size:
        arrays["pre_logits/kernel"] = _normal(rng, (d, representation_size), d ** -0.5)
        arrays["pre_logits/bias"] = _normal(rng, (representation_size,), 0.1)
        width = representation_size
    head_scale = 0.0 if zero_head else width ** -0.5
    arrays["head/kernel"] = _normal(rng, (width, classes), head_scale)
    arrays["head/bias"] = _normal(rng, (classes,), 0.0 if zero_head else 0.1)
    return arrays


def big_vision_names(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same arrays under big_vision's names: `params/` prefix, per-type module counters."""
    renames = {"/MultiHeadDotProductAttention_1/": "/MultiHeadDotProductAttention_0/",
               "/LayerNorm_2/": "/LayerNorm_1/", "/MlpBlock_3/": "/MlpBlock_0/"}
    renamed = {}
    for key, value in arrays.items():
        for old, new in renames.items():
            key = key.replace(old, new)
        renamed["params/" + key] = value
    return renamed


def save(path, arrays: dict[str, np.ndarray]) -> str:
    np.savez(path, **arrays)
    return str(path)
