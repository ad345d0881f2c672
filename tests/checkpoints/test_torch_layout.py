"""timm and Hugging Face `.safetensors` ViT checkpoints: layout detection, exact numerics against the
NumPy reference on the source models' own layouts (tests/reference.py), all-or-nothing loading, no unpickling.

Checkpoints are written with NumPy and `safetensors.numpy`; no torch needed."""

import json
import math
import os
import pickle
import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_vit
from keras_vit import kernels
from keras_vit import layers as vit_layers
import keras_vit.convert
from keras_vit.cli import convert
from keras_vit.checkpoints import config_files, resample
from tests.reference import (TORCH_EPS, gelu_erf, quick_gelu, released_from_torch, torch_logits,
                             vit_logits)
from tests.testing import TINY_VIT, hf_state_dict, save_safetensors, timm_family_state_dict, timm_state_dict

TI16 = dict(hidden_dim=192, mlp_dim=768, num_heads=3, num_layers=12, patch_size=16)


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


@pytest.mark.slow
def test_timm_ti16_at_224_matches_the_numpy_forward(tmp_path):
    state = timm_state_dict(depth=12, width=192, mlp=768, patch=16, grid=14, classes=1000)
    path = save_safetensors(state, tmp_path / "vit_tiny.safetensors")
    model = keras_vit.ViTTi16(weights=path, include_preprocessing=False, classifier_activation=None)
    block = model.get_layer("encoderblock_0")
    assert (block.gelu_approximate, block.layer_norm_epsilon) == (False, 1e-6)
    x = images(224, 224)
    assert_logits_match(model(x), torch_logits(state, x, num_heads=3))


def test_hugging_face_on_a_resized_rectangular_input_matches_the_numpy_forward(tmp_path):
    state = hf_state_dict()  # trained at 32x32: a 4x4 grid, resampled to 5x3 bicubically, as transformers does
    path = save_safetensors(state, tmp_path / "hf.safetensors")
    model = tiny(path, input_shape=(40, 24, 3), classes=10)
    assert model.get_layer("encoder_norm").epsilon == 1e-12
    assert model.get_layer("posembed_input").pos_embedding.shape == (1, 16, 48)
    key = "vit.embeddings.position_embeddings"
    # The resize itself is checked against torch in tests/checkpoints/test_resample.py.
    grid = resample.resize_grid(state[key][0, 1:].reshape(4, 4, -1), (5, 3), resample.BICUBIC)
    at_size = dict(state, **{key: np.concatenate([state[key][:, :1], grid.reshape(1, 15, -1)], axis=1)})
    x = images(40, 24)
    assert_logits_match(model(x), vit_logits(released_from_torch(at_size, num_heads=3), x, posemb_grid=(5, 3),
                                             eps=TORCH_EPS["huggingface"], gelu=gelu_erf, pixels=False))


def test_hugging_face_vit_model_pooler_is_pre_logits(tmp_path):
    state = hf_state_dict(prefix="", classes=None, pooler=True)
    path = save_safetensors(state, tmp_path / "hf_model.safetensors")
    model = tiny(path, include_top=False, pooling="token", representation_size=48)
    x = images(32, 32)
    expected = torch_logits(state, x, num_heads=3)
    np.testing.assert_allclose(np.asarray(model(x), np.float64), expected, rtol=0, atol=1e-5)


def test_options_survive_keras_saving_and_conflicts_are_errors(tmp_path):
    path = save_safetensors(timm_state_dict(), tmp_path / "timm.safetensors")
    model = tiny(path, classes=10)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert loaded.get_layer("encoderblock_1").mlp.gelu_approximate is False
    x = images(32, 32)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))
    assert tiny(None).get_layer("encoderblock_0").gelu_approximate is True  # the original's numerics
    # A timm file does not record its numerics: the user's replace timm's defaults.
    assert tiny(path, classes=10, gelu_approximate=True).get_layer("encoderblock_0").gelu_approximate is True
    # A Hugging Face config.json beside the file fixes them: a contradicting value is an error.
    hf_path = save_safetensors(hf_state_dict(), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text('{"model_type": "vit", "hidden_act": "gelu", "layer_norm_eps": 1e-12}')
    with pytest.raises(ValueError, match=r"gelu_approximate=True contradicts the config.json beside .*whose model "
                                         r"has gelu_approximate=False"):
        tiny(hf_path, classes=10, gelu_approximate=True)


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
    state = timm_state_dict()
    path = save_safetensors(state, tmp_path / "timm.safetensors")
    for output in ("tiny.keras", "tiny.weights.h5"):
        assert convert.main([path, str(tmp_path / output), "--num-heads", "3"]) == 0
        difference = float(capsys.readouterr().out.split("max abs difference ")[1].split()[0])
        assert difference < 1e-5
    x = images(32, 32)  # the written file computes the source model
    assert_logits_match(keras.saving.load_model(tmp_path / "tiny.keras")(x), torch_logits(state, x, num_heads=3))
    with pytest.raises(ValueError, match="number of heads is not stored"):
        keras_vit.convert.convert_checkpoint(path, str(tmp_path / "x.keras"))


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
    message = load_fails(random_model, save_safetensors(state, tmp_path / "bad.safetensors"), match)
    assert "no weight was changed" in message and "missing key 'blocks.1.norm2.bias'" in message


def test_missing_hugging_face_key_is_named_as_in_the_file(tmp_path, random_model):
    state = hf_state_dict()
    del state["vit.encoder.layer.0.attention.attention.key.bias"]
    load_fails(random_model, save_safetensors(state, tmp_path / "bad.safetensors"),
               r"missing key 'vit.encoder.layer.0.attention.attention.key.bias'")


def test_truncated_file_is_a_clear_error(tmp_path, random_model):
    path = save_safetensors(timm_state_dict(), tmp_path / "good.safetensors")
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


# The family options of timm files, each as its models combine them: (timm_family_state_dict arguments,
# VisionTransformer options). Checked against the reference's own statement of timm's layout. The numerics no
# file records (a CLIP's LayerNorm epsilon and QuickGELU) are given, as a user would.
TIMM_FAMILIES = {
    "deit3": (dict(layer_scale=True, no_embed_class=True), dict(layer_scale_init=1e-5, no_embed_class=True)),
    "dinov2_registers": (dict(layer_scale=True, no_embed_class=True, registers=4),
                         dict(layer_scale_init=1e-5, no_embed_class=True, num_register_tokens=4)),
    "qk_norm_norm_pre_fc_norm": (dict(qk_norm=True, norm_pre=True, fc_norm=True),
                                 dict(qk_norm=True, norm_pre=True, fc_norm=True)),
    "deit_distilled": (dict(distilled=True), dict(distillation_token=True)),
    "clip_openai": (dict(norm_pre=True, patch_bias=False), dict(norm_pre=True, patch_bias=False,
                                                                layer_norm_epsilon=1e-5, activation="quick_gelu")),
    "siglip": (dict(map_head=True), dict(classifier="map")),
}
NUMERICS = {"clip_openai": dict(eps=1e-5, gelu=quick_gelu)}  # the reference's; timm's defaults otherwise


@pytest.mark.parametrize("family", [name if name == "dinov2_registers" else pytest.param(name, marks=pytest.mark.slow)
                                    for name in sorted(TIMM_FAMILIES)])
def test_timm_family_files_load_and_match_the_numpy_forward(tmp_path, family):
    state_options, model_options = TIMM_FAMILIES[family]
    state = timm_family_state_dict(**state_options)
    path = save_safetensors(state, tmp_path / f"{family}.safetensors")
    x = images(32, 32)
    expected = torch_logits(state, x, num_heads=3, no_embed_class=state_options.get("no_embed_class", False),
                            **NUMERICS.get(family, {}))
    assert_logits_match(tiny(path, classes=10, **model_options)(x), expected)
    numerics = {key: model_options[key] for key in ("layer_norm_epsilon", "activation") if key in model_options}
    model, difference = keras_vit.convert.convert_checkpoint(path, str(tmp_path / "converted.keras"), num_heads=3,
                                                             **numerics)
    assert difference == 0.0  # the architecture, options included, read from the file alone
    assert_logits_match(model(x), expected)
    from_file = keras_vit.VisionTransformer(weights=path, num_heads=3, input_shape=(32, 32, 3), classes=10,
                                           include_preprocessing=False, classifier_activation=None, **numerics)
    assert_logits_match(from_file(x), expected)  # architecture and options from the keys, the heads given
    block = from_file.get_layer("encoderblock_1")
    assert (block.layer_scale_init is not None, block.qk_norm) == ("layer_scale" in state_options,
                                                                   "qk_norm" in state_options)
    layers = {layer.name for layer in from_file.layers}
    assert ("head_dist" in layers) == ("distilled" in state_options)
    map_head = "map_head" in state_options  # SigLIP: attention pooling, no class token
    assert ("MAPHead_0" in layers, "cls" in layers) == (map_head, not map_head)
    assert from_file.get_layer("embedding").use_bias == state_options.get("patch_bias", True)


@pytest.mark.parametrize("extra, map_head, feature", [
    ({"patch_embed.norm.weight": np.ones(48, "float32")}, False, "a patch-embedding norm"),
    ({"blocks.1.attn.norm.weight": np.ones(48, "float32")}, False, "scale_attn_norm"),
    ({"attn_pool.pos_embed": np.ones((1, 16, 48), "float32")}, True, "attention pooling with its own position"),
    ({"attn_pool.latent": np.ones((1, 2, 48), "float32")}, True, "attention pooling of 2 latents"),
], ids=["patch_norm", "scale_attn_norm", "pooling_position", "two_latents"])
def test_unsupported_timm_features_are_refused(tmp_path, random_model, extra, map_head, feature):
    state = timm_family_state_dict(map_head=map_head)
    state.update(extra)
    path = save_safetensors(state, tmp_path / "variant.safetensors")
    with pytest.raises(ValueError, match=f"features keras_vit does not implement: {feature}"):
        tiny(path, classes=10)
    load_fails(random_model, path, feature)


def test_unknown_layout_lists_the_recognized_ones(tmp_path, random_model):
    path = save_safetensors({"encoder.weight": np.ones(3, "float32")}, tmp_path / "other.safetensors")
    load_fails(random_model, path, r"Not a timm or Hugging Face ViT state dict \(1 keys: 'encoder.weight'\)"
                                   r"(.|\n)*Recognized layouts: timm")


def test_timm_config_states_the_heads_and_a_guess_is_said(tmp_path, monkeypatch):
    """timm's `save_for_hf` writes `model_args` (and the entry point's name) into config.json: the heads are read
    from it, checked against the weights, and only a file that states nothing gets the variant's guess, said once."""
    from keras_vit import variants

    # A variant whose shapes this file has, with another head count: the guess would fit, silently wrong.
    monkeypatch.setitem(variants.VARIANTS, "Tiny/8", dict(patch_size=8, hidden_dim=48, mlp_dim=96, num_heads=3,
                                                          num_layers=2))
    inputs = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype("float32")

    def load(folder, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = keras_vit.VisionTransformer(weights=str(folder), input_shape=(32, 32, 3), classes=10,
                                                include_preprocessing=False, classifier_activation=None, **kwargs)
        guesses = [str(w.message) for w in caught if "number of heads" in str(w.message)]
        return model, guesses

    def folder(name, config):
        path = tmp_path / name
        path.mkdir()
        save_safetensors(timm_state_dict(), path / "model.safetensors")
        if config is not None:
            (path / "config.json").write_text(json.dumps(config))
        return path

    six_heads, _ = load(folder("given", None), num_heads=6)
    expected = six_heads.predict_on_batch(inputs)
    stated, guesses = load(folder("model_args", {"architecture": "vit_tiny_patch16_224", "model_args": {
        "num_heads": 6, "depth": 2, "embed_dim": 48}}))
    assert stated.vit_config.num_heads == 6 and guesses == []
    np.testing.assert_array_equal(stated.predict_on_batch(inputs), expected)
    guessed, guesses = load(folder("bare", None))
    assert guessed.vit_config.num_heads == 3 and len(guesses) == 1 and "num_heads=3 is guessed" in guesses[0]
    assert np.abs(guessed.predict_on_batch(inputs) - expected).max() > 1e-3  # the guess was wrong here
    # The entry point's own heads, by its name and width (timm's vit_base_patch16_gap_224 has 16, not 12).
    named = config_files.Beside(str(folder("named", {"architecture": "vit_small_patch16_224.augreg"})
                                    / "model.safetensors"))
    assert config_files.read_timm_config(named, 384) == {"num_heads": 6}
    assert config_files.read_timm_config(named, 48) == {}
    with pytest.raises(ValueError, match=r"config.json beside .* contradicts its weights: it says num_layers=12"):
        load(folder("contradicts", {"architecture": "vit_tiny_patch16_224", "model_args": {"depth": 12}}))
    with pytest.raises(ValueError, match=r"num_heads=3 contradicts the config.json"):
        load(tmp_path / "model_args", num_heads=3)
