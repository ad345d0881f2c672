"""The fused TransformerBlock / MlpBlock call computes what the Keras-layer path computes."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras_vit import fused
from keras_vit import layers as vit_layers


@pytest.fixture
def block_and_tokens():
    block = vit_layers.TransformerBlock(num_heads=4, mlp_dim=64, name="encoderblock_0")
    tokens = np.random.default_rng(0).normal(size=(3, 9, 32)).astype("float32")
    block(tokens)
    for weight in block.weights:  # non-zero biases so every term is checked
        weight.assign(np.random.default_rng(len(weight.path)).normal(0, 0.2, weight.shape).astype("float32"))
    return block, tokens


def _run(block, tokens, fused):
    previous = vit_layers.FUSED_CALL
    vit_layers.FUSED_CALL = fused
    try:
        x = tf.constant(tokens)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = block(x, training=True)
            loss = tf.reduce_sum(y * tf.cos(y))
        grads = tape.gradient(loss, [x] + [w.value for w in block.trainable_weights])
        return y.numpy(), [g.numpy() for g in grads]
    finally:
        vit_layers.FUSED_CALL = previous


def test_fused_call_matches_layer_path_forward_and_gradients(block_and_tokens):
    block, tokens = block_and_tokens
    y_fused, g_fused = _run(block, tokens, True)
    y_ref, g_ref = _run(block, tokens, False)
    np.testing.assert_allclose(y_fused, y_ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(g_fused, g_ref):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_fused_call_keeps_weight_paths(block_and_tokens):
    block, _ = block_and_tokens
    paths = sorted(w.path for w in block.weights)
    assert "encoderblock_0/MultiHeadDotProductAttention_1/query/kernel" in paths
    assert "encoderblock_0/MlpBlock_3/Dense_0/kernel" in paths
    shapes = {w.path: tuple(w.shape) for w in block.weights}
    assert shapes["encoderblock_0/MultiHeadDotProductAttention_1/query/kernel"] == (32, 4, 8)
    assert shapes["encoderblock_0/MultiHeadDotProductAttention_1/attention_output/kernel"] == (4, 8, 32)



def _step(step_name, block):
    """A tf.function called `step_name` returning the block's output and gradients."""
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = block(x, training=True)
            loss = tf.reduce_sum(y * tf.cos(y))
        return y, tape.gradient(loss, [x] + [w.value for w in block.trainable_weights])
    step.__name__ = step_name
    return tf.function(step)


def _op_types(function, x) -> set[str]:
    """Op types in a traced function's graph and in the functions it calls."""
    graph = function.get_concrete_function(x).graph
    types = {op.type for op in graph.get_operations()}
    for library_function in graph.as_graph_def().library.function:
        types |= {node.op for node in library_function.node_def}
    return types


@pytest.mark.skipif(not fused._onednn_available(), reason="TensorFlow build without oneDNN's layer-norm op")
def test_cpu_kernels_in_a_keras_step_match_the_portable_path(block_and_tokens):
    block, tokens = block_and_tokens
    x = tf.constant(tokens)
    keras_step, user_function = _step("one_step_on_data", block), _step("user_function", block)
    assert fused.ONEDNN_LAYER_NORM in _op_types(keras_step, x)
    assert not any(t.startswith("_Mkl") for t in _op_types(user_function, x))
    (y_fast, g_fast), (y_ref, g_ref) = keras_step(x), user_function(x)
    np.testing.assert_allclose(y_fast.numpy(), y_ref.numpy(), rtol=1e-5, atol=1e-5)
    for got, want in zip(g_fast, g_ref):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


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
