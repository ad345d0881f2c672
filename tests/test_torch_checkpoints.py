"""timm and Hugging Face `.safetensors` ViT checkpoints: layout detection, exact numerics against
NumPy forward passes of the source models' equations, all-or-nothing loading, no unpickling.

Checkpoints are written with NumPy and `safetensors.numpy`; no torch needed."""

import math
import os
import pickle

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_vit
from keras_vit import kernels, torch_checkpoints
from keras_vit.cli import convert
from keras_vit import layers as vit_layers
from tests.testing import TINY_VIT

safetensors_numpy = pytest.importorskip("safetensors.numpy")

TI16 = dict(hidden_dim=192, mlp_dim=768, num_heads=3, num_layers=12, patch_size=16)


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


def save(state, path) -> str:
    safetensors_numpy.save_file(state, str(path))
    return str(path)


def images(height, width, batch=2, seed=1):
    return np.random.default_rng(seed).uniform(-1, 1, (batch, height, width, 3)).astype("float32")


def tiny(weights, input_shape=(32, 32, 3), **kwargs):
    return keras_vit.VisionTransformer(**TINY_VIT, weights=weights, input_shape=input_shape,
                                       include_preprocessing=False, classifier_activation=None, **kwargs)


def assert_logits_match(logits, expected):
    logits = np.asarray(logits, np.float64)
    assert 1.0 < np.abs(expected).max() < 100.0 and expected.std() > 0.3, "degenerate test logits"
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)


# --- exact numerics ---


def test_timm_ti16_at_224_matches_the_numpy_forward(tmp_path):
    state = timm_state_dict(depth=12, width=192, mlp=768, patch=16, grid=14, classes=1000)
    path = save(state, tmp_path / "vit_tiny.safetensors")
    model = keras_vit.ViTTi16(weights=path, include_preprocessing=False, classifier_activation=None)
    block = model.get_layer("encoderblock_0")
    assert (block.gelu_approximate, block.layer_norm_epsilon) == (False, 1e-6)
    x = images(224, 224)
    assert_logits_match(model(x), torch_checkpoints.reference_forward(state, x, num_heads=3))


def test_hugging_face_on_a_resized_rectangular_input_matches_the_numpy_forward(tmp_path):
    state = hf_state_dict()  # trained at 32x32: a 4x4 grid, resampled to 5x3
    path = save(state, tmp_path / "hf.safetensors")
    model = tiny(path, input_shape=(40, 24, 3), classes=10)
    assert model.get_layer("encoder_norm").epsilon == 1e-12
    assert model.get_layer("posembed_input").pos_embedding.shape == (1, 16, 48)
    x = images(40, 24)
    assert_logits_match(model(x), torch_checkpoints.reference_forward(state, x, num_heads=3))


def test_hugging_face_vit_model_pooler_is_pre_logits(tmp_path):
    state = hf_state_dict(prefix="", classes=None, pooler=True)
    path = save(state, tmp_path / "hf_model.safetensors")
    model = tiny(path, include_top=False, pooling="token", representation_size=48)
    x = images(32, 32)
    expected = torch_checkpoints.reference_forward(state, x, num_heads=3)
    np.testing.assert_allclose(np.asarray(model(x), np.float64), expected, rtol=0, atol=1e-5)


def test_options_survive_keras_saving_and_conflicts_are_errors(tmp_path):
    path = save(timm_state_dict(), tmp_path / "timm.safetensors")
    model = tiny(path, classes=10)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert loaded.get_layer("encoderblock_1").mlp.gelu_approximate is False
    x = images(32, 32)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))
    assert tiny(None).get_layer("encoderblock_0").gelu_approximate is True  # the original's numerics
    with pytest.raises(ValueError, match=r"gelu_approximate=True contradicts the checkpoint"):
        tiny(path, classes=10, gelu_approximate=True)


def test_old_block_configs_default_to_the_original_gelu():
    config = vit_layers.TransformerBlock(3, 96).get_config()
    del config["gelu_approximate"]
    assert vit_layers.TransformerBlock.from_config(config).gelu_approximate is True


@pytest.mark.parametrize("cpu_kernels", [False, True])
@pytest.mark.parametrize("training", [False, True])
def test_exact_gelu_block_matches_numpy_in_both_kernel_scopes(cpu_kernels, training):
    block = vit_layers.TransformerBlock(3, 96, gelu_approximate=False)
    x = images(5, 48, batch=2)[..., 0].reshape(2, 5, 48) * 2
    block(x)
    rng = np.random.default_rng(0)
    for weight in block.weights:
        weight.assign(rng.normal(scale=0.3, size=weight.shape).astype("float32"))

    def traced(x):
        with kernels.cpu_kernels(cpu_kernels):
            return block.mlp(x, training=training)
    got = np.asarray(tf.function(traced)(tf.constant(x)))
    dense_0, dense_1 = block.mlp.dense_0, block.mlp.dense_1
    h = x.astype(np.float64) @ np.asarray(dense_0.kernel) + np.asarray(dense_0.bias)
    h = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
    np.testing.assert_allclose(got, h @ np.asarray(dense_1.kernel) + np.asarray(dense_1.bias), atol=1e-5)


def test_converter_writes_keras_and_weights_files(tmp_path, capsys):
    path = save(timm_state_dict(), tmp_path / "timm.safetensors")
    for output in ("tiny.keras", "tiny.weights.h5"):
        assert convert.main([path, str(tmp_path / output), "--num-heads", "3"]) == 0
        difference = float(capsys.readouterr().out.split("max abs difference ")[1].split()[0])
        assert difference < 1e-5
    with pytest.raises(ValueError, match="number of heads is not stored"):
        torch_checkpoints.convert_safetensors(path, str(tmp_path / "x.keras"))


# --- bad files: a clear error, nothing loaded, no code run ---


@pytest.fixture
def random_model():
    model = tiny(None, classes=10)
    return model, [np.array(weight) for weight in model.weights]


def load_fails(model_and_weights, path, match) -> str:
    """Loading raises a ValueError matching `match` and changes no weight; returns the message."""
    model, before = model_and_weights
    with pytest.raises(ValueError, match=match) as error:
        keras_vit.load_weights(model, str(path))
    for weight, value in zip(model.weights, before):
        np.testing.assert_array_equal(np.array(weight), value)
    return str(error.value)


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.pop("blocks.1.mlp.fc1.weight"),
     r"missing key 'blocks.1.mlp.fc1.weight' for model weight 'encoderblock_1/MlpBlock_3/Dense_0/kernel'"),
    (lambda s: s.update({"blocks.0.attn.extra.weight": np.ones((2, 2), "float32")}),
     r"unexpected key 'blocks.0.attn.extra.weight' \(2, 2\)"),
    (lambda s: s.update({"blocks.0.mlp.fc2.weight": np.ones((48, 64), "float32")}),
     r"shape mismatch for key 'blocks.0.mlp.fc2.weight' \(as 'Transformer/encoderblock_0/MlpBlock_3/Dense_1/"
     r"kernel'\) -> 'encoderblock_0/MlpBlock_3/Dense_1/kernel': expected \(96, 48\), found \(64, 48\)"),
    (lambda s: s.update({"blocks.0.attn.qkv.weight": np.ones((96, 48), "float32")}),
     r"cannot convert key 'blocks.0.attn.qkv.weight' \(96, 48\): expected a fused query/key/value"),
], ids=["missing", "unexpected", "wrong_shape", "unsplittable_qkv"])
def test_bad_timm_keys_list_every_problem_and_load_nothing(tmp_path, random_model, edit, match):
    state = timm_state_dict()
    edit(state)
    state.pop("blocks.1.norm2.bias")  # a second problem, listed too
    message = load_fails(random_model, save(state, tmp_path / "bad.safetensors"), match)
    assert "no weight was changed" in message and "missing key 'blocks.1.norm2.bias'" in message


def test_missing_hugging_face_key_is_named_as_in_the_file(tmp_path, random_model):
    state = hf_state_dict()
    del state["vit.encoder.layer.0.attention.attention.key.bias"]
    load_fails(random_model, save(state, tmp_path / "bad.safetensors"),
               r"missing key 'vit.encoder.layer.0.attention.attention.key.bias'")


def test_truncated_file_is_a_clear_error(tmp_path, random_model):
    path = save(timm_state_dict(), tmp_path / "good.safetensors")
    data = open(path, "rb").read()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[:-100])
    load_fails(random_model, truncated, r"Could not read .* as a .safetensors file: tensor .* ends at byte "
                                        r"\d+ of the data, but the file holds only \d+ bytes of data \(truncated\?\)")
    truncated.write_bytes(data[:20])
    load_fails(random_model, truncated, r"its header length is \d+ bytes, but only 12 bytes follow")
    with pytest.raises(ValueError, match="as a .safetensors file"):
        tiny(str(truncated))


class _Payload:
    """Unpickling this creates a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("suffix", [".bin", ".pth"])
def test_pickle_files_are_never_unpickled(tmp_path, random_model, suffix):
    marker = tmp_path / "pwned"
    path = tmp_path / f"pytorch_model{suffix}"
    path.write_bytes(pickle.dumps({"patch_embed.proj.weight": _Payload(str(marker))}))
    with pytest.raises(ValueError, match=r"does not unpickle(.|\n)*safetensors.torch import save_file"):
        tiny(str(path))
    load_fails(random_model, path, "does not unpickle")
    assert not marker.exists() and os.listdir(tmp_path) == [path.name]


@pytest.mark.parametrize("extra, feature", [
    ({"blocks.0.ls1.gamma": np.ones(48, "float32")}, "layer scale"),
    ({"reg_token": np.ones((1, 4, 48), "float32")}, "register tokens"),
    ({"fc_norm.weight": np.ones(48, "float32")}, "fc_norm"),
    ({"pos_embed": np.ones((1, 16, 48), "float32")}, "no_embed_class"),
], ids=["layer_scale", "register_tokens", "fc_norm", "no_embed_class"])
def test_unsupported_timm_features_are_refused(tmp_path, random_model, extra, feature):
    state = timm_state_dict()
    state.update(extra)
    path = save(state, tmp_path / "variant.safetensors")
    with pytest.raises(ValueError, match=f"features keras_vit does not implement: {feature}"):
        tiny(path, classes=10)
    load_fails(random_model, path, feature)


def test_unknown_layout_lists_the_recognized_ones(tmp_path, random_model):
    path = save({"encoder.weight": np.ones(3, "float32")}, tmp_path / "other.safetensors")
    load_fails(random_model, path, r"Not a timm or Hugging Face ViT state dict \(1 keys: 'encoder.weight'\)"
                                   r"(.|\n)*Recognized layouts: timm")
