"""Tests for `keras_vit.masked`: masked patch prediction (paper Sec. 4.6, App. B.1.2).

References are independent NumPy loops; statistics use tolerances of 5 binomial standard deviations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import fewshot, masked
from tests.testing import (REPO, TINY_HYBRID, TINY_VIT, TRAIN_VIT_OVERRIDES, digits_few_shot_reference,
                           randomize, ridge_few_shot_accuracy, run_serialization_test, subprocess_env)

SHAPE = (32, 32, 3)


def _images(count: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 255, (count, *SHAPE)).astype("float32")


def _tiny_masked(target: str = "mean", seed: int = 0, **kwargs) -> masked.MaskedPatchModel:
    return masked.masked_patch_model(dict(input_shape=SHAPE, **TINY_VIT), target=target, seed=seed, **kwargs)


# === Corruption ===


def _classify_corruption(tokens: np.ndarray, corrupted: np.ndarray, mask_vector: np.ndarray):
    """Per position: 0 unchanged, 1 [mask], 2 another patch of the same image; asserts nothing else occurs."""
    kinds = np.zeros(tokens.shape[:2], "int64")
    for b in range(tokens.shape[0]):
        for i in range(tokens.shape[1]):
            row = corrupted[b, i]
            if np.array_equal(row, tokens[b, i]):
                continue
            if np.array_equal(row, mask_vector):
                kinds[b, i] = 1
                continue
            others = [j for j in range(tokens.shape[1]) if j != i and np.array_equal(row, tokens[b, j])]
            assert others, f"position {(b, i)} is neither unchanged, [mask] nor another patch"
            kinds[b, i] = 2
    return kinds


def test_corruption_statistics_over_many_draws():
    batch, patches, draws = 32, 64, 10
    layer = masked.PatchCorruption(seed=3)
    tokens = np.random.default_rng(0).normal(size=(batch, patches, 8)).astype("float32")
    counts = np.zeros(3)
    per_position = np.zeros(patches)
    for _ in range(draws):
        out, mask = (np.asarray(t) for t in layer(tokens))
        kinds = _classify_corruption(tokens, out, np.asarray(layer.mask_embedding))
        np.testing.assert_array_equal(mask.sum(axis=1), patches // 2)  # Exactly 50% of every image.
        assert not kinds[mask == 0].any(), "an uncorrupted position changed"
        counts += np.bincount(kinds[mask == 1], minlength=3)
        per_position += mask.sum(axis=0)
    total = counts.sum()
    assert total == draws * batch * patches // 2
    for share, expected in zip(counts / total, (0.1, 0.8, 0.1)):  # unchanged, [mask], other patch
        tolerance = 5 * np.sqrt(expected * (1 - expected) / total)  # 5 binomial std: 0.0075 / 0.01
        assert abs(share - expected) < tolerance, (counts / total, tolerance)
    # Every position is corrupted half of the time (no positional bias).
    frequency = per_position / (draws * batch)
    assert np.all(np.abs(frequency - 0.5) < 5 * np.sqrt(0.25 / (draws * batch))), frequency


def test_corruption_is_deterministic_given_a_seed():
    tokens = np.random.default_rng(1).normal(size=(4, 16, 8)).astype("float32")

    def draws(seed):
        layer = masked.PatchCorruption(seed=seed)
        layer.build(tokens.shape)
        layer.mask_embedding.assign(np.ones(8, "float32"))
        return [np.asarray(layer(tokens)[0]) for _ in range(3)]

    first, again, other = draws(7), draws(7), draws(8)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[1], first[0])  # The generator advances between calls.
    assert not np.array_equal(first[0], other[0])


def test_layers_serialize():
    for layer in (masked.PatchCorruption(0.4, 0.7, 0.2, seed=5), masked.PatchTargets((8, 4), "4x4", 2, (-1, 1)),
                  masked.MaskedPatchHead("l2", patch_dim=192), masked.PatchTokens(0)):
        run_serialization_test(layer)


# === Targets, against NumPy loops ===


def _numpy_targets(images: np.ndarray, patch: int, target: str, bits: int = 3) -> np.ndarray:
    levels = 2 ** bits
    unit = images.astype("float64") / 255.0
    rows = []
    for image in unit:
        values = []
        for top in range(0, image.shape[0], patch):
            for left in range(0, image.shape[1], patch):
                block = image[top:top + patch, left:left + patch]
                if target == "l2":
                    values.append((2 * block - 1).reshape(-1))
                    continue
                cells = [block] if target == "mean" else [
                    block[r:r + patch // 4, c:c + patch // 4] for r in range(0, patch, patch // 4)
                    for c in range(0, patch, patch // 4)]
                ids = []
                for cell in cells:
                    red, green, blue = (min(int(v * levels), levels - 1) for v in cell.mean(axis=(0, 1)))
                    ids.append(red * levels * levels + green * levels + blue)
                values.append(ids[0] if target == "mean" else ids)
        rows.append(values)
    return np.array(rows)


@pytest.mark.parametrize("target", masked.TARGETS)
def test_targets_equal_numpy(target):
    images = _images(3)
    images[0, :8, :8] = 255.0  # A full-white patch: the top colour bin, 511.
    expected = _numpy_targets(images, 8, target)
    got = np.asarray(masked.patch_targets(images, 8, target))
    if target == "l2":
        np.testing.assert_allclose(got, expected, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, expected)
    if target == "mean":
        assert got[0, 0] == 511 and got.shape == (3, 16) and got.max() < 512


def test_targets_from_minus_one_to_one_input():
    images = _images(2)
    np.testing.assert_array_equal(masked.patch_targets(images / 127.5 - 1, 8, value_range=(-1, 1)),
                                  _numpy_targets(images, 8, "mean"))


# === Loss ===


@pytest.mark.parametrize("target", masked.TARGETS)
def test_only_corrupted_patches_count_in_the_loss(target):
    model = _tiny_masked(target)
    out = {key: np.asarray(value) for key, value in model(_images(2)).items()}
    mask = out["mask"]
    rng = np.random.default_rng(0)
    changed = out["predictions"] + rng.normal(size=out["predictions"].shape).astype("float32") * 5
    keep = mask.reshape(mask.shape + (1,) * (changed.ndim - 2)) == 1
    changed = np.where(keep, out["predictions"], changed)  # New predictions where mask == 0 only.
    loss = float(masked.masked_patch_loss(out["targets"], out["predictions"], mask, target))
    assert float(masked.masked_patch_loss(out["targets"], changed, mask, target)) == pytest.approx(loss, rel=1e-6)
    # NumPy reference: mean over corrupted patches of the per-patch loss.
    logits, targets = out["predictions"].astype("float64"), out["targets"]
    if target == "l2":
        per_patch = ((logits - targets) ** 2).mean(axis=-1)
    else:
        log_probs = logits - logits.max(-1, keepdims=True)
        log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
        nll = -np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        per_patch = nll.mean(axis=-1) if target == "4x4" else nll
    assert loss == pytest.approx(per_patch[mask == 1].mean(), rel=1e-5)
    assert float(model.compute_loss(y_pred=out)) == pytest.approx(loss, rel=1e-6)


# === Model: fit, round trip, transfer ===


def test_keras_round_trip_gives_the_same_outputs(tmp_path):
    model = masked.masked_patch_model(dict(input_shape=SHAPE, **TINY_HYBRID), target="4x4", seed=4)
    randomize(model)
    path = str(tmp_path / "masked.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, masked.MaskedPatchModel) and loaded.target == "4x4"
    images = _images(2)
    for _ in range(2):  # The corruption seed state travels with the weights: equal draws call after call.
        expected, got = model(images), loaded(images)
        for key in ("predictions", "targets", "mask"):
            np.testing.assert_allclose(np.asarray(got[key]), np.asarray(expected[key]), atol=1e-5)


@pytest.mark.parametrize("architecture", [TINY_VIT, TINY_HYBRID], ids=["plain", "hybrid"])
def test_encoder_weights_move_into_a_classifier_unchanged(architecture):
    model = masked.masked_patch_model(dict(input_shape=SHAPE, **architecture), seed=0)
    randomize(model, seed=1)  # Every weight away from its initialization (zero cls, unit norms).
    classifier = keras_vit.VisionTransformer(input_shape=SHAPE, classes=10, weights=None, **architecture)
    head_before = [np.array(w) for w in classifier.get_layer("head").weights]
    moved = masked.transfer_encoder_weights(model, classifier)
    assert "embedding" in moved and "encoder_norm" in moved and "cls" in moved
    assert ("conv_root" in moved) == ("resnet_stages" in architecture)
    for name in moved:
        for source, copied in zip(model.network.get_layer(name).weights, classifier.get_layer(name).weights):
            np.testing.assert_array_equal(np.asarray(source), np.asarray(copied))
    encoder_names = {layer.name for layer in classifier.layers if layer.weights} - {"head"}
    assert encoder_names == set(moved)  # Every classifier weight but the head came over.
    for before, after in zip(head_before, classifier.get_layer("head").weights):
        np.testing.assert_array_equal(before, np.asarray(after))
    with pytest.raises(ValueError, match="embedding"):
        wider = keras_vit.VisionTransformer(input_shape=SHAPE, weights=None, **{**architecture, "hidden_dim": 24})
        masked.transfer_encoder_weights(model, wider)


def test_wraps_a_given_model_and_shares_its_weights():
    vit = keras_vit.VisionTransformer(input_shape=SHAPE, classes=10, weights=None, include_preprocessing=False,
                                      **TINY_VIT)
    model = masked.masked_patch_model(vit, target="l2", seed=0)
    assert model.network.get_layer("embedding") is vit.get_layer("embedding")
    assert model.network.get_layer("targets").value_range == (-1.0, 1.0)  # No preprocessing layer: [-1, 1].
    with pytest.raises(ValueError, match="Unknown target"):
        masked.masked_patch_model(vit, target="colour")
    normalized = keras_vit.VisionTransformer(input_shape=SHAPE, weights=None, include_preprocessing=False,
                                             image_std=(0.25, 0.25, 0.25), **TINY_VIT)
    targets = masked.masked_patch_model(normalized, target="l2", seed=0).network.get_layer("targets")
    assert targets.value_range == (-2.0, 2.0)  # [0, 1] pixels through (x - 0.5) / 0.25


def test_encoder_weights_move_only_between_the_same_encoder_layers():
    model = _tiny_masked()
    with_norm_pre = keras_vit.VisionTransformer(input_shape=SHAPE, weights=None, norm_pre=True, **TINY_VIT)
    with pytest.raises(ValueError, match=r"encoder layers \['embedding', 'cls', 'posembed_input', 'encoderblock_0'"):
        masked.transfer_encoder_weights(model, with_norm_pre)


@pytest.mark.slow
def test_mixed_bfloat16_fit_step():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = _tiny_masked(seed=2)
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    before = np.array(model.network.get_layer("corruption").mask_embedding)
    history = model.fit(_images(4), epochs=1, batch_size=4, verbose=0).history
    loss = history["loss"][0]
    out = model(_images(2))
    assert np.isfinite(loss) and set(history) == {"loss", "masked_accuracy"}
    assert out["predictions"].dtype == "float32"
    assert model.network.get_layer("encoderblock_0").compute_dtype == "bfloat16"
    assert model.network.get_layer("corruption").mask_embedding.dtype == "float32"
    assert not np.array_equal(before, np.array(model.network.get_layer("corruption").mask_embedding))


MIRRORED_SCRIPT = textwrap.dedent("""
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras, numpy as np
    from keras_vit import masked
    from tests.testing import TINY_VIT, randomize
    images = np.random.default_rng(0).uniform(0, 255, (8, 32, 32, 3)).astype("float32")
    start, results = None, {}
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    for name, strategy in (("default", tf.distribute.get_strategy()), ("mirrored", mirrored)):
        with strategy.scope():
            # All patches masked: the corruption does not depend on how the batch is split.
            model = masked.masked_patch_model(dict(input_shape=(32, 32, 3), **TINY_VIT), seed=0,
                                              corruption_rate=1.0, mask_rate=1.0, random_rate=0.0)
            model.compile(optimizer=keras.optimizers.SGD(0.5))
        if start is None:
            randomize(model, scale=0.1)
            start = model.get_weights()
        model.set_weights(start)
        dataset = tf.data.Dataset.from_tensor_slices(images).batch(8)
        history = model.fit(dataset, epochs=2, verbose=0).history
        results[name] = (model.get_weights(), history["loss"])
    (a, loss_a), (b, loss_b) = results["default"], results["mirrored"]
    print("MAX DIFF:", max(float(np.max(np.abs(x - y))) for x, y in zip(a, b)))
    print("MAX CHANGE:", max(float(np.max(np.abs(x - y))) for x, y in zip(a, start)))
    print("LOSS DIFF:", max(abs(x - y) for x, y in zip(loss_a, loss_b)))
    print("LOSS DROP:", loss_a[0] - loss_a[1])
    # The stochastic corruption also runs under the strategy (its seed state is a mirrored variable).
    with mirrored.scope():
        model = masked.masked_patch_model(dict(input_shape=(32, 32, 3), **TINY_VIT), seed=0)
        model.compile(optimizer=keras.optimizers.Adam(1e-3))
    print("STOCHASTIC LOSS:", model.fit(dataset, epochs=1, verbose=0).history["loss"][0])
""")


@pytest.mark.slow
def test_mirrored_two_cpus_fit_on_images_matches_one_device():
    env = subprocess_env()
    result = subprocess.run([sys.executable, "-c", MIRRORED_SCRIPT], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    value = {key: float(result.stdout.split(key + ":")[1].split()[0])
             for key in ("MAX DIFF", "MAX CHANGE", "LOSS DIFF", "LOSS DROP", "STOCHASTIC LOSS")}
    assert value["MAX CHANGE"] > 1e-3, result.stdout  # Training moved the weights...
    assert value["MAX DIFF"] < 1e-5, result.stdout  # ...identically: the loss is scaled per replica.
    assert value["LOSS DIFF"] < 1e-5, result.stdout
    assert value["LOSS DROP"] > 0.1, result.stdout  # fit on images alone learns.
    assert np.isfinite(value["STOCHASTIC LOSS"]), result.stdout


# === The masked_patches recipe ===


@pytest.mark.slow
def test_masked_patches_recipe_defaults_and_outputs_start_finetune_and_fewshot(tmp_path):
    from keras_vit.training import configs, trainer

    paper = configs.get_config("masked_patches")
    assert (paper.optimizer, paper.weight_decay, paper.lr, paper.warmup_steps, paper.decay) == (
        "adamw", 0.0, 2e-4, 10_000, "cosine")  # Adam: AdamW without weight decay.
    assert (paper.batch_size, paper.corruption_rate, paper.masked_target, paper.target_bits) == (4096, 0.5, "mean", 3)
    tiny = [*TRAIN_VIT_OVERRIDES, "image_size=16", "batch_size=16", "epochs=1", "steps_per_epoch=2", "total_steps=0",
            "warmup_steps=1", "dataset=digits", "train_split=train", "eval_split=test", "shuffle_buffer=64",
            "masked_target=4x4"]
    config = configs.apply_overrides(paper, tiny)
    summary = trainer.train_and_evaluate(config, str(tmp_path / "mpp"), verbose=0)
    assert summary["optimizer_iterations"] == 2 and np.isfinite(summary["loss"]) and "masked_accuracy" in summary
    assert not os.path.exists(tmp_path / "mpp" / "backup" / "worker_0")  # Removed when the run completes.
    assert os.path.exists(tmp_path / "mpp" / "train_log.jsonl")
    trained = keras.saving.load_model(summary["model_path"])
    # A supervised fine-tune starts from the encoder weights, copied unchanged; its head is new.
    finetune = configs.apply_overrides(configs.get_config("digits"), [
        *TRAIN_VIT_OVERRIDES, "image_size=16", "recipe=finetune", f"weights={summary['encoder_weights_path']}"])
    classifier = trainer.build_model(finetune, 10)
    for layer in masked.encoder_layers(trained):
        for source, loaded in zip(layer.weights, classifier.get_layer(layer.name).weights):
            np.testing.assert_array_equal(np.asarray(source), np.asarray(loaded))
    # Few-shot evaluation reads the pooled features of encoder.keras.
    encoder = keras.saving.load_model(summary["encoder_path"])
    results = fewshot.digits_accuracy(encoder, shots=(1,), seeds=2)
    np.testing.assert_allclose(results[1], digits_few_shot_reference(encoder, shots=(1,), seeds=2)[1], atol=1e-12)


@pytest.mark.slow
def test_masked_digits_few_shot_matches_ridge_reference():
    """masked_digits measures few-shot accuracy on the training recipes' split (1,437 / 360 digits)."""
    from keras_vit import datasets
    from keras_vit.training import masked_digits

    encoder = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), include_top=False, pooling="token",
                                          weights=None)
    results = masked_digits.few_shot(encoder, shots=(1, 5), seeds=2)
    (train_x, train_y), (test_x, test_y) = (datasets.digits(split) for split in ("train", "test"))
    assert (len(train_y), len(test_y)) == (1437, 360)
    train_features, test_features = (encoder.predict(datasets.resize(x, (32, 32)), verbose=0)
                                     for x in (train_x, test_x))
    for k in (1, 5):
        expected = [ridge_few_shot_accuracy(train_features, train_y, test_features, test_y, k, seed) for seed in (0, 1)]
        np.testing.assert_allclose(results[k], (np.mean(expected), np.std(expected)), atol=1e-12)


@pytest.mark.slow
def test_masked_digits_rerun_after_a_stop_does_not_train_completed_runs_again(tmp_path, monkeypatch):
    """keras-vit-masked-digits stopped in its fine-tuning: the same call again trains only the runs not completed."""
    from keras_vit.training import masked_digits, trainer

    train_and_evaluate, trained, stop_at = trainer.train_and_evaluate, [], [2]

    def stopping(config, workdir, **options):  # Ctrl-C as the run numbered `stop_at` starts.
        if len(trained) == stop_at[0]:
            raise KeyboardInterrupt
        trained.append(os.path.basename(workdir))
        return train_and_evaluate(config, workdir, **options)

    monkeypatch.setattr(trainer, "train_and_evaluate", stopping)
    # The training runs' encoder (tests.testing.TRAIN_VIT at 16 px) and 2 pre-training steps an epoch: which runs
    # train again does not depend on the model's size or the epoch's length.
    monkeypatch.setattr(masked_digits, "_architecture", lambda classifier: [
        *TRAIN_VIT_OVERRIDES, "image_size=16", f"classifier={classifier}"])
    monkeypatch.setattr(masked_digits, "PRETRAIN", [*masked_digits.PRETRAIN, "steps_per_epoch=2"])
    tiny = dict(pretrain_epochs=1, shots=(1,), seeds=1, finetune_epochs=1, finetune_seeds=1)
    with pytest.raises(KeyboardInterrupt):
        masked_digits.measure(str(tmp_path), **tiny)
    assert trained == ["pretrain", "ft_scratch_0"] and not os.path.exists(tmp_path / "summary.json")
    stop_at[0] = -1
    result = masked_digits.measure(str(tmp_path), **tiny)
    assert trained == ["pretrain", "ft_scratch_0", "ft_pretrained_0"]  # Only the run that had not completed.
    completed = json.loads((tmp_path / "pretrain" / masked_digits.STAGE_FILE).read_text())
    assert result["pretrain"]["masked_loss"] == completed["summary"]["loss"]
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(result))
    # Another config trains again, and so does the fine-tuning from the encoder it changed; scratch is reused.
    masked_digits.measure(str(tmp_path), **{**tiny, "pretrain_epochs": 2})
    assert trained[3:] == ["pretrain", "ft_pretrained_0"]
    assert json.loads((tmp_path / "pretrain" / masked_digits.STAGE_FILE).read_text())["inputs"]["epochs"] == 2


@pytest.mark.parametrize("options, prefix", [
    (dict(num_register_tokens=2, no_embed_class=True, layer_scale_init=1e-5), 3),  # DINOv2: class + 2 registers
    (dict(distillation_token=True), 2),                                             # DeiT distilled
    (dict(classifier="map"), 0),                                                    # SigLIP: no prefix token
], ids=["dinov2_registers", "deit_distilled", "map"])
def test_masked_patch_model_predicts_the_patch_tokens_of_the_vit_family(options, prefix):
    model = masked.masked_patch_model(dict(TINY_VIT, input_shape=(32, 32, 3), **options), seed=0)
    assert model.network.get_layer("encoder_norm").output.shape[1] == prefix + 16  # a 4x4 grid and the prefix
    assert model.network.get_layer("patch_tokens").num_prefix_tokens == prefix
    outputs = model(_images(2))
    assert outputs["predictions"].shape[:2] == outputs["targets"].shape == (2, 16)  # one prediction per patch
