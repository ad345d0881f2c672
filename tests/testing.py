"""Shared test fixtures: tiny model configs, layer checks and serialization round trips, writers of
checkpoints in the released `.npz` layout (google-research/vision_transformer's files) and in the timm /
Hugging Face `.safetensors` layouts. The NumPy reference forward pass is tests/reference.py."""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import json
import logging
import math
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Callable

import keras
import numpy as np
import pytest

import keras_vit
from tests.reference import gelu_tanh, released_names, vit_logits

# Tiny configurations that run in seconds on a CPU.
TINY_VIT = dict(patch_size=8, hidden_dim=48, mlp_dim=96, num_heads=3, num_layers=2)
# ResNet root /4 and stage 2 /2: stride 8 (a 4x4 grid at 32 px), 256 -> 512 channels.
TINY_HYBRID = dict(TINY_VIT, patch_size=1, num_layers=1, resnet_stages=(1, 1))
# The smaller encoder of the training runs (16 px images: a 2x2 grid), as `training/` overrides.
TRAIN_VIT = dict(patch_size=8, hidden_dim=16, mlp_dim=32, num_heads=2, num_layers=1)
TRAIN_VIT_OVERRIDES = ["variant=", *(f"{key}={value}" for key, value in TRAIN_VIT.items())]
# A tiny digits run (tests/training/test_training.py, tests/training/test_training_runs.py): 2 epochs of 3 steps at
# 16 pixels.
TRAIN_TINY = [*TRAIN_VIT_OVERRIDES, "image_size=16", "batch_size=16", "epochs=2", "steps_per_epoch=3",
              "warmup_steps=2", "validate=false", "shuffle_buffer=64"]


def needs(package: str, why: str) -> pytest.MarkDecorator:
    """Skips a test whose `package` is not installed, naming the install command: the README's environment
    (`pip install -c constraints.txt -e ".[all]"`) has only what setup.py declares; `.ci/torch` runs these."""
    return pytest.mark.skipif(
        importlib.util.find_spec(package) is None,
        reason=f"needs {package} ({why}), which the README's environment does not install: "
               f"pip install -c constraints.txt {package}")


# A JAX test process compiles hundreds of tiny one-off computations (each eager op, each step of a few-step run), so
# much of its time is compiling. At XLA's backend optimization level 0 they compile about twice as fast; outputs agree
# to float32 rounding (a tiny ViT's forward bit for bit, its weights after 3 Adam steps to 1.5e-8 on the AVX2 EPYC).
JAX_TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
    """`XLA_FLAGS` for a JAX test process (with `devices` CPU host devices), after this environment's own flags."""
    devices_flag = f" --xla_force_host_platform_device_count={devices}" if devices else ""
    return f"{os.environ.get('XLA_FLAGS', '')} {JAX_TEST_XLA_FLAGS}{devices_flag}".strip()


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_path(*first: str) -> str:
    """`PYTHONPATH` for a test's subprocess: `first`, then this environment's own entries (an environment whose
    packages come by `PYTHONPATH`, not site-packages, keeps them)."""
    own = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry and entry not in first]
    return os.pathsep.join([*first, *own])


def made_once(tmp_path_factory, name: str, make: Callable[[Path], object]) -> Path:
    """The folder `name`, filled by `make(folder)` once per test run. Under pytest-xdist a module's fixture runs
    once in each worker that runs one of its tests: here the first worker to ask makes the folder (the other
    waits on a lock, then reads it). `make` must give the same files in any worker (seeded weights). Tests only
    read the folder."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        folder = tmp_path_factory.mktemp(name)
        make(folder)
        return folder
    root = tmp_path_factory.getbasetemp().parent / "made_once"  # this run's, shared by its workers
    root.mkdir(exist_ok=True)
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed while making it
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports of localhost that were free a moment ago (all bound at once, then released)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for probe in sockets:
            probe.bind(("localhost", 0))
        return [probe.getsockname()[1] for probe in sockets]
    finally:
        for probe in sockets:
            probe.close()


def subprocess_env(**variables: str) -> dict[str, str]:
    """The environment of a test's Python subprocess: this one's, with this repository first on `PYTHONPATH`,
    TensorFlow's info logs off and no GPU, then `variables`."""
    return {**os.environ, "PYTHONPATH": python_path(REPO), "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "",
            **variables}


def to_numpy(x, dtype=None) -> np.ndarray:
    """A tensor or variable of any Keras backend as a NumPy array (of `dtype` if given)."""
    array = keras.ops.convert_to_numpy(x)
    return array if dtype is None else array.astype(dtype)


def randomize(model_or_layer, seed: int = 0, scale: float = 0.2) -> None:
    """Gives every weight non-trivial random values (zero-initialised heads and tokens too)."""
    rng = np.random.default_rng(seed)
    for weight in model_or_layer.weights:
        weight.assign(rng.normal(scale=scale, size=weight.shape).astype("float32"))


def graph_op_types(graph_def) -> set[str]:
    """Op types of a GraphDef's nodes and of the nodes of every function in its library."""
    types = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        types |= {node.op for node in function.node_def}
    return types


def run_serialization_test(layer: keras.layers.Layer) -> keras.layers.Layer:
    """`from_config(get_config())` rebuilds an equal config; also through Keras' serializer."""
    config = layer.get_config()
    clone = layer.__class__.from_config(config)
    assert json.dumps(clone.get_config(), sort_keys=True) == json.dumps(config, sort_keys=True)
    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(revived) is type(layer)
    assert json.dumps(revived.get_config(), sort_keys=True) == json.dumps(config, sort_keys=True)
    return clone


def run_layer_test(layer: keras.layers.Layer, input_shape: tuple, expected_output_shape: tuple,
                   train: bool = True) -> np.ndarray:
    """Builds a layer, calls it eagerly and symbolically, checks shapes, round-trips its
    config, and runs one training step of a model around it. Returns the eager output."""
    run_serialization_test(layer)
    rng = np.random.default_rng(0)
    x = rng.normal(size=input_shape).astype("float32")
    eager = to_numpy(layer(x))
    assert eager.shape == expected_output_shape, (eager.shape, expected_output_shape)
    assert np.isfinite(eager).all()
    symbolic = layer(keras.Input(batch_shape=(None, *input_shape[1:])))
    assert tuple(symbolic.shape[1:]) == expected_output_shape[1:]
    assert tuple(layer.compute_output_shape((None, *input_shape[1:]))[1:]) == expected_output_shape[1:]
    if train and layer.trainable_weights:
        inputs = keras.Input(shape=input_shape[1:])
        model = keras.Model(inputs, layer(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        before = [to_numpy(w) for w in layer.trainable_weights]
        target = rng.normal(size=expected_output_shape).astype("float32")
        model.train_on_batch(x, target)
        assert any(not np.allclose(b, to_numpy(w)) for b, w in zip(before, layer.trainable_weights)), \
            "a training step changed no weight"
    return eager


def ridge_few_shot_accuracy(train_features, train_labels, test_features, test_labels, shots: int, seed: int,
                            l2_reg: float = 1.0) -> float:
    """Test accuracy of scikit-learn's ridge regression (unpenalized intercept) onto {-1, 1}
    one-vs-rest targets, fit on the k-shot draw `keras_vit.fewshot.sample_few_shot(train_labels, shots, seed)`."""
    from sklearn.linear_model import Ridge

    from keras_vit.fewshot import sample_few_shot

    chosen = sample_few_shot(train_labels, shots, seed)
    targets = 2.0 * np.eye(int(train_labels.max()) + 1)[train_labels[chosen]] - 1.0
    ridge = Ridge(alpha=l2_reg).fit(np.asarray(train_features, "float64")[chosen], targets)
    return float(np.mean(ridge.predict(np.asarray(test_features, "float64")).argmax(axis=1) == test_labels))


def digits_few_shot_reference(features_model: keras.Model, shots, seeds: int,
                              l2_reg: float = 1.0) -> dict[int, tuple[float, float]]:
    """`ridge_few_shot_accuracy` of the outputs of `features_model` on the digits split of
    `keras_vit.fewshot.digits_accuracy` (half of each class each), for each k: `{k: (mean, std over seeds)}`."""
    from keras_vit import datasets

    height, width, channels = features_model.inputs[0].shape[1:]
    (train_x, train_y), (test_x, test_y) = (datasets.digits(split, test_fraction=0.5) for split in ("train", "test"))
    train_x, test_x = (datasets.resize(x, (height, width), channels) for x in (train_x, test_x))
    train_features = features_model.predict(train_x, batch_size=64, verbose=0)
    test_features = features_model.predict(test_x, batch_size=64, verbose=0)
    results = {}
    for k in shots:
        accuracies = [ridge_few_shot_accuracy(train_features, train_y, test_features, test_y, k, seed, l2_reg)
                      for seed in range(seeds)]
        results[k] = (float(np.mean(accuracies)), float(np.std(accuracies)))
    return results


# --- Checkpoints in the released `.npz` layout (random values) ---
# Every key and shape follows the public files: `Transformer/` prefix, old Flax module names,
# attention kernels (D, heads, head_dim), GroupNorm scale/bias as (1, 1, 1, C) in hybrids.


def _normal(rng, shape, scale):
    return (rng.standard_normal(shape) * scale).astype("float32")


def _norm_arrays(rng, prefix, shape, scale=0.1):
    return {f"{prefix}/scale": (1 + _normal(rng, shape, scale)), f"{prefix}/bias": _normal(rng, shape, scale)}


def _resnet_arrays(rng, stages, scale, width=64) -> tuple[dict, int]:
    """Hybrid stem keys; returns (arrays, output channels)."""
    arrays = {"conv_root/kernel": _normal(rng, (7, 7, 3, width), 1.0),
              **_norm_arrays(rng, "gn_root", (1, 1, 1, width), scale)}
    channels = width
    for stage, units in enumerate(stages, start=1):
        filters = width * 2 ** (stage - 1)
        for unit in range(1, units + 1):
            p = f"block{stage}/unit{unit}"
            arrays.update({f"{p}/conv1/kernel": _normal(rng, (1, 1, channels, filters), 1.0),
                           f"{p}/conv2/kernel": _normal(rng, (3, 3, filters, filters), 1.0),
                           f"{p}/conv3/kernel": _normal(rng, (1, 1, filters, 4 * filters), 1.0)})
            for gn, size in (("gn1", filters), ("gn2", filters), ("gn3", 4 * filters)):
                arrays.update(_norm_arrays(rng, f"{p}/{gn}", (1, 1, 1, size), scale))
            if unit == 1:  # channel count (and, after stage 1, stride) changes: projection
                arrays[f"{p}/conv_proj/kernel"] = _normal(rng, (1, 1, channels, 4 * filters), 1.0)
                arrays.update(_norm_arrays(rng, f"{p}/gn_proj", (1, 1, 1, 4 * filters), scale))
            channels = 4 * filters
    return arrays, channels


def vit_checkpoint(config: dict = TINY_VIT, *, grid: int = 4, classes: int = 10, classifier: str = "token",
                   representation_size: int | None = None, zero_head: bool = False,
                   vector_scale: float | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Arrays of a released-layout checkpoint of the architecture `config` (TINY_VIT's keys,
    plus `resnet_stages` for a hybrid) for a square `grid` x `grid` patch grid.

    Kernels have standard deviation 1 / sqrt(fan in). The other arrays (biases, norm offsets,
    class token, position embedding) are far from their initial values by default, 0.1 and
    0.5, so that a loader that drops or misplaces one changes the logits; `vector_scale` sets
    them all (0.02, as in a trained network, for a checkpoint to fine-tune from)."""
    bias = 0.1 if vector_scale is None else vector_scale
    token = 0.5 if vector_scale is None else vector_scale
    rng = np.random.default_rng(seed)
    d, heads, mlp = config["hidden_dim"], config["num_heads"], config["mlp_dim"]
    stages = config.get("resnet_stages")
    arrays, channels = _resnet_arrays(rng, stages, bias) if stages else ({}, 3)
    patch = config["patch_size"]
    arrays["embedding/kernel"] = _normal(rng, (patch, patch, channels, d), (patch * patch * channels) ** -0.5)
    arrays["embedding/bias"] = _normal(rng, (d,), bias)
    prefix = 1 if classifier == "token" else 0
    if prefix:
        arrays["cls"] = _normal(rng, (1, 1, d), token)
    arrays["Transformer/posembed_input/pos_embedding"] = _normal(rng, (1, prefix + grid * grid, d), token)
    for i in range(config["num_layers"]):
        b = f"Transformer/encoderblock_{i}"
        arrays.update(_norm_arrays(rng, f"{b}/LayerNorm_0", (d,), bias))
        m = f"{b}/MultiHeadDotProductAttention_1"
        for name in ("query", "key", "value"):
            arrays[f"{m}/{name}/kernel"] = _normal(rng, (d, heads, d // heads), d ** -0.5)
            arrays[f"{m}/{name}/bias"] = _normal(rng, (heads, d // heads), bias)
        arrays[f"{m}/out/kernel"] = _normal(rng, (heads, d // heads, d), d ** -0.5)
        arrays[f"{m}/out/bias"] = _normal(rng, (d,), bias)
        arrays.update(_norm_arrays(rng, f"{b}/LayerNorm_2", (d,), bias))
        arrays[f"{b}/MlpBlock_3/Dense_0/kernel"] = _normal(rng, (d, mlp), d ** -0.5)
        arrays[f"{b}/MlpBlock_3/Dense_0/bias"] = _normal(rng, (mlp,), bias)
        arrays[f"{b}/MlpBlock_3/Dense_1/kernel"] = _normal(rng, (mlp, d), mlp ** -0.5)
        arrays[f"{b}/MlpBlock_3/Dense_1/bias"] = _normal(rng, (d,), bias)
    arrays.update(_norm_arrays(rng, "Transformer/encoder_norm", (d,), bias))
    width = d
    if representation_size:
        arrays["pre_logits/kernel"] = _normal(rng, (d, representation_size), d ** -0.5)
        arrays["pre_logits/bias"] = _normal(rng, (representation_size,), bias)
        width = representation_size
    arrays["head/kernel"] = _normal(rng, (width, classes), 0.0 if zero_head else width ** -0.5)
    arrays["head/bias"] = _normal(rng, (classes,), 0.0 if zero_head else bias)
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


def save_checkpoint(path, arrays: dict[str, np.ndarray]) -> str:
    np.savez(path, **arrays)
    return str(path)


# === timm and Hugging Face state dicts (torch shapes and names), written as `.safetensors` ===


def _weights(rng, depth, width, mlp, patch, tokens, classes):
    """Random, non-degenerate weights in torch shapes, scaled so that logits are O(1)-O(10)."""
    def linear(out, inp, gain=1.0):
        return (rng.normal(size=(out, inp)) * gain / math.sqrt(inp)).astype("float32")

    def vector(n, mean=0.0, scale=0.1):
        return (mean + rng.normal(size=n) * scale).astype("float32")

    common = dict(conv=(rng.normal(size=(width, 3, patch, patch)) / math.sqrt(3 * patch * patch)).astype("float32"),
                  conv_bias=vector(width), cls=vector((1, 1, width), scale=0.5),
                  pos=vector((1, tokens, width), scale=0.5), norm=(vector(width, 1.0), vector(width)),
                  head=(linear(classes, width, gain=3.0), vector(classes)))
    blocks = [dict(norm1=(vector(width, 1.0), vector(width)), norm2=(vector(width, 1.0), vector(width)),
                   qkv=[(linear(width, width), vector(width)) for _ in range(3)],
                   proj=(linear(width, width), vector(width)),
                   fc1=(linear(mlp, width, 1.5), vector(mlp, scale=0.5)), fc2=(linear(width, mlp, 0.5), vector(width)))
              for _ in range(depth)]
    return common, blocks


def timm_state_dict(seed=0, depth=2, width=48, mlp=96, patch=8, grid=4, classes=10):
    common, blocks = _weights(np.random.default_rng(seed), depth, width, mlp, patch, 1 + grid * grid, classes)
    state = {"patch_embed.proj.weight": common["conv"], "patch_embed.proj.bias": common["conv_bias"],
             "cls_token": common["cls"], "pos_embed": common["pos"], "norm.weight": common["norm"][0],
             "norm.bias": common["norm"][1], "head.weight": common["head"][0], "head.bias": common["head"][1]}
    for i, block in enumerate(blocks):
        b = f"blocks.{i}."
        state.update({b + "norm1.weight": block["norm1"][0], b + "norm1.bias": block["norm1"][1],
                      b + "attn.qkv.weight": np.concatenate([w for w, _ in block["qkv"]]),
                      b + "attn.qkv.bias": np.concatenate([bias for _, bias in block["qkv"]]),
                      b + "attn.proj.weight": block["proj"][0], b + "attn.proj.bias": block["proj"][1],
                      b + "norm2.weight": block["norm2"][0], b + "norm2.bias": block["norm2"][1],
                      b + "mlp.fc1.weight": block["fc1"][0], b + "mlp.fc1.bias": block["fc1"][1],
                      b + "mlp.fc2.weight": block["fc2"][0], b + "mlp.fc2.bias": block["fc2"][1]})
    return state


def timm_family_state_dict(seed=0, *, registers=0, layer_scale=False, no_embed_class=False, qk_norm=False,
                           norm_pre=False, fc_norm=False, distilled=False, map_head=False, patch_bias=True, **kwargs):
    """`timm_state_dict` with the keys of timm's family options (DeiT-III, DINOv2, CLIP's patch embedding
    without bias, SigLIP's attention pooling without a class token, ...), non-degenerate values."""
    state = timm_state_dict(seed, **kwargs)
    rng = np.random.default_rng(seed + 100)
    width = state["cls_token"].shape[-1]
    depth = len({key.split(".")[1] for key in state if key.startswith("blocks.")})

    def vector(n, mean=0.0, scale=0.3):
        return (mean + rng.normal(size=n) * scale).astype("float32")

    if no_embed_class:
        state["pos_embed"] = state["pos_embed"][:, 1:]
    if distilled:  # DeiT distilled: a second prefix token with a position, and a second head
        state["dist_token"] = vector((1, 1, width), scale=0.5)
        state["pos_embed"] = np.concatenate([state["pos_embed"][:, :1], vector((1, 1, width), scale=0.5),
                                             state["pos_embed"][:, 1:]], axis=1)
        classes = state["head.weight"].shape[0]
        state["head_dist.weight"] = (rng.normal(size=(classes, width)) * 3 / math.sqrt(width)).astype("float32")
        state["head_dist.bias"] = vector(classes)
    if registers:
        state["reg_token"] = vector((1, registers, width), scale=0.5)
    for i in range(depth):
        if layer_scale:
            state.update({f"blocks.{i}.ls1.gamma": vector(width, 0.8), f"blocks.{i}.ls2.gamma": vector(width, 0.8)})
        if qk_norm:
            head_dim = width // 3
            for name in ("q_norm", "k_norm"):
                state.update({f"blocks.{i}.attn.{name}.weight": vector(head_dim, 1.0),
                              f"blocks.{i}.attn.{name}.bias": vector(head_dim)})
    for name, present in (("norm_pre", norm_pre), ("fc_norm", fc_norm)):
        if present:
            state.update({f"{name}.weight": vector(width, 1.0), f"{name}.bias": vector(width)})
    if fc_norm:  # timm's final norm is the identity then
        del state["norm.weight"], state["norm.bias"]
    if not patch_bias:  # CLIP
        del state["patch_embed.proj.bias"]
    if map_head:  # SigLIP: no class token, attention pooling (timm's AttentionPoolLatent)
        del state["cls_token"]
        state["pos_embed"] = state["pos_embed"][:, 1:]
        mlp = state["blocks.0.mlp.fc1.weight"].shape[0]

        def linear(out, inp):
            return (rng.normal(size=(out, inp)) / math.sqrt(inp)).astype("float32")

        state.update({"attn_pool.latent": vector((1, 1, width), scale=0.5),
                      "attn_pool.q.weight": linear(width, width) * 2, "attn_pool.q.bias": vector(width),
                      "attn_pool.kv.weight": linear(2 * width, width) * 2, "attn_pool.kv.bias": vector(2 * width),
                      "attn_pool.proj.weight": linear(width, width), "attn_pool.proj.bias": vector(width),
                      "attn_pool.norm.weight": vector(width, 1.0), "attn_pool.norm.bias": vector(width),
                      "attn_pool.mlp.fc1.weight": linear(mlp, width), "attn_pool.mlp.fc1.bias": vector(mlp),
                      "attn_pool.mlp.fc2.weight": linear(width, mlp), "attn_pool.mlp.fc2.bias": vector(width)})
    return state


def hf_state_dict(seed=0, depth=2, width=48, mlp=96, patch=8, grid=4, classes=10, prefix="vit.", pooler=False):
    """ViTForImageClassification (prefix "vit.", a classifier) or ViTModel (no prefix, classes=None)."""
    common, blocks = _weights(np.random.default_rng(seed), depth, width, mlp, patch, 1 + grid * grid, classes or 1)
    e = prefix + "embeddings."
    state = {e + "patch_embeddings.projection.weight": common["conv"],
             e + "patch_embeddings.projection.bias": common["conv_bias"], e + "cls_token": common["cls"],
             e + "position_embeddings": common["pos"], prefix + "layernorm.weight": common["norm"][0],
             prefix + "layernorm.bias": common["norm"][1]}
    if classes:
        state.update({"classifier.weight": common["head"][0], "classifier.bias": common["head"][1]})
    if pooler:
        state.update({"pooler.dense.weight": blocks[0]["proj"][0] * 2, "pooler.dense.bias": blocks[0]["proj"][1]})
    for i, block in enumerate(blocks):
        b = f"{prefix}encoder.layer.{i}."
        state.update({b + "layernorm_before.weight": block["norm1"][0], b + "layernorm_before.bias": block["norm1"][1],
                      b + "attention.output.dense.weight": block["proj"][0],
                      b + "attention.output.dense.bias": block["proj"][1],
                      b + "layernorm_after.weight": block["norm2"][0], b + "layernorm_after.bias": block["norm2"][1],
                      b + "intermediate.dense.weight": block["fc1"][0], b + "intermediate.dense.bias": block["fc1"][1],
                      b + "output.dense.weight": block["fc2"][0], b + "output.dense.bias": block["fc2"][1]})
        for name, (weight, bias) in zip(("query", "key", "value"), block["qkv"]):
            state.update({f"{b}attention.attention.{name}.weight": weight, f"{b}attention.attention.{name}.bias": bias})
    return state


def save_safetensors(state, path) -> str:
    """Writes a state dict with the `safetensors` package (torch not needed)."""
    from safetensors.numpy import save_file

    save_file({key: np.ascontiguousarray(value) for key, value in state.items()}, str(path))  # a transposed
    # (Fortran-ordered) array would be written in its memory order
    return str(path)


# Hugging Face's layouts of the ViT family (transformers 4.57+), stated here from its modelling code, not by
# keras_vit's translator: (embeddings prefix, block prefix, block names, final norm).
_HF_BLOCKS = {
    "deit": ("deit.embeddings.", "deit.encoder.layer.{i}.",
             dict(ln0="layernorm_before", ln2="layernorm_after", q="attention.attention.query",
                  k="attention.attention.key", v="attention.attention.value", out="attention.output.dense",
                  fc1="intermediate.dense", fc2="output.dense"), "deit.layernorm"),
    "dinov2": ("embeddings.", "encoder.layer.{i}.",
               dict(ln0="norm1", ln2="norm2", q="attention.attention.query", k="attention.attention.key",
                    v="attention.attention.value", out="attention.output.dense", fc1="mlp.fc1", fc2="mlp.fc2"),
               "layernorm"),
    "clip": ("vision_model.embeddings.", "vision_model.encoder.layers.{i}.",
             dict(ln0="layer_norm1", ln2="layer_norm2", q="self_attn.q_proj", k="self_attn.k_proj",
                  v="self_attn.v_proj", out="self_attn.out_proj", fc1="mlp.fc1", fc2="mlp.fc2"),
             "vision_model.post_layernorm"),
}
_HF_BLOCKS["siglip"] = _HF_BLOCKS["clip"]


def hugging_face_family_state_dict(released: dict[str, np.ndarray], model: str) -> dict[str, np.ndarray]:
    """A keras_vit model's weights under the released names (`tests.reference.released_names`) as the state dict
    of a Hugging Face model: "deit" (DeiTForImageClassificationWithTeacher), "dinov2" (Dinov2Model, with
    registers Dinov2WithRegistersModel), "clip" (CLIPVisionModel, with a `head` CLIPVisionModelWithProjection,
    whose projection has no bias) or "siglip" (SiglipVisionModel). float32."""
    a = {key: np.asarray(value, np.float64) for key, value in released.items()}
    embeddings, block, names, final = _HF_BLOCKS[model]
    width = a["embedding/kernel"].shape[-1]

    def linear(kernel):  # Dense (in, out) or head-split kernels -> torch Linear (out, in)
        return kernel.reshape(width, -1).T if kernel.shape[0] == width else kernel.reshape(-1, width).T

    state = {}
    conv = a["embedding/kernel"].transpose(3, 2, 0, 1)
    posemb = a["Transformer/posembed_input/pos_embedding"]
    if model in ("clip", "siglip"):
        state[embeddings + "patch_embedding.weight"] = conv
        state[embeddings + "position_embedding.weight"] = posemb[0]
        if "embedding/bias" in a:
            state[embeddings + "patch_embedding.bias"] = a["embedding/bias"]
        if "cls" in a:
            state[embeddings + "class_embedding"] = a["cls"].reshape(-1)
        if "norm_pre/scale" in a:
            state["vision_model.pre_layrnorm.weight"], state["vision_model.pre_layrnorm.bias"] = \
                a["norm_pre/scale"], a["norm_pre/bias"]
    else:
        state[embeddings + "patch_embeddings.projection.weight"] = conv
        state[embeddings + "patch_embeddings.projection.bias"] = a["embedding/bias"]
        state[embeddings + "position_embeddings"] = posemb
        state[embeddings + "cls_token"] = a["cls"]
    if "dist_token" in a:
        state[embeddings + "distillation_token"] = a["dist_token"]
    if model == "dinov2":
        state[embeddings + "mask_token"] = np.zeros((1, width))  # training only
        if "registers" in a:
            state[embeddings + "register_tokens"] = a["registers"]
    depth = len({key.split("/")[1] for key in a if key.startswith("Transformer/encoderblock_")})
    for i in range(depth):
        r, b = f"Transformer/encoderblock_{i}", block.format(i=i)
        m = f"{r}/MultiHeadDotProductAttention_1"
        for name, released_name in (("ln0", f"{r}/LayerNorm_0"), ("ln2", f"{r}/LayerNorm_2")):
            state[f"{b}{names[name]}.weight"], state[f"{b}{names[name]}.bias"] = \
                a[released_name + "/scale"], a[released_name + "/bias"]
        for name, released_name in (("q", "query"), ("k", "key"), ("v", "value"), ("out", "out")):
            state[f"{b}{names[name]}.weight"] = linear(a[f"{m}/{released_name}/kernel"])
            state[f"{b}{names[name]}.bias"] = a[f"{m}/{released_name}/bias"].reshape(-1)
        for name, dense in (("fc1", "Dense_0"), ("fc2", "Dense_1")):
            state[f"{b}{names[name]}.weight"] = a[f"{r}/MlpBlock_3/{dense}/kernel"].T
            state[f"{b}{names[name]}.bias"] = a[f"{r}/MlpBlock_3/{dense}/bias"]
        if f"{r}/ls1/scale" in a:
            state[f"{b}layer_scale1.lambda1"], state[f"{b}layer_scale2.lambda1"] = \
                a[f"{r}/ls1/scale"], a[f"{r}/ls2/scale"]
    state[final + ".weight"], state[final + ".bias"] = a["Transformer/encoder_norm/scale"], \
        a["Transformer/encoder_norm/bias"]
    if "MAPHead_0/probe" in a:  # SigLIP's head: nn.MultiheadAttention with a packed q/k/v
        h, m = "vision_model.head.", "MAPHead_0/MultiHeadDotProductAttention_0"
        state[h + "probe"] = a["MAPHead_0/probe"]
        state[h + "attention.in_proj_weight"] = np.concatenate([linear(a[f"{m}/{n}/kernel"])
                                                                for n in ("query", "key", "value")])
        state[h + "attention.in_proj_bias"] = np.concatenate([a[f"{m}/{n}/bias"].reshape(-1)
                                                              for n in ("query", "key", "value")])
        state[h + "attention.out_proj.weight"] = linear(a[f"{m}/out/kernel"])
        state[h + "attention.out_proj.bias"] = a[f"{m}/out/bias"]
        state[h + "layernorm.weight"], state[h + "layernorm.bias"] = a["MAPHead_0/LayerNorm_0/scale"], \
            a["MAPHead_0/LayerNorm_0/bias"]
        for fc, dense in (("fc1", "Dense_0"), ("fc2", "Dense_1")):
            state[f"{h}mlp.{fc}.weight"] = a[f"MAPHead_0/MlpBlock_0/{dense}/kernel"].T
            state[f"{h}mlp.{fc}.bias"] = a[f"MAPHead_0/MlpBlock_0/{dense}/bias"]
    if "head/kernel" in a:
        if model == "clip":  # visual_projection: a Linear without bias
            state["visual_projection.weight"] = a["head/kernel"].T
        else:
            state["cls_classifier.weight"], state["cls_classifier.bias"] = a["head/kernel"].T, a["head/bias"]
            state["distillation_classifier.weight"] = a["head_dist/kernel"].T
            state["distillation_classifier.bias"] = a["head_dist/bias"]
    return {key: value.astype("float32") for key, value in state.items()}


# ---------------------------------------------------------------------------------------
# The family harness: `run_model_test(Family(...), tmp_path)` (the rows: tests/models/test_model_families.py)
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: builder arguments, the checkpoint it loads, and the reference's numerics.

    `checkpoint`: `vit_checkpoint` arguments of an `.npz` file in the original layout, loaded through
    `weights=`; None for the family options, which the original layout lacks: the `.npz` file holds a random
    model's weights under the reference's own names (`released_names`)."""
    config: dict
    input_shape: tuple = (32, 32, 3)
    checkpoint: dict | None = dataclasses.field(default_factory=dict)
    eps: float = 1e-6
    gelu: object = gelu_tanh

    def arrays(self) -> dict[str, np.ndarray]:
        if self.checkpoint is None:  # a model's random weights under the reference's own names
            source = build(self)
            randomize(source, seed=1, scale=0.3)
            return {key: value.astype("float32") for key, value in released_names(source).items()}
        return vit_checkpoint(self.config, classes=10, **{"grid": 4, "seed": 1, **self.checkpoint})

    def reference(self, arrays, images) -> np.ndarray:
        grid = None if self.checkpoint is None else (self.checkpoint.get("grid", 4),) * 2  # None: the model's own
        rope = self.config.get("rope_theta", 100.0) if self.config.get("rope") else None
        return vit_logits(arrays, images, resnet_stages=self.config.get("resnet_stages"), posemb_grid=grid,
                          eps=self.eps, gelu=self.gelu, no_embed_class=self.config.get("no_embed_class", False),
                          rope_theta=rope, rope_form=self.config.get("rope"),
                          rope_reference_grid=self.config.get("rope_reference_grid"))



ATOL = 1e-4  # float32 model vs float64 reference, logits of order 1


def images(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 255, size=(3, *shape)).astype("float32")


def build(family: Family, weights: str | None = None) -> keras.Model:
    return keras_vit.VisionTransformer(**family.config, input_shape=family.input_shape, classes=10,
                                       classifier_activation=None, weights=weights)


def unbuilt_layers(model: keras.Model) -> list[str]:
    return [layer.path for layer in model._flatten_layers(include_self=False, recursive=True) if not layer.built]


def outputs(model: keras.Model, x: np.ndarray) -> np.ndarray:
    return np.asarray(model(x, training=False))


def run_model_test(family: Family, tmp_path) -> tuple[keras.Model, np.ndarray]:
    """The checks every family passes; returns the loaded model and its logits on `images`."""
    arrays = family.arrays()
    model = build(family, weights=save_checkpoint(tmp_path / "checkpoint.npz", arrays))
    assert unbuilt_layers(model) == []
    assert model.output_shape == (None, 10)
    x = images(family.input_shape)
    logits = outputs(model, x)
    np.testing.assert_allclose(logits, family.reference(arrays, x), atol=ATOL, rtol=0)
    np.testing.assert_allclose(model.predict(x, verbose=0), logits, atol=1e-5, rtol=0)

    assert model.vit_config == keras_vit.ViTConfig(**{**dict(model.vit_config), **family.config})
    from_config = keras_vit.models.ViTModel.from_config(model.get_config())
    assert from_config.vit_config == model.vit_config
    assert unbuilt_layers(from_config) == []
    from_config.set_weights(model.get_weights())
    np.testing.assert_array_equal(outputs(from_config, x), logits)

    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")  # safe mode, no custom_objects
    np.testing.assert_array_equal(outputs(loaded, x), logits)
    assert (loaded.vit_config, loaded.preprocessing_config) == (model.vit_config, model.preprocessing_config)
    assert [w.path for w in loaded.weights] == [w.path for w in model.weights]

    model.save_weights(tmp_path / "model.weights.h5")
    rebuilt = build(family)
    rebuilt.load_weights(tmp_path / "model.weights.h5")
    np.testing.assert_array_equal(outputs(rebuilt, x), logits)
    return model, logits


# ---------------------------------------------------------------------------------------
# The export harness: tiny classifiers, and a SavedModel loaded as TF Serving loads it
# ---------------------------------------------------------------------------------------

TINY_CLASSIFIERS = {kind: dict(config, input_shape=(32, 32, 3), classes=10, weights=None)
                    for kind, config in (("plain", TINY_VIT), ("hybrid", TINY_HYBRID))}


def tiny_model(kind: str, seed: int = 0, **overrides) -> keras.Model:
    """A tiny classifier of `TINY_CLASSIFIERS` with random, non-trivial weights (the head is zeros at init)."""
    model = keras_vit.VisionTransformer(**{**TINY_CLASSIFIERS[kind], **overrides}, name=f"tiny_{kind}")
    randomize(model, seed, scale=0.3)
    return model


class TF1Server:
    """Loads a SavedModel with the TF1 loader under tag `serve`, as TF Serving's C++ loader does."""

    def __init__(self, path):
        import tensorflow as tf

        self.graph = tf.Graph()
        self.session = tf.compat.v1.Session(graph=self.graph)
        with self.graph.as_default():
            meta_graph = tf.compat.v1.saved_model.loader.load(self.session, ["serve"], str(path))
        self.signatures = meta_graph.signature_def

    def predict(self, signature: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        signature_def = self.signatures[signature]
        feed = {signature_def.inputs[key].name: value for key, value in inputs.items()}
        fetch = {key: info.name for key, info in signature_def.outputs.items()}
        return self.session.run(fetch, feed_dict=feed)


# ---------------------------------------------------------------------------------------
# Disk faults, made for real: a small tmpfs (needs root, as CI runs; skips elsewhere)
# ---------------------------------------------------------------------------------------

def mounted_tmpfs(folder, size: str):
    """Mounts a tmpfs of `size` (e.g. "16m") at the new folder `folder` and returns it; skips the test where this
    user may not mount. Unmount with `unmount(folder)`."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root); this user is not")
    os.makedirs(folder)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    return folder


def unmount(folder) -> None:
    subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(folder, leave: int) -> None:
    """Fills the file system of `folder` with `folder/filler` to its last `leave` bytes."""
    import shutil

    with open(os.path.join(folder, "filler"), "wb") as filler:
        filler.write(b"\0" * (shutil.disk_usage(folder).free - leave))


def run_train_cli(capsys, *arguments: str) -> tuple[int, str, str]:
    """keras-vit-train run in this process (for what needs no process of its own: its flags and one-line
    stops): the exit status, stdout and stderr the console script ends with (a `SystemExit` message is stderr's
    last line, status 1, as the interpreter prints it). Ctrl-C, a second process and kills run as processes."""
    from absl import flags

    from keras_vit.cli import train
    capsys.readouterr()
    level = logging.getLogger().level
    try:
        train.main(flags.FLAGS(["keras-vit-train", *arguments]))
        status, message = 0, ""
    except SystemExit as stop:
        status, message = (1, f"{stop.code}\n") if isinstance(stop.code, str) else (stop.code or 0, "")
    finally:
        flags.FLAGS.unparse_flags()
        logging.getLogger().setLevel(level)
    out, err = capsys.readouterr()
    return status, out, err + message


def hub_cache_of(root, repo: str, folder: str, commit: str = "5e1f0c2a") -> None:
    """`folder` in huggingface_hub's cache layout under `root`: each file a blob named by its sha256, linked from
    snapshots/<commit>/, and refs/main naming the commit."""
    import hashlib

    model = root / ("models--" + repo.replace("/", "--"))
    (model / "blobs").mkdir(parents=True)
    (model / "snapshots" / commit).mkdir(parents=True)
    (model / "refs").mkdir()
    (model / "refs" / "main").write_text(commit)
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as file:
            data = file.read()
        blob = hashlib.sha256(data).hexdigest()
        (model / "blobs" / blob).write_bytes(data)
        (model / "snapshots" / commit / name).symlink_to(os.path.join("..", "..", "blobs", blob))
