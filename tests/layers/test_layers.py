"""Per-layer tests: build, eager and symbolic calls, config round trips, a training step,
and numerics against the NumPy reference of tests/reference.py."""

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import kernels
from keras_vit import layers as vit_layers
from tests.reference import encoder_block, gelu_tanh, quick_gelu, released_names, rope_tables, silu
from tests.testing import randomize, run_layer_test, run_serialization_test, to_numpy

# --- Patches and patch embedding ---


def test_patches_layer():
    layer = keras_vit.Patches(4)
    out = run_layer_test(layer, (2, 8, 12, 3), (2, 6, 48), train=False)
    x = np.random.default_rng(0).normal(size=(2, 8, 12, 3)).astype("float32")
    # Patch (row 1, column 2) is rows 4:8, columns 8:12, flattened (row, column, channel).
    np.testing.assert_array_equal(to_numpy(layer(x))[:, 1 * 3 + 2], x[:, 4:8, 8:12].reshape(2, -1))
    assert out.shape == (2, 6, 48)


def test_patches_rectangular_patch():
    layer = keras_vit.Patches((2, 4))
    x = np.arange(2 * 4 * 8 * 1, dtype="float32").reshape(2, 4, 8, 1)
    out = to_numpy(layer(x))
    assert out.shape == (2, 4, 8)
    np.testing.assert_array_equal(out[0, 3], x[0, 2:4, 4:8].reshape(-1))


def test_patch_encoder_equals_strided_convolution():
    layer = keras_vit.PatchEncoder(hidden_dim=16, patch_size=4)
    out = run_layer_test(layer, (2, 8, 12, 3), (2, 6, 16))
    conv = keras.layers.Conv2D(16, 4, strides=4, padding="valid")
    x = np.random.default_rng(0).normal(size=(2, 8, 12, 3)).astype("float32")
    conv.build(x.shape)
    conv.set_weights(layer.get_weights())  # Same (4, 4, 3, 16) kernel layout as the checkpoints.
    np.testing.assert_allclose(to_numpy(layer(x)), to_numpy(conv(x)).reshape(2, 6, 16), atol=1e-5)
    # And it is the linear map of the flattened patches.
    patches = to_numpy(keras_vit.Patches(4)(x))
    kernel, bias = layer.get_weights()
    np.testing.assert_allclose(to_numpy(layer(x)), patches @ kernel.reshape(-1, 16) + bias, atol=1e-5)
    assert out.shape == (2, 6, 16)


@pytest.mark.parametrize("layer_cls", [keras_vit.Patches, lambda p: keras_vit.PatchEncoder(8, p)])
def test_patch_size_must_divide_input(layer_cls):
    with pytest.raises(ValueError, match=r"Image width 10 is not divisible by the patch size 4"):
        layer_cls(4)(np.zeros((1, 8, 10, 3), "float32"))


def test_patch_size_must_be_positive():
    with pytest.raises(ValueError, match=r"patch_size=0"):
        keras_vit.Patches(0)


# --- Tokens and position embeddings ---


def test_class_token():
    layer = keras_vit.ClassToken()
    out = run_layer_test(layer, (2, 5, 8), (2, 6, 8))
    np.testing.assert_array_equal(out[:, 0], 0.0)  # Zeros at init, as the original.
    layer.cls.assign(np.arange(8, dtype="float32").reshape(1, 1, 8))
    x = np.ones((3, 5, 8), "float32")
    out = to_numpy(layer(x))
    np.testing.assert_array_equal(out[:, 0], np.broadcast_to(np.arange(8), (3, 8)))
    np.testing.assert_array_equal(out[:, 1:], x)


@pytest.mark.parametrize("kind", ["learned", "learned_2d", "sincos_2d", "none"])
def test_position_embedding_kinds(kind):
    layer = keras_vit.PositionEmbedding(grid_size=(2, 3), num_prefix_tokens=1, kind=kind)
    run_layer_test(layer, (2, 7, 8), (2, 7, 8), train=kind in ("learned", "learned_2d"))
    x = np.random.default_rng(1).normal(size=(2, 7, 8)).astype("float32")
    table = layer.embedding()
    expected = x if table is None else x + to_numpy(table)
    np.testing.assert_allclose(to_numpy(layer(x)), expected, atol=1e-6)


def test_learned_position_embedding_has_class_token_row():
    layer = keras_vit.PositionEmbedding(grid_size=(14, 14), name="posembed_input")
    layer.build((None, 197, 768))
    assert [(w.path, tuple(w.shape)) for w in layer.weights] == [
        ("posembed_input/pos_embedding", (1, 197, 768))]


def test_learned_2d_position_embedding_is_row_and_column_concatenation():
    layer = keras_vit.PositionEmbedding(grid_size=(2, 3), num_prefix_tokens=1, kind="learned_2d")
    layer.build((None, 7, 8))
    table = to_numpy(layer.embedding())[0]
    rows, columns = to_numpy(layer.row_embedding), to_numpy(layer.column_embedding)
    np.testing.assert_array_equal(table[0], to_numpy(layer.prefix_embedding)[0])
    np.testing.assert_array_equal(table[1 + 1 * 3 + 2], np.concatenate([rows[1], columns[2]]))


def test_sincos_2d_position_embedding_formula():
    table = vit_layers.sincos_2d_position_embedding((3, 4), 16)
    omega = 1.0 / 10_000 ** (np.arange(4) / 3)
    row, column = 2, 1  # Token 2 * 4 + 1.
    expected = np.concatenate([np.sin(column * omega), np.cos(column * omega),
                               np.sin(row * omega), np.cos(row * omega)])
    np.testing.assert_allclose(table[2 * 4 + 1], expected, rtol=1e-6)
    layer = keras_vit.PositionEmbedding(grid_size=(3, 4), num_prefix_tokens=1, kind="sincos_2d")
    x = np.zeros((1, 13, 16), "float32")
    out = to_numpy(layer(x))[0]
    np.testing.assert_array_equal(out[0], 0.0)  # No embedding on the class token.
    np.testing.assert_allclose(out[1:], table, rtol=1e-6)
    assert not layer.weights


def test_position_embedding_errors():
    with pytest.raises(ValueError, match=r"Unknown position embedding 'fourier'"):
        keras_vit.PositionEmbedding((2, 2), kind="fourier")
    # Built for another token count: the message call() gives, from build.
    with pytest.raises(ValueError, match=r"^position_embedding\w* expects 5 tokens \(1 prefix \+ 2x2 grid\), "
                                         r"from images of the size the model was built for. Received: 6 tokens. "
                                         r"Resize the images"):
        keras_vit.PositionEmbedding((2, 2)).build((None, 6, 8))
    with pytest.raises(ValueError, match=r"divisible by 4. Received: 6"):
        keras_vit.PositionEmbedding((2, 2), kind="sincos_2d").build((None, 5, 6))


# --- Encoder block ---


def test_transformer_block_layer():
    layer = keras_vit.TransformerBlock(num_heads=2, mlp_dim=16, dropout_rate=0.1,
                                       attention_dropout_rate=0.1, drop_path_rate=0.1)
    run_layer_test(layer, (2, 5, 8), (2, 5, 8))


def test_transformer_block_matches_numpy_reference():
    layer = keras_vit.TransformerBlock(num_heads=3, mlp_dim=40, name="encoderblock_0")
    x = np.random.default_rng(2).normal(size=(2, 7, 24)).astype("float32")
    layer(x)
    randomize(layer, seed=3)
    expected, expected_scores = encoder_block(released_names(layer), "Transformer/encoderblock_0",
                                              x.astype("float64"))
    np.testing.assert_allclose(to_numpy(layer(x)), expected, atol=1e-5)
    out, scores = layer(x, return_attention_scores=True)
    np.testing.assert_allclose(to_numpy(out), expected, atol=1e-5)
    np.testing.assert_allclose(to_numpy(scores), expected_scores, atol=1e-6)


@pytest.mark.parametrize("fused", ["on", "off"])
def test_transformer_block_matches_numpy_reference_fused_or_not(fused, monkeypatch):
    """The fused attention (`keras.ops.dot_product_attention`) and the explicit matmuls give the reference."""
    monkeypatch.setenv(kernels.FUSED_ATTENTION_SWITCH, fused)
    layer = keras_vit.TransformerBlock(num_heads=3, mlp_dim=40, name="encoderblock_0")
    x = np.random.default_rng(4).normal(size=(2, 9, 24)).astype("float32")
    layer(x)
    randomize(layer, seed=5)
    expected, _ = encoder_block(released_names(layer), "Transformer/encoderblock_0", x.astype("float64"))
    np.testing.assert_allclose(to_numpy(layer(x)), expected, atol=1e-5)
    np.testing.assert_allclose(to_numpy(layer(x, training=True)), expected, atol=1e-5)  # no dropout: fused too


def test_attention_scores_and_attention_dropout_take_the_explicit_path(monkeypatch):
    monkeypatch.setenv(kernels.FUSED_ATTENTION_SWITCH, "on")

    def fused_attention(*args):
        raise AssertionError("fused_attention called")

    monkeypatch.setattr(kernels, "fused_attention", fused_attention)
    layer = keras_vit.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.5)
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    with pytest.raises(AssertionError, match="fused_attention called"):
        layer(x)  # inference without scores: fused
    _, scores = layer(x, return_attention_scores=True)
    np.testing.assert_allclose(to_numpy(scores).sum(-1), 1.0, atol=1e-5)
    assert to_numpy(layer(x, training=True)).shape == (2, 5, 8)  # attention dropout: explicit


def test_fused_attention_where_it_measured_faster_chosen_once_when_built(monkeypatch):
    monkeypatch.delenv(kernels.FUSED_ATTENTION_SWITCH, raising=False)
    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        expected = (jax.default_backend() != "cpu",) * 2
    elif backend == "torch":
        import torch
        expected = (True, torch.cuda.is_available())
    else:
        expected = (False, False)  # TensorFlow: the same composite ops, the explicit path
    layer = keras_vit.MultiHeadDotProductAttention(num_heads=2)
    layer.build((None, 5, 8))
    assert (layer.attention_kernel.fused(False), layer.attention_kernel.fused(True)) == expected
    monkeypatch.setenv(kernels.FUSED_ATTENTION_SWITCH, "off" if expected[0] else "on")
    assert layer.attention_kernel.fused(False) == expected[0]  # built: the switch read later changes nothing
    rebuilt = keras_vit.MultiHeadDotProductAttention(num_heads=2)
    rebuilt.build((None, 5, 8))
    assert rebuilt.attention_kernel.fused(False) != expected[0]  # a layer built under the switch follows it


def test_rematerialized_block_gives_the_same_training_step(monkeypatch):
    """`remat=True` (the backend's gradient checkpointing) recomputes activations: same loss, same update."""
    checkpointed = []
    original = kernels._checkpointed
    monkeypatch.setattr(kernels, "_checkpointed", lambda function: checkpointed.append(1) or original(function))
    x = np.random.default_rng(0).normal(size=(4, 5, 8)).astype("float32")
    y = np.random.default_rng(1).normal(size=(4, 5, 8)).astype("float32")
    models = []
    for remat in (False, True):
        block = keras_vit.TransformerBlock(num_heads=2, mlp_dim=16, dropout_rate=0.0, remat=remat)
        model = keras.Sequential([keras.Input((5, 8)), block])
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        models.append(model)
    randomize(models[0], seed=2)
    initial = models[0].get_weights()
    models[1].set_weights(initial)
    assert models[1].layers[0].get_config()["remat"] is True
    losses = [float(model.train_on_batch(x, y)) for model in models]
    assert checkpointed, "the remat=True block was not checkpointed"
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for plain, rematerialized in zip(models[0].get_weights(), models[1].get_weights()):
        np.testing.assert_allclose(rematerialized, plain, atol=1e-6)
    assert max(np.abs(w - w0).max() for w, w0 in zip(models[0].get_weights(), initial)) > 1e-3  # a real step
    with pytest.raises(ValueError, match=r"remat=True needs a block without random masks.*drop_path_rate=0.1"):
        keras_vit.TransformerBlock(num_heads=2, mlp_dim=16, drop_path_rate=0.1, remat=True)


@pytest.mark.parametrize("fused", ["on", "off"])
def test_block_options_match_the_numpy_reference(fused, monkeypatch):
    """Layer scale (DeiT-III, DINOv2), per-head q/k LayerNorm (timm's qk_norm) and quick GELU (OpenAI CLIP)."""
    monkeypatch.setenv(kernels.FUSED_ATTENTION_SWITCH, fused)
    layer = keras_vit.TransformerBlock(num_heads=3, mlp_dim=40, layer_scale_init=0.1, qk_norm=True,
                                       activation="quick_gelu", layer_norm_epsilon=1e-5, name="encoderblock_0")
    x = np.random.default_rng(6).normal(size=(2, 7, 24)).astype("float32")
    layer(x)
    randomize(layer, seed=7, scale=0.5)
    arrays = released_names(layer)
    assert {"Transformer/encoderblock_0/ls1/scale", "Transformer/encoderblock_0/MultiHeadDotProductAttention_1/"
            "query_norm/scale"} <= set(arrays)
    assert np.abs(arrays["Transformer/encoderblock_0/ls1/scale"] - 0.1).max() > 0.05  # randomized, not the init
    expected, expected_scores = encoder_block(arrays, "Transformer/encoderblock_0", x.astype("float64"), eps=1e-5,
                                              gelu=quick_gelu)
    np.testing.assert_allclose(to_numpy(layer(x)), expected, atol=1e-5)
    _, scores = layer(x, return_attention_scores=True)
    np.testing.assert_allclose(to_numpy(scores), expected_scores, atol=1e-6)
    plain, _ = encoder_block(arrays, "Transformer/encoderblock_0", x.astype("float64"), eps=1e-5)
    assert np.abs(plain - expected).max() > 1e-3  # quick GELU is not the tanh GELU here


def test_layer_scale_starts_at_its_init_value_and_bad_activation_is_named():
    block = keras_vit.TransformerBlock(num_heads=2, mlp_dim=8, layer_scale_init=1e-5)
    block.build((None, 3, 8))
    np.testing.assert_array_equal(to_numpy(block.scale_attention.gamma), np.full(8, 1e-5, "float32"))
    with pytest.raises(ValueError, match=r"Unknown activation 'relu'. Expected one of \('gelu', 'quick_gelu', 'silu'"):
        keras_vit.MlpBlock(8, activation="relu")


def test_register_tokens_are_inserted_after_the_class_token():
    tokens = np.random.default_rng(0).normal(size=(2, 5, 4)).astype("float32")
    layer = keras_vit.RegisterTokens(3, position=1)
    layer.build(tokens.shape)
    layer.registers.assign(np.arange(12, dtype="float32").reshape(1, 3, 4))
    out = to_numpy(layer(tokens))
    assert out.shape == (2, 8, 4)
    np.testing.assert_array_equal(out[:, 0], tokens[:, 0])
    np.testing.assert_array_equal(out[:, 1:4], np.broadcast_to(np.arange(12).reshape(1, 3, 4), (2, 3, 4)))
    np.testing.assert_array_equal(out[:, 4:], tokens[:, 1:])


def test_transformer_block_uses_tanh_gelu_and_epsilon_1e6():
    layer = keras_vit.TransformerBlock(num_heads=1, mlp_dim=4)
    layer.build((None, 3, 4))
    assert layer.norm_attention.epsilon == layer.norm_mlp.epsilon == 1e-6
    mlp = keras_vit.MlpBlock(mlp_dim=6)
    x = np.random.default_rng(0).normal(size=(2, 4)).astype("float32") * 3
    mlp(x)
    w0, b0, w1, b1 = [to_numpy(w, "float64") for w in mlp.weights]
    np.testing.assert_allclose(to_numpy(mlp(x)), gelu_tanh(x @ w0 + b0) @ w1 + b1, atol=1e-5)


def test_transformer_block_dropout_only_in_training():
    layer = keras_vit.TransformerBlock(num_heads=2, mlp_dim=16, dropout_rate=0.5, drop_path_rate=0.5)
    x = np.random.default_rng(0).normal(size=(4, 5, 8)).astype("float32")
    np.testing.assert_array_equal(to_numpy(layer(x)), to_numpy(layer(x, training=False)))
    assert not np.allclose(to_numpy(layer(x, training=True)), to_numpy(layer(x)))


def test_attention_projections_start_from_different_kernels():
    """An unseeded Keras initializer instance repeats its values: each projection gets its own copy."""
    keras.utils.set_random_seed(0)
    attention = keras_vit.MultiHeadDotProductAttention(num_heads=2)
    attention.build((None, 5, 8))
    kernels = [to_numpy(layer.kernel).reshape(8, 8) for layer in (attention.query_dense, attention.key_dense,
                                                                    attention.value_dense, attention.output_dense)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not np.allclose(kernels[i], kernels[j])
    limit = np.sqrt(6 / 16)  # Glorot-uniform of the (D, D) view, as the original's xavier_uniform
    assert all(np.abs(kernel).max() <= limit for kernel in kernels)


def test_every_layer_of_a_built_model_is_built():
    """Keras runs a model eagerly before compiling its steps while any layer reports built=False."""
    for kwargs in (dict(drop_path_rate=0.1, dropout_rate=0.1), dict(classifier="gap"), dict(resnet_stages=(1,),
                                                                                            patch_size=1)):
        model = keras_vit.VisionTransformer(**{**dict(patch_size=8, hidden_dim=16, mlp_dim=32, num_heads=2,
                                                      num_layers=2), **kwargs}, input_shape=(16, 16, 3), classes=3)
        unbuilt = [layer.path for layer in _all_layers(model) if not layer.built]
        assert not unbuilt, unbuilt


def _all_layers(layer):
    yield layer
    for attribute in vars(layer).values():
        if isinstance(attribute, keras.layers.Layer) and attribute is not layer:
            yield from _all_layers(attribute)
    if isinstance(layer, keras.Model):
        for sublayer in layer.layers:
            yield from _all_layers(sublayer)


def test_transformer_block_heads_must_divide_width():
    with pytest.raises(ValueError, match=r"Hidden size 10 is not divisible by num_heads=3"):
        keras_vit.TransformerBlock(num_heads=3, mlp_dim=8)(np.zeros((1, 2, 10), "float32"))


def test_stochastic_depth_drops_whole_examples():
    layer = keras_vit.StochasticDepth(0.5, seed=1)
    run_layer_test(layer, (2, 3, 4), (2, 3, 4), train=False)
    x = np.ones((256, 3, 4), "float32")
    np.testing.assert_array_equal(to_numpy(layer(x)), x)
    out = to_numpy(layer(x, training=True))
    per_example = out.reshape(256, -1)
    assert set(np.unique(per_example)) <= {0.0, 2.0}
    assert (per_example == per_example[:, :1]).all()  # All or nothing per example.
    assert 0.3 < (per_example[:, 0] == 0).mean() < 0.7
    with pytest.raises(ValueError, match=r"rate=1.0"):
        keras_vit.StochasticDepth(1.0)


@pytest.mark.parametrize("method", ["token", "avg", "token_avg"])
def test_token_pooling(method):
    layer = keras_vit.TokenPooling(method, num_prefix_tokens=2 if method == "token_avg" else 0)
    out = run_layer_test(layer, (2, 5, 8), (2, 16 if method == "token_avg" else 8), train=False)
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    expected = {"token": x[:, 0], "avg": x.mean(1),
                "token_avg": np.concatenate([x[:, 0], x[:, 2:].mean(1)], axis=-1)}[method]
    np.testing.assert_allclose(out, expected, atol=1e-6)
    with pytest.raises(ValueError, match=r"Unknown pooling 'max'"):
        keras_vit.TokenPooling("max")


# --- Hybrid stem ---


def test_std_conv_standardizes_kernel():
    layer = keras_vit.StdConv2D(6, 3, padding="same", use_bias=False)
    run_layer_test(layer, (2, 8, 8, 4), (2, 8, 8, 6))
    x = np.random.default_rng(0).normal(size=(2, 8, 8, 4)).astype("float32")
    kernel = to_numpy(layer.kernel, "float64") * 5 + 3
    layer.kernel.assign(kernel.astype("float32"))
    mean = kernel.mean(axis=(0, 1, 2), keepdims=True)
    standardized = (kernel - mean) / (kernel.std(axis=(0, 1, 2), keepdims=True) + 1e-5)
    plain = keras.layers.Conv2D(6, 3, padding="same", use_bias=False)
    plain.build(x.shape)
    plain.set_weights([standardized.astype("float32")])
    np.testing.assert_allclose(to_numpy(layer(x)), to_numpy(plain(x)), atol=1e-4)


def test_bottleneck_unit():
    layer = keras_vit.BottleneckUnit(filters=32, strides=2)
    run_layer_test(layer, (2, 8, 8, 64), (2, 4, 4, 128))
    paths = {w.path.split("/", 1)[1] for w in layer.weights}
    assert {"conv1/kernel", "gn1/gamma", "conv2/kernel", "conv3/kernel", "gn3/beta", "conv_proj/kernel",
            "gn_proj/gamma"} <= paths
    identity = keras_vit.BottleneckUnit(filters=32, strides=1)
    identity.build((None, 4, 4, 128))
    assert not identity.needs_projection  # Same shape: the shortcut is the input itself.
    groups = [layer.gn1, layer.gn2, layer.gn3, layer.gn_proj]
    assert all(g.groups == 32 and g.epsilon == 1e-6 for g in groups)


def _group_norm_and_input():
    from keras_vit import resnet

    layer = resnet.GroupNormalization(groups=4, epsilon=1e-6)
    x = np.random.default_rng(0).normal(3.0, 2.0, (2, 5, 3, 8)).astype("float32")
    layer.build(x.shape)
    randomize(layer, seed=1, scale=1.0)
    return layer, x


def test_token_row_traced_for_the_gpu_delegate_is_the_same_row():
    """`kernels.token_row` (the class token, DeiT's distillation token, the MAP head's probe) gives tokens[:, i]
    inside `scope.for_litert` and `scope.for_gpu_delegate` (a slice and a reshape) as outside them."""
    from keras_vit.kernels import scope
    tokens = np.random.default_rng(0).normal(size=(2, 5, 4)).astype("float32")
    for index in (0, 1):
        for traced_for in (scope.for_litert, scope.for_gpu_delegate):
            with traced_for():
                assert scope.litert()
                traced = keras.ops.convert_to_numpy(kernels.token_row(tokens, index))
            np.testing.assert_array_equal(traced, tokens[:, index])
        assert not scope.litert()
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(kernels.token_row(tokens, index)), tokens[:, index])


def test_group_norm_traced_for_the_gpu_delegate_gives_keras_numbers():
    """The hybrid's GroupNorm inside `scope.for_gpu_delegate` (channels grouped as (batch, positions, groups,
    channels / group)) and outside (Keras' layer) both compute the NumPy equation."""
    from keras_vit.kernels import scope

    layer, x = _group_norm_and_input()
    gamma, beta = (to_numpy(weight).reshape(4, 2) for weight in (layer.gamma, layer.beta))
    groups = x.reshape(2, 15, 4, 2)
    mean, variance = groups.mean((1, 3), keepdims=True), groups.var((1, 3), keepdims=True)
    expected = ((groups - mean) / np.sqrt(variance + 1e-6) * gamma + beta).reshape(x.shape)
    outside = to_numpy(layer(x))
    with scope.for_gpu_delegate():
        inside = to_numpy(layer(x))
    np.testing.assert_allclose(outside, expected, atol=2e-5, rtol=0)
    np.testing.assert_allclose(inside, outside, atol=2e-5, rtol=0)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="inspects a TensorFlow graph")
def test_group_norm_traced_for_the_gpu_delegate_has_rank_4_tensors():
    """Keras' GroupNormalization makes a rank-5 tensor, which LiteRT's GPU delegate refuses; traced for it, none."""
    import tensorflow as tf

    from keras_vit.kernels import scope

    layer, x = _group_norm_and_input()

    def largest_rank():
        graph = tf.function(layer).get_concrete_function(tf.TensorSpec(x.shape)).graph
        return max(len(output.shape) for op in graph.get_operations() for output in op.outputs if output.shape.rank)

    assert largest_rank() == 5  # Keras' own, outside the scope
    with scope.for_gpu_delegate():
        assert largest_rank() == 4


def test_every_public_layer_round_trips_its_config():
    public = [keras_vit.Patches((2, 4)), keras_vit.PatchEncoder(8, 2, kernel_initializer="zeros"),
              keras_vit.ClassToken(), keras_vit.PositionEmbedding((3, 2), 0, "sincos_2d"),
              keras_vit.PositionEmbedding((4, 4), 2, patch_stride=16),
              keras_vit.StochasticDepth(0.2, seed=3), keras_vit.MlpBlock(12, 0.1),
              keras_vit.TransformerBlock(2, 8, 0.1, 0.2, 0.3, 1e-5), keras_vit.TokenPooling("avg"),
              keras_vit.TransformerBlock(2, 8, layer_scale_init=0.5, qk_norm=True, activation="quick_gelu"),
              keras_vit.RegisterTokens(4, position=1), keras_vit.LayerScale(0.25),
              keras_vit.StdConv2D(4, 3, strides=2), keras_vit.BottleneckUnit(8, 2),
              keras_vit.RotaryPositionEmbedding(16, (8, 4), 5, 50.0, shift=0.1, jitter=1.2, rescale=2.0, seed=1),
              keras_vit.MlpBlock(12, activation="silu", gated=True),
              keras_vit.TransformerBlock(2, 8, gated_mlp=True, activation="silu")]
    for layer in public:
        clone = run_serialization_test(layer)
        own = {k: v for k, v in layer.get_config().items() if k not in ("name", "dtype", "trainable")}
        assert {k: clone.get_config()[k] for k in own} == own


def test_drop_path_in_training_keeps_or_drops_whole_branches():
    """Training with drop path: each example's output is one of the four keep/drop combinations
    of the two residual branches, kept ones scaled by 1 / (1 - rate), computed in NumPy."""
    rate = 0.5
    layer = keras_vit.TransformerBlock(num_heads=2, mlp_dim=8, drop_path_rate=rate, name="encoderblock_0")
    x = np.random.default_rng(4).normal(size=(64, 3, 4)).astype("float32")
    layer(x)
    randomize(layer, seed=5)
    w = released_names(layer)
    out = to_numpy(layer(x, training=True), "float64")

    def block(tokens, keep_attention, keep_mlp):
        return encoder_block(w, "Transformer/encoderblock_0", tokens, attention_scale=keep_attention / (1 - rate),
                             mlp_scale=keep_mlp / (1 - rate))[0]

    combinations = [(a, m) for a in (0, 1) for m in (0, 1)]
    seen = set()
    for index in range(len(x)):
        errors = [np.abs(out[index] - block(x[index:index + 1].astype("float64"), *c)[0]).max() for c in combinations]
        assert min(errors) < 1e-5, errors
        seen.add(combinations[int(np.argmin(errors))])
    assert seen == set(combinations)  # all four occur in 64 examples (a miss has probability ~1e-7)


# --- Rotary position embeddings (DINOv3, EVA-02) ---


def test_rotary_angles_match_the_numpy_reference_on_a_non_square_grid():
    """(cos, sin) of a 3x5 grid of 8-pixel patches after 5 prefix tokens: DINOv3's angles (`rope_tables`), the
    prefix rows exactly cos 1, sin 0."""
    layer = keras_vit.RotaryPositionEmbedding(16, patch_stride=8, num_prefix_tokens=5, theta=50.0)
    cos, sin = (to_numpy(table) for table in layer(np.zeros((2, 24, 40, 3), "float32")))
    expected_cos, expected_sin = rope_tables((3, 5), 16, 50.0, 5)
    assert cos.shape == sin.shape == (5 + 15, 16)
    np.testing.assert_allclose(cos, expected_cos, atol=2e-6)
    np.testing.assert_allclose(sin, expected_sin, atol=2e-6)
    assert np.all(cos[:5] == 1) and np.all(sin[:5] == 0)
    transposed = rope_tables((5, 3), 16, 50.0, 5)[1]
    assert np.abs(transposed - expected_sin).max() > 0.1  # rows and columns are not interchangeable


def test_eva02_rotary_angles_are_patch_indices_on_the_reference_grid():
    """EVA-02's form: positions are patch indices scaled to the reference grid (timm's `ref_feat_shape`), no 2 pi,
    against `rope_tables`; without a reference grid, the indices themselves. The form survives `get_config`."""
    layer = keras_vit.RotaryPositionEmbedding(16, patch_stride=8, num_prefix_tokens=1, theta=1000.0, form="eva02",
                                              reference_grid=(2, 3))
    images = np.zeros((1, 24, 40, 3), "float32")
    cos, sin = (to_numpy(table) for table in layer(images))
    expected_cos, expected_sin = rope_tables((3, 5), 16, 1000.0, 1, "eva02", (2, 3))
    np.testing.assert_allclose(cos, expected_cos, atol=2e-6)
    np.testing.assert_allclose(sin, expected_sin, atol=2e-6)
    plain = keras_vit.RotaryPositionEmbedding(16, 8, 1, 1000.0, form="eva02")
    np.testing.assert_allclose(to_numpy(plain(images)[1]), rope_tables((3, 5), 16, 1000.0, 1, "eva02")[1], atol=2e-6)
    assert np.abs(to_numpy(plain(images)[1]) - sin).max() > 0.1
    copy = keras_vit.RotaryPositionEmbedding.from_config(layer.get_config())
    assert (copy.form, copy.reference_grid) == ("eva02", (2, 3))
    np.testing.assert_array_equal(to_numpy(copy(images)[1]), sin)
    with pytest.raises(ValueError, match=r"form must be 'dinov3' or 'eva02' \(reference_grid with 'eva02' only\)"):
        keras_vit.RotaryPositionEmbedding(16, 8, reference_grid=(2, 3))


def test_interleaved_rotation_is_the_half_rotation_of_permuted_columns():
    """What the EVA-02 loader relies on: rotating interleaved pairs (2i, 2i + 1) of q and k (timm's `rot`, written
    here from its definition) gives the same q . k as rotating the pairs (i, i + d / 2) of q and k whose columns
    are permuted to [0, 2, 4, ..., 1, 3, 5, ...] with the half layout's table."""
    rng = np.random.default_rng(3)
    q, k = rng.normal(size=(2, 15, 16))
    cos, sin = rope_tables((3, 5), 16, 1000.0, 0, "eva02", (2, 3))
    angles = np.arctan2(sin, cos)[:, :8]  # (tokens, d / 2): one angle per pair
    interleaved_cos, interleaved_sin = np.repeat(np.cos(angles), 2, -1), np.repeat(np.sin(angles), 2, -1)

    def rot(x):  # [x0, x1, x2, x3] -> [-x1, x0, -x3, x2]
        return np.stack([-x[..., 1::2], x[..., 0::2]], -1).reshape(x.shape)

    def interleaved(x):
        return x * interleaved_cos + rot(x) * interleaved_sin

    def half(x):
        x = np.concatenate([x[..., 0::2], x[..., 1::2]], -1)
        return x * cos + np.concatenate([-x[..., 8:], x[..., :8]], -1) * sin

    np.testing.assert_allclose(half(q) @ half(k).T, interleaved(q) @ interleaved(k).T, atol=1e-12)
    assert np.abs(half(q) @ half(k).T - (q * cos + rot(q) * sin) @ (k * cos + rot(k) * sin).T).max() > 0.1


@pytest.mark.parametrize("fused", ["on", "off"])
def test_block_with_rotary_positions_and_a_gated_mlp_matches_the_numpy_reference(fused, monkeypatch):
    """q and k of the patch rows rotated (not the prefix rows), and the SwiGLU MLP, as the NumPy reference; the
    class token's row alone (`output_tokens=1`, what `head_rows_model` computes) and the attention scores agree."""
    monkeypatch.setenv(kernels.FUSED_ATTENTION_SWITCH, fused)
    layer = keras_vit.TransformerBlock(num_heads=2, mlp_dim=24, gated_mlp=True, activation="silu",
                                       layer_scale_init=0.5, name="encoderblock_0")
    x = np.random.default_rng(8).normal(size=(2, 2 + 15, 32)).astype("float32")
    rotary = keras_vit.RotaryPositionEmbedding(16, 8, num_prefix_tokens=2)(np.zeros((1, 24, 40, 3), "float32"))
    layer(x, rotary=rotary)
    randomize(layer, seed=9, scale=0.5)
    arrays = released_names(layer)
    tables = rope_tables((3, 5), 16, 100.0, 2)
    expected, expected_scores = encoder_block(arrays, "Transformer/encoderblock_0", x.astype("float64"),
                                              gelu=silu, rotary=tables)
    # Outputs up to ~11 in float32 (the reference in float64): 1e-5 absolute and relative (PyTorch's CPU kernels
    # were 1.2e-5 off at -11.05).
    np.testing.assert_allclose(to_numpy(layer(x, rotary=rotary)), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(to_numpy(layer(x, rotary=rotary, output_tokens=1)), expected[:, :1], rtol=1e-5,
                               atol=1e-5)
    _, scores = layer(x, rotary=rotary, return_attention_scores=True)
    np.testing.assert_allclose(to_numpy(scores), expected_scores, atol=1e-6)
    unrotated, _ = encoder_block(arrays, "Transformer/encoderblock_0", x.astype("float64"), gelu=silu)
    assert np.abs(unrotated - expected).max() > 1e-2  # the rotation matters here


def test_rematerialized_rope_block_is_checkpointed_with_its_rotary_tables(monkeypatch):
    """`remat=True` on a RoPE block: the (cos, sin) tables are passed on to the checkpointed call (not dropped, nor
    the remat skipped): same loss, same update as without."""
    checkpointed = []
    original = kernels._checkpointed
    monkeypatch.setattr(kernels, "_checkpointed", lambda function: checkpointed.append(1) or original(function))
    rng = np.random.default_rng(0)
    x, y = (rng.normal(size=(2, 1 + 6, 16)).astype("float32") for _ in range(2))
    images = np.zeros((2, 16, 24, 3), "float32")
    models = []
    for remat in (False, True):
        tokens, pixels = keras.Input((7, 16)), keras.Input((16, 24, 3))
        rotary = keras_vit.RotaryPositionEmbedding(8, 8, num_prefix_tokens=1)(pixels)
        block = keras_vit.TransformerBlock(num_heads=2, mlp_dim=16, gated_mlp=True, activation="silu", remat=remat)
        model = keras.Model([tokens, pixels], block(tokens, rotary=rotary))
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        models.append(model)
    randomize(models[0], seed=2)
    initial = models[0].get_weights()
    models[1].set_weights(initial)
    losses = [float(model.train_on_batch([x, images], y)) for model in models]
    assert checkpointed, "the remat=True block was not checkpointed"
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for plain, rematerialized in zip(models[0].get_weights(), models[1].get_weights()):
        np.testing.assert_allclose(rematerialized, plain, atol=1e-6)


def test_rotary_augmentations_act_in_training_only():
    """DINOv3's shift, jitter and rescale move the patch coordinates in training, never the prefix rows; in
    inference the angles are the plain ones. A shift alone moves every patch's y by the same amount."""
    images = np.zeros((1, 32, 32, 3), "float32")
    plain = [to_numpy(table) for table in keras_vit.RotaryPositionEmbedding(8, 8, 1)(images)]
    augmented = keras_vit.RotaryPositionEmbedding(8, 8, 1, shift=0.1, jitter=1.5, rescale=2.0, seed=3)
    for inference in (augmented(images), augmented(images, training=False)):
        for table, expected in zip(inference, plain):
            np.testing.assert_array_equal(to_numpy(table), expected)
    cos, sin = (to_numpy(table) for table in augmented(images, training=True))
    assert np.abs(cos - plain[0]).max() > 1e-2 and np.all(cos[:1] == 1) and np.all(sin[:1] == 0)
    shifted = keras_vit.RotaryPositionEmbedding(8, 8, 1, shift=0.1, seed=4)
    cos, sin = (to_numpy(table) for table in shifted(images, training=True))
    # Column 0 holds 2 pi y (frequency 1): its phase moves by 2 pi times one shift for every patch.
    moved = np.angle(np.exp(1j * (np.arctan2(sin[1:, 0], cos[1:, 0]) - np.arctan2(plain[1][1:, 0], plain[0][1:, 0]))))
    assert np.ptp(moved) < 1e-5 and 1e-4 < np.abs(moved[0]) <= 2 * np.pi * 0.1
