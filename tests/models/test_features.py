"""Per-block features (`keras_vit.features_model`): the blocks' tokens against the NumPy reference, prefix tokens
split from NHWC patch maps, the final norm on request, use as a backbone, export."""

import keras
import numpy as np
import pytest

import keras_vit
from tests import reference
from tests.reference import layer_norm, released_names, vit_logits
from tests.testing import TINY_VIT, randomize

DINOV2_LIKE = dict(TINY_VIT, num_layers=3, layer_scale_init=1e-5, num_register_tokens=4)


def dinov2_like(**kwargs):
    model = keras_vit.VisionTransformer(**DINOV2_LIKE, input_shape=(32, 48, 3), include_top=False, **kwargs)
    randomize(model, seed=3, scale=0.3)
    return model


def pixels(shape=(2, 32, 48, 3)):
    return np.random.default_rng(0).uniform(0, 255, shape).astype("float32")


def reference_blocks(model, x):
    blocks = []
    vit_logits(released_names(model), x, posemb_grid=(4, 6), block_outputs=blocks)
    return blocks


def test_block_features_are_the_blocks_tokens_split_into_prefix_and_nhwc_maps():
    model = dinov2_like()
    features = keras_vit.features_model(model, blocks=[0, -1])
    x = pixels()
    out = features(x)
    assert sorted(out) == ["block_0", "block_0_prefix", "block_2", "block_2_prefix"]
    expected = reference_blocks(model, x)
    for index in (0, 2):
        tokens = expected[index]  # (2, 1 + 4 + 4 * 6, 48): class token, 4 registers, 4 x 6 patches
        np.testing.assert_allclose(np.asarray(out[f"block_{index}_prefix"]), tokens[:, :5], atol=1e-5)
        np.testing.assert_allclose(np.asarray(out[f"block_{index}"]), tokens[:, 5:].reshape(2, 4, 6, 48), atol=1e-5)
    assert {id(w) for w in features.weights} <= {id(w) for w in model.weights}  # shared, not copied


def test_tokens_output_and_final_norm():
    model = dinov2_like()
    features = keras_vit.features_model(model, blocks=[1], output="tokens", norm=True)
    x = pixels()
    norm = {key: value for key, value in released_names(model).items() if "encoder_norm" in key}
    expected = layer_norm(reference_blocks(model, x)[1], norm["Transformer/encoder_norm/scale"],
                          norm["Transformer/encoder_norm/bias"])
    np.testing.assert_allclose(np.asarray(features(x)["block_1"]), expected[:, 5:], atol=1e-5)


def test_bad_requests_are_named():
    model = dinov2_like()
    with pytest.raises(ValueError, match=r"Block 3 does not exist: model 'vision_transformer' has 3 blocks"):
        keras_vit.features_model(model, blocks=[3])
    with pytest.raises(ValueError, match=r"Unknown output 'nchw'. Expected one of \('nhwc', 'tokens'\)"):
        keras_vit.features_model(model, output="nchw")
    with pytest.raises(ValueError, match="norm=True needs the model's final norm 'encoder_norm'"):
        keras_vit.features_model(dinov2_like(fc_norm=True), norm=True)


@pytest.mark.parametrize("options, prefix, class_token", [
    (dict(), 5, True),                        # class token and 4 registers
    (dict(classifier="gap"), 4, False),       # registers only: the mean of all rows
], ids=["class_token", "gap"])
def test_explain_model_rollout_is_the_numpy_rollout(options, prefix, class_token):
    """`explain_model`'s in-graph `AttentionRollout` against the float64 NumPy rollout of the same attention."""
    model = dinov2_like(**options)
    x = pixels()
    explained = keras_vit.features.explain_model(model)
    grid = keras.Model(explained.input, explained.get_layer("attention_rollout").output)(x)
    attentions = [np.asarray(scores) for scores in keras_vit.attention_model(model)(x)["attention"]]
    expected = reference.rollout_map(reference.rollout(attentions), (4, 6), prefix, class_token)
    np.testing.assert_allclose(np.asarray(grid), expected, rtol=0, atol=1e-6)
    assert explained(x)["rollout"].shape == (2, 32, 48)


@pytest.mark.slow
def test_features_as_a_segmentation_backbone_train_and_round_trip(tmp_path):
    features = keras_vit.features_model(dinov2_like(), blocks=[-1])
    image = keras.Input((32, 48, 3))
    maps = features(image)["block_2"]  # (batch, 4, 6, 48)
    logits = keras.layers.UpSampling2D(8, interpolation="bilinear")(keras.layers.Conv2D(3, 1)(maps))
    segmenter = keras.Model(image, logits)
    segmenter.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = pixels(), np.random.default_rng(1).integers(0, 3, (2, 32, 48))
    losses = [float(segmenter.train_on_batch(x, y)) for _ in range(5)]
    assert segmenter.output_shape == (None, 32, 48, 3) and losses[-1] < losses[0]
    segmenter.save(tmp_path / "segmenter.keras")
    loaded = keras.saving.load_model(tmp_path / "segmenter.keras")
    np.testing.assert_allclose(np.asarray(loaded(x)), np.asarray(segmenter(x)), atol=1e-6)


@pytest.mark.slow
def test_features_model_exports_as_a_saved_model(tmp_path):
    import tensorflow as tf

    features = keras_vit.features_model(dinov2_like(), blocks=[0, 2])
    features.export(str(tmp_path / "features"), format="tf_saved_model", verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "features"))  # kept: its variables live as long as it does
    served = loaded.serve(tf.constant(pixels()))
    expected = features(pixels())
    assert sorted(served) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(served[key].numpy(), np.asarray(value), atol=1e-5)
