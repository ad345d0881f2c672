"""The fused TransformerBlock / MlpBlock call computes what the Keras-layer path computes."""

import numpy as np
import pytest
import tensorflow as tf

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
