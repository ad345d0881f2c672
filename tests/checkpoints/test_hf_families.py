"""Hugging Face `.safetensors` files of the ViT family (DeiT, DINOv2 with and without registers, CLIP, SigLIP):
the architecture, options and (with `config.json`) the numerics and heads from the files, exact outputs against
the NumPy reference, clear errors for what contradicts a config.

Each file is a random keras_vit model's weights under the released names (`tests.reference.released_names`),
written in the Hugging Face layout by the tests' own statement of it (`tests.testing`), never by keras_vit's
translator; the reference computes on the released names. No torch needed."""

import json

import numpy as np
import pytest

import keras_vit
from tests.reference import gelu_erf, gelu_tanh, quick_gelu, released_names, vit_logits
from tests.testing import TINY_VIT, hugging_face_family_state_dict, randomize, save_safetensors

# name: (Hugging Face model, the source model's options, its numerics (the model class's defaults), pooling of
# the loaded model: None with a head (logits), else the embedding it returns).
FAMILIES = {
    "deit_distilled": ("deit", dict(distillation_token=True), dict(eps=1e-12, gelu=gelu_erf), None),
    "dinov2": ("dinov2", dict(layer_scale_init=1e-5), dict(eps=1e-6, gelu=gelu_erf), "token"),
    "dinov2_registers": ("dinov2", dict(layer_scale_init=1e-5, num_register_tokens=4), dict(eps=1e-6, gelu=gelu_erf),
                         "token"),
    "clip": ("clip", dict(norm_pre=True, patch_bias=False), dict(eps=1e-5, gelu=quick_gelu), "token"),
    "clip_projection": ("clip", dict(norm_pre=True, patch_bias=False), dict(eps=1e-5, gelu=quick_gelu), None),
    "siglip": ("siglip", dict(classifier="map"), dict(eps=1e-6, gelu=gelu_tanh), "map"),
}
_KERAS_NUMERICS = {gelu_erf: dict(activation="gelu", gelu_approximate=False),
                   gelu_tanh: dict(activation="gelu", gelu_approximate=True),
                   quick_gelu: dict(activation="quick_gelu")}


def images(seed=1):
    return np.random.default_rng(seed).uniform(-1, 1, (2, 32, 32, 3)).astype("float32")


def source_arrays(name: str) -> dict[str, np.ndarray]:
    """Random weights of the family's model under the released names (a CLIP projection has no bias)."""
    _, options, numerics, pooling = FAMILIES[name]
    model = keras_vit.VisionTransformer(**TINY_VIT, **options, input_shape=(32, 32, 3), include_top=pooling is None,
                                        pooling=pooling, classes=10, layer_norm_epsilon=numerics["eps"],
                                        **_KERAS_NUMERICS[numerics["gelu"]])
    randomize(model, seed=3, scale=0.3)
    arrays = released_names(model)
    if name == "clip_projection":
        arrays["head/bias"] = np.zeros_like(arrays["head/bias"])
    return arrays


def write(name: str, folder, config: dict | None = None) -> tuple[str, dict]:
    arrays = source_arrays(name)
    path = save_safetensors(hugging_face_family_state_dict(arrays, FAMILIES[name][0]), folder / "model.safetensors")
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return path, arrays


def load(path: str, pooling, **kwargs):
    return keras_vit.VisionTransformer(weights=path, input_shape=(32, 32, 3), include_preprocessing=False,
                                       include_top=pooling is None, pooling=pooling, classes=10,
                                       classifier_activation=None, **kwargs)


@pytest.mark.parametrize("name", [name if name in ("dinov2_registers", "siglip") else
                                  pytest.param(name, marks=pytest.mark.slow) for name in sorted(FAMILIES)])
def test_hugging_face_family_file_matches_the_numpy_forward(tmp_path, name):
    """Built from the file alone (heads given, numerics the class defaults): architecture, options, output."""
    path, arrays = write(name, tmp_path)
    _, options, numerics, pooling = FAMILIES[name]
    model = load(path, pooling, num_heads=3)
    x = images()
    expected = vit_logits(arrays, x, pixels=False, **numerics)
    assert 0.5 < np.abs(expected).max() < 100 and expected.std() > 0.1, "degenerate test output"
    np.testing.assert_allclose(np.asarray(model(x), np.float64), expected, rtol=0, atol=1e-5)
    layers = {layer.name for layer in model.layers}
    assert ("registers" in layers) == ("num_register_tokens" in options)
    assert ("norm_pre" in layers, "MAPHead_0" in layers, "head_dist" in layers) == (
        "norm_pre" in options, name == "siglip", name == "deit_distilled")
    assert model.get_layer("embedding").use_bias == options.get("patch_bias", True)
    block = model.get_layer("encoderblock_0")
    assert (block.layer_norm_epsilon, block.layer_scale_init is not None) == (numerics["eps"],
                                                                             "layer_scale_init" in options)


def test_config_json_gives_heads_and_numerics_and_contradictions_are_errors(tmp_path):
    config = {"model_type": "clip_vision_model", "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
              "num_attention_heads": 3}
    path, arrays = write("clip", tmp_path, config)
    model = load(path, "token")  # no num_heads: the config's
    assert model.get_layer("encoderblock_0").num_heads == 3
    x = images()
    np.testing.assert_allclose(np.asarray(model(x), np.float64),
                               vit_logits(arrays, x, pixels=False, eps=1e-5, gelu=quick_gelu), rtol=0, atol=1e-5)
    for wrong, message in ((dict(layer_norm_epsilon=1e-6), "layer_norm_epsilon=1e-06 contradicts"),
                           (dict(activation="gelu"), "activation='gelu' contradicts"),
                           (dict(num_heads=4), "num_heads=4 contradicts the config.json")):
        with pytest.raises(ValueError, match=message):
            load(path, "token", **wrong)
    (tmp_path / "config.json").write_text(json.dumps(dict(config, hidden_act="relu")))
    with pytest.raises(ValueError, match=r"hidden_act='relu' is not implemented by keras_vit"):
        load(path, "token")


def test_image_tower_of_a_whole_siglip_file_with_a_nested_config(tmp_path):
    """A SiglipModel file holds the text tower too (ignored); its config nests the vision one."""
    arrays = source_arrays("siglip")
    state = hugging_face_family_state_dict(arrays, "siglip")
    state.update({"text_model.embeddings.token_embedding.weight": np.ones((7, 48), "float32"),
                  "logit_scale": np.ones(1, "float32"), "logit_bias": np.ones(1, "float32")})
    path = save_safetensors(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "siglip", "text_config": {"hidden_act": "relu"},
                                                      "vision_config": {"num_attention_heads": 3}}))
    model = load(path, "map")
    x = images()
    np.testing.assert_allclose(np.asarray(model(x), np.float64),
                               vit_logits(arrays, x, pixels=False, eps=1e-6, gelu=gelu_tanh), rtol=0, atol=1e-5)


def test_dinov2_swiglu_is_refused_by_key(tmp_path):
    key = "encoder.layer.0.mlp.weights_in.weight"
    state = hugging_face_family_state_dict(source_arrays("dinov2"), "dinov2")
    path = save_safetensors(dict(state, **{key: np.ones((10, 48), "float32")}), tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"features keras_vit does not implement: the SwiGLU MLP \(use_swiglu_ffn\) "
                                         f"\\({key}\\)"):
        load(path, "token", num_heads=3)
