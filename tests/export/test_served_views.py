"""What a served ViT answers beyond class probabilities: the pooled embedding, blocks' features, the attention
rollout, and zero-shot classifiers made of class embeddings (`keras_vit.features`), and the SavedModel signatures
that serve them from encoded images (`keras-vit-export --signatures`), called through TF1's loader as TF Serving
loads them."""

import json
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_vit
from keras_vit import features, fewshot, image_io
from keras_vit.cli import export as export_cli
from keras_vit.export import model_io, saved_model
from keras_vit.geometry import model_geometry
from tests import reference
from tests.testing import TF1Server, tiny_model

PIXELS = np.random.default_rng(3).uniform(0, 255, (3, 32, 32, 3)).astype("float32")


def as_numpy(outputs):
    return {key: np.asarray(value, np.float64) for key, value in outputs.items()}


@pytest.mark.parametrize("kind, overrides", [("plain", {}), ("plain", dict(classifier="gap")),
                                             ("hybrid", {})])
def test_rollout_layer_matches_the_numpy_rollout(kind, overrides):
    model = tiny_model(kind, **overrides)
    explained = features.explain_model(model)
    grid = keras.Model(explained.input, explained.get_layer("attention_rollout").output)(PIXELS)
    attentions = [np.asarray(a) for a in keras_vit.attention_model(model)(PIXELS)["attention"]]  # float64 oracle:
    geometry = model_geometry(model)
    expected = reference.rollout_map(reference.rollout(attentions), geometry.grid, geometry.num_prefix_tokens,
                                     geometry.class_token)
    np.testing.assert_allclose(np.asarray(grid), expected, rtol=0, atol=1e-6)
    outputs = explained(PIXELS)
    assert outputs["rollout"].shape == (3, 32, 32)
    np.testing.assert_allclose(np.asarray(outputs["output"]), np.asarray(model(PIXELS)), rtol=0, atol=1e-6)


def test_embedding_is_what_the_head_reads_and_normalizes_to_unit_length():
    model = tiny_model("plain", classifier_activation=None)
    pooled = as_numpy(features.embedding_model(model)(PIXELS))["embedding"]
    kernel, bias = model.get_layer("head").get_weights()
    np.testing.assert_allclose(pooled @ kernel + bias, np.asarray(model(PIXELS)), rtol=0, atol=1e-5)
    head = as_numpy(features.embedding_model(model, "head", l2_normalize=True)(PIXELS))["embedding"]
    logits = np.asarray(model(PIXELS), np.float64)
    np.testing.assert_allclose(head, logits / np.linalg.norm(logits, axis=1, keepdims=True), rtol=0, atol=1e-6)
    tower = tiny_model("plain", include_top=False, pooling="avg")
    assert features.embedding_model(tower)(PIXELS)["embedding"].shape == (3, 48)
    with pytest.raises(ValueError, match="source='head' needs a classification head"):
        features.embedding_model(tower, "head")
    with pytest.raises(ValueError, match="outputs tokens .* build it with include_top=False and pooling="):
        features.embedding_model(tiny_model("plain", include_top=False))
    with pytest.raises(ValueError, match="Unknown embedding source 'cls'"):
        features.embedding_model(model, "cls")


def test_derived_models_take_an_image_tensor_as_the_model_does():
    """A model built from a ViT's layers keeps the ViT's input structure: called with a batch of images, as the ViT
    is, it warns nothing. (Built from `model.inputs`, a list, Keras warns on every such call that the structure of
    the inputs does not match.)"""
    model = tiny_model("plain", classifier_activation=None)
    derived = {"feature_extractor": fewshot.feature_extractor(model),
               "features_model": features.features_model(model),
               "embedding_model": features.embedding_model(model),
               "zero_shot_classifier": features.zero_shot_classifier(model, np.eye(4, 10)),
               "explain_model": features.explain_model(model),
               "logits_model": model_io.logits_model(model)}
    for name, view in derived.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            view(PIXELS)
        assert not isinstance(view.input, (list, tuple, dict)), (name, view.input)


def test_zero_shot_classifier_is_the_scaled_cosine_with_the_class_embeddings():
    model = tiny_model("plain", classifier_activation=None)
    classes = np.random.default_rng(0).normal(size=(4, 10))
    zero_shot = features.zero_shot_classifier(model, classes, logit_scale=50.0, logit_bias=-2.0,
                                              classifier_activation=None)
    image = np.asarray(model(PIXELS), np.float64)
    cosine = (image / np.linalg.norm(image, axis=1, keepdims=True)) @ \
        (classes / np.linalg.norm(classes, axis=1, keepdims=True)).T
    np.testing.assert_allclose(np.asarray(zero_shot(PIXELS)), 50.0 * cosine - 2.0, rtol=0, atol=1e-4)
    assert isinstance(zero_shot, keras_vit.ViTModel) and zero_shot.vit_config == model.vit_config
    with pytest.raises(ValueError, match=r"class_embeddings must be \(classes, 10\)"):
        features.zero_shot_classifier(model, np.ones((4, 48)))
    with pytest.raises(ValueError, match=r"rows \[1\] are zero vectors"):
        features.zero_shot_classifier(model, np.stack([np.ones(10), np.zeros(10)]))


def jpegs(count=2):
    from sklearn.datasets import load_sample_image

    photo = load_sample_image("flower.jpg")
    crops = [photo[40 * i:40 * i + 150, 60 * i:60 * i + 200] for i in range(count)]
    return [tf.io.encode_jpeg(crop, quality=95).numpy() for crop in crops]


def fitted(encoded, preprocessing, size=(32, 32)):
    transform = preprocessing.resize_arguments
    return np.concatenate([image_io.fit_to_model(image_io.decode_rgb(data)[None], size, **transform).numpy()
                           for data in encoded])


@pytest.mark.slow
def test_signatures_embed_features_explain_through_the_tf1_loader(tmp_path):
    model = tiny_model("plain", image_mean=(0.48, 0.46, 0.41), image_std=(0.27, 0.26, 0.28),
                       resize_mode="shortest_edge", crop_fraction=0.875, interpolation="bicubic")
    model_file = tmp_path / "tiny.keras"
    model.save(model_file)
    export_cli.main(["--model", str(model_file), "--out", str(tmp_path / "served"), "--signatures",
                     "embed,features,explain", "--feature-blocks", "0,-1", "--l2-normalize", "--max-batch", "2"])
    path = tmp_path / "served" / "1"
    shown = subprocess.run([sys.executable, "-m", "tensorflow.python.tools.saved_model_cli", "show", "--dir",
                            str(path), "--tag_set", "serve"], capture_output=True, text=True, check=True).stdout
    for name in ("serving_default", "serving_bytes", "embed", "features", "explain"):
        assert f'"{name}"' in shown, shown
    server, encoded = TF1Server(path), jpegs()
    images = fitted(encoded, model.preprocessing_config)
    request = {"image_bytes": np.array(encoded)}

    embedded = server.predict("embed", request)["embedding"]
    expected = as_numpy(features.embedding_model(model, l2_normalize=True)(images))["embedding"]
    np.testing.assert_allclose(embedded, expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(embedded, axis=1), 1.0, atol=1e-6)

    served = server.predict("features", request)
    expected = as_numpy(features.features_model(model, [0, -1])(images))
    assert sorted(served) == sorted(expected) == ["block_0", "block_0_prefix", "block_1", "block_1_prefix"]
    for key in expected:
        np.testing.assert_allclose(served[key], expected[key], rtol=0, atol=1e-4)

    explained = server.predict("explain", request)
    expected = as_numpy(features.explain_model(model)(images))
    np.testing.assert_allclose(explained["rollout"], expected["rollout"], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(explained["classes"], expected["output"].argmax(-1))
    np.testing.assert_allclose(explained["scores"], expected["output"].max(-1), rtol=0, atol=1e-5)

    for name in ("embed", "features", "explain"):  # the limits of serving_default hold on every signature
        with pytest.raises(tf.errors.InvalidArgumentError, match="over the limit of max_batch=2"):
            server.predict(name, {"image_bytes": np.array(jpegs(3))})
    metadata = json.loads((path / "assets.extra" / "keras_vit_export.json").read_text())
    assert metadata["signatures"] == ["serving_default", "serving_bytes", "embed", "features", "explain"]
    assert metadata["preprocessing"]["resize_mode"] == "shortest_edge"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["hf_dinov3_swiglu_112", "timm_eva02_mlp_norm_126"])
def test_rotary_models_serve_features_and_explain_as_keras_computes_them(tmp_path, family):
    """DINOv3's and EVA-02's rotary blocks (their angles from each image's grid) behind the `features` and `explain`
    signatures of `keras-vit-export --weights <folder>`, through TF1's loader, against the same model in Keras."""
    from keras_vit import model_files
    from tests.data.make_family_files import FOLDER

    folder = f"{FOLDER}/{family}"
    assert export_cli.main(["--weights", folder, "--out", str(tmp_path / "served"), "--signatures",
                            "features,explain", "--feature-blocks", "0,-1"]) == 0
    model = model_files.load_or_build(weights=folder)  # what the command built
    assert model.vit_config.rope is not None
    server, encoded = TF1Server(tmp_path / "served" / "1"), jpegs()
    images = fitted(encoded, model.preprocessing_config, model_io.image_size(model))
    request = {"image_bytes": np.array(encoded)}
    served = server.predict("features", request)
    expected = as_numpy(features.features_model(model, [0, -1])(images))
    assert sorted(served) == sorted(expected) and len(expected) == 4
    for key in expected:
        scale = max(1.0, float(np.abs(expected[key]).max()))
        np.testing.assert_allclose(served[key] / scale, expected[key] / scale, rtol=0, atol=1e-4, err_msg=key)
    explained = server.predict("explain", request)
    rollout = as_numpy(features.explain_model(model)(images))["rollout"]
    assert explained["rollout"].shape == rollout.shape == (2, *model_io.image_size(model))
    np.testing.assert_allclose(explained["rollout"], rollout, rtol=0, atol=1e-5)
    assert np.ptp(rollout) > 0  # a map, not a constant


@pytest.mark.slow
def test_a_tower_serves_its_embedding_and_a_zero_shot_head_serves_classes(tmp_path):
    tower = tiny_model("plain", include_top=False, pooling="token")
    path = saved_model.export_saved_model(tower, tmp_path / "tower", version=1, l2_normalize=True)
    server, encoded = TF1Server(path), jpegs()
    served = server.predict("serving_bytes", {"image_bytes": np.array(encoded)})
    expected = as_numpy(features.embedding_model(tower, l2_normalize=True)(fitted(encoded,
                                                                                  tower.preprocessing_config)))
    np.testing.assert_allclose(served["embedding"], expected["embedding"], rtol=0, atol=1e-5)

    classes = np.random.default_rng(1).normal(size=(3, 48)).astype("float32")
    np.save(tmp_path / "classes.npy", classes)
    (tmp_path / "names.txt").write_text("cat\ndog\nbird\n")
    tower_file = tmp_path / "tower.keras"
    tower.save(tower_file)
    with pytest.raises(SystemExit):
        export_cli.main(["--model", str(tower_file), "--out", str(tmp_path / "bad"), "--signatures", "embed,shap"])
    export_cli.main(["--model", str(tower_file), "--out", str(tmp_path / "zero_shot"), "--class-embeddings",
                     str(tmp_path / "classes.npy"), "--embedding", "pooled", "--class-names",
                     str(tmp_path / "names.txt"), "--top-k", "3"])
    served = TF1Server(tmp_path / "zero_shot" / "1").predict("serving_bytes", {"image_bytes": np.array(encoded)})
    cosine = expected["embedding"] @ (classes / np.linalg.norm(classes, axis=1, keepdims=True)).T
    np.testing.assert_allclose(served["logits"], 100.0 * cosine, rtol=0, atol=1e-3)
    np.testing.assert_array_equal(served["class_names"][:, 0].astype(str),
                                  np.array(["cat", "dog", "bird"])[cosine.argmax(1)])
