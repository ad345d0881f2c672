"""Tests of keras_vit.inspection, keras_vit.fewshot and their command lines, on tiny models."""

import itertools
import math
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from PIL import Image

import keras_vit
import keras_vit.model_files
from keras_vit import fewshot
from keras_vit import inspection as vit_inspect
from keras_vit.cli import fewshot as fewshot_cli
from keras_vit.cli import inspect as inspect_cli
from tests import reference
from tests.testing import REPO, TINY_VIT, digits_few_shot_reference

ROOT = REPO


def tiny_model(input_shape=(32, 48, 3), **kwargs):
    config = {**TINY_VIT, "classes": 10, "weights": None, **kwargs}
    return keras_vit.VisionTransformer(input_shape=input_shape, **config)


def random_images(shape=(32, 48, 3), count=2, seed=0):
    return np.random.default_rng(seed).uniform(0, 255, (count, *shape)).astype("float32")


def row_stochastic(shape, seed=0):
    weights = np.random.default_rng(seed).uniform(size=shape)
    return weights / weights.sum(axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("model") / "tiny.keras")
    tiny_model().save(path)
    return path


# === Attention rollout ===

def test_rollout_rows_sum_to_one():
    attentions = [row_stochastic((2, 3, 7, 7), seed) for seed in range(3)]
    np.testing.assert_allclose(vit_inspect.rollout(attentions).sum(axis=-1), 1.0, atol=1e-6)


def test_rollout_matches_the_numpy_reference():
    attentions = [row_stochastic((2, 3, 7, 7), seed) for seed in range(4)]
    joint = vit_inspect.rollout(attentions)
    np.testing.assert_allclose(joint, reference.rollout(attentions), rtol=0, atol=1e-6)
    for grid, prefix, class_token in (((2, 3), 1, True), ((2, 2), 3, False), ((2, 3), 1, None)):
        np.testing.assert_allclose(vit_inspect.rollout_map(joint, grid, prefix, class_token),
                                   reference.rollout_map(joint, grid, prefix, class_token is not False),
                                   rtol=0, atol=1e-7)


def test_rollout_known_answer():
    # Layer 1 sends every token to token 1, layer 2 to token 2. With the residual identity,
    # layer 2 splits the class token between itself and token 2, which layer 1 splits
    # between token 1 and 2: [0.5, 0, 0.5] @ [[.5, .5, 0], [0, 1, 0], [0, .5, .5]].
    to_token_1, to_token_2 = (np.broadcast_to(np.eye(3)[j], (1, 1, 3, 3)) for j in (1, 2))
    joint = vit_inspect.rollout([to_token_1, to_token_2])
    np.testing.assert_allclose(joint[0, 0], [0.25, 0.5, 0.25])


def test_identity_attention_gives_uniform_map():
    identity = np.broadcast_to(np.eye(6), (1, 2, 6, 6))
    joint = vit_inspect.rollout([identity, identity])
    np.testing.assert_allclose(joint[0], np.eye(6))
    # Without a class token (GAP) every patch carries 1/N of the output.
    np.testing.assert_allclose(vit_inspect.rollout_map(joint, (2, 3), 0), np.full((1, 2, 3), 1 / 6), rtol=1e-6)
    # With one, the class token only ever attends to itself: no patch contributes.
    np.testing.assert_allclose(vit_inspect.rollout_map(joint, (1, 5), 1), np.zeros((1, 1, 5)))


def test_uniform_attention_gives_uniform_class_token_map():
    uniform = np.full((1, 2, 7, 7), 1 / 7)
    heatmap = vit_inspect.rollout_map(vit_inspect.rollout([uniform] * 3), (2, 3), 1)
    np.testing.assert_allclose(heatmap, np.full((1, 2, 3), heatmap[0, 0, 0]), rtol=1e-6)
    assert heatmap[0, 0, 0] > 0


def test_rollout_rejects_wrong_shapes():
    with pytest.raises(ValueError, match=r"Received shape: \(2, 7, 7\)"):
        vit_inspect.rollout([np.ones((2, 7, 7))])
    with pytest.raises(ValueError, match="empty"):
        vit_inspect.rollout([])


def test_attention_rollout_on_rectangular_token_and_gap_models():
    images = random_images()
    heatmap = vit_inspect.attention_rollout(tiny_model(), images)
    assert heatmap.shape == (2, 4, 6) and np.all(heatmap >= 0) and np.all(heatmap.sum(axis=(1, 2)) < 1)
    gap = vit_inspect.attention_rollout(tiny_model(classifier="gap"), images)
    np.testing.assert_allclose(gap.sum(axis=(1, 2)), 1.0, rtol=1e-5)


@pytest.mark.parametrize("options, prefix, class_token", [
    (dict(num_register_tokens=4, no_embed_class=True), 5, True),  # DINOv2: class token after the table, registers
    (dict(num_register_tokens=2, classifier="map"), 2, False),    # registers, no class token, attention pooling
    (dict(distillation_token=True), 2, True),                      # DeiT distilled
], ids=["dinov2_registers", "map_registers", "deit_distilled"])
def test_rollout_and_distance_skip_every_prefix_token(options, prefix, class_token):
    model = tiny_model(**options)
    images = random_images()
    assert vit_inspect.token_layout(model)[1] == prefix
    attentions = [np.asarray(attention) for attention in keras_vit.attention_model(model)(images)["attention"]]
    expected = reference.rollout_map(reference.rollout(attentions), (4, 6), prefix, class_token)
    np.testing.assert_allclose(vit_inspect.attention_rollout(model, images), expected, rtol=1e-5, atol=1e-7)
    distances = vit_inspect.mean_attention_distance(model, images)
    assert distances.shape == (2, 3) and np.all(distances > 0)


def test_hybrid_layout_rollout_and_no_filters():
    model = tiny_model(patch_size=1, resnet_stages=(1,), num_layers=1)
    assert vit_inspect.token_layout(model) == ((8, 12), 1, (4, 4))
    assert vit_inspect.attention_rollout(model, random_images(count=1)).shape == (1, 8, 12)
    with pytest.raises(ValueError, match=r"256 input channels"):
        vit_inspect.embedding_filters(model)


def test_images_of_wrong_shape_are_rejected():
    with pytest.raises(ValueError, match=r"Received shape: \(1, 32, 32, 3\)"):
        vit_inspect.attention_rollout(tiny_model(), random_images((32, 32, 3), count=1))


# === Mean attention distance ===

def brute_force_uniform_distance(rows, columns, stride):
    """Mean over query patches of the mean pixel distance to every patch, by explicit loops."""
    cells = list(itertools.product(range(rows), range(columns)))
    total = sum(math.hypot(stride * (r - q), stride * (c - p)) for (r, c), (q, p) in itertools.product(cells, cells))
    return total / len(cells) ** 2


def test_uniform_attention_distance_on_a_2x2_grid():
    uniform = np.full((1, 1, 5, 5), 1 / 5)
    # Each patch sees itself (0), two neighbours (8 px) and the diagonal (8 * sqrt 2 px).
    expected = (0 + 8 + 8 + 8 * math.sqrt(2)) / 4
    np.testing.assert_allclose(vit_inspect.attention_distance(uniform, (2, 2), (8, 8), 1), [[expected]])


def test_uniform_attention_gives_analytic_mean_distance():
    model = tiny_model()
    for index in range(TINY_VIT["num_layers"]):
        attention = model.get_layer(f"encoderblock_{index}").attention
        for weight in attention.query_dense.weights + attention.key_dense.weights:
            weight.assign(np.zeros(weight.shape))  # all logits 0: uniform attention
    distances = vit_inspect.mean_attention_distance(model, random_images(count=3), batch_size=2)
    assert distances.shape == (2, 3)
    np.testing.assert_allclose(distances, brute_force_uniform_distance(4, 6, 8), rtol=1e-5)


def test_self_attention_has_zero_distance():
    identity = np.broadcast_to(np.eye(7), (2, 3, 7, 7))
    np.testing.assert_allclose(vit_inspect.attention_distance(identity, (2, 3), (16, 16), 1), 0.0)


# === Position embeddings and filters ===

@pytest.mark.parametrize("kind", ["learned", "learned_2d", "sincos_2d"])
def test_position_embedding_similarity_rectangular(kind):
    similarity = vit_inspect.position_embedding_similarity(tiny_model(position_embedding=kind))
    assert similarity.shape == (4, 6, 4, 6)
    flat = similarity.reshape(24, 24)
    np.testing.assert_allclose(np.diag(flat), 1.0, rtol=1e-6)
    np.testing.assert_allclose(flat, flat.T, atol=1e-12)


def test_position_embedding_similarity_needs_an_embedding():
    with pytest.raises(ValueError, match="position_embedding='none'"):
        vit_inspect.position_embedding_similarity(tiny_model(position_embedding="none"))


def test_embedding_filters_recover_a_planted_component():
    model = tiny_model()
    layer = model.get_layer("embedding")
    rng = np.random.default_rng(0)
    pattern = np.zeros((8, 8, 3))
    pattern[:, :4, 0] = 1.0  # left half red
    pattern /= np.linalg.norm(pattern)
    # 48 filters that differ (almost) only along `pattern`.
    kernel = pattern[..., None] * rng.normal(size=48) + 1e-4 * rng.normal(size=(8, 8, 3, 48))
    layer.kernel.assign(kernel)
    tiles = vit_inspect.embedding_filters(model, n=5)
    assert tiles.shape == (5, 8, 8, 3) and tiles.min() == 0.0 and tiles.max() == 1.0
    first = tiles[0] - tiles[0].mean()
    cosine = abs(np.sum(first * pattern)) / (np.linalg.norm(first) * np.linalg.norm(pattern - pattern.mean()))
    assert cosine > 0.99


def test_embedding_filters_rejects_bad_n():
    with pytest.raises(ValueError, match="n=0"):
        vit_inspect.embedding_filters(tiny_model(), n=0)


# === The default model is left alone ===

def test_inspection_leaves_the_model_alone():
    model = tiny_model()
    layers_before = list(model.layers)
    images = random_images()
    before = keras.ops.convert_to_numpy(model(images))
    vit_inspect.attention_rollout(model, images)
    vit_inspect.mean_attention_distance(model, images)
    after = keras.ops.convert_to_numpy(model(images))
    np.testing.assert_array_equal(before, after)
    assert model.layers == layers_before and len(model.outputs) == 1


# === Few-shot ===

def test_few_shot_on_separable_features_is_perfect():
    rng = np.random.default_rng(0)
    centres = 5.0 * np.eye(4, 16)
    train_labels, test_labels = np.repeat(np.arange(4), 10), np.repeat(np.arange(4), 25)
    train = centres[train_labels] + 0.1 * rng.normal(size=(40, 16))
    test = centres[test_labels] + 0.1 * rng.normal(size=(100, 16))
    for shots in (1, 5):
        assert fewshot.few_shot_accuracy(train, train_labels, test, test_labels, shots) == 1.0


def test_least_squares_fits_plus_minus_one_targets():
    features = np.eye(3)
    weights, bias = fewshot.fit_least_squares(features, np.arange(3), 3, l2_reg=1e-9)
    np.testing.assert_allclose(features @ weights + bias, 2 * np.eye(3) - 1, atol=1e-6)


def test_sample_few_shot():
    labels = np.array([0, 0, 0, 1, 1, 2, 2, 2])
    chosen = fewshot.sample_few_shot(labels, 2, seed=1)
    np.testing.assert_array_equal(np.bincount(labels[chosen]), [2, 2, 2])
    with pytest.raises(ValueError, match="Class 1 has 2 examples; expected at least shots=3"):
        fewshot.sample_few_shot(labels, 3)


def test_feature_extractor_takes_the_heads_input():
    with_pre_logits = fewshot.feature_extractor(tiny_model(representation_size=24))
    assert with_pre_logits.output.shape == (None, 24)
    assert fewshot.feature_extractor(tiny_model()).output.shape == (None, 48)
    images = random_images()
    for options, layer in ((dict(fc_norm=True, num_register_tokens=2), "fc_norm"),
                           (dict(classifier="map"), "MAPHead_0")):
        model = tiny_model(**options)
        head_input = keras.Model(model.input, model.get_layer("head").input)  # what the head sees, after fc_norm
        extractor = fewshot.feature_extractor(model)
        assert extractor.layers[-1].name == layer
        np.testing.assert_array_equal(np.asarray(extractor(images)), np.asarray(head_input(images)))
    with pytest.raises(ValueError, match="outputs tokens, not pooled features"):
        fewshot.feature_extractor(tiny_model(include_top=False))


@pytest.mark.slow
def test_digits_few_shot_and_its_command_line(saved_model, capsys):
    model = keras.saving.load_model(saved_model)
    results = fewshot.digits_accuracy(model, shots=(1, 5), seeds=2)
    pooled = keras.Model(model.input, model.get_layer("pool").output)  # No pre_logits: the pooled token.
    expected = digits_few_shot_reference(pooled, shots=(1, 5), seeds=2)
    assert sorted(results) == [1, 5]
    for k in (1, 5):
        np.testing.assert_allclose(results[k], expected[k], atol=1e-12)
    assert fewshot_cli.main(["--model", saved_model, "--shots", "1", "5", "--seeds", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"{k:>3}-shot digits accuracy: {expected[k][0]:.4f} +- {expected[k][1]:.4f} (2 draws)"
                       for k in (1, 5)]


# === Inspection command line ===

def test_command_line_writes_four_pngs(saved_model, tmp_path):
    image = str(tmp_path / "input.png")
    Image.fromarray(random_images((40, 30, 3), count=1)[0].astype("uint8")).save(image)
    assert inspect_cli.main(["--model", saved_model, "--image", image, image, "--out", str(tmp_path / "out")]) == 0
    paths = [str(tmp_path / "out" / name) for name in vit_inspect.FIGURES]
    for path in paths:
        with open(path, "rb") as file:
            assert file.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(path) > 1000


def test_command_line_needs_one_model_source(tmp_path, capsys):
    with pytest.raises(SystemExit):
        inspect_cli.main(["--image", "x.png", "--out", str(tmp_path)])
    assert "one of --model, --variant or --weights is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        inspect_cli.main(["--model", "m.keras", "--weights", "w.npz", "--image", "x.png", "--out", str(tmp_path)])
    assert "--model is a saved model: give it alone" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Give a model .*a `variant`, or weights= a local weights file"):
        keras_vit.model_files.load_or_build(None)
    with pytest.raises(ValueError, match="not both"):
        keras_vit.model_files.load_or_build("m.keras", variant="B/16")


@pytest.mark.slow
def test_help():
    result = subprocess.run([sys.executable, "-m", "keras_vit.cli.inspect", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--variant" in result.stdout and "attention_rollout.png" in result.stdout
