"""One harness, every model family: the same checks for each row of FAMILIES.

`run_model_test` (tests/testing.py) follows keras-hub's `run_backbone_test`: build, every layer built, load a
checkpoint in the original layout through `weights=`, forward pass against the shared NumPy reference
(`tests/reference.py`), `predict` equal to the call, `get_config` / `.keras` / `.weights.h5` round trips
with identical outputs. `test_family_saved_model` adds the TF Serving export (slow). A new family is one
more row.
"""

from __future__ import annotations

import numpy as np
import pytest

import keras_vit
from tests.reference import gelu_erf, quick_gelu, silu
from tests.testing import (TINY_HYBRID, TINY_VIT, Family, build, images, outputs, randomize, run_model_test,
                           save_checkpoint)

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
    # transformers' Dinov2WithRegistersForImageClassification: the head on [class token; mean patch token]
    "dinov2_registers_classifier": Family(dict(TINY_VIT, classifier="token_gap", layer_scale_init=1e-5,
                                               num_register_tokens=4), checkpoint=None),
    "fc_norm_avg": Family(dict(TINY_VIT, fc_norm=True, num_register_tokens=2), checkpoint=None),
    "qk_norm_gap": Family(dict(TINY_VIT, qk_norm=True, classifier="gap", num_register_tokens=1), checkpoint=None),
    # DINOv3 H+ / 7B: rotary positions (on a non-square grid), registers, layer scale, the gated SiLU MLP.
    "dinov3_rope_swiglu": Family(dict(TINY_VIT, position_embedding="none", rope="dinov3", rope_theta=50.0,
                                      num_register_tokens=4, layer_scale_init=1e-5, gated_mlp=True, activation="silu",
                                      gelu_approximate=False, layer_norm_epsilon=1e-5),
                                 input_shape=(24, 40, 3), checkpoint=None, eps=1e-5, gelu=silu),
    # EVA-02 B / L: rotary positions in patches of a (non-square) reference grid beside the position table, the
    # gated SiLU MLP with its hidden-layer norm, the patch tokens' mean and fc_norm.
    "eva02_rope_mlp_norm": Family(dict(TINY_VIT, rope="eva02", rope_theta=1000.0, rope_reference_grid=(2, 3),
                                       gated_mlp=True, mlp_norm=True, activation="silu", gelu_approximate=False,
                                       fc_norm=True),
                                  checkpoint=None, gelu=silu),
}
FAST_FAMILIES = ("vit", "dinov2_registers")  # the rest run in the full suite only (`-m "not slow"` is the fast subset)


@pytest.mark.parametrize("name", [name if name in FAST_FAMILIES else pytest.param(name, marks=pytest.mark.slow)
                                  for name in sorted(FAMILIES)])
def test_family(name, tmp_path):
    run_model_test(FAMILIES[name], tmp_path)


# Every option of the ViT family, and the numerics, as `ViTConfig` fields that some family sets.
FAMILY_OPTIONS = ("classifier", "representation_size", "patch_bias", "num_register_tokens", "no_embed_class",
                  "distillation_token", "norm_pre", "layer_scale_init", "qk_norm", "fc_norm", "layer_norm_epsilon",
                  "gelu_approximate", "activation", "position_embedding", "rope", "rope_theta", "rope_reference_grid",
                  "gated_mlp", "mlp_norm")


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


# The families that have a file in tests/data/families (ViT, DeiT distilled, DINOv2 with registers, CLIP, SigLIP's
# MAP head, DINOv3) are exported from it, as a SavedModel and a float32 LiteRT file, and checked against the source
# library's outputs (tests/checkpoints/test_family_files.py); the others here.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit_resampled_non_square", "hybrid"])
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
