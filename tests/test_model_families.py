"""One harness, every model family: the same checks for each row of FAMILIES.

`run_model_test` follows keras-hub's `run_backbone_test`: build, every layer built, load a checkpoint in
the original layout through `weights=`, forward pass against the shared NumPy reference
(`tests/reference.py`), `predict` equal to the call, `get_config` / `.keras` / `.weights.h5` round trips
with identical outputs. `test_family_saved_model` adds the TF Serving export (slow). A new family is one
more row.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest

import keras_vit
from tests.reference import gelu_erf, gelu_tanh, quick_gelu, released_names, vit_logits
from tests.testing import TINY_HYBRID, TINY_VIT, randomize, save_checkpoint, vit_checkpoint


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
        return vit_logits(arrays, images, resnet_stages=self.config.get("resnet_stages"), posemb_grid=grid,
                          eps=self.eps, gelu=self.gelu, no_embed_class=self.config.get("no_embed_class", False))


FAMILIES = {
    "vit": Family(TINY_VIT),
    "vit_gap": Family(dict(TINY_VIT, classifier="gap"), checkpoint={"classifier": "gap"}),
    "vit_pre_logits": Family(dict(TINY_VIT, representation_size=24), checkpoint={"representation_size": 24}),
    "vit_resampled_non_square": Family(TINY_VIT, input_shape=(24, 40, 3), checkpoint={"grid": 5}),
    "vit_pytorch_numerics": Family(dict(TINY_VIT, layer_norm_epsilon=1e-12, gelu_approximate=False),
                                   eps=1e-12, gelu=gelu_erf),
    "hybrid": Family(TINY_HYBRID),
    # The ViT family's options (issue 25), each as its timm models combine them:
    "deit3": Family(dict(TINY_VIT, layer_scale_init=1e-5, no_embed_class=True), checkpoint=None),
    "dinov2_registers": Family(dict(TINY_VIT, layer_scale_init=1e-5, num_register_tokens=4, no_embed_class=True),
                               checkpoint=None),
    "dinov2_registers_hf": Family(dict(TINY_VIT, layer_scale_init=1e-5, num_register_tokens=4), checkpoint=None),
    "clip_openai": Family(dict(TINY_VIT, norm_pre=True, patch_bias=False, activation="quick_gelu",
                               layer_norm_epsilon=1e-5), checkpoint=None, eps=1e-5, gelu=quick_gelu),
    "siglip_map": Family(dict(TINY_VIT, classifier="map"), checkpoint=None),
    "map_registers_qk_norm": Family(dict(TINY_VIT, classifier="map", num_register_tokens=2, qk_norm=True,
                                         gelu_approximate=False),
                                    checkpoint=None, gelu=gelu_erf),
    "deit_distilled": Family(dict(TINY_VIT, distillation_token=True), checkpoint=None),
    "fc_norm_avg": Family(dict(TINY_VIT, fc_norm=True, num_register_tokens=2), checkpoint=None),
    "qk_norm_gap": Family(dict(TINY_VIT, qk_norm=True, classifier="gap", num_register_tokens=1), checkpoint=None),
}
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
    assert loaded.vit_config == model.vit_config
    assert [w.path for w in loaded.weights] == [w.path for w in model.weights]

    model.save_weights(tmp_path / "model.weights.h5")
    rebuilt = build(family)
    rebuilt.load_weights(tmp_path / "model.weights.h5")
    np.testing.assert_array_equal(outputs(rebuilt, x), logits)
    return model, logits


FAST_FAMILIES = ("vit", "dinov2_registers")  # the rest run in the full suite only (`-m "not slow"` is the fast subset)


@pytest.mark.parametrize("name", [name if name in FAST_FAMILIES else pytest.param(name, marks=pytest.mark.slow)
                                  for name in sorted(FAMILIES)])
def test_family(name, tmp_path):
    run_model_test(FAMILIES[name], tmp_path)


# Every option of the ViT family, and the numerics, as `ViTConfig` fields that some family sets.
FAMILY_OPTIONS = ("classifier", "representation_size", "patch_bias", "num_register_tokens", "no_embed_class",
                  "distillation_token", "norm_pre", "layer_scale_init", "qk_norm", "fc_norm", "layer_norm_epsilon",
                  "gelu_approximate", "activation")


def test_families_cover_every_family_option():
    assert set(FAMILY_OPTIONS) <= set(keras_vit.variants.OPTIONS)
    assert {option for family in FAMILIES.values() for option in family.config} >= set(FAMILY_OPTIONS)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_through_a_variant_builder(name):
    """`keras_vit.ViTTi16(qk_norm=True, ...)`: every family's options as keywords of a public builder (the tiny
    architecture too) give the model `VisionTransformer` builds, the same config and the same logits."""
    family = FAMILIES[name]
    builder = keras_vit.R50ViTB16 if "resnet_stages" in family.config else keras_vit.ViTTi16
    built = builder(weights=None, input_shape=family.input_shape, classes=10, classifier_activation=None,
                    **family.config)
    direct = build(family)
    assert built.vit_config == direct.vit_config
    for option, value in family.config.items():
        assert getattr(built.vit_config, option) == (tuple(value) if isinstance(value, list) else value), option
    randomize(direct, seed=2)
    built.set_weights(direct.get_weights())
    x = images(family.input_shape)
    np.testing.assert_array_equal(outputs(built, x), outputs(direct, x))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit", "vit_resampled_non_square", "hybrid", "dinov2_registers", "clip_openai",
                                  "deit_distilled", "siglip_map"])
def test_family_saved_model(name, tmp_path):
    import tensorflow as tf

    from keras_vit.export import saved_model

    family = FAMILIES[name]
    model = build(family, weights=save_checkpoint(tmp_path / "checkpoint.npz", family.arrays()))
    logits = outputs(model, images(family.input_shape))  # the harness checks them: test_family[name]
    path = saved_model.export_saved_model(model, tmp_path / "serving")
    served = tf.saved_model.load(str(path)).signatures["serving_default"]
    served_logits = served(images=tf.constant(images(family.input_shape)))["logits"].numpy()
    np.testing.assert_allclose(served_logits, logits, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["clip_openai", "deit_distilled", "dinov2_registers", "siglip_map"])
def test_family_float32_tflite(name, tmp_path):
    """The float32 LiteRT file of each family option set gives the Keras model's logits."""
    from keras_vit.export import tflite

    family = FAMILIES[name]
    model = build(family, weights=save_checkpoint(tmp_path / "checkpoint.npz", family.arrays()))
    x = images(family.input_shape)
    lite = tflite.LiteRTClassifier(tflite.convert(model, tmp_path / "model.tflite", "float32"))
    np.testing.assert_allclose(np.stack([lite(image) for image in x]), outputs(model, x), atol=1e-5, rtol=0)
