"""Shared test fixtures: tiny model configs, NumPy references written from the paper's
equations (arXiv:2010.11929, Sec. 3.1, and vit_jax's models_vit.py), a writer of checkpoints in the
released `.npz` layout (google-research/vision_transformer's files), layer checks and serialization
round trips."""

from __future__ import annotations

import json
import math

import keras
import numpy as np

# Tiny configurations that run in seconds on a CPU.
TINY_VIT = dict(patch_size=8, hidden_dim=48, mlp_dim=96, num_heads=3, num_layers=2)
# ResNet root /4 and stage 2 /2: stride 8 (a 4x4 grid at 32 px), 256 -> 512 channels.
TINY_HYBRID = dict(TINY_VIT, patch_size=1, num_layers=1, resnet_stages=(1, 1))
# The smaller encoder of the training runs (16 px images: a 2x2 grid), as `training/` overrides.
TRAIN_VIT = dict(patch_size=8, hidden_dim=16, mlp_dim=32, num_heads=2, num_layers=1)
TRAIN_VIT_OVERRIDES = ["variant=", *(f"{key}={value}" for key, value in TRAIN_VIT.items())]


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


# --- NumPy references (float64), on arrays named as in the released checkpoints ---


def released_names(model_or_layer) -> dict[str, np.ndarray]:
    """The weights of a keras_vit model or encoder block, float64, under the names of the
    released `.npz` files (the test's own statement of that layout, not keras_vit's converter)."""
    arrays = {}
    for weight in model_or_layer.weights:
        key = weight.path.replace("/gamma", "/scale").replace("/beta", "/bias")
        key = key.replace("/attention_output/", "/out/").replace("cls/cls", "cls")
        if key.split("/")[0].startswith(("encoderblock_", "posembed_input", "encoder_norm")):
            key = "Transformer/" + key
        arrays[key] = to_numpy(weight, "float64")
    return arrays


def layer_norm(x, scale, bias, eps=1e-6):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * scale + bias


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def encoder_block(a, block: str, x, attention_scale=1.0, mlp_scale=1.0):
    """x + MHA(LN(x)), then + MLP(LN(.)) with GELU in its tanh form, for the block named `block`
    (e.g. "Transformer/encoderblock_0"). The residual branches are multiplied by `attention_scale`
    and `mlp_scale` (0 or 1 / keep rate under drop path). Returns the output and the attention weights."""
    y = layer_norm(x, a[f"{block}/LayerNorm_0/scale"], a[f"{block}/LayerNorm_0/bias"])
    m = f"{block}/MultiHeadDotProductAttention_1"
    q, k, v = (np.einsum("btd,dhk->bthk", y, a[f"{m}/{n}/kernel"]) + a[f"{m}/{n}/bias"]
               for n in ("query", "key", "value"))
    weights = softmax(np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1]))
    attended = np.einsum("bhqs,bshk->bqhk", weights, v)
    x = x + attention_scale * (np.einsum("bqhk,hkd->bqd", attended, a[f"{m}/out/kernel"]) + a[f"{m}/out/bias"])
    y = layer_norm(x, a[f"{block}/LayerNorm_2/scale"], a[f"{block}/LayerNorm_2/bias"])
    mlp = f"{block}/MlpBlock_3"
    y = gelu_tanh(y @ a[f"{mlp}/Dense_0/kernel"] + a[f"{mlp}/Dense_0/bias"])
    return x + mlp_scale * (y @ a[f"{mlp}/Dense_1/kernel"] + a[f"{mlp}/Dense_1/bias"]), weights


def zoom_linear(grid, new_h, new_w):
    """scipy.ndimage.zoom(grid, (new_h/h, new_w/w, 1), order=1), point by point."""
    h, w, _ = grid.shape
    out = np.zeros((new_h, new_w, grid.shape[2]))
    for i in range(new_h):
        y = i * (h - 1) / (new_h - 1) if new_h > 1 else 0.0
        y0 = min(int(y), h - 1)
        y1, fy = min(y0 + 1, h - 1), y - y0
        for j in range(new_w):
            x = j * (w - 1) / (new_w - 1) if new_w > 1 else 0.0
            x0 = min(int(x), w - 1)
            x1, fx = min(x0 + 1, w - 1), x - x0
            out[i, j] = ((1 - fy) * (1 - fx) * grid[y0, x0] + (1 - fy) * fx * grid[y0, x1]
                         + fy * (1 - fx) * grid[y1, x0] + fy * fx * grid[y1, x1])
    return out


def _same_pads(size, kernel, stride):
    total = max((-(-size // stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def conv(x, kernel, stride, padding):
    kh, kw, _, out_channels = kernel.shape
    if padding == "SAME":
        pads = (_same_pads(x.shape[1], kh, stride), _same_pads(x.shape[2], kw, stride))
        x = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    oh, ow = (x.shape[1] - kh) // stride + 1, (x.shape[2] - kw) // stride + 1
    out = np.zeros((x.shape[0], oh, ow, out_channels))
    for i in range(kh):
        for j in range(kw):
            out += x[:, i:i + stride * oh:stride, j:j + stride * ow:stride, :] @ kernel[i, j]
    return out


def _std_conv(x, kernel, stride):
    mean = kernel.mean(axis=(0, 1, 2), keepdims=True)
    std = kernel.std(axis=(0, 1, 2), keepdims=True)  # population std
    return conv(x, (kernel - mean) / (std + 1e-5), stride, "SAME")


def _group_norm(x, scale, bias, groups=32):
    b, h, w, c = x.shape
    g = x.reshape(b, h, w, groups, c // groups)
    g = (g - g.mean(axis=(1, 2, 4), keepdims=True)) / np.sqrt(g.var(axis=(1, 2, 4), keepdims=True) + 1e-6)
    return g.reshape(b, h, w, c) * scale.reshape(-1) + bias.reshape(-1)


def _max_pool_same(x):
    pads = (_same_pads(x.shape[1], 3, 2), _same_pads(x.shape[2], 3, 2))
    x = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)), constant_values=-np.inf)
    oh, ow = (x.shape[1] - 3) // 2 + 1, (x.shape[2] - 3) // 2 + 1
    return np.max([x[:, i:i + 2 * oh:2, j:j + 2 * ow:2] for i in range(3) for j in range(3)], axis=0)


def _resnet(a, x, stages):
    x = np.maximum(_group_norm(_std_conv(x, a["conv_root/kernel"], 2), a["gn_root/scale"], a["gn_root/bias"]), 0)
    x = _max_pool_same(x)
    for s, units in enumerate(stages, start=1):
        for u in range(1, units + 1):
            p, stride = f"block{s}/unit{u}", 2 if s > 1 and u == 1 else 1

            def gn(y, name):
                return _group_norm(y, a[f"{p}/{name}/scale"], a[f"{p}/{name}/bias"])

            y = np.maximum(gn(_std_conv(x, a[f"{p}/conv1/kernel"], 1), "gn1"), 0)
            y = np.maximum(gn(_std_conv(y, a[f"{p}/conv2/kernel"], stride), "gn2"), 0)
            y = gn(_std_conv(y, a[f"{p}/conv3/kernel"], 1), "gn3")
            residual = gn(_std_conv(x, a[f"{p}/conv_proj/kernel"], stride), "gn_proj") if u == 1 else x
            x = np.maximum(residual + y, 0)
    return x


def vit_logits(arrays, images, resnet_stages=None, posemb_grid=None):
    """Logits of the released-layout checkpoint `arrays` on `images` in [0, 255], at the images'
    resolution. `posemb_grid`: the (rows, columns) its position embedding was trained at, square
    by default; another grid at the images' resolution is resampled with `zoom_linear`."""
    a = {key: np.asarray(value, np.float64) for key, value in arrays.items()}
    x = images.astype(np.float64) / 127.5 - 1
    if resnet_stages:
        x = _resnet(a, x, resnet_stages)
    patch = a["embedding/kernel"].shape[0]
    x = conv(x, a["embedding/kernel"], patch, "VALID") + a["embedding/bias"]
    gh, gw = x.shape[1:3]
    x = x.reshape(x.shape[0], gh * gw, -1)
    posemb = a["Transformer/posembed_input/pos_embedding"][0]
    prefix = 1 if "cls" in a else 0
    if prefix:
        x = np.concatenate([np.broadcast_to(a["cls"], (x.shape[0], 1, x.shape[2])), x], axis=1)
    old = posemb_grid or (int(np.sqrt(len(posemb) - prefix)),) * 2
    if tuple(old) != (gh, gw):
        grid = zoom_linear(posemb[prefix:].reshape(*old, -1), gh, gw).reshape(gh * gw, -1)
        posemb = np.concatenate([posemb[:prefix], grid])
    x = x + posemb
    num_blocks = len({key.split("/")[1] for key in a if key.startswith("Transformer/encoderblock_")})
    for i in range(num_blocks):
        x, _ = encoder_block(a, f"Transformer/encoderblock_{i}", x)
    x = layer_norm(x, a["Transformer/encoder_norm/scale"], a["Transformer/encoder_norm/bias"])
    x = x[:, 0] if prefix else x.mean(axis=1)
    if "pre_logits/kernel" in a:
        x = np.tanh(x @ a["pre_logits/kernel"] + a["pre_logits/bias"])
    return x @ a["head/kernel"] + a["head/bias"]


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

    save_file(state, str(path))
    return str(path)
