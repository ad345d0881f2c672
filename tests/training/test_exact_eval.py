"""Exact evaluation on any split: the last eval batch is padded with weight-0 rows (`data.exact_batches`), so every
example counts once, on one device or many, on TensorFlow (tf.distribute) and JAX (keras.distribution)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from keras_vit.training import data, supervised
from tests.training.test_multihost import _env, _run_processes
from tests.testing import REPO, free_ports, subprocess_env


def _examples(count: int) -> tf.data.Dataset:
    images = np.arange(count * 2, dtype="float32").reshape(count, 2) + 1
    labels = np.eye(3, dtype="float32")[np.arange(count) % 3]
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(4)


@pytest.mark.parametrize("count, batch, batches, known", [(10, 4, 3, True), (8, 4, 2, True), (1, 8, 1, True),
                                                     (449, 32, 15, True), (10, 4, 3, False), (8, 4, 2, False)])
def test_every_example_once_in_full_batches(count, batch, batches, known):
    dataset = data.exact_batches(_examples(count), batch, num_batches=batches if known else None)
    assert int(dataset.cardinality()) == (batches if known else tf.data.UNKNOWN_CARDINALITY)
    rows = list(dataset.as_numpy_iterator())
    assert len(rows) == batches and all(images.shape == (batch, 2) for images, _, _ in rows)
    weights = np.concatenate([w for _, _, w in rows])
    images = np.concatenate([x for x, _, _ in rows])
    assert weights.sum() == count and set(np.unique(weights)) <= {0.0, 1.0}
    np.testing.assert_array_equal(images[:count], np.arange(count * 2, dtype="float32").reshape(count, 2) + 1)
    assert not images[count:].any() and not weights[count:].any()


def test_a_smaller_shard_steps_as_often_as_the_largest():
    """A process whose shard is smaller pads to the others' batch count (else it would leave a collective
    waiting), with batches of padding only where its examples run out."""
    shards = [data.multihost.Shard(i, 4) for i in range(4)]
    sizes = [shard.size(5) for shard in shards]
    assert sizes == [2, 1, 1, 1]
    batches = -(-max(sizes) // 1)
    for size in sizes:
        rows = list(data.exact_batches(_examples(size), 1, num_batches=batches).as_numpy_iterator())
        assert len(rows) == 2 and [float(w[0]) for _, _, w in rows] == [1.0] * size + [0.0] * (2 - size)


def test_weighted_metrics_and_loss_count_only_real_rows():
    import keras
    config = type("C", (), {"loss": "softmax", "label_smoothing": 0.0})()
    compiled = supervised._compile(config, 3)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(7, 3)).astype("float32")
    labels = np.eye(3, dtype="float32")[rng.integers(0, 3, 7)]
    top1, _, loss = compiled["weighted_metrics"]
    padded_logits = np.concatenate([logits, rng.normal(size=(1, 3)).astype("float32")])
    padded_labels = np.concatenate([labels, np.zeros((1, 3), "float32")])
    weights = np.array([1.0] * 7 + [0.0], "float32")
    top1.update_state(padded_labels, padded_logits, sample_weight=weights)
    loss.update_state(padded_labels, padded_logits, sample_weight=weights)
    assert float(top1.result()) == pytest.approx((logits.argmax(1) == labels.argmax(1)).mean())
    log_softmax = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    assert float(loss.result()) == pytest.approx(-(labels * log_softmax).sum(1).mean(), rel=1e-5)
    assert isinstance(compiled["loss"], keras.losses.CategoricalCrossentropy)


# === 449 digits written as PNG files (25% of scikit-learn's 1,797), one set of weights, 1, 2 and 8 devices ===

EVAL_SCRIPT = textwrap.dedent("""
    import json, os, sys
    backend, folder, weights = sys.argv[1:4]
    if backend == "tensorflow":
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
    import keras
    from keras_vit.training import configs, data, distribute, multihost, trainer
    cluster = multihost.Cluster.from_flags_and_env()
    if cluster.given:  # 2 processes: each reads its half of the folder; 1 or 4 of each one's devices.
        multihost.initialize(cluster, join_timeout_s=60, heartbeat_timeout_s=10)
    config = configs.apply_overrides(configs.get_config("digits"), [
        *sys.argv[4:], "dataset=folder", f"data_dir={folder}", "train_split=train", "eval_split=test",
        "batch_size=32"])
    datasets = data.make_datasets(config)
    report = {}
    for count in ((2, 8) if cluster.given else (1, 2, 8)):
        if backend == "jax":
            import jax
            devices = [d for p in range(jax.process_count())
                       for d in [d for d in jax.devices() if d.process_index == p][:count // jax.process_count()]]
            strategy = (keras.distribution.DataParallel(devices=[f"cpu:{d.id}" for d in devices],
                                                        auto_shard_dataset=False) if count > 1 else None)
        else:
            import tensorflow as tf
            strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(count)])
        with distribute.build_scope(strategy):
            model = trainer.build_model(config, datasets.num_classes)
            model.load_weights(weights)
            model.compile(optimizer="sgd", **trainer.recipe_of(config).compile(config, datasets.num_classes))
        with distribute.run_scope(strategy):
            results = trainer.exact_results(model.evaluate(trainer.evaluation_data(config, datasets),
                                                           return_dict=True, verbose=0))
        report[count] = dict(results, replicas=distribute.num_replicas(strategy))
    if multihost.is_writer():
        print("REPORT:" + json.dumps(report))
""")


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory):
    """scikit-learn's digits as 8x8 PNG files in train/ and test/ class folders: a stratified 25% held out, less one
    image (449: no device count above 1 divides it). The test only evaluates: train/ holds 4 images of each class
    (its class folders name the classes), so that each process checks 40 training files, not 1,347."""
    from PIL import Image
    from keras_vit import datasets
    root = tmp_path_factory.mktemp("digits_folder")
    for split in ("train", "test"):
        images, labels = datasets.digits(split, test_fraction=0.25)
        if split == "test":
            images, labels = images[:449], labels[:449]
        else:
            chosen = np.concatenate([np.flatnonzero(labels == label)[:4] for label in range(10)])
            images, labels = images[chosen], labels[chosen]
        for index, (image, label) in enumerate(zip(images, labels)):
            folder = root / split / str(int(label))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.asarray(image, np.uint8)).save(folder / f"{index}.png")
    return root


@pytest.mark.slow
def test_top1_of_449_images_is_the_same_on_1_2_8_devices_and_2_jax_processes(digits_folder, tmp_path):
    from keras_vit.training import configs, trainer
    from tests.testing import TRAIN_VIT_OVERRIDES
    overrides = [*TRAIN_VIT_OVERRIDES, "image_size=16"]
    config = configs.apply_overrides(configs.get_config("digits"), [
        *overrides, "dataset=folder", f"data_dir={digits_folder}", "train_split=train", "eval_split=test",
        "batch_size=32"])
    datasets = data.make_datasets(config)
    assert datasets.num_eval_examples == 449
    model = trainer.build_model(config, datasets.num_classes)
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()])
    model.save_weights(tmp_path / "model.weights.h5")
    # The NumPy count: the model's predictions on every eval image, one at a time, against the labels.
    images, labels = zip(*[(x, y) for batch_x, batch_y in datasets.eval.as_numpy_iterator()
                           for x, y in zip(batch_x, batch_y)])
    logits = np.concatenate([np.asarray(model(np.stack(images[i:i + 50]), training=False))
                             for i in range(0, len(images), 50)])
    correct = int((logits.argmax(1) == np.argmax(labels, 1)).sum())
    assert 20 < correct < 429, correct  # neither all right nor all wrong: the count can tell
    table = {}
    # TensorFlow in one process (1, 2 and 8 devices); JAX in two (2 and 8 devices: each process pads its half, the
    # single process's case of the same padding).
    done = subprocess.run([sys.executable, "-c", EVAL_SCRIPT, "tensorflow", str(digits_folder),
                           str(tmp_path / "model.weights.h5"), *overrides],
                          cwd=REPO, env=subprocess_env(KERAS_BACKEND="tensorflow"), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    table["tensorflow"] = json.loads(done.stdout.split("REPORT:", 1)[1])
    port = free_ports(1)[0]
    script = [sys.executable, "-c", EVAL_SCRIPT, "jax", str(digits_folder), str(tmp_path / "model.weights.h5"),
              *overrides]
    runs = _run_processes([script, script], [_env(i, port, devices=4) for i in (0, 1)], 900)
    assert all(run.returncode == 0 for run in runs), runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    table["jax_2_processes"] = json.loads(runs[0].stdout.split("REPORT:", 1)[1])
    print(json.dumps({"numpy_correct": correct, **table}))
    for backend, rows in table.items():
        for count, row in rows.items():
            assert row["replicas"] == int(count)
            assert round(row["top1"] * 449) == correct and row["top1"] == pytest.approx(correct / 449, abs=1e-6), \
                (backend, count, row["top1"], correct)
            assert row["loss"] == pytest.approx(table["tensorflow"]["1"]["loss"], rel=1e-4), (backend, count)
