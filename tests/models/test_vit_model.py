"""Keras' own model tools work through keras_vit's layers: quantization (`model.quantize`) and LoRA
(`enable_lora`). Backend-agnostic: tests/models/test_backends.py runs this file on JAX (and PyTorch) too.

Which path computes what: a quantized `Dense` / `HeadProjection` takes Keras' quantized call (checked equal
to Keras' own layer); a LoRA layer computes through `keras_vit.kernels.dense` with its merged kernel.
"""

import gc
import warnings

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import datasets
from keras_vit import layers as vit_layers
from tests.testing import TINY_VIT, randomize, to_numpy

PROJECTIONS = ("query", "key", "value", "attention_output", "Dense_0", "Dense_1")


def _model(**kwargs):
    return keras_vit.VisionTransformer(**TINY_VIT, input_shape=(16, 16, 3), classifier_activation=None,
                                       **{"classes": 5, **kwargs})


def _images(count=6, seed=1):
    return np.random.default_rng(seed).uniform(0, 255, (count, 16, 16, 3)).astype("float32")


def _projections(model):
    blocks = [layer for layer in model.layers if isinstance(layer, vit_layers.TransformerBlock)]
    return [(name, layer) for block in blocks for name, layer in zip(PROJECTIONS, (
        block.attention.query_dense, block.attention.key_dense, block.attention.value_dense,
        block.attention.output_dense, block.mlp.dense_0, block.mlp.dense_1))]


# ---------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode, tolerance", [("int8", 0.05), ("int4", 0.25)])
def test_quantized_logits_stay_close_to_float32(mode, tolerance):
    """Tolerance: max |logit difference| <= `tolerance` x max |logit| (int8: 5%, int4: 25%)."""
    model = _model()
    randomize(model, scale=0.1)
    x = _images(8)
    expected = to_numpy(model.predict(x, verbose=0))
    model.quantize(mode)
    assert {layer.quantization_mode for _, layer in _projections(model)} == {mode}
    got = to_numpy(model.predict(x, verbose=0))
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()
    assert np.abs(got - expected).max() > 0  # the quantized weights are in use


class _OwnScale(keras.layers.Layer):
    """A layer of the user's own, without a `quantize`."""

    def call(self, x):
        return 2.0 * x


def test_quantize_is_keras_without_its_notice_for_each_float_layer_of_ours(monkeypatch):
    """`ViTModel.quantize` quantizes as `keras.Model.quantize` does (the same outputs, bit for bit) without Keras'
    warning for each layer keras_vit builds that stays float; a layer of the user's own still gets it."""
    ours, theirs = _model(), _model()
    randomize(ours, scale=0.1)
    theirs.set_weights(ours.get_weights())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours.quantize("int8")
    assert not [w for w in caught if issubclass(w.category, UserWarning)], [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as keras_notices, monkeypatch.context() as patch:
        # Keras' full collection for each of the 13 kernels it deletes (0.4 s or more each in a test process) changes
        # no number: skipped here (test_quantize_collects_garbage_once... counts them).
        patch.setattr(gc, "collect", lambda generation=2: 0)
        warnings.simplefilter("always")
        keras.Model.quantize(theirs, "int8")
    assert "Layer PositionEmbedding does not have a `quantize` method implemented." in {
        str(w.message) for w in keras_notices}
    assert {layer.quantization_mode for _, layer in _projections(ours)} == {"int8"}
    x = _images()
    np.testing.assert_array_equal(to_numpy(ours.predict(x, verbose=0)), to_numpy(theirs.predict(x, verbose=0)))
    backbone = _model(include_top=False, pooling="token")
    mine = keras_vit.ViTModel(backbone.input, _OwnScale(name="own_scale")(backbone.output))
    with pytest.warns(UserWarning, match="Layer _OwnScale does not have a `quantize` method"):
        mine.quantize("int8")


def test_quantize_collects_garbage_once_where_keras_collects_for_each_deleted_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    counting = gc.collect
    theirs = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keras.Model.quantize(theirs, "int8")
    assert len(calls) == len(_projections(theirs)) + 1  # Keras: one per float kernel deleted, the head's too
    calls.clear()
    ours = _model()
    ours.quantize("int8")
    assert calls == [2] and gc.collect is counting
    with pytest.raises(ValueError, match="int3"):
        _model().quantize("int3")
    assert gc.collect is counting  # restored after an error too


@pytest.mark.parametrize("make_ours, make_keras, input_shape", [
    (lambda: vit_layers.Dense(6), lambda: keras.layers.Dense(6), (2, 5, 8)),
    (lambda: vit_layers.HeadProjection("btd,dnh->btnh", (None, 2, 3), bias_axes="nh"),
     lambda: keras.layers.EinsumDense("btd,dnh->btnh", (None, 2, 3), bias_axes="nh"), (2, 5, 8)),
    (lambda: vit_layers.HeadProjection("btnh,nhd->btd", (None, 8), bias_axes="d"),
     lambda: keras.layers.EinsumDense("btnh,nhd->btd", (None, 8), bias_axes="d"), (2, 5, 2, 3)),
])
def test_quantized_projection_takes_keras_quantized_path(make_ours, make_keras, input_shape, monkeypatch):
    monkeypatch.setattr(gc, "collect", lambda generation=2: 0)  # Keras' collection as it deletes a kernel: time only
    ours, theirs = make_ours(), make_keras()
    ours.build(input_shape)
    theirs.build(input_shape)
    randomize(ours)
    theirs.set_weights(ours.get_weights())
    x = np.random.default_rng(0).normal(size=input_shape).astype("float32")
    np.testing.assert_allclose(to_numpy(ours(x)), to_numpy(theirs(x)), atol=1e-5)
    ours.quantize("int8")
    theirs.quantize("int8")
    np.testing.assert_array_equal(to_numpy(ours(x)), to_numpy(theirs(x)))


@pytest.mark.slow
def test_int8_digits_model_keeps_its_top1():
    """A small digits model (patch 8, width 64, 2 blocks at 32 px: 16 tokens, to keep the suite short on every
    backend), trained briefly with `model.fit`: its int8 version predicts the same class for >= 99% of the 360
    test digits."""
    keras.utils.set_random_seed(0)
    (train_x, train_y), (test_x, test_y) = datasets.digits("train"), datasets.digits("test")
    train_x, test_x = datasets.resize(train_x, (32, 32)), datasets.resize(test_x, (32, 32))
    model = keras_vit.VisionTransformer(patch_size=8, hidden_dim=64, mlp_dim=128, num_heads=4, num_layers=2,
                                        input_shape=(32, 32, 3), classes=10, classifier_activation=None,
                                        weights=None)
    model.compile(keras.optimizers.AdamW(2e-3, weight_decay=0.05),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(train_x, train_y, batch_size=64, epochs=6, verbose=0)
    float_logits = to_numpy(model.predict(test_x, verbose=0))
    accuracy = (float_logits.argmax(1) == test_y).mean()
    assert accuracy >= 0.8, accuracy
    model.quantize("int8")
    int8_logits = to_numpy(model.predict(test_x, verbose=0))
    assert (int8_logits.argmax(1) == float_logits.argmax(1)).mean() >= 0.99
    assert abs((int8_logits.argmax(1) == test_y).mean() - accuracy) <= 0.01


# ---------------------------------------------------------------------------------------
# LoRA
# ---------------------------------------------------------------------------------------

def _merged_kernel(layer) -> np.ndarray:
    """The layer's kernel plus its LoRA update, (alpha / rank) A B, in NumPy."""
    kernel = to_numpy(layer._kernel)
    a, b = to_numpy(layer.lora_kernel_a), to_numpy(layer.lora_kernel_b)
    update = np.tensordot(a, b, axes=1)  # (in..., rank) x (rank, out...)
    return kernel + (layer.lora_alpha / layer.lora_rank) * update.reshape(kernel.shape)


def test_lora_update_changes_outputs_exactly_as_the_merged_kernel():
    model = _model()
    randomize(model)
    x = _images()
    before = to_numpy(model(x))
    model.enable_lora(4, target_names=PROJECTIONS)
    rng = np.random.default_rng(3)
    for _, layer in _projections(model):
        layer.lora_kernel_b.assign(rng.normal(scale=0.1, size=layer.lora_kernel_b.shape).astype("float32"))
    got = to_numpy(model(x))
    merged = _model()
    sources = {weight.path: weight for weight in model.weights}
    for target in merged.weights:
        target.assign(sources[target.path])
    for (_, source), (_, target) in zip(_projections(model), _projections(merged)):
        target._kernel.assign(_merged_kernel(source))
    np.testing.assert_allclose(got, to_numpy(merged(x)), rtol=1e-5, atol=1e-5)
    assert np.abs(got - before).max() > 1e-3  # the update is in use
    np.testing.assert_allclose(to_numpy(model.predict(x, verbose=0)), got, rtol=1e-5, atol=1e-5)  # compiled steps


def test_lora_freezes_all_but_its_updates_and_rejects_unknown_targets():
    model = _model()
    model.enable_lora(2)
    trainable = sorted(weight.path.split("/", 1)[1] for weight in model.trainable_weights)
    blocks = sorted({weight.path.split("/")[0] for weight in model.trainable_weights})
    assert blocks == ["encoderblock_0", "encoderblock_1"]
    assert {path.rsplit("/", 1)[-1] for path in trainable} == {"lora_kernel_a", "lora_kernel_b", "bias"}
    assert {path.split("/")[1] for path in trainable} == {"query", "value"}
    with pytest.raises(ValueError, match=r"Unknown LoRA targets \['qkv'\]\. Expected some of"):
        _model().enable_lora(2, target_names=("query", "qkv"))


@pytest.mark.slow
def test_lora_finetune_of_a_frozen_backbone_lowers_the_loss():
    """Only the LoRA updates (and their projections' biases) train: the head is frozen too."""
    keras.utils.set_random_seed(0)
    backbone = _model(include_top=False, pooling="token")
    randomize(backbone)
    backbone.enable_lora(4)
    frozen = {weight.path: to_numpy(weight) for weight in backbone.weights if "lora" not in weight.path
              and not weight.path.endswith("bias")}
    head = keras.layers.Dense(5, trainable=False)
    model = keras.Sequential([backbone, head])
    model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _images(16, seed=4), np.arange(16) % 5
    losses = model.fit(x, y, batch_size=16, epochs=60, verbose=0).history["loss"]
    assert losses[-1] < 0.8 * losses[0], losses
    for weight in backbone.weights:
        if weight.path in frozen:
            np.testing.assert_array_equal(to_numpy(weight), frozen[weight.path])


def test_one_garbage_collection_defers_only_its_own_threads_collections():
    """Inside `one_garbage_collection` this thread's `gc.collect()` does nothing (Keras calls it for every variable a
    quantized layer drops) and one real collection runs as it closes; another thread's `gc.collect()` collects while
    it is open, and `gc.collect` is the real one again afterwards."""
    import gc
    import weakref

    from keras_vit.vit_model import one_garbage_collection

    class Cycle:
        pass

    def cycle() -> weakref.ref:
        node = Cycle()
        node.self = node  # only a collection frees it
        return weakref.ref(node)

    real_collect, results, automatic = gc.collect, {}, gc.isenabled()
    gc.disable()  # only explicit collections, so that what frees a cycle is known
    try:
        _collections_in_threads(one_garbage_collection, cycle, results)
    finally:
        if automatic:
            gc.enable()
    assert results == {"deferred here": True, "deferred after a nested scope": True, "collected there": True,
                       "collected on close": True}
    assert gc.collect is real_collect


def _collections_in_threads(one_garbage_collection, cycle, results: dict) -> None:
    import gc
    import threading

    with one_garbage_collection():
        mine = cycle()
        gc.collect()
        results["deferred here"] = mine() is not None
        with one_garbage_collection():  # nested: still deferred, and one collection at the outermost close
            gc.collect()
        results["deferred after a nested scope"] = mine() is not None

        def other_thread():
            theirs = cycle()
            gc.collect()
            results["collected there"] = theirs() is None

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    results["collected on close"] = mine() is None
