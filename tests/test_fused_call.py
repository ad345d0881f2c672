"""The fused TransformerBlock / MlpBlock call computes what the Keras-layer path computes."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras_vit import fused
from keras_vit import layers as vit_layers
from tests.testing import graph_op_types, randomize


@pytest.fixture
def block_and_tokens():
    block = vit_layers.TransformerBlock(num_heads=4, mlp_dim=64, name="encoderblock_0")
    tokens = np.random.default_rng(0).normal(size=(3, 9, 32)).astype("float32")
    block(tokens)
    randomize(block)  # non-zero biases so every term is checked
    return block, tokens


def _output_and_gradients(block, x):
    """The block's training output and the gradients of a non-linear loss of it."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = block(x, training=True)
        loss = tf.reduce_sum(y * tf.cos(y))
    return y, tape.gradient(loss, [x] + [w.value for w in block.trainable_weights])


def _assert_same(result, reference):
    """Outputs equal to 1e-5, gradients to 1e-4."""
    (y, grads), (y_ref, grads_ref) = result, reference
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, grads_ref):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def _run(block, tokens, fused):
    previous = vit_layers.FUSED_CALL
    vit_layers.FUSED_CALL = fused
    try:
        return _output_and_gradients(block, tf.constant(tokens))
    finally:
        vit_layers.FUSED_CALL = previous


def test_fused_call_matches_layer_path_forward_and_gradients(block_and_tokens):
    block, tokens = block_and_tokens
    _assert_same(_run(block, tokens, True), _run(block, tokens, False))


def test_fused_call_keeps_weight_paths(block_and_tokens):
    block, _ = block_and_tokens
    paths = sorted(w.path for w in block.weights)
    assert "encoderblock_0/MultiHeadDotProductAttention_1/query/kernel" in paths
    assert "encoderblock_0/MlpBlock_3/Dense_0/kernel" in paths
    shapes = {w.path: tuple(w.shape) for w in block.weights}
    assert shapes["encoderblock_0/MultiHeadDotProductAttention_1/query/kernel"] == (32, 4, 8)
    assert shapes["encoderblock_0/MultiHeadDotProductAttention_1/attention_output/kernel"] == (4, 8, 32)


def _step(step_name, function):
    """`function` as a tf.function called `step_name` (the name `fused.use_cpu_kernels` checks)."""
    def step(x):
        return function(x)
    step.__name__ = step_name
    return tf.function(step)


def _op_types(function, x) -> set[str]:
    """Op types in a traced function's graph and in the functions it calls."""
    return graph_op_types(function.get_concrete_function(x).graph.as_graph_def())


@pytest.mark.skipif(not fused._onednn_available(), reason="TensorFlow build without oneDNN's layer-norm op")
def test_cpu_kernels_in_a_keras_step_match_the_portable_path(block_and_tokens):
    block, tokens = block_and_tokens
    x = tf.constant(tokens)
    def training_step(x):
        return _output_and_gradients(block, x)
    keras_step, user_function = _step("one_step_on_data", training_step), _step("user_function", training_step)
    assert fused.ONEDNN_LAYER_NORM in _op_types(keras_step, x)
    assert not any(t.startswith("_Mkl") for t in _op_types(user_function, x))
    _assert_same(keras_step(x), user_function(x))


@pytest.mark.skipif(not fused._onednn_available(), reason="TensorFlow build without oneDNN's layer-norm op")
def test_keras_fit_and_predict_trace_the_cpu_kernels(monkeypatch):
    """Fails if a Keras release renames its step functions (the fast path would silently go)."""
    seen = []
    original = fused.use_cpu_kernels
    monkeypatch.setattr(fused, "use_cpu_kernels", lambda: seen.append(original()) or seen[-1])
    model = keras.Sequential([keras.Input((5, 8)), vit_layers.TransformerBlock(num_heads=2, mlp_dim=16),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x, y = np.ones((4, 5, 8), "float32"), np.ones((4, 1), "float32")
    model.fit(x, y, epochs=1, verbose=0)
    model.predict(x, verbose=0)
    model.evaluate(x, y, verbose=0)
    assert seen and all(seen), seen
    seen.clear()
    model.compile("sgd", "mse", jit_compile=True)  # XLA compiles the whole step: portable ops
    model.fit(x, y, epochs=1, verbose=0)
    assert seen and not any(seen), seen


@pytest.mark.skipif(not fused._onednn_available(), reason="TensorFlow build without oneDNN's layer-norm op")
def test_bfloat16_projections_run_as_convolutions_in_a_keras_step(block_and_tokens):
    """In bfloat16 the projections take oneDNN's 1x1-convolution kernel, only inside Keras steps."""
    block = vit_layers.TransformerBlock(num_heads=4, mlp_dim=64, dtype="mixed_bfloat16")
    block.build((None, 9, 32))
    block.set_weights(block_and_tokens[0].get_weights())
    x = tf.constant(block_and_tokens[1])

    def inference(x):
        return block(x, training=False)
    keras_step, user_function = _step("one_step_on_data", inference), _step("user_function", inference)
    assert "Conv2D" in _op_types(keras_step, x)
    assert "Conv2D" not in _op_types(user_function, x)
    fast, portable = np.asarray(keras_step(x), "float32"), np.asarray(user_function(x), "float32")
    # Both round to bfloat16 (8 significant bits); only the summation order differs.
    np.testing.assert_allclose(fast, portable, rtol=2 ** -7, atol=2 ** -7)
    assert np.abs(fast - portable).mean() < 2 ** -8
