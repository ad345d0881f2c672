"""Model tests: exact parameter counts of every variant, the keras.applications options,
a NumPy forward pass of a whole model, saving, mixed precision and argument errors."""

import collections
import inspect
import json
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import _keras_internals, variants
from tests.testing import TINY_HYBRID, TINY_VIT, randomize, to_numpy

# Exact counts at 224 px with a 1000-class head, from vit_jax/models_test.py.
PARAM_COUNTS = {
    "ViTTi16": 5_717_416,
    "ViTS16": 22_050_664,
    "ViTS32": 22_878_952,
    "ViTB8": 86_576_872,
    "ViTB16": 86_567_656,
    "ViTB32": 88_224_232,
    "ViTL16": 304_326_632,
    "ViTL32": 306_535_400,
    "ViTH14": 632_045_800,
    "R50ViTB16": 98_659_112,
    "R26ViTS32": 36_431_912,
    "R50ViTL32": 328_994_856,
}


def tiny(**kwargs):
    config = dict(TINY_VIT, input_shape=(32, 32, 3), classes=10)
    config.update(kwargs)
    model = keras_vit.VisionTransformer(**config)
    randomize(model)
    return model


def images(shape=(2, 32, 32, 3), seed=0):
    return np.random.default_rng(seed).uniform(0, 255, size=shape).astype("float32")


def test_all_variants_counted():
    assert set(keras_vit.BUILDERS) == set(PARAM_COUNTS)
    assert {builder.variant for builder in keras_vit.BUILDERS.values()} == set(variants.VARIANTS)


@pytest.fixture
def zero_initializers(monkeypatch):
    """Keras' random initializers draw zeros: drawing a full-size variant's weights (632M for H/14, 5.7 of its 7.4 s
    to build here) is not what a parameter count checks."""
    def zeros(initializer, shape, dtype=None):
        return keras.ops.zeros(shape, dtype or keras.config.floatx())
    for name in ("VarianceScaling", "RandomUniform", "RandomNormal", "TruncatedNormal"):
        monkeypatch.setattr(getattr(keras.initializers, name), "__call__", zeros)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PARAM_COUNTS))
def test_variant_parameter_count_and_shapes(name, zero_initializers):
    builder = keras_vit.BUILDERS[name]
    model = builder(weights=None)
    assert model.count_params() == PARAM_COUNTS[name]
    assert model.output_shape == (None, 1000)
    stride = variants.total_stride(variants.VARIANTS[builder.variant])
    assert model.get_layer("posembed_input").num_tokens == (224 // stride) ** 2 + 1
    assert model.name == "vit_" + builder.variant.lower().replace("+", "_").replace("/", "")
    keras.backend.clear_session()


def test_builder_signature_is_keras_applications_style():
    parameters = inspect.signature(keras_vit.ViTB16).parameters
    assert list(parameters)[:8] == ["include_top", "weights", "input_tensor", "input_shape", "pooling",
                                    "classes", "classifier_activation", "include_preprocessing"]
    assert parameters["weights"].default == "imagenet"
    assert "ViT-B/16" in keras_vit.ViTB16.__doc__ and "R50+ViT-B/16" in keras_vit.R50ViTB16.__doc__


def test_preprocessing_maps_pixels_to_minus_one_one():
    with_preprocessing = tiny()
    without = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), classes=10,
                                          include_preprocessing=False)
    without.set_weights(with_preprocessing.get_weights())
    x = images()
    np.testing.assert_allclose(with_preprocessing(x), without(x / 127.5 - 1), atol=1e-5)


def test_include_top_false_poolings():
    base = dict(TINY_VIT, input_shape=(32, 48, 3), include_top=False)
    x = images((2, 32, 48, 3))
    sequence = keras_vit.VisionTransformer(**base)
    assert sequence.output_shape == (None, 1 + 4 * 6, 48)
    randomize(sequence)
    tokens = np.asarray(sequence(x))
    for pooling, expected in (("token", tokens[:, 0]), ("avg", tokens.mean(1))):
        pooled = keras_vit.VisionTransformer(**base, pooling=pooling)
        pooled.set_weights(sequence.get_weights())
        assert pooled.output_shape == (None, 48)
        np.testing.assert_allclose(pooled(x), expected, atol=1e-5)


def test_gap_classifier_has_no_class_token():
    model = tiny(classifier="gap")
    assert "cls" not in [layer.name for layer in model.layers]
    assert model.get_layer("posembed_input").weights[0].shape == (1, 16, 48)
    features = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), include_top=False,
                                           classifier="gap")
    assert features.output_shape == (None, 16, 48)


def test_classifier_activation_none_returns_logits():
    probabilities = tiny()
    logits = tiny(classifier_activation=None)
    logits.set_weights(probabilities.get_weights())
    x = images()
    np.testing.assert_allclose(keras.ops.softmax(logits(x)), probabilities(x), atol=1e-6)


def test_head_is_zero_initialised():
    model = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), classes=7)
    np.testing.assert_array_equal(model.get_layer("head").get_weights()[0], 0.0)


def test_input_tensor():
    tensor = keras.Input(shape=(16, 24, 3))
    model = keras_vit.VisionTransformer(**TINY_VIT, input_tensor=tensor, classes=3)
    assert model.input_shape == (None, 16, 24, 3)
    assert model.output_shape == (None, 3)
    same = keras_vit.VisionTransformer(**TINY_VIT, input_tensor=tensor, input_shape=(16, None, 3), classes=3)
    assert same.input_shape == (None, 16, 24, 3)  # A None in input_shape agrees with any size.
    with pytest.raises(ValueError, match=r"`input_shape` \(32, 32, 3\) differs from the shape of `input_tensor`, "
                                         r"\(16, 24, 3\)\. Expected one of them, or the same shape\."):
        keras_vit.VisionTransformer(**TINY_VIT, input_tensor=tensor, input_shape=(32, 32, 3), classes=3)


def test_drop_path_rate_rises_linearly():
    model = keras_vit.VisionTransformer(**dict(TINY_VIT, num_layers=3), input_shape=(32, 32, 3),
                                        drop_path_rate=0.2)
    rates = [model.get_layer(f"encoderblock_{i}").drop_path_rate for i in range(3)]
    np.testing.assert_allclose(rates, [0.0, 0.1, 0.2])


@pytest.mark.slow
def test_remat_reaches_every_block_and_its_config():
    model = tiny(remat=True)
    blocks = [layer for layer in model.layers if isinstance(layer, keras_vit.TransformerBlock)]
    assert len(blocks) == TINY_VIT["num_layers"] and all(block.remat for block in blocks)
    rebuilt = keras_vit.models.ViTModel.from_config(model.get_config())
    assert all(layer.remat for layer in rebuilt.layers if isinstance(layer, keras_vit.TransformerBlock))
    with pytest.raises(ValueError, match="remat=True needs a block without random masks"):
        tiny(remat=True, dropout_rate=0.1)


def test_distillation_token_needs_a_class_token_and_no_registers():
    with pytest.raises(ValueError, match=r"distillation_token=True needs classifier='token'.*num_register_tokens=4"):
        tiny(distillation_token=True, num_register_tokens=4)
    model = tiny(distillation_token=True)
    assert model.get_layer("posembed_input").num_prefix_tokens == 2
    assert model.get_layer("head_dist").output.shape == (None, 10)


def test_tiny_model_trains():
    model = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(16, 16, 3), classes=2)
    x = images((32, 16, 16, 3))
    y = (x[..., 0].mean((1, 2)) > 127.5).astype("int32")
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="sparse_categorical_crossentropy")
    history = model.fit(x, y, epochs=8, batch_size=16, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def _fit_and_evaluate() -> tuple[collections.Counter, dict, list, list]:
    """A tiny model's fit (with validation) and evaluate: its traces of each step, the history, the evaluation and
    the weights."""
    keras.utils.set_random_seed(0)
    model = keras_vit.VisionTransformer(**dict(TINY_VIT, num_layers=1), input_shape=(16, 16, 3), classes=2)
    traces = collections.Counter()
    for name in ("train_step", "test_step"):
        def counted(*args, _name=name, _step=getattr(model, name), **kwargs):
            traces[_name] += 1  # Python runs only while TensorFlow traces the step
            return _step(*args, **kwargs)
        setattr(model, name, counted)
    x = images((32, 16, 16, 3))
    y = (x[..., 0].mean((1, 2)) > 127.5).astype("int32")
    model.compile(optimizer=keras.optimizers.AdamW(3e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    history = model.fit(x, y, epochs=2, batch_size=16, validation_data=(x[:16], y[:16]), verbose=0)
    return traces, history.history, model.evaluate(x, y, batch_size=16, verbose=0), model.get_weights()


@pytest.fixture(scope="module")
def fit_traced_once():
    return _fit_and_evaluate()


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="Keras' TensorFlow trainer")
def test_fit_and_evaluate_trace_each_step_once(fit_traced_once):
    """Keras' TensorFlow trainer builds the optimizer's slots and the metrics inside the first trace of a step
    where no tf.distribute strategy is in scope, and TensorFlow then traces the step again: `ViTModel` builds
    them first (`_keras_internals.symbolic_build`), as Keras' JAX and PyTorch trainers do."""
    traces, history, evaluation, _ = fit_traced_once
    assert traces == {"train_step": 1, "test_step": 1}
    assert len(history["val_loss"]) == 2 and np.isfinite(evaluation).all()


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="Keras' TensorFlow trainer")
@pytest.mark.parametrize("internal", ["STRATEGY_ATTRIBUTE", "DATASET_ATTRIBUTE"])
def test_without_the_keras_internal_fit_is_keras_own(monkeypatch, fit_traced_once, internal):
    """The fallback, forced: with the trainer's (or the epoch iterator's) attribute gone, Keras builds in the first
    trace as it does for any model; the step is traced twice and computes the same numbers."""
    monkeypatch.setattr(_keras_internals, internal, "_not_in_this_keras")
    traces, history, evaluation, weights = _fit_and_evaluate()
    assert traces["train_step"] == 2
    np.testing.assert_array_equal(history["loss"], fit_traced_once[1]["loss"])
    np.testing.assert_array_equal(evaluation, fit_traced_once[2])
    for weight, expected in zip(weights, fit_traced_once[3]):
        np.testing.assert_array_equal(weight, expected)


def test_keras_save_and_load_learned_2d_with_drop_path(tmp_path):
    """The options the checkpoint families of tests/models/test_model_families.py do not cover."""
    model = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), classes=5,
                                        position_embedding="learned_2d", drop_path_rate=0.1)
    randomize(model)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)  # safe_mode on, no custom_objects.
    x = images()
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))
    assert [w.path for w in loaded.weights] == [w.path for w in model.weights]


def test_hybrid_model_shapes():
    model = keras_vit.VisionTransformer(**TINY_HYBRID, input_shape=(32, 64, 3), include_top=False)
    # Stem stride 2 ** (1 + 2) = 8: a 4 x 8 grid plus the class token.
    assert model.output_shape == (None, 33, 48)
    assert model.get_layer("embedding").weights[0].shape == (1, 1, 512, 48)


@pytest.mark.slow
def test_mixed_bfloat16():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = tiny(classifier_activation=None)
    assert {w.dtype for w in model.weights} == {"float32"}
    assert model.get_layer("encoderblock_0").compute_dtype == "bfloat16"
    logits = model.predict(images(), verbose=0)
    assert logits.dtype == np.float32
    keras.mixed_precision.set_global_policy("float32")
    reference = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), classes=10,
                                            classifier_activation=None)
    reference.set_weights(model.get_weights())
    np.testing.assert_allclose(logits, reference.predict(images(), verbose=0), atol=0.15, rtol=0.05)


def test_attention_model_shares_weights_and_matches():
    model = tiny(input_shape=(16, 24, 3))
    probe = keras_vit.attention_model(model)
    x = images((2, 16, 24, 3))
    outputs = probe(x)
    np.testing.assert_allclose(outputs["output"], model(x), atol=1e-6)
    assert len(outputs["attention"]) == 2
    scores = np.asarray(outputs["attention"][1])
    assert scores.shape == (2, 3, 1 + 2 * 3, 1 + 2 * 3)
    np.testing.assert_allclose(scores.sum(-1), 1.0, atol=1e-5)
    assert {id(w) for w in probe.weights} == {id(w) for w in model.weights}
    model.get_layer("head").bias.assign(np.arange(10, dtype="float32"))  # Shared, not copied.
    np.testing.assert_allclose(probe(x)["output"], model(x), atol=1e-6)
    # The probe does not alter the original graph: it still has a single output.
    assert len(model.outputs) == 1


def test_attention_model_hybrid():
    model = keras_vit.VisionTransformer(**TINY_HYBRID, input_shape=(32, 32, 3), classes=4)
    scores = keras_vit.attention_model(model)(images())["attention"]
    assert [s.shape for s in scores] == [(2, 3, 17, 17)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_shape=(30, 32, 3)), r"Input height 30 is not divisible by the model's patch stride 8"),
    (dict(input_shape=(32, 36, 3)), r"Input width 36 is not divisible by the model's patch stride 8"),
    (dict(classifier="cls"),
     r"Unknown classifier 'cls'. Expected one of \('token', 'gap', 'map', 'token_gap', 'patch_gap'\)"),
    (dict(pooling="max", include_top=False), r"Unknown pooling 'max'. Expected None or one of"),
    (dict(position_embedding="alibi"), r"Unknown position_embedding 'alibi'"),
    (dict(classes=0), r"`classes` must be a positive int. Received: classes=0"),
    (dict(classes=2.5), r"Received: classes=2.5"),
    (dict(input_shape=(32, 32)), r"`input_shape` must be \(height, width, channels\). Received: \(32, 32\)"),
    (dict(input_shape=(32, 32, 0)), r"input has 0 channels; expected a positive number"),
    (dict(classifier="gap", include_top=False, pooling="token"), r"pooling='token' needs a class token"),
    (dict(classifier="map", include_top=False, pooling="token_avg"), r"pooling='token_avg' needs a class token"),
    (dict(include_top=False, pooling="map"), r"pooling='map' is the attention-pooling head of classifier='map'"),
])
def test_bad_arguments(kwargs, message):
    config = dict(TINY_VIT, input_shape=(32, 32, 3), weights=None)
    config.update(kwargs)
    with pytest.raises(ValueError, match=message):
        keras_vit.VisionTransformer(**config)


def test_pretrained_weights_need_three_channels(tmp_path):
    model = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3))
    path = str(tmp_path / "tiny.weights.h5")
    model.save_weights(path)
    with pytest.raises(ValueError, match=r"input has 1 channels; expected 3 \(RGB\)"):
        keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 1), weights=path)
    with pytest.raises(ValueError, match=r"classifier_activation must be None or 'softmax'"):
        keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), weights=path,
                                    classifier_activation="sigmoid")


def test_grayscale_input_without_pretrained_weights():
    model = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(16, 16, 1), classes=3)
    assert model.get_layer("embedding").weights[0].shape == (8, 8, 1, 48)


def test_unknown_variant():
    with pytest.raises(ValueError, match=r"Unknown variant 'B/15'"):
        keras_vit.VisionTransformer("B/15", weights=None)
    assert keras_vit.decode_variant("ViT-B_16") == keras_vit.decode_variant("B/16")


def _keras_version(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3])


@pytest.mark.slow
def test_files_written_by_keras_vit_0_1_0_load_unchanged():
    """0.1.0 kept its attention in keras.layers.MultiHeadAttention: its .keras and .weights.h5
    files (tests/data, a 1-block model with every weight random) load into today's layers.

    The `.keras` file holds the configs of the Keras that wrote it (3.15.1): an older Keras cannot
    read them (e.g. initializer arguments it does not know), so under one only `.weights.h5` is read."""
    data = Path(__file__).parents[1] / "data"
    io = np.load(data / "tiny_0_1_0_io.npz")
    with zipfile.ZipFile(data / "tiny_0_1_0.keras") as archive:
        written_by = json.loads(archive.read("metadata.json"))["keras_version"]
    if _keras_version(keras.__version__) >= _keras_version(written_by):
        loaded = keras.saving.load_model(data / "tiny_0_1_0.keras")
        np.testing.assert_allclose(loaded(io["images"]), io["probabilities"], atol=1e-6)
    rebuilt = keras_vit.VisionTransformer(patch_size=8, hidden_dim=16, mlp_dim=32, num_heads=2, num_layers=1,
                                          input_shape=(16, 16, 3), classes=3, dropout_rate=0.1,
                                          attention_dropout_rate=0.1, drop_path_rate=0.1)
    rebuilt.load_weights(data / "tiny_0_1_0.weights.h5")
    np.testing.assert_allclose(rebuilt.predict(io["images"], verbose=0), io["probabilities"], atol=1e-6)


@pytest.mark.slow
def test_a_keras_file_written_by_keras_vit_0_2_0_loads_and_predicts_the_same():
    """tests/data/vit_0_2_0.keras (`tests/data/make_keras_0_2_0.py`, written by 0.2.0 before `ViTModel` moved to
    `keras_vit.vit_model`, the input fields moved from `ViTConfig` to `PreprocessingConfig` and `resize_size` was
    added): it loads as a `ViTModel` with both configs, the new field at its default, and predicts what 0.2.0 did."""
    data = Path(__file__).parents[1] / "data"
    io = np.load(data / "vit_0_2_0_io.npz")
    with zipfile.ZipFile(data / "vit_0_2_0.keras") as archive:
        written_by = json.loads(archive.read("metadata.json"))["keras_version"]
    if _keras_version(keras.__version__) < _keras_version(written_by):
        pytest.skip(f"written by Keras {written_by}, whose configs Keras {keras.__version__} cannot read")
    loaded = keras.saving.load_model(data / "vit_0_2_0.keras")
    assert isinstance(loaded, keras_vit.ViTModel)
    config, preprocessing = loaded.vit_config, loaded.preprocessing_config
    assert config.position_resampling == "bicubic" and not hasattr(config, "crop_fraction")
    assert (preprocessing.resize_size, preprocessing.crop_fraction, preprocessing.resize_mode) == (
        None, 0.56, "shortest_edge")
    np.testing.assert_allclose(loaded.predict(io["images"], verbose=0), io["embeddings"], rtol=0, atol=1e-5)


def test_default_model_has_no_non_trainable_state():
    """No seed generators (non-trainable variables) where nothing is random, as keras.layers.Dropout."""
    assert not tiny().non_trainable_variables
    with_drop_path = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), classes=10, drop_path_rate=0.1)
    assert any("seed_generator" in v.path for v in with_drop_path.non_trainable_variables)


def test_token_avg_pooling_is_the_class_token_beside_the_patch_mean_and_a_token_gap_head_reads_it():
    """`pooling="token_avg"`: [class token; mean of the patch tokens, registers left out], 2 D wide (the features
    DINOv2's and DINOv3's linear classifiers read); `classifier="token_gap"` puts the head on it."""
    config = dict(TINY_VIT, input_shape=(32, 32, 3), num_register_tokens=2, weights=None)
    tokens = keras_vit.VisionTransformer(**config, include_top=False)
    pooled = keras_vit.VisionTransformer(**config, include_top=False, pooling="token_avg")
    pooled.set_weights(tokens.get_weights())
    x = np.random.default_rng(0).uniform(0, 255, (2, 32, 32, 3)).astype("float32")
    sequence = to_numpy(tokens(x))
    np.testing.assert_allclose(to_numpy(pooled(x)), np.concatenate([sequence[:, 0], sequence[:, 3:].mean(1)], -1),
                               atol=1e-6)
    classifier = keras_vit.VisionTransformer(**dict(config, classifier="token_gap"), classes=3,
                                             classifier_activation=None)
    assert classifier.get_layer("head").kernel.shape == (2 * TINY_VIT["hidden_dim"], 3)
    assert classifier.vit_config.num_prefix_tokens == 3 and classifier.vit_config.class_token
