"""Tests for `training/` in this process: configs, optimizers, input pipelines, stops and resume, fine-tuning.

Tiny models and a few steps each; runs as processes (strategies, kills, the command line) are in
tests/training/test_training_runs.py. No test touches the network.
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_vit
from tests.testing import TRAIN_TINY, TRAIN_VIT, python_path, save_checkpoint, subprocess_env, vit_checkpoint
from keras_vit.training import configs, data, multihost, preemption, resume, supervised, trainer
from keras_vit.training.configs import Config


def tiny_config(*overrides: str, recipe: str = "digits") -> Config:
    return configs.apply_overrides(configs.get_config(recipe), [*TRAIN_TINY, *overrides])


def _write_images(folder, count: int, seed: int = 0) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    for i in range(count):
        Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(os.path.join(folder, f"{i}.png"))


# === Configs, schedule, optimizer ===


def test_overrides_parse_types_and_reject_unknown_fields():
    config = configs.apply_overrides(configs.get_config("finetune"), ["lr=0.01", "validate=false", "weights=/x.npz"])
    assert (config.lr, config.validate, config.weights, config.optimizer) == (0.01, False, "/x.npz", "sgd")
    with pytest.raises(ValueError, match="Unknown config field 'learning_rate'"):
        configs.apply_overrides(config, ["learning_rate=1"])
    with pytest.raises(ValueError, match="Override batch_size='big': expected an int."):
        configs.apply_overrides(config, ["batch_size=big"])
    with pytest.raises(ValueError, match="Override lr='fast': expected a float."):
        configs.apply_overrides(config, ["lr=fast"])
    with pytest.raises(ValueError, match="Unknown config 'imagenet'"):
        configs.get_config("imagenet")


def test_weights_that_state_their_architecture_replace_the_recipes():
    """`weights=` a file that states its architecture clears the recipe's architecture fields and classifier (the
    file's, with those overridden beside it); a `.weights.h5` file or a registered name keeps them; a field left 0
    without such a file is refused by name."""
    from keras_vit.training import recipe
    from tests.data.make_family_files import FOLDER

    folder = os.path.join(FOLDER, "timm_dinov3_112")
    config = configs.apply_overrides(configs.get_config("finetune"), [f"weights={folder}", "num_heads=2"])
    assert (config.variant, config.patch_size, config.hidden_dim, config.num_heads, config.classifier) == (
        "", 0, 0, 2, "")
    assert recipe.pooling(config) == "avg"  # timm's DINOv3 default: the patch tokens' mean
    assert (recipe.architecture(config).patch_size, recipe.architecture(config).hidden_dim) == (16, 32)
    for weights in ("/x/encoder.weights.h5", "imagenet21k"):
        kept = configs.apply_overrides(configs.get_config("finetune"), [f"weights={weights}"])
        assert (kept.variant, kept.patch_size, kept.classifier) == ("B/16", 16, "token")
    with pytest.raises(ValueError, match=r"^patch_size=0 takes the architecture of the weights file, but "
                                         r"weights='' is not a file that states one"):
        recipe.build_backbone(configs.apply_overrides(configs.get_config("digits"), ["patch_size=0"]))
    with pytest.raises(ValueError, match=r"^classifier='' takes the pooling of the weights file, but weights='w.h5'"):
        recipe.pooling(configs.apply_overrides(configs.get_config("digits"), ["classifier=", "weights=w.h5"]))


def test_configs_out_of_range_are_refused_naming_each_value():
    numeric = {field.name for field in dataclasses.fields(configs.Config) if field.type in ("int", "float")}
    assert set(configs.RANGES) == numeric  # Every number has its range.
    digits = configs.get_config("digits")
    with pytest.raises(ValueError, match=re.escape(
            "Config values out of range: grad_accum_steps=0 (expected >= 1); lr=-0.1 (expected >= 0); "
            "dropout_rate=1.5 (expected 0 to 1).")):
        configs.apply_overrides(digits, ["dropout_rate=1.5", "lr=-0.1", "grad_accum_steps=0"])
    with pytest.raises(ValueError, match=re.escape("mask_rate + random_rate = 1.05 (expected at most 1")):
        dataclasses.replace(configs.get_config("masked_patches"), mask_rate=0.95)
    with pytest.raises(ValueError, match=re.escape("target_bits=9 (expected 1 to 8)")):
        configs.Config(target_bits=9)
    edges = configs.apply_overrides(digits, ["dropout_rate=1", "lr=0", "batch_size=1", "target_bits=8", "epochs=0",
                                             "shuffle_buffer=0"])
    assert (edges.dropout_rate, edges.lr, edges.batch_size, edges.target_bits, edges.epochs, edges.shuffle_buffer) \
        == (1, 0, 1, 8, 0, 0)
    for name in configs.RECIPES:  # The paper's recipes are in range.
        configs.get_config(name)


def test_paper_defaults():
    pretrain, finetune = configs.get_config("pretrain"), configs.get_config("finetune")
    assert (pretrain.optimizer, pretrain.b1, pretrain.b2, pretrain.global_clipnorm) == ("adamw", 0.9, 0.999, 1.0)
    assert (finetune.optimizer, finetune.momentum, finetune.weight_decay, finetune.decay) == ("sgd", 0.9, 0.0, "cosine")
    assert (finetune.warmup_steps, finetune.batch_size * finetune.grad_accum_steps) == (500, 512)


@pytest.mark.parametrize("decay, quarter, three_quarters", [
    ("cosine", (2 + 2 ** 0.5) / 4, (2 - 2 ** 0.5) / 4),  # (1 + cos(pi t)) / 2 at t = 1/4 and 3/4
    ("linear", 0.75, 0.25),  # 1 - t
])
def test_warmup_then_decay(decay, quarter, three_quarters):
    """Linear warmup to the peak 2.0 over 10 steps, then the decay over 100 steps to 0."""
    schedule = trainer.WarmupDecay(2.0, warmup_steps=10, total_steps=110, decay=decay)
    values = [float(schedule(step)) for step in (0, 3, 5, 10, 35, 60, 85, 110, 130)]
    expected = [0.0, 0.6, 1.0, 2.0, 2.0 * quarter, 1.0, 2.0 * three_quarters, 0.0, 0.0]
    np.testing.assert_allclose(values, expected, atol=1e-6)


@pytest.mark.slow
def test_gradient_accumulation_updates_every_second_step():
    model = trainer.build_model(tiny_config(), num_classes=10)
    model.compile(trainer.make_optimizer(tiny_config("grad_accum_steps=2", "warmup_steps=0"), total_steps=10),
                  supervised.make_loss(tiny_config()))
    x, y = np.full((4, 16, 16, 3), 100.0, "float32"), np.eye(10, dtype="float32")[:4]
    start = model.get_weights()
    model.train_on_batch(x, y)
    assert int(model.optimizer.iterations) == 0
    assert all(np.array_equal(a, b) for a, b in zip(start, model.get_weights()))
    model.train_on_batch(x, y)
    assert int(model.optimizer.iterations) == 1
    assert not all(np.array_equal(a, b) for a, b in zip(start, model.get_weights()))



@pytest.mark.parametrize("keras_has_it", [True, False])
def test_synced_backup_takes_process_0s_state_or_without_the_keras_internal_each_its_own(
        tmp_path, monkeypatch, caplog, keras_has_it):
    """Process 1 of a simulated 2-process run: it takes process 0's weights, optimizer state and first epoch (Keras'
    private `model._initial_epoch`). The fallback, forced: without that attribute, no broadcast, its own state."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("adam", "mse")
    model.optimizer.build(model.trainable_variables)
    variables = [*model.variables, *model.optimizer.variables]
    own = [np.asarray(v.value) for v in variables]
    process_0 = [np.full(v.shape, 7, v.dtype) for v in variables] + [np.array(3, np.int64)]
    broadcasts = []
    monkeypatch.setattr(resume.multihost, "process_count", lambda: 2)
    monkeypatch.setattr(resume.multihost, "broadcast_from_process_0",
                        lambda values, strategy=None: broadcasts.append(values) or process_0)
    if not keras_has_it:
        monkeypatch.setattr(resume.SyncedBackupAndRestore, "INITIAL_EPOCH", "_not_in_this_keras")
    callback = resume.SyncedBackupAndRestore(str(tmp_path / "backup"))
    callback.set_model(model)
    callback.on_train_begin()
    if keras_has_it:
        assert len(broadcasts) == 1 and int(broadcasts[0][-1]) == -1  # no backup of its own: epoch -1
        assert model._initial_epoch == 3
        assert all(np.array_equal(np.asarray(v.value), expected) for v, expected in zip(variables, process_0))
    else:
        assert not broadcasts and model._initial_epoch is None
        assert all(np.array_equal(np.asarray(v.value), expected) for v, expected in zip(variables, own))
        assert "has no model._not_in_this_keras: each worker restores its own backup" in caplog.text


def test_broadcast_from_process_0_through_a_tf_distribute_strategy(monkeypatch):
    """The TensorFlow path of a multi-worker run, on one replica here (the replica of process 0): its values come
    back as NumPy arrays of their own dtypes, through the float64 all-reduce."""
    monkeypatch.setattr(resume.multihost, "process_count", lambda: 2)
    variable = keras.Variable(np.array([1.5, -2.25], np.float32))
    values = [variable.value, np.arange(6, dtype=np.float32).reshape(2, 3), np.array(3, np.int64)]
    out = resume.multihost.broadcast_from_process_0(values, tf.distribute.get_strategy())
    assert [(v.dtype, v.shape) for v in out] == [(np.float32, (2,)), (np.float32, (2, 3)), (np.int64, ())]
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(out, values))


def _adamw_pair(**kwargs) -> tuple[keras.optimizers.Optimizer, keras.optimizers.Optimizer]:
    return keras.optimizers.AdamW(**kwargs), trainer.AdamW(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(learning_rate=3e-3, weight_decay=0.05, global_clipnorm=1.0),
                                    dict(learning_rate=1e-2, beta_1=0.8, beta_2=0.95, epsilon=1e-6),
                                    dict(learning_rate=1e-2, amsgrad=True)])
def test_fused_adamw_update_equals_keras_adamw(kwargs):
    """Same variables and moments as keras.optimizers.AdamW after five steps on the same gradients."""
    rng = np.random.default_rng(0)
    start = [rng.normal(size=(4, 3)).astype("float32"), rng.normal(size=5).astype("float32")]
    grads = [[tf.constant(rng.normal(size=w.shape).astype("float32")) for w in start] for _ in range(5)]
    results = []
    for optimizer in _adamw_pair(**kwargs):
        variables = [keras.Variable(w) for w in start]
        for step_grads in grads:
            optimizer.apply_gradients(zip(step_grads, variables))
        results.append([v.numpy() for v in variables] + [v.numpy() for v in optimizer.variables])
    keras_values, fused_values = results
    assert np.max(np.abs(keras_values[0] - start[0])) > 1e-2  # the updates did move the variables
    for got, want in zip(fused_values, keras_values):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_fused_adamw_runs_one_kernel_per_variable():
    keras_adamw, fused_adamw = _adamw_pair(learning_rate=1e-3)
    variables = [keras.Variable(np.ones((3, 2), "float32")), keras.Variable(np.zeros(2, "float32"))]
    grads = [tf.ones((3, 2)), tf.ones(2)]
    for optimizer in (keras_adamw, fused_adamw):
        optimizer.build(variables)

    def op_types(optimizer):
        function = tf.function(lambda: optimizer.apply_gradients(zip(grads, variables)))
        return [op.type for op in function.get_concrete_function().graph.get_operations()]
    assert "ResourceApplyAdam" not in op_types(keras_adamw)
    assert op_types(fused_adamw).count("ResourceApplyAdam") == 2


# === Input pipelines and bad input ===


def test_digits_pipeline_shapes_and_split():
    datasets = data.make_datasets(tiny_config())
    images, labels = next(iter(datasets.train))
    assert images.shape == (16, 16, 16, 3) and labels.shape == (16, 10)
    assert float(tf.reduce_max(images)) <= 255.0 and (datasets.num_train_examples, datasets.num_eval_examples) == (
        1437, 360)


@pytest.mark.slow
def test_randaugment_and_mixup_give_soft_labels():
    datasets = data.make_datasets(tiny_config("randaugment=true", "mixup_alpha=0.4"))
    images, labels = next(iter(datasets.train))
    assert images.shape == (16, 16, 16, 3) and np.all(np.isfinite(images))
    np.testing.assert_allclose(tf.reduce_sum(labels, axis=-1), 1.0, rtol=1e-5)
    assert float(tf.reduce_min(tf.reduce_max(labels, axis=-1))) < 1.0 - 1e-6  # Some labels were mixed.


@pytest.mark.slow
def test_bfloat16_sigmoid_label_smoothing_run(tmp_path):
    summary = trainer.train_and_evaluate(
        tiny_config("precision=bfloat16", "loss=sigmoid", "label_smoothing=0.1", "epochs=1"), str(tmp_path),
        verbose=0)
    assert np.isfinite(summary["loss"]) and summary["optimizer_iterations"] == 3
    assert keras.mixed_precision.global_policy().name == "float32"  # Restored after the run.
    model = keras.saving.load_model(summary["model_path"], compile=False)
    assert model.get_layer("encoderblock_0").compute_dtype == "bfloat16" and model.output.dtype == "float32"


LOAD_WITHOUT_TRAINING = textwrap.dedent("""
    import sys, keras, numpy as np
    import keras_vit
    model = keras.saving.load_model(sys.argv[1])  # The default compile=True, as users call it.
    print("LOGITS SHAPE:", model.predict(np.zeros((2, 16, 16, 3), "float32"), verbose=0).shape)
    print("TRAINING IMPORTED:", "training" in sys.modules)
""")


@pytest.mark.slow
def test_saved_model_loads_without_the_training_package(tmp_path):
    summary = trainer.train_and_evaluate(tiny_config("epochs=1"), str(tmp_path / "run"), verbose=0)
    env = subprocess_env(PYTHONPATH=python_path())  # keras_vit: the installed one.
    result = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_TRAINING, summary["model_path"]], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "LOGITS SHAPE: (2, 10)" in result.stdout and "TRAINING IMPORTED: False" in result.stdout


def test_inception_crop_box_is_a_function_of_its_seed_at_its_own_size():
    """`random_box`, the Inception crop's box: part of the image at its own size (the square pipeline resizes it to
    image_size, the NaFlex one keeps its aspect ratio), the same box for the same seed."""
    image = tf.random.uniform((40, 30, 3), seed=1)
    boxes = [np.asarray(data.random_box(image, min_area=0.05, seed=tf.constant([seed, 7]))) for seed in (0, 0, 1, 2, 3)]
    np.testing.assert_array_equal(boxes[0], boxes[1])
    assert len({box.tobytes() for box in boxes}) == 4  # four seeds, four boxes
    assert all(box.shape[0] <= 40 and box.shape[1] <= 30 and box.shape[2] == 3 for box in boxes)
    assert len({box.shape for box in boxes}) > 1  # not resized: boxes of several shapes


def test_training_batches_are_the_same_for_the_same_seed():
    """The augmentations draw from per-example stateless seeds: two pipelines of one config give the same batches
    (the parallel map's thread order does not matter); another seed gives other batches."""
    def first_batches(seed):
        config = tiny_config("inception_crop=true", "crop_min_area=0.3", "random_flip=true", f"seed={seed}")
        return [images.numpy() for images, _ in data.make_datasets(config).train.take(3)]

    first, again, other = first_batches(0), first_batches(0), first_batches(1)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[0], other[0])


@pytest.mark.slow
def test_unknown_dataset_fails_fast_even_with_download():
    start = time.time()
    with pytest.raises(ValueError, match="Unknown dataset 'no_such_dataset_xyz'"):
        data.make_datasets(tiny_config("dataset=no_such_dataset_xyz", "download=true"))
    assert time.time() - start < 30


def test_tfds_not_prepared_fails_fast(tmp_path):
    with pytest.raises(FileNotFoundError, match="not prepared .* download=False"):
        data.make_datasets(tiny_config("dataset=mnist", f"data_dir={tmp_path}", "download=false"))


def test_tfds_by_name_with_mock_data(tmp_path):
    import tensorflow_datasets as tfds

    config = tiny_config("dataset=cifar10", "train_split=train[:98%]", f"data_dir={tmp_path}", "download=false",
                         "batch_size=4")
    with tfds.testing.mock_data(num_examples=8):
        datasets = data.make_datasets(config)
        images, labels = next(iter(datasets.train))
    assert images.shape == (4, 16, 16, 3) and labels.shape == (4, 10) and datasets.num_classes == 10


def test_empty_and_missing_image_folders(tmp_path):
    os.makedirs(tmp_path / "train" / "cat")
    with pytest.raises(ValueError, match="has no images"):
        data.folder_source(str(tmp_path), "train")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.folder_source(str(tmp_path), "test")


def test_a_large_image_folder_shows_a_progress_bar_while_it_is_checked(tmp_path, monkeypatch, capsys):
    _write_images(tmp_path / "train" / "cat", 3)
    (tmp_path / "train" / "cat" / "broken.png").write_bytes(b"not an image")
    monkeypatch.setattr(data, "PROGRESS_FROM", 5)
    assert data.folder_source(str(tmp_path), "train").skipped == 1
    assert capsys.readouterr().out == ""  # 4 files: below the threshold, quiet.
    monkeypatch.setattr(data, "PROGRESS_FROM", 4)
    assert data.folder_source(str(tmp_path), "train").num_examples == 3
    assert "4/4" in capsys.readouterr().out


@pytest.mark.slow
def test_image_folder_trains_and_counts_corrupt_images(tmp_path):
    for split, count in (("train", 6), ("test", 2)):
        for name in ("cat", "dog"):
            _write_images(tmp_path / "images" / split / name, count)
    (tmp_path / "images" / "train" / "dog" / "broken.jpg").write_bytes(b"not an image at all")
    config = tiny_config("dataset=folder", f"data_dir={tmp_path / 'images'}", "batch_size=4", "epochs=1",
                         "steps_per_epoch=2", "random_flip=true")
    summary = trainer.train_and_evaluate(config, str(tmp_path / "run"), verbose=0)
    assert summary["skipped_examples"] == 1 and summary["num_eval_examples"] == 4
    assert json.load(open(summary["eval_path"]))["top5"] == 1.0  # Two classes: top-5 is always right.
    assert os.path.exists(tmp_path / "run" / "checkpoints" / "last.weights.h5")
    assert os.listdir(tmp_path / "run" / "tensorboard")


@pytest.mark.slow
def test_image_folder_decodes_odd_files_and_skips_bad_ones(tmp_path):
    """Every valid format decodes as serving decodes it; corrupt, truncated, empty, oversized files,
    a folder and a FIFO named like images are skipped and counted, without a crash or a hang."""
    from keras_vit import image_io
    from tests import images as odd

    valid, bad = odd.valid_images(), odd.bad_images()
    extension = {"jpeg": ".jpg", "png": ".png", "gif": ".gif", "bmp": ".bmp"}
    for split in ("train", "test"):
        for name, payload in valid.items():
            folder = tmp_path / split / ("cat" if "png" in name else "dog")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{name}{extension[name.split('_')[0]]}").write_bytes(payload)
    train_dog = tmp_path / "train" / "dog"
    for name, (_, payload, _) in bad.items():
        kind = next((k for k in extension if k in name), "png")
        (train_dog / f"{name}{extension[kind]}").write_bytes(payload)
    (train_dog / "folder.jpg").mkdir()
    os.mkfifo(train_dog / "pipe.png")  # Reading it would block forever.
    start = time.time()
    source = data.folder_source(str(tmp_path), "train")
    assert source.skipped == len(bad) + 2 and source.num_examples == len(valid)
    decoded = [(image.numpy(), int(label)) for image, label in source.dataset]
    in_order = sorted(valid, key=lambda n: ("png" not in n, n))  # cat (PNGs) first, then dog; by file name.
    assert len(decoded) == len(in_order)
    for (image, label), name in zip(decoded, in_order):
        np.testing.assert_array_equal(image, image_io.decode_rgb(tf.constant(valid[name])).numpy(), err_msg=name)
        assert label == (0 if "png" in name else 1)
    config = tiny_config("dataset=folder", f"data_dir={tmp_path}", "batch_size=4", "epochs=1", "steps_per_epoch=2")
    datasets = data.make_datasets(config)
    assert datasets.skipped == len(bad) + 2
    images, labels = next(iter(datasets.train))
    assert images.shape == (4, 16, 16, 3) and np.isfinite(images.numpy()).all()
    assert time.time() - start < 60


def _input_iterators() -> list:
    """The tf.data iterators alive in this process."""
    return [item for item in gc.get_objects() if isinstance(item, tf.data.Iterator)]


@pytest.mark.slow
def test_nan_loss_stops_with_message_and_keeps_last_good_checkpoint(tmp_path):
    class PoisonWeights(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                self.model.get_layer("head").kernel.assign(np.full(self.model.get_layer("head").kernel.shape, np.nan))

    before = {id(item) for item in _input_iterators()}
    with pytest.raises(trainer.NaNLossError, match=r"Loss became nan at epoch 2, batch 1"):
        trainer.train_and_evaluate(tiny_config("epochs=3"), str(tmp_path), callbacks=[PoisonWeights()], verbose=0)
    # Nothing of the stopped input pipeline is left for a later garbage collection.
    assert [item for item in _input_iterators() if id(item) not in before] == []
    assert os.listdir(tmp_path / "backup" / "worker_0")  # The epoch-1 backup survives for a restart.
    model = trainer.build_model(tiny_config(), num_classes=10)
    model.load_weights(str(tmp_path / "checkpoints" / "last.weights.h5"))
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert not os.path.exists(tmp_path / "model.keras")


class InterruptAt(keras.callbacks.Callback):
    """Ctrl-C (as in a notebook) once the optimizer has made `step` updates."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.model.optimizer.iterations.numpy() == self.step:
            raise KeyboardInterrupt


@pytest.mark.slow
def test_interrupt_mid_epoch_frees_the_pipeline_and_resumes(tmp_path):
    config = tiny_config("epochs=3", "steps_per_epoch=4")
    before = {id(item) for item in _input_iterators()}
    with pytest.raises(KeyboardInterrupt, match=r"resumes from its last backup in .*backup"):
        # Mid-way through the second epoch.
        trainer.train_and_evaluate(config, str(tmp_path), callbacks=[InterruptAt(6)], verbose=0)
    assert [item for item in _input_iterators() if id(item) not in before] == []
    # The same call resumes from the end of epoch 1 and runs the 3 x 4 steps in all.
    summary = trainer.train_and_evaluate(config, str(tmp_path), verbose=0)
    assert summary["optimizer_iterations"] == 12 and os.path.exists(summary["model_path"])


class SigtermAt(keras.callbacks.Callback):
    """A real SIGTERM to this process (as a preempted VM's) as optimizer step `step + 1` begins."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def on_train_batch_begin(self, batch, logs=None):
        if trainer.optimizer_iterations(self.model) == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_fit_plan_trains_the_rest_of_a_partly_trained_epoch_first():
    assert trainer.fit_plan(0, 4, 3) == [(3, 4)]
    assert trainer.fit_plan(7, 4, 3) == [(2, 1), (3, 4)]  # epoch 2's last step, then epoch 3
    assert trainer.fit_plan(8, 4, 3) == [(3, 4)]
    assert trainer.fit_plan(12, 4, 3) == [(3, 4)]  # trained: `fit` runs no epoch


@pytest.mark.slow
@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="Python takes signal handlers in the main thread only")
@pytest.mark.parametrize("accumulation", [1, 2])
def test_sigterm_mid_epoch_stops_after_its_step_and_the_rerun_resumes_there_as_never_stopped(tmp_path, accumulation):
    """A SIGTERM in step 6 of 12 (epoch 2 of 3, shuffled data): the run ends after that step with its backup; the
    same call resumes at step 6 (the rest of epoch 2, then epoch 3, on the data that comes next) and ends with
    the weights and loss of the run never stopped. With 2 micro-batches an update, it stops at an update's end."""
    config = tiny_config("epochs=3", "steps_per_epoch=4", "shuffle_buffer=64", f"grad_accum_steps={accumulation}")
    straight = trainer.train_and_evaluate(config, str(tmp_path / "straight"), verbose=0)
    stopped_dir, handler = tmp_path / "stopped", signal.getsignal(signal.SIGTERM)
    with pytest.raises(preemption.Preempted) as stop:
        trainer.train_and_evaluate(config, str(stopped_dir), callbacks=[SigtermAt(5 // accumulation)], verbose=0)
    assert stop.value.backed_up and stop.value.step == 6 // accumulation, str(stop.value)
    assert signal.getsignal(signal.SIGTERM) == handler  # the run's own handler is gone
    resumed = trainer.train_and_evaluate(config, str(stopped_dir), verbose=0)
    starts = [json.loads(line) for line in (stopped_dir / "train_log.jsonl").read_text().splitlines()]
    assert starts == [{"initial_epoch": 0, "optimizer_iterations": 0},
                      {"initial_epoch": 1, "optimizer_iterations": 6 // accumulation}]
    assert resumed["optimizer_iterations"] == straight["optimizer_iterations"] == 12 // accumulation
    assert resumed["loss"] == pytest.approx(straight["loss"], rel=1e-6, abs=1e-7)
    for got, want in zip(*(keras.saving.load_model(summary["model_path"], compile=False).get_weights()
                           for summary in (resumed, straight))):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    rows = list(csv.DictReader(open(stopped_dir / "history.csv")))
    assert [row["epoch"] for row in rows] == ["0", "1", "2"]  # no row for the stopped part of epoch 2


def test_stop_at_step_asks_the_processes_at_each_update_and_stops_where_any_was_signalled():
    """`StopAtStep` asks `agree` (`multihost.any_process` in a multi-process run) with this process's request at
    each update's end only (2 micro-batches an update here); where another process was signalled (`agree` says so,
    this request unmarked) it saves and stops all the same, `here=False`. One process: `any_process` is the flag."""
    asked, saved = [], []
    request = preemption.StopRequest(grace_s=30)
    stop = preemption.StopAtStep(request, lambda: saved.append(True) or True, first_batch=2, accumulation=2,
                                 agree=lambda flag: asked.append(flag) or len(asked) == 2)
    for batch in range(3):
        stop.on_train_batch_end(batch)
    with pytest.raises(preemption.Preempted, match=r"^Preempted \(SIGTERM to another process of the run\) after "
                                                   r"step 3: its backup is written$") as stopped:
        stop.on_train_batch_end(3)
    assert asked == [False, False] and saved == [True] and not stopped.value.here and request.finished.is_set()
    assert multihost.any_process(True) is True and multihost.any_process(False) is False


@pytest.mark.slow
@pytest.mark.parametrize("keras_has_it", [True, False])
def test_interrupt_in_the_final_evaluation_resumes_without_training_again(tmp_path, monkeypatch, caplog,
                                                                          keras_has_it):
    """Ctrl-C once `fit` has finished: the backup is kept, and holds the trained state (the end of training saves it,
    backups every 2 steps of 3), so the same call only evaluates. The fallback, forced: without Keras' private
    `_save_model`, the backup is the last step save (epoch 2, batch 3) and the resume trains epoch 2 again."""
    evaluate = keras.Model.evaluate

    def interrupted_once(self, *args, **kwargs):
        monkeypatch.setattr(keras.Model, "evaluate", evaluate)
        raise KeyboardInterrupt

    monkeypatch.setattr(keras.Model, "evaluate", interrupted_once)
    if not keras_has_it:
        monkeypatch.setattr(resume.SyncedBackupAndRestore, "SAVE", "_not_in_this_keras")
    config = tiny_config("backup_every_steps=2")
    with pytest.raises(KeyboardInterrupt, match=r"resumes from its last backup in .*backup"):
        trainer.train_and_evaluate(config, str(tmp_path), verbose=0)
    metadata = json.loads((tmp_path / "backup" / "worker_0" / "training_metadata.json").read_text())
    summary = trainer.train_and_evaluate(config, str(tmp_path), verbose=0)
    starts = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    if keras_has_it:
        assert metadata == {"epoch": 2, "batch": 0}
        assert starts == [{"initial_epoch": 0, "optimizer_iterations": 0},
                          {"initial_epoch": 2, "optimizer_iterations": 6}]  # evaluated, no step trained
        assert summary["optimizer_iterations"] == 6
    else:
        assert metadata == {"epoch": 1, "batch": 2}
        assert "has no BackupAndRestore._not_in_this_keras" in caplog.text
        assert starts[1] == {"initial_epoch": 1, "optimizer_iterations": 6} and summary["optimizer_iterations"] == 9
    assert os.path.exists(summary["model_path"]) and 0 <= summary["top1"] <= 1
    assert not (tmp_path / "backup" / "worker_0").exists()  # Deleted once the run's files are saved.


@pytest.mark.slow
def test_resume_keeps_the_model_and_optimizer_and_names_what_changed(tmp_path, caplog):
    """A backup is resumed only with its model and optimizer: another is refused before anything loads (Keras
    would fail on the model's variables, and drop another optimizer's state, restarting the schedule). A lower
    learning rate, as after a NaN stop, resumes with a warning and is recorded for the next resume."""
    with pytest.raises(KeyboardInterrupt):
        trainer.train_and_evaluate(tiny_config(), str(tmp_path), callbacks=[InterruptAt(4)], verbose=0)
    recorded = tmp_path / "backup" / "worker_0" / "config.json"
    assert json.loads(recorded.read_text()) == json.loads(json.dumps(dataclasses.asdict(tiny_config())))
    backup = sorted(os.listdir(recorded.parent))
    for changed, named in [("hidden_dim=32", "hidden_dim 16 -> 32"), ("optimizer=sgd", "optimizer 'adamw' -> 'sgd'")]:
        with pytest.raises(resume.ResumeConfigError, match=(
                rf"^{tmp_path} holds the backup of a run with another model or optimizer \({named}\)\. Resume it with "
                rf"the config it was made with, or train in a new workdir \(with the same model, "
                rf"weights={tmp_path}/checkpoints/last.weights.h5 starts")):
            trainer.train_and_evaluate(tiny_config(changed), str(tmp_path), verbose=0)
        assert sorted(os.listdir(recorded.parent)) == backup
    summary = trainer.train_and_evaluate(tiny_config("lr=1e-4"), str(tmp_path), verbose=0)
    assert "with a changed config: lr 0.002 -> 0.0001." in caplog.text
    assert summary["optimizer_iterations"] == 6 and not recorded.parent.exists()


def test_a_url_workdir_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^workdir 'gs://bucket/run' is a URL; the training workdir is a local path"):
        trainer.train_and_evaluate(tiny_config(), "gs://bucket/run", verbose=0)
    assert os.listdir(tmp_path) == []  # no local folder "gs:"


@pytest.mark.slow
def test_a_second_run_of_a_workdir_is_refused_while_the_first_trains(tmp_path, monkeypatch):
    """Two runs of one workdir would overwrite each other's backups: the second stops before it touches anything.
    The lock goes with the first run (a SIGKILLed run's too: tests/training/test_training_runs.py).
    Without `fcntl` (Windows) no lock is taken."""
    with resume.exclusive_backup(str(tmp_path), 0):
        with pytest.raises(resume.RunInProgressError, match=(
                rf"^Another process \(process {os.getpid()} on .+\) is training in {tmp_path}: its backup "
                rf"{tmp_path}/backup/worker_0 is locked\. Wait for that run to end or stop it, or train in another")):
            trainer.train_and_evaluate(tiny_config(), str(tmp_path), verbose=0)
        assert os.listdir(tmp_path / "backup" / "worker_0") == ["lock"]
        with monkeypatch.context() as no_fcntl:
            no_fcntl.setitem(sys.modules, "fcntl", None)
            with resume.exclusive_backup(str(tmp_path), 0):
                pass
    summary = trainer.train_and_evaluate(tiny_config(), str(tmp_path), verbose=0)
    assert summary["optimizer_iterations"] == 6 and not (tmp_path / "backup" / "worker_0").exists()


# === Fine-tuning ===


def _finetune_loss_falls(tmp_path, weights: str, image_size: int, epochs: int = 4) -> None:
    config = tiny_config(f"weights={weights}", f"image_size={image_size}", f"epochs={epochs}", "steps_per_epoch=8",
                         "recipe=finetune", "optimizer=sgd", "lr=0.03", "weight_decay=0", "warmup_steps=1",
                         "shuffle_buffer=2000", "inception_crop=false")
    trainer.train_and_evaluate(config, str(tmp_path / "ft"), verbose=0)
    with open(tmp_path / "ft" / "history.csv") as f:
        losses = [float(row["loss"]) for row in csv.DictReader(f)]
    # The zero-initialized head starts at exactly ln(10) = 2.303.
    assert losses[-1] < losses[0] - 0.15 and losses[-1] < np.log(10) - 0.2, losses


@pytest.mark.slow
def test_finetune_from_weights_h5_new_zero_head_and_loss_falls(tmp_path):
    keras.utils.set_random_seed(1)
    backbone = keras_vit.VisionTransformer(**TRAIN_VIT, include_top=False, pooling="token", input_shape=(16, 16, 3))
    path = str(tmp_path / "backbone.weights.h5")
    backbone.save_weights(path)
    model = trainer.build_model(tiny_config(f"weights={path}", "recipe=finetune"), num_classes=7)
    assert model.output.shape == (None, 7) and not model.get_layer("head").kernel.numpy().any()
    np.testing.assert_array_equal(model.get_layer("embedding").get_weights()[0],
                                  backbone.get_layer("embedding").get_weights()[0])
    _finetune_loss_falls(tmp_path, path, image_size=16, epochs=6)


@pytest.mark.slow
def test_finetune_from_original_npz_at_another_resolution(tmp_path):
    path = str(tmp_path / "ViT-tiny.npz")
    # An ImageNet-21k style checkpoint pre-trained at 16 px (2x2 patches); fine-tuned at 32 px (4x4).
    save_checkpoint(path, vit_checkpoint(TRAIN_VIT, grid=2, classes=21843, representation_size=16,
                                         vector_scale=0.02))
    # 16 epochs: the loss falls far enough whatever the checkpoint's random draw (checked for seeds 0-3).
    _finetune_loss_falls(tmp_path, path, image_size=32, epochs=16)


@pytest.mark.parametrize("tf_config, expected", [
    (None, 0),
    ({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}, 1),
    ({"cluster": {"chief": ["c:1"], "worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}, 0),
    ({"cluster": {"chief": ["c:1"], "worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}, 1),
])
def test_process_index_is_unique_per_process(monkeypatch, tf_config, expected):
    from keras_vit.training import multihost

    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    assert multihost.process_index() == expected and multihost.process_count() == (1 if tf_config is None else 2)
    assert multihost.is_writer() == (expected == 0) and multihost.shard() == multihost.Shard()


@pytest.mark.parametrize("classifier, pooling", [("token", "token"), ("gap", "avg"), ("map", "map")])
def test_finetune_backbone_pools_as_its_classifier(classifier, pooling):
    config = configs.apply_overrides(configs.get_config("digits"), [f"classifier={classifier}", "weights=w.npz"])
    assert supervised.FINETUNE.backbone(config, 10) == dict(include_top=False, pooling=pooling)
