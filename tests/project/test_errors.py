"""Errors on the README's and the docs' paths: the first line names the cause and the fix."""

import numpy as np
import pytest

import keras
import keras_vit
from export import model_io
from tests.testing import TINY_VIT, save_safetensors, timm_family_state_dict, timm_state_dict


def first_line(error) -> str:
    return str(error.value).splitlines()[0]


@pytest.mark.parametrize("weights", ["typo.safetensors", "checkpoints/ViT-B_16.npz", "model.weights.h5",
                                     "nowhere/imagenet"])
def test_missing_weights_file_says_so_before_anything_else(weights, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as error:
        keras_vit.VisionTransformer(weights=weights, num_heads=6)
    assert first_line(error).startswith(f"weights={weights!r}: no such file (relative to ")
    assert "keras_vit.list_weights()" in first_line(error)
    with pytest.raises(FileNotFoundError, match="no such file"):
        keras_vit.ViTTi16(weights=weights)


def test_unknown_registered_name_is_still_named_as_such():
    with pytest.raises(ValueError, match=r"^Unknown weights 'imagenet22k' for variant 'Ti/16'"):
        keras_vit.ViTTi16(weights="imagenet22k")


@pytest.fixture(scope="module")
def siglip_file(tmp_path_factory):
    return save_safetensors(timm_family_state_dict(seed=7, map_head=True, patch_bias=False),
                            tmp_path_factory.mktemp("siglip") / "siglip.safetensors")


@pytest.mark.parametrize("pooling", [None, "avg", "token"])
def test_siglip_backbone_without_map_pooling_names_it_in_one_line(siglip_file, pooling):
    with pytest.raises(ValueError) as error:
        keras_vit.VisionTransformer(weights=siglip_file, num_heads=3, include_top=False, pooling=pooling,
                                    input_shape=(32, 32, 3))
    message = str(error.value)
    assert "\n" not in message and "pass pooling='map'" in message and f"pooling={pooling!r}" in message


def test_siglip_backbone_with_map_pooling_loads_and_gives_tokens_through_features(siglip_file):
    model = keras_vit.VisionTransformer(weights=siglip_file, num_heads=3, include_top=False, pooling="map",
                                        input_shape=(32, 32, 3), include_preprocessing=False)
    images = np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)).astype("float32")
    assert model(images).shape == (2, 48)
    tokens = keras_vit.features_model(model, blocks=[-1], output="tokens")(images)
    assert tokens["block_1"].shape == (2, 16, 48)


def test_checkpoint_that_does_not_fit_names_the_fix_in_its_first_line(tmp_path):
    model = keras_vit.VisionTransformer(**dict(TINY_VIT, num_layers=3), input_shape=(32, 32, 3), classes=10)
    path = save_safetensors(timm_state_dict(), tmp_path / "two_blocks.safetensors")
    with pytest.raises(ValueError) as error:
        keras_vit.load_weights(model, path)
    assert first_line(error).startswith(f"{path!r} does not fit model")
    assert f"VisionTransformer(weights={path!r})" in first_line(error)
    assert "checkpoint: hidden size 48, 2 encoder blocks; model: hidden size 48, 3 encoder blocks" in str(error.value)


def test_checkpoint_without_patch_bias_still_shows_its_width(tmp_path, siglip_file):
    model = keras_vit.VisionTransformer(**dict(TINY_VIT, hidden_dim=24, mlp_dim=48), input_shape=(32, 32, 3),
                                        classes=10, classifier="map", patch_bias=False)
    with pytest.raises(ValueError, match=r"checkpoint: hidden size 48, 2 encoder blocks; model: hidden size 24"):
        keras_vit.load_weights(model, siglip_file)


def _nested():
    vit = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), include_top=False, pooling="token",
                                      name="vit")
    image = keras.Input((32, 32, 3))
    return keras.Model(image, keras.layers.Dense(3)(vit(image)), name="app"), vit


@pytest.mark.parametrize("tool", [keras_vit.attention_model, keras_vit.features_model])
def test_nested_vit_error_names_the_layer_to_pass(tool):
    app, vit = _nested()
    with pytest.raises(ValueError) as error:
        tool(app)
    assert first_line(error) == ("Model 'app' holds its ViT as the nested model 'vit', whose encoder blocks this "
                                 "needs at the top level: pass model.get_layer('vit') instead.")
    tool(app.get_layer("vit"))  # as the message says
    with pytest.raises(ValueError, match=r"^Model 'plain' has no TransformerBlock layers: expected a keras_vit"):
        tool(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="plain"))


def test_exporting_an_embedding_tower_says_to_add_a_head():
    backbone = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), include_top=False, pooling="token",
                                           name="tower")
    with pytest.raises(ValueError) as error:
        model_io.logits_model(backbone)
    assert first_line(error).startswith("Model 'tower' has no classification `head`")
    assert "include_top=True" in first_line(error) and "keras.layers.Dense(classes, name='head')" in first_line(error)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="Keras' TensorFlow trainer relaxes shapes")
def test_a_later_fit_or_predict_on_images_of_another_size_names_the_size_and_changes_nothing():
    """The first `fit` checks its inputs against the model's (Keras' ValueError). A later one on images of another
    size is traced with the image shape relaxed to unknown sizes, which passes that check: the position embedding's
    own check then stops the step, before any weight changes, with what was wrong and how to fix it."""
    import tensorflow as tf
    model = keras_vit.VisionTransformer(**dict(TINY_VIT, num_layers=1), input_shape=(32, 32, 3), classes=3)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 8)
    model.fit(rng.uniform(-1, 1, (8, 32, 32, 3)).astype("float32"), labels, batch_size=4, verbose=0)
    model.predict(rng.uniform(-1, 1, (4, 32, 32, 3)).astype("float32"), verbose=0)
    weights = [w.numpy().copy() for w in model.weights]
    small = rng.uniform(-1, 1, (8, 16, 16, 3)).astype("float32")
    expected = r"expects 17 tokens \(1 prefix \+ 4x4 grid\).*Received: 5 tokens.*input_shape=\(None, None, 3\)"
    with pytest.raises(tf.errors.InvalidArgumentError, match=expected):
        model.fit(small, labels, batch_size=4, verbose=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match=expected):
        model.predict(small, batch_size=4, verbose=0)
    for weight, before in zip(model.weights, weights):
        np.testing.assert_array_equal(weight.numpy(), before)


def test_position_embedding_checks_the_token_count_known_or_not():
    layer = keras_vit.layers.PositionEmbedding(grid_size=(2, 2), num_prefix_tokens=1)
    tokens = np.zeros((2, 5, 4), "float32")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer(tokens)),
                               np.broadcast_to(keras.ops.convert_to_numpy(layer.pos_embedding), (2, 5, 4)))
    with pytest.raises(ValueError, match=r"expects 5 tokens \(1 prefix \+ 2x2 grid\).*Received: 7 tokens"):
        layer(np.zeros((2, 7, 4), "float32"))
    if keras.backend.backend() == "tensorflow":  # a graph traced for any number of tokens checks at run time
        import tensorflow as tf
        add = tf.function(layer, input_signature=[tf.TensorSpec((None, None, 4))])
        np.testing.assert_allclose(add(tokens).numpy(), keras.ops.convert_to_numpy(layer(tokens)))
        with pytest.raises(tf.errors.InvalidArgumentError, match="Received: 7 tokens"):
            add(np.zeros((2, 7, 4), "float32"))
