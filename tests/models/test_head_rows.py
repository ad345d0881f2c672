"""The last encoder block computing only the token rows a head reads (`TransformerBlock(output_tokens=n)`,
`keras_vit.head_rows_model`): the same numbers as the whole block, fewer matmul rows, and `ViTModel.predict` and
the exports computing that way. Backend-agnostic but for the graph checks: tests/models/test_backends.py runs this file
on JAX and PyTorch too."""

import collections
import gc
import io
import weakref
import zipfile

import h5py
import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import kernels
from tests.reference import encoder_block, released_names
from tests.testing import TINY_VIT, randomize, to_numpy

IMAGES = np.random.default_rng(0).uniform(0, 255, (5, 32, 32, 3)).astype("float32")
ON_TENSORFLOW = pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="inspects a TensorFlow graph")


def build(seed: int = 1, **options) -> keras.Model:
    options = {"classes": 7, **options} if options.get("include_top", True) else options
    model = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), weights=None, **options)
    randomize(model, seed=seed)
    return model


@pytest.mark.parametrize("fused", ["on", "off"])
def test_block_output_tokens_are_the_first_rows_of_the_whole_block(fused, monkeypatch):
    """`output_tokens=n`: the first n rows of the block's output and of its attention weights (their queries
    attend to every token), against the NumPy reference, with layer scale and q/k norms."""
    monkeypatch.setenv(kernels.FUSED_ATTENTION_SWITCH, fused)
    layer = keras_vit.TransformerBlock(num_heads=3, mlp_dim=40, layer_scale_init=0.5, qk_norm=True,
                                       name="encoderblock_0")
    x = np.random.default_rng(6).normal(size=(2, 7, 24)).astype("float32")
    layer(x)
    randomize(layer, seed=7)
    expected, expected_scores = encoder_block(released_names(layer), "Transformer/encoderblock_0",
                                              x.astype("float64"))
    for rows in (1, 2):
        out = layer(x, output_tokens=rows)
        assert tuple(out.shape) == (2, rows, 24)
        np.testing.assert_allclose(to_numpy(out), expected[:, :rows], atol=1e-5)
        out, scores = layer(x, return_attention_scores=True, output_tokens=rows)
        np.testing.assert_allclose(to_numpy(out), expected[:, :rows], atol=1e-5)
        np.testing.assert_allclose(to_numpy(scores), expected_scores[:, :, :rows], atol=1e-6)
    symbolic_out, symbolic_scores = layer(keras.Input((7, 24)), return_attention_scores=True, output_tokens=2)
    assert tuple(symbolic_out.shape) == (None, 2, 24) and tuple(symbolic_scores.shape) == (None, 3, 2, 7)


HEADS = {"class token": dict(), "DeiT distilled": dict(distillation_token=True),
         "registers": dict(num_register_tokens=2), "pooled class token": dict(include_top=False, pooling="token")}


def last_block_calls(model: keras.Model) -> list:
    """The `output_tokens` of each call of the model's last block, from its functional config."""
    last = keras_vit.layers.transformer_blocks(model)[-1].name
    (layer,) = [layer for layer in model.get_config()["layers"] if layer["name"] == last]
    return [node["kwargs"].get("output_tokens") for node in layer["inbound_nodes"]]


@pytest.mark.parametrize("options", HEADS.values(), ids=HEADS)
def test_head_rows_model_computes_the_rows_the_head_reads_with_the_same_outputs(options):
    model = build(**options)
    twin = keras_vit.head_rows_model(model)
    assert twin is not model
    assert last_block_calls(model) == [None]
    assert last_block_calls(twin) == [2 if options.get("distillation_token") else 1]
    expected = to_numpy(model(IMAGES, training=False))
    assert np.ptp(expected) > 0.1
    np.testing.assert_allclose(to_numpy(twin(IMAGES, training=False)), expected, atol=1e-6)
    np.testing.assert_allclose(model.predict(IMAGES, batch_size=2, verbose=0), expected, atol=1e-6)


def test_head_rows_model_is_the_model_itself_where_an_output_reads_other_rows():
    for options in (dict(classifier="gap"), dict(classifier="map"), dict(fc_norm=True),
                    dict(include_top=False), dict(include_top=False, pooling="avg")):
        model = build(**options)
        assert keras_vit.head_rows_model(model) is model, options
    model = build()
    tokens = model.get_layer("encoder_norm").output
    for outputs in ([model.output, tokens],  # the tokens are an output
                    [model.output, keras.layers.GlobalAveragePooling1D()(tokens)]):  # a layer reads every row
        other = keras_vit.ViTModel(model.input, outputs)
        assert keras_vit.head_rows_model(other) is other


def test_predict_runs_the_head_rows_twin(monkeypatch):
    """`ViTModel.predict` calls the last block with `output_tokens` (a spy on `TransformerBlock.call`), with the
    outputs of the model's own call; a model whose outputs read every row predicts as before."""
    calls = []
    block_call = keras_vit.TransformerBlock.call

    def spy(self, x, *args, **kwargs):
        calls.append((self.name, kwargs.get("output_tokens")))
        return block_call(self, x, *args, **kwargs)

    monkeypatch.setattr(keras_vit.TransformerBlock, "call", spy)
    for options, last_call in ((dict(), ("encoderblock_1", 1)), (dict(classifier="gap"), ("encoderblock_1", None))):
        model = build(**options)
        expected = to_numpy(model(IMAGES, training=False))
        calls.clear()
        np.testing.assert_allclose(model.predict(IMAGES, batch_size=2, verbose=0), expected, atol=1e-6)
        assert last_call in calls and ("encoderblock_0", None) in calls, calls
        assert all(tokens == last_call[1] for name, tokens in calls if name == "encoderblock_1"), calls


def test_a_predicted_model_is_freed_with_its_twin_once_unreferenced():
    """The twin `predict` makes is kept by the model, not by keras_vit: a model dropped after `predict` is collected
    (with its traced functions), whether its twin is another model or itself (it reads every row), and a `.keras`
    file holds the same weights as before `predict`."""
    for options in (dict(), dict(classifier="gap")):
        model = build(**options)
        model.predict(IMAGES, batch_size=2, verbose=0)
        assert (keras_vit.head_rows_model(model) is model) == (options != {}), options
        freed = weakref.ref(model)
        del model
        gc.collect()
        assert freed() is None, options


def test_predict_leaves_the_keras_file_as_it_was(tmp_path):
    """The twin is no part of the model's saved state: the same config and the same weight entries after `predict`."""
    model = build()
    model.save(tmp_path / "before.keras")
    model.predict(IMAGES, batch_size=2, verbose=0)
    model.save(tmp_path / "after.keras")
    entries = []
    for name in ("before", "after"):
        with zipfile.ZipFile(tmp_path / f"{name}.keras") as archive:
            with h5py.File(io.BytesIO(archive.read("model.weights.h5"))) as weights:
                names: list[str] = []
                weights.visit(names.append)
            entries.append((archive.read("config.json"), names))
    assert entries[0] == entries[1]


def matmul_rows(model: keras.Model, images: int = 3) -> collections.Counter:
    """How many (Batch)MatMuls of each row count a traced inference call of `model` runs."""
    import tensorflow as tf

    function = tf.function(lambda x: model(x, training=False))
    graph = function.get_concrete_function(tf.TensorSpec((images, 32, 32, 3), tf.float32)).graph
    return collections.Counter(int(op.inputs[0].shape[0]) for op in graph.get_operations() if op.type == "MatMul")


@ON_TENSORFLOW
def test_head_rows_model_and_the_served_logits_run_fewer_matmul_rows():
    """3 images of 17 tokens: the whole model runs each block's six projections on 51 rows; the twin runs only the
    last block's keys and values there, its query, output and MLP projections on the 3 class tokens (the patch
    embedding: 48 rows, the head: 3). The exports' logits model (`export.model_io.pixel_logits_model`) is the twin."""
    from keras_vit.export import model_io

    model = build()
    assert matmul_rows(model) == collections.Counter({51: 12, 48: 1, 3: 1})
    assert matmul_rows(keras_vit.head_rows_model(model)) == collections.Counter({51: 8, 48: 1, 3: 5})
    assert matmul_rows(model_io.pixel_logits_model(model)) == collections.Counter({51: 8, 48: 1, 3: 5})
