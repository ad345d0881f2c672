"""Models of any input size (`input_shape=(None, None, 3)`): the position embedding, stored at the checkpoint's grid,
is fitted to each image's grid inside the graph. The reference is a model built at the image's size, whose weights
the loader resamples in float64 (`checkpoints.npz.resample_position_embedding`) at build time; the NumPy oracles are
tests/reference.py's."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_vit
from keras_vit import inspection as vit_inspect
from keras_vit import layers as vit_layers
from keras_vit import models
from keras_vit.checkpoints import loader, npz, resample
from tests.reference import sincos_2d, zoom_linear
from tests.testing import (REPO, TINY_HYBRID, TINY_VIT, graph_op_types, hf_state_dict, save_checkpoint,
                           save_safetensors, timm_family_state_dict, timm_state_dict, to_numpy, vit_checkpoint,
                           xla_flags)

LOGITS = dict(classes=10, classifier_activation=None)
ANY_SIZE = (None, None, 3)
# The checkpoint's own 32 px (no resampling), larger, non-square and smaller-and-non-square inputs.
SIZES = [(32, 32), (48, 48), (24, 40), (64, 56)]


def _images(size, count=2, seed=0):
    return np.random.default_rng(seed).uniform(0, 255, (count, *size, 3)).astype("float32")


def _build(config, size, path=None, **kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="keras_vit: position embedding")
        return keras_vit.VisionTransformer(**config, weights=path, input_shape=size, **LOGITS, **kwargs)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny ViT checkpoint of a 4x4 grid: made for 32 px images."""
    return save_checkpoint(tmp_path_factory.mktemp("dynamic") / "vit.npz", vit_checkpoint(seed=7))


@pytest.fixture(scope="module")
def any_size_model(checkpoint):
    return _build(TINY_VIT, ANY_SIZE, checkpoint)


@pytest.mark.parametrize("length, size", [(5, 1), (5, 2), (5, 5), (5, 8), (7, 3), (4, 13), (1, 6), (14, 40)])
def test_zoom_axis_is_the_numpy_resampling(length, size):
    x = np.random.default_rng(length * size).normal(size=(length, 3, 6)).astype("float32")
    expected = zoom_linear(x.reshape(length, 1, -1).astype("float64"), size, 1).reshape(size, *x.shape[1:])
    np.testing.assert_allclose(to_numpy(resample.zoom_axis(x, 0, size)), expected, atol=1e-6, rtol=0)
    in_graph = tf.function(lambda table, n: resample.zoom_axis(table, 0, n))  # the size as a run-time tensor
    np.testing.assert_allclose(in_graph(x, tf.constant(size)).numpy(), expected, atol=1e-6, rtol=0)
    np.testing.assert_allclose(to_numpy(resample.zoom_axis(np.swapaxes(x, 0, 1), 1, size)),
                               np.swapaxes(expected, 0, 1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("prefix", [0, 1, 2])
def test_layer_table_is_the_loader_resampling(prefix):
    layer = keras_vit.PositionEmbedding((4, 4), prefix, patch_stride=8)
    tokens = np.zeros((1, prefix + 3 * 5, 6), "float32")
    layer.build((None, None, 6))
    table = np.random.default_rng(prefix).normal(size=layer.pos_embedding.shape).astype("float32")
    layer.pos_embedding.assign(table)
    expected = npz.resample_position_embedding(table, (3, 5), num_prefix_tokens=prefix)
    np.testing.assert_allclose(to_numpy(layer(tokens, np.zeros((1, 24, 40, 3), "float32"))), expected, atol=1e-6,
                               rtol=0)
    np.testing.assert_array_equal(to_numpy(layer.embedding((4, 4))), table)  # the stored grid: as it is
    fixed = keras_vit.PositionEmbedding((4, 4), prefix)
    fixed.build((None, None, 6))
    with pytest.raises(ValueError, match="was given images but has no `patch_stride`"):
        fixed(tokens, np.zeros((1, 24, 40, 3), "float32"))


def test_sincos_grid_is_the_numpy_table():
    for grid in ((3, 5), (14, 14), (1, 1)):
        np.testing.assert_allclose(to_numpy(vit_layers.sincos_2d_position_embedding(grid, 48)), sincos_2d(grid, 48),
                                   atol=2e-6, rtol=0)


def test_logits_match_models_built_at_each_size(checkpoint, any_size_model):
    layer = any_size_model.get_layer("posembed_input")
    assert (layer.grid_size, layer.patch_stride) == ((4, 4), (8, 8))  # the checkpoint's grid: loaded as it is
    np.testing.assert_array_equal(to_numpy(layer.pos_embedding),
                                  npz.read_npz(checkpoint)["Transformer/posembed_input/pos_embedding"])
    for size in SIZES:
        images = _images(size)
        expected = to_numpy(_build(TINY_VIT, (*size, 3), checkpoint)(images))
        assert np.ptp(expected) > 1.0, "degenerate logits"
        np.testing.assert_allclose(to_numpy(any_size_model(images)), expected, atol=1e-5, rtol=0, err_msg=str(size))
        # predict: a tf.function that Keras retraces with unknown height and width after a few sizes.
        np.testing.assert_allclose(any_size_model.predict(images, verbose=0), expected, atol=1e-5, rtol=0)


def test_unknown_size_graph_matches(checkpoint, any_size_model):
    serve = tf.function(any_size_model, input_signature=[tf.TensorSpec((None, None, None, 3))])
    for size in SIZES[:3]:
        images = _images(size, seed=1)
        expected = to_numpy(_build(TINY_VIT, (*size, 3), checkpoint)(images))
        np.testing.assert_allclose(serve(images).numpy(), expected, atol=1e-5, rtol=0)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="Image height 30 is not divisible by the patch size 8. Expected a multiple of 8"):
        serve(np.zeros((1, 30, 32, 3), "float32"))


def test_sizes_off_the_stride_are_refused(any_size_model):
    with pytest.raises(ValueError, match="Image width 36 is not divisible by the patch size 8"):
        any_size_model(np.zeros((1, 32, 36, 3), "float32"))
    with pytest.raises(ValueError, match="Input width 30 is not divisible by the model's patch stride 8"):
        _build(TINY_VIT, (None, 30, 3))  # a static side is still checked when the model is built


def test_stored_grid_is_the_checkpoints_else_the_default_size():
    model = _build(TINY_VIT, ANY_SIZE)
    assert model.get_layer("posembed_input").grid_size == (28, 28)  # 224 / 8
    assert model(_images((16, 24), count=1)).shape == (1, 10)
    source = loader.resolve("imagenet", variant="B/16", image_size=(None, None), include_top=True, classes=1000)
    assert source.checkpoint.image_size == 384  # nothing is downloaded before the model is built
    assert models._grid_size(ANY_SIZE, 16, None, source) == (24, 24)


def test_timm_safetensors_checkpoint(tmp_path):
    path = str(tmp_path / "timm.safetensors")
    save_safetensors(timm_state_dict(seed=9, grid=4), path)
    model = _build(TINY_VIT, ANY_SIZE, path)
    assert model.get_layer("posembed_input").grid_size == (4, 4)
    for size in ((32, 32), (24, 40)):
        images = _images(size)
        np.testing.assert_allclose(to_numpy(model(images)), to_numpy(_build(TINY_VIT, (*size, 3), path)(images)),
                                   atol=1e-5, rtol=0)


def test_hugging_face_file_fits_its_table_bicubically_as_the_loader(tmp_path):
    path = save_safetensors(hf_state_dict(seed=3), tmp_path / "hf.safetensors")
    model = _build(TINY_VIT, ANY_SIZE, path, include_preprocessing=False)
    assert model.get_layer("posembed_input").resampling == "bicubic"
    images = _images((24, 40)) / 127.5 - 1
    fixed = _build(TINY_VIT, (24, 40, 3), path, include_preprocessing=False)
    np.testing.assert_allclose(to_numpy(model(images)), to_numpy(fixed(images)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", [
    dict(state=dict(layer_scale=True, no_embed_class=True, registers=4), build=dict(layer_scale_init=1e-5)),
    dict(state=dict(map_head=True, patch_bias=False), build=dict()),  # SigLIP-style: no class token
    dict(state=dict(distilled=True), build=dict()),
], ids=["dinov2_registers", "map_no_class_token", "deit_distilled"])
def test_family_files_at_any_size(tmp_path, family):
    """The ViT family's prefix tokens (registers without a position, the class token after the table, no class
    token, a distillation token with a position) on the resampled grid, as a model built at the size."""
    path = save_safetensors(timm_family_state_dict(seed=4, **family["state"]), tmp_path / "family.safetensors")
    model = _build(TINY_VIT, ANY_SIZE, path, include_preprocessing=False, **family["build"])
    for size in ((32, 32), (24, 40)):
        images = _images(size) / 127.5 - 1
        expected = to_numpy(_build(TINY_VIT, (*size, 3), path, include_preprocessing=False, **family["build"])(images))
        np.testing.assert_allclose(to_numpy(model(images)), expected, atol=1e-5, rtol=0, err_msg=str(size))


def test_hybrid(tmp_path):
    path = save_checkpoint(tmp_path / "hybrid.npz", vit_checkpoint(TINY_HYBRID, seed=8))
    model = _build(TINY_HYBRID, ANY_SIZE, path)
    assert model.get_layer("posembed_input").patch_stride == (8, 8)  # ResNet /8, patch 1
    for size in ((32, 32), (24, 40)):
        images = _images(size)
        np.testing.assert_allclose(to_numpy(model(images)), to_numpy(_build(TINY_HYBRID, (*size, 3), path)(images)),
                                   atol=1e-5, rtol=0)
    # The stem pads any size; the position embedding refuses one off the stride.
    with pytest.raises(ValueError, match="Image height 36 is not divisible by the patch stride 8"):
        model(np.zeros((1, 36, 32, 3), "float32"))


def test_learned_2d_and_sincos_2d():
    size = (24, 40)
    images = _images(size)
    for kind in ("learned_2d", "sincos_2d"):
        model = _build(TINY_VIT, ANY_SIZE, position_embedding=kind)
        for weight in model.weights:  # non-trivial values everywhere
            weight.assign(np.random.default_rng(len(weight.path)).normal(0, 0.3, weight.shape).astype("float32"))
        fixed = _build(TINY_VIT, (*size, 3), position_embedding=kind)
        for target, source in zip(fixed.weights, model.weights):
            value = to_numpy(source)
            if target.path.endswith(("row_embedding", "column_embedding")):  # the reference resampling, NumPy
                value = zoom_linear(value[:, None].astype("float64"), target.shape[0], 1)[:, 0]
            target.assign(value)
        np.testing.assert_allclose(to_numpy(model(images)), to_numpy(fixed(images)), atol=1e-5, rtol=0, err_msg=kind)


def test_keras_file_round_trip(tmp_path, any_size_model):
    path = str(tmp_path / "any_size.keras")
    any_size_model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.input_shape == (None, None, None, 3)
    for size in ((32, 32), (24, 40)):
        images = _images(size)
        np.testing.assert_array_equal(to_numpy(loaded(images)), to_numpy(any_size_model(images)))


def test_features_and_attention_models(checkpoint, any_size_model):
    size = (24, 40)
    images = _images(size)
    fixed = _build(TINY_VIT, (*size, 3), checkpoint)
    features, expected = keras_vit.features_model(any_size_model)(images), keras_vit.features_model(fixed)(images)
    assert features["block_1"].shape == (2, 3, 5, 48) and features["block_1_prefix"].shape == (2, 1, 48)
    for key, value in expected.items():
        np.testing.assert_allclose(to_numpy(features[key]), to_numpy(value), atol=1e-5, rtol=0, err_msg=key)
    tokens = keras_vit.features_model(any_size_model, output="tokens")(_images((16, 16)))
    assert tokens["block_0"].shape == (2, 4, 48)
    attention = keras_vit.attention_model(any_size_model)(images)["attention"]
    for scores, reference in zip(attention, keras_vit.attention_model(fixed)(images)["attention"]):
        assert scores.shape == (2, 3, 16, 16)
        np.testing.assert_allclose(to_numpy(scores), to_numpy(reference), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="keras_vit.inspection needs a model of a fixed input size"):
        vit_inspect.attention_rollout(any_size_model, images)


def test_fixed_size_models_keep_the_plain_table(any_size_model):
    model = _build(TINY_VIT, (32, 32, 3))
    layer = model.get_layer("posembed_input")
    assert layer.patch_stride is None and len(layer._inbound_nodes[0].input_tensors) == 1
    assert layer.embedding() is layer.pos_embedding  # added as it is

    def op_types(keras_model, shape):
        traced = tf.function(keras_model).get_concrete_function(tf.TensorSpec(shape))
        return graph_op_types(traced.graph.as_graph_def())

    resampling = {"Assert", "Range"}  # the run-time check, the grid's indices
    assert not op_types(model, (None, 32, 32, 3)) & resampling
    assert op_types(any_size_model, (None, None, None, 3)) >= resampling


@pytest.mark.parametrize("serving_kernels", ["onednn", "eigen"])
def test_saved_model_serves_images_at_their_own_size(tmp_path, checkpoint, any_size_model, serving_kernels,
                                                     monkeypatch):
    """Also the eigen export, its images run in groups of 2 (a budget shrunk to that), its attention head by head."""
    from keras_vit.export import model_io, saved_model, serving

    group = 2 if serving_kernels == "eigen" else None
    monkeypatch.setattr(serving, "EIGEN_GROUP_BYTES", 2 * 4 * model_io.widest_activation_per_image(any_size_model))
    path = saved_model.export_saved_model(any_size_model, tmp_path / "export", max_pixels=64 * 64,
                                          serving_kernels=serving_kernels)
    metadata = saved_model.read_metadata(path)
    assert (metadata["image_size"], metadata["any_size_stride"], metadata["image_group"]) == ([32, 32], 8, group)
    loaded = tf.saved_model.load(str(path))
    serve = loaded.signatures["serving_default"]
    for size in ((32, 32), (24, 40), (64, 56)):
        images = _images(size, count=5, seed=2)  # groups of 2, 2 and 1 in the eigen export
        expected = to_numpy(_build(TINY_VIT, (*size, 3), checkpoint)(images))
        np.testing.assert_allclose(serve(images=tf.constant(images))["logits"].numpy(), expected, atol=1e-5, rtol=0)
    refused = "Image of 30x32 pixels is not a whole number of patches: height and width must be multiples of the " \
              "patch stride 8"
    with pytest.raises(tf.errors.InvalidArgumentError, match=refused):
        serve(images=tf.zeros((1, 30, 32, 3)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="over the limit of max_pixels=4096"):
        serve(images=tf.zeros((1, 72, 64, 3)))
    # serving_bytes resizes to the checkpoint's size, 32 x 32.
    image = _images((32, 32), count=1)[0].round().astype("uint8")
    logits = loaded.signatures[serving.BYTES_SIGNATURE](image_bytes=tf.io.encode_png(image)[None])["logits"]
    np.testing.assert_allclose(logits.numpy(), to_numpy(any_size_model(image[None].astype("float32"))), atol=1e-5,
                               rtol=0)


def test_cli_any_size_needs_a_variant(capsys):
    from keras_vit.cli import export

    with pytest.raises(SystemExit):
        export.main(["--model", "vit.keras", "--any-size", "--out", "unused"])
    assert "--any-size builds a --variant" in capsys.readouterr().err


@pytest.mark.slow
def test_tflite_converts_at_the_checkpoint_size(tmp_path, any_size_model):
    from keras_vit.export import tflite

    report = tflite.export_tflite(any_size_model, tmp_path, images=_images((32, 32), count=4), modes=("float32",),
                                  calibration_count=0)
    (result,) = report["modes"]
    assert report["input_size"] == [32, 32] and result["non_builtin_ops"] == []
    assert result["max_abs_diff"] <= 1e-4 and result["passed"]


@pytest.mark.slow
def test_jax_backend_gives_the_same_logits(tmp_path, checkpoint, any_size_model):
    pytest.importorskip("jax")
    images = {f"{h}x{w}": _images((h, w), seed=3) for h, w in SIZES}
    np.savez(tmp_path / "images.npz", **images)
    script = textwrap.dedent(f"""
        import json
        import numpy as np
        import keras_vit
        model = keras_vit.VisionTransformer(**{json.dumps(TINY_VIT)}, weights={checkpoint!r},
                                            input_shape=(None, None, 3), classes=10, classifier_activation=None)
        images = np.load({str(tmp_path / "images.npz")!r})
        np.savez({str(tmp_path / "jax.npz")!r}, **{{key: model.predict(images[key], verbose=0) for key in images}})
    """)
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "2", "XLA_FLAGS": xla_flags()}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    logits = np.load(tmp_path / "jax.npz")
    for key, value in images.items():
        np.testing.assert_allclose(logits[key], to_numpy(any_size_model(value)), atol=1e-5, rtol=0, err_msg=key)
