"""`train_and_evaluate(config, workdir)`: `model.fit` under a tf.distribute strategy with
crash-safe backups, best/last weights, TensorBoard, NaN stop and a final top-1/top-5 evaluation.

Layout of `workdir` (worker `i > 0` of a multi-worker run writes the same under `workdir/worker_<i>/`):
    backup/worker_<i>/     keras.callbacks.BackupAndRestore (deleted when a run completes); on restart
                           every worker takes the chief's restored state (SyncedBackupAndRestore)
    checkpoints/last.weights.h5, checkpoints/best.weights.h5
    tensorboard/           TensorBoard scalars
    history.csv            one row per epoch, appended across restarts
    train_log.jsonl        one line per (re)start: first epoch and optimizer iterations
    model.keras, model.eval.json
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

import keras_vit
from . import data as data_lib
from . import distribute
from .configs import Config

PRECISIONS = {"float32": "float32", "bfloat16": "mixed_bfloat16"}


class NaNLossError(FloatingPointError):
    """Training produced a non-finite loss."""


# === Model, optimizer, loss ===


@keras.saving.register_keras_serializable(package="keras_vit_training")
class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup from 0 to `peak` over `warmup_steps`, then cosine or linear decay to 0 at `total_steps`."""

    def __init__(self, peak: float, warmup_steps: int, total_steps: int, decay: str = "cosine"):
        if decay not in ("cosine", "linear"):
            raise ValueError(f"Unknown decay {decay!r}. Expected 'cosine' or 'linear'.")
        self.peak, self.warmup_steps, self.total_steps, self.decay = peak, warmup_steps, total_steps, decay

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        warmup = step / max(self.warmup_steps, 1)
        progress = tf.clip_by_value((step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1), 0., 1.)
        decayed = 0.5 * (1.0 + tf.cos(math.pi * progress)) if self.decay == "cosine" else 1.0 - progress
        return self.peak * tf.where(step < self.warmup_steps, warmup, decayed)

    def get_config(self):
        return dict(peak=self.peak, warmup_steps=self.warmup_steps, total_steps=self.total_steps, decay=self.decay)


class FusedAdamUpdate:
    """Optimizer mixin for Keras Adam/AdamW: each variable's update is TensorFlow's fused
    `ResourceApplyAdam` kernel, one op instead of Keras' dozen (the same formula in the same
    order); its measured effect is in benchmarks/RESULTS.md. AMSGrad keeps Keras' update."""

    def update_step(self, gradient, variable, learning_rate):
        if self.amsgrad:
            return super().update_step(gradient, variable, learning_rate)
        dtype = variable.dtype
        index = self._get_variable_index(variable)
        step = tf.cast(self.iterations + 1, dtype)
        beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
        tf.raw_ops.ResourceApplyAdam(
            var=variable.handle, m=self._momentums[index].handle, v=self._velocities[index].handle,
            beta1_power=tf.pow(beta_1, step), beta2_power=tf.pow(beta_2, step), lr=tf.cast(learning_rate, dtype),
            beta1=beta_1, beta2=beta_2, epsilon=tf.cast(self.epsilon, dtype), grad=tf.cast(gradient, dtype))


@keras.saving.register_keras_serializable(package="keras_vit_training")
class AdamW(FusedAdamUpdate, distribute.AllReducedClipping, keras.optimizers.AdamW):
    """keras.optimizers.AdamW with the fused update, clipping the all-reduced gradient under tf.distribute."""


@keras.saving.register_keras_serializable(package="keras_vit_training")
class SGD(distribute.AllReducedClipping, keras.optimizers.SGD):
    """keras.optimizers.SGD clipping the all-reduced gradient under tf.distribute."""


def build_model(config: Config, num_classes: int) -> keras.Model:
    """The ViT of `config`, returning logits, with `weights=config.weights` passed to the builder.

    `pretrain` keeps the builder's head (and pre-logits). `finetune` builds the backbone without a
    head at the new resolution (the weights loader resizes position embeddings), drops the
    pre-logits and adds one zero-initialized Dense head for `num_classes`.
    """
    architecture = {} if config.variant else dict(
        patch_size=config.patch_size, hidden_dim=config.hidden_dim, mlp_dim=config.mlp_dim,
        num_heads=config.num_heads, num_layers=config.num_layers)
    common = dict(weights=config.weights or None, input_shape=(config.image_size, config.image_size, 3),
                  classifier=config.classifier, dropout_rate=config.dropout_rate,
                  attention_dropout_rate=config.attention_dropout_rate, drop_path_rate=config.drop_path_rate,
                  **architecture)
    if config.recipe == "pretrain":
        return keras_vit.VisionTransformer(config.variant or None, classes=num_classes, classifier_activation=None,
                                           representation_size=config.representation_size or None, **common)
    if config.recipe != "finetune":
        raise ValueError(f"Unknown recipe {config.recipe!r}. Expected 'pretrain' or 'finetune'.")
    if not config.weights:
        raise ValueError("recipe='finetune' needs weights=<.npz or .weights.h5 path, or a registered name>.")
    backbone = keras_vit.VisionTransformer(config.variant or None, include_top=False,
                                           pooling="token" if config.classifier == "token" else "avg", **common)
    logits = keras.layers.Dense(num_classes, kernel_initializer="zeros", name="head", dtype="float32")(backbone.output)
    return keras_vit.ViTModel(backbone.input, logits, name=f"{backbone.name}_finetune")


def make_optimizer(config: Config, total_steps: int) -> keras.optimizers.Optimizer:
    """AdamW or SGD with momentum, warmup + decay schedule, global-norm clipping, gradient accumulation."""
    schedule = WarmupDecay(config.lr, config.warmup_steps, total_steps, config.decay)
    common = dict(learning_rate=schedule, global_clipnorm=config.global_clipnorm or None,
                  gradient_accumulation_steps=config.grad_accum_steps if config.grad_accum_steps > 1 else None)
    if config.optimizer == "adamw":
        return AdamW(weight_decay=config.weight_decay, beta_1=config.b1, beta_2=config.b2, **common)
    if config.optimizer == "sgd":
        return SGD(momentum=config.momentum, weight_decay=config.weight_decay or None, **common)
    raise ValueError(f"Unknown optimizer {config.optimizer!r}. Expected 'adamw' or 'sgd'.")


def make_loss(config: Config) -> keras.losses.Loss:
    """Softmax or sigmoid cross-entropy on logits, with label smoothing."""
    if config.loss == "softmax":
        return keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=config.label_smoothing)
    if config.loss == "sigmoid":
        return keras.losses.BinaryCrossentropy(from_logits=True, label_smoothing=config.label_smoothing)
    raise ValueError(f"Unknown loss {config.loss!r}. Expected 'softmax' or 'sigmoid'.")


# === Callbacks ===


class StopOnNaN(keras.callbacks.Callback):
    """Raises `NaNLossError` at the first non-finite batch loss, before any later callback saves.

    Raising (rather than `stop_training`) skips the end-of-epoch and end-of-training callbacks, so
    the backup and the last/best weights keep the last good state.
    """

    def __init__(self, workdir: str):
        super().__init__()
        self.workdir = workdir
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not np.isfinite(float(loss)):
            raise NaNLossError(f"Loss became {float(loss)} at epoch {self.epoch + 1}, batch {batch + 1}; training "
                               f"stopped. The last good state is kept in {self.workdir} (backup/, checkpoints/). "
                               f"Lower the learning rate or check the input data.")


class SyncedBackupAndRestore(keras.callbacks.BackupAndRestore):
    """BackupAndRestore whose restored state is the chief's on every worker of a multi-worker run.

    Each worker backs up to its own folder (a shared one crashes on an HDF5 file lock). A worker
    killed between the workers' writes of the same backup leaves the backups one save apart;
    restored as they are, the workers would start from different weights and epochs, and their
    collectives fail on the first step. After restoring, every worker takes the chief's weights,
    optimizer state and first epoch.
    """

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        strategy = self.model.distribute_strategy
        if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return
        variables = [*self.model.variables, *self.model.optimizer.variables]
        restored = getattr(self.model, "_initial_epoch", None)  # Set by the parent from the backup.
        epoch = -1 if restored is None else restored
        *values, chief_epoch = distribute.broadcast_from_first_replica(
            strategy, [v.value for v in variables] + [tf.constant(epoch, tf.int64)])
        for variable, value in zip(variables, values):
            variable.assign(value)
        chief_epoch = int(chief_epoch)
        if chief_epoch != epoch:
            logging.warning("This worker's backup (epoch %d) is replaced by the chief's (epoch %d).", epoch,
                            chief_epoch)
        self.model._initial_epoch = chief_epoch if chief_epoch >= 0 else None


class RunLog(keras.callbacks.Callback):
    """Appends the first epoch and optimizer iterations of every (re)start to `train_log.jsonl`."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self._logged = False

    def on_epoch_begin(self, epoch, logs=None):
        if self._logged:
            return
        self._logged = True
        entry = {"initial_epoch": epoch, "optimizer_iterations": int(self.model.optimizer.iterations.numpy())}
        logging.info("Training starts at epoch %d, optimizer iteration %d.", epoch, entry["optimizer_iterations"])
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")


def make_callbacks(config: Config, workdir: str, outdir: str, worker: int,
                   best_metric: str | None = "top1") -> list[keras.callbacks.Callback]:
    """NaN guard (first), backup per worker, run log, last/best weights, CSV history, TensorBoard.

    `best_metric`: the metric (higher is better) whose best epoch `checkpoints/best.weights.h5` keeps;
    `None` for no best checkpoint (e.g. masked-patch pre-training, which has no labels).
    """
    checkpoints = os.path.join(outdir, "checkpoints")
    os.makedirs(checkpoints, exist_ok=True)
    best = [] if best_metric is None else [keras.callbacks.ModelCheckpoint(
        os.path.join(checkpoints, "best.weights.h5"), save_weights_only=True,
        monitor=f"val_{best_metric}" if config.validate else best_metric, mode="max", save_best_only=True)]
    return [
        StopOnNaN(outdir),
        # double_checkpoint: a kill while the backup is written leaves the previous one to restore.
        SyncedBackupAndRestore(os.path.join(workdir, "backup", f"worker_{worker}"),
                               save_freq=config.backup_every_steps or "epoch", double_checkpoint=True),
        RunLog(os.path.join(outdir, "train_log.jsonl")),
        keras.callbacks.ModelCheckpoint(os.path.join(checkpoints, "last.weights.h5"), save_weights_only=True),
        *best,
        keras.callbacks.CSVLogger(os.path.join(outdir, "history.csv"), append=True),
        keras.callbacks.TensorBoard(os.path.join(outdir, "tensorboard")),
    ]


# === Entry point ===


def _schedule(config: Config, num_train_examples: int | None) -> tuple[int, int]:
    """(steps_per_epoch, epochs) from the config and the training split size."""
    if not config.steps_per_epoch and num_train_examples is None:
        raise ValueError(f"The size of {config.dataset!r} split {config.train_split!r} is unknown: "
                         "set steps_per_epoch.")
    steps = config.steps_per_epoch or max(num_train_examples // config.batch_size, 1)
    epochs = math.ceil(config.total_steps / steps) if config.total_steps else config.epochs
    return steps, epochs


def prepare_run(config: Config, workdir: str, strategy: tf.distribute.Strategy):
    """Checks the config against the strategy, seeds, makes this worker's output folder and the datasets.

    Returns:
        (worker index, output folder, datasets, steps per epoch, epochs).
    """
    if config.precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {config.precision!r}. Expected one of {sorted(PRECISIONS)}.")
    distribute.check_global_batch(config.batch_size, strategy)
    worker = distribute.worker_index()
    outdir = workdir if distribute.is_chief() else os.path.join(workdir, f"worker_{worker}")
    os.makedirs(outdir, exist_ok=True)
    keras.utils.set_random_seed(config.seed)
    datasets = data_lib.make_datasets(config)
    steps_per_epoch, epochs = _schedule(config, datasets.num_train_examples)
    logging.info("Config: %s", dataclasses.asdict(config))
    return worker, outdir, datasets, steps_per_epoch, epochs


def train_and_evaluate(config: Config, workdir: str, *, strategy: tf.distribute.Strategy | None = None,
                       callbacks: Sequence[keras.callbacks.Callback] = (), verbose: str | int = "auto") -> dict:
    """Trains `config` in `workdir` (resuming from its backup), evaluates, saves the model.

    Args:
        config: Config. The run (`training.configs.get_config(name)` plus overrides).
        workdir: str. Output folder; the same folder resumes an interrupted run.
        strategy: optional tf.distribute strategy. Defaults to the current (default) strategy.
        callbacks: extra Keras callbacks, run after the NaN guard.
        verbose: `model.fit` verbosity (the progress bar). Defaults to `"auto"`.

    `recipe="masked_patches"` runs `training.masked.train_masked_patches` instead (its own summary).

    Returns:
        dict with `top1`, `top5`, `loss` on the eval split, `model_path`, `eval_path`,
        `optimizer_iterations` and `skipped_examples` (corrupt files left out).
    """
    if config.recipe == "masked_patches":  # Self-supervised: no labels, its own outputs (training/masked.py).
        from . import masked
        return masked.train_masked_patches(config, workdir, strategy=strategy, callbacks=callbacks, verbose=verbose)
    strategy = strategy or tf.distribute.get_strategy()
    worker, outdir, datasets, steps_per_epoch, epochs = prepare_run(config, workdir, strategy)
    logging.info("Strategy %s with %d replicas; %s train / %s eval examples, %d classes; %d epochs x %d steps.",
                 type(strategy).__name__, strategy.num_replicas_in_sync, datasets.num_train_examples,
                 datasets.num_eval_examples, datasets.num_classes, epochs, steps_per_epoch)
    previous_policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(PRECISIONS[config.precision])
    try:
        with strategy.scope():
            model = build_model(config, datasets.num_classes)
            model.compile(optimizer=make_optimizer(config, epochs * steps_per_epoch), loss=make_loss(config),
                          metrics=[keras.metrics.CategoricalAccuracy(name="top1"),
                                   keras.metrics.TopKCategoricalAccuracy(min(5, datasets.num_classes), name="top5")])
        nan_guard, *standard = make_callbacks(config, workdir, outdir, worker)
        model.fit(datasets.train, epochs=epochs, steps_per_epoch=steps_per_epoch, shuffle=False,  # tf.data shuffles.
                  validation_data=datasets.eval if config.validate else None,
                  callbacks=[nan_guard, *callbacks, *standard], verbose=verbose)
        results = model.evaluate(datasets.eval, return_dict=True, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)
    model_path = os.path.join(outdir, "model.keras")
    eval_path = os.path.join(outdir, "model.eval.json")
    # Saved uncompiled: the file is the deployable model and must load wherever keras_vit is
    # installed. Its compile state names this package's optimizers and schedule, which only
    # resuming needs, and resuming restores them from the BackupAndRestore folder instead.
    keras_vit.ViTModel(model.input, model.output, name=model.name).save(model_path)
    summary = {"top1": float(results["top1"]), "top5": float(results["top5"]), "loss": float(results["loss"]),
               "num_eval_examples": datasets.num_eval_examples, "skipped_examples": datasets.skipped,
               "optimizer_iterations": int(model.optimizer.iterations.numpy()), "model_path": model_path,
               "eval_path": eval_path}
    with open(eval_path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    logging.info("Eval: top-1 %.4f, top-5 %.4f. Saved %s", summary["top1"], summary["top5"], model_path)
    return summary
