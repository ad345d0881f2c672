"""`keras_vit.geometry.model_geometry`: the input size, stride, grid, prefix tokens, pixel input, encoder end, pooled
features and head of real models, against numbers known from how they are built; the same numbers from the layers
of a model without a `ViTConfig` (the fallback), and from a `.keras` file of keras_vit 0.1.0 and 0.2.0."""

import json
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import features, fewshot
from keras_vit.geometry import model_geometry
from tests.testing import TINY_HYBRID, TINY_VIT

DATA = Path(__file__).parents[1] / "data"
NUMBERS = ("input_size", "stride", "grid", "num_prefix_tokens", "class_token", "pixel_input", "value_range")


def build(input_shape=(32, 48, 3), **options):
    return keras_vit.VisionTransformer(**{**TINY_VIT, "classes": 10, "weights": None, "input_shape": input_shape,
                                          **options})


def numbers(geometry) -> dict:
    return {name: getattr(geometry, name) for name in NUMBERS}


def without_config(model: keras.Model) -> keras.Model:
    """The same layers in a plain functional model: no `vit_config`, so the geometry is read from the layers."""
    plain = keras.Model(model.inputs, model.outputs, name=f"{model.name}_plain")
    assert getattr(plain, "vit_config", None) is None
    return plain


def load_fixture(name: str) -> keras.Model:
    with zipfile.ZipFile(DATA / name) as archive:
        written_by = json.loads(archive.read("metadata.json"))["keras_version"]
    if tuple(int(part) for part in keras.__version__.split(".")[:2]) < tuple(
            int(part) for part in written_by.split(".")[:2]):
        pytest.skip(f"written by Keras {written_by}, whose configs Keras {keras.__version__} cannot read")
    return keras.saving.load_model(DATA / name)


# (options, input shape) -> input size, stride, grid, prefix tokens, class token, pixel input, value range; the
# layer names of the encoder's end, the pooled features' layer and the head.
CASES = {
    "class_token": (dict(), (32, 48, 3), (32, 48), (8, 8), (4, 6), 1, True, True, (0.0, 255.0),
                    "encoder_norm", "pool", "head"),
    "gap": (dict(classifier="gap"), (32, 48, 3), (32, 48), (8, 8), (4, 6), 0, False, True, (0.0, 255.0),
            "encoder_norm", "pool", "head"),
    "map": (dict(classifier="map"), (32, 32, 3), (32, 32), (8, 8), (4, 4), 0, False, True, (0.0, 255.0),
            "encoder_norm", "MAPHead_0", "head"),
    "registers": (dict(num_register_tokens=4, no_embed_class=True), (32, 32, 3), (32, 32), (8, 8), (4, 4), 5, True,
                  True, (0.0, 255.0), "encoder_norm", "pool", "head"),
    "distilled": (dict(distillation_token=True), (32, 32, 3), (32, 32), (8, 8), (4, 4), 2, True, True, (0.0, 255.0),
                  "encoder_norm", "pool", "head_average"),
    "fc_norm_pre_logits": (dict(classifier="gap", fc_norm=True, representation_size=24), (16, 32, 3), (16, 32),
                           (8, 8), (2, 4), 0, False, True, (0.0, 255.0), "encoderblock_1", "pre_logits", "head"),
    # ResNet root /4 and one more stage /2, patch 1: stride 8.
    "hybrid": (dict(TINY_HYBRID), (32, 32, 3), (32, 32), (8, 8), (4, 4), 1, True, True, (0.0, 255.0),
               "encoder_norm", "pool", "head"),
    # Any size: the grid the table is stored for, the default 224 px (224 / 8 = 28).
    "any_size": (dict(), (None, None, 3), None, (8, 8), (28, 28), 1, True, True, (0.0, 255.0), "encoder_norm", "pool",
                 "head"),
    # Normalized input: [0, 1] pixels through (x - 0.5) / 0.25 span [-2, 2].
    "normalized_input": (dict(include_preprocessing=False, image_std=(0.25, 0.25, 0.25)), (32, 32, 3), (32, 32),
                         (8, 8), (4, 4), 1, True, False, (-2.0, 2.0), "encoder_norm", "pool", "head"),
    "original_normalization": (dict(include_preprocessing=False), (32, 32, 3), (32, 32), (8, 8), (4, 4), 1, True,
                               False, (-1.0, 1.0), "encoder_norm", "pool", "head"),
}


@pytest.mark.parametrize("case", CASES)
def test_geometry_of_built_models_and_of_their_layers(case):
    (options, shape, size, stride, grid, prefix, class_token, pixel_input, value_range, end, pooled,
     head) = CASES[case]
    model = build(shape, **options)
    expected = dict(zip(NUMBERS, (size, stride, grid, prefix, class_token, pixel_input, value_range)))
    geometry = model_geometry(model)
    assert numbers(geometry) == expected
    assert geometry.config is model.vit_config
    assert geometry.image is model.inputs[0]
    assert geometry.encoder_end.name == end
    assert (geometry.encoder_norm is None) == (end != "encoder_norm")
    assert geometry.head.name == head
    pooled_layer = model.get_layer(pooled)
    assert geometry.pooled is pooled_layer.output
    assert geometry.patch_embedding is model.get_layer("embedding")
    assert geometry.position_embedding is model.get_layer("posembed_input")
    fallback = model_geometry(without_config(model))  # the same numbers from the layers
    assert numbers(fallback) == expected | ({"value_range": (-1.0, 1.0)} if case == "normalized_input" else {})
    assert fallback.config is None and fallback.head is geometry.head and fallback.pooled is geometry.pooled


def test_a_pooled_backbone_pools_its_output_and_a_token_backbone_nothing():
    pooled = build(include_top=False, pooling="map", classifier="map")
    geometry = model_geometry(pooled)
    assert geometry.head is None and geometry.pooled is pooled.outputs[0] and geometry.pooled.shape == (None, 48)
    tokens = model_geometry(build(include_top=False))
    assert tokens.head is None and tokens.pooled is None and tokens.encoder_end.name == "encoder_norm"


def test_derived_models_have_the_geometry_of_their_model():
    model = build(num_register_tokens=2)
    expected = numbers(model_geometry(model))
    for derived in (keras_vit.features_model(model), keras_vit.attention_model(model),
                    fewshot.feature_extractor(model)):
        assert getattr(derived, "vit_config", None) is None
        assert numbers(model_geometry(derived)) == expected
    assert model_geometry(keras_vit.attention_model(model)).encoder_end.name == "encoder_norm"
    zero_shot = features.zero_shot_classifier(model, np.eye(10, 48), source="pooled")
    geometry = model_geometry(zero_shot)
    assert numbers(geometry) == expected and geometry.head.name == "zero_shot_head"


def test_keras_file_of_keras_vit_0_1_0_through_the_layers():
    """tests/data/tiny_0_1_0.keras has no `vit_config`: patch 8 at 16 px, a class token, its preprocessing."""
    model = load_fixture("tiny_0_1_0.keras")
    geometry = model_geometry(model)
    assert geometry.config is None
    assert numbers(geometry) == dict(input_size=(16, 16), stride=(8, 8), grid=(2, 2), num_prefix_tokens=1,
                                     class_token=True, pixel_input=True, value_range=(0.0, 255.0))
    assert geometry.head.name == "head" and geometry.pooled is model.get_layer("pool").output


def test_keras_file_of_keras_vit_0_2_0_from_its_config_and_from_its_layers():
    """tests/data/vit_0_2_0.keras: a DINOv2-like model of patch 32 at 64 px (a 2 x 2 grid), a class token and no
    registers, its processor's preprocessing, include_top=False with pooling="token"."""
    model = load_fixture("vit_0_2_0.keras")
    expected = dict(input_size=(64, 64), stride=(32, 32), grid=(2, 2), num_prefix_tokens=1, class_token=True,
                    pixel_input=True, value_range=(0.0, 255.0))
    for geometry in (model_geometry(model), model_geometry(without_config(model))):
        assert numbers(geometry) == expected
        assert geometry.head is None and geometry.pooled is model.outputs[0]
        assert geometry.encoder_end is model.get_layer("encoder_norm")
    assert model_geometry(model).config is model.vit_config


def test_a_model_that_is_not_a_keras_vit_model_is_named():
    with pytest.raises(ValueError, match=r"Model 'plain' has no TransformerBlock layers: expected a keras_vit"):
        model_geometry(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="plain"))
    vit = build(include_top=False, pooling="token", name="vit")
    image = keras.Input((32, 48, 3))
    app = keras.Model(image, keras.layers.Dense(3)(vit(image)), name="app")
    with pytest.raises(ValueError, match=r"holds its ViT as the nested model 'vit'"):
        model_geometry(app)
