"""`train_and_evaluate(config, workdir)`: the one training run of every recipe. `model.fit` under a
tf.distribute strategy (TensorFlow) or a keras.distribution (JAX; `distribute.py`) with crash-safe backups
(`resume.py`) from which a rerun resumes at the batch they were written after, a stop at the step a SIGTERM
arrives in with its backup (`preemption.py`), last (and best) weights, TensorBoard, NaN stop and a final
evaluation. The recipe is looked up by
`config.recipe` in `RECIPES` (`training/recipe.py` says what a recipe provides; `supervised.py` and
`masked.py` are the recipes).

Layout of `workdir` (worker `i > 0` of a tf.distribute multi-worker run writes the same under
`workdir/worker_<i>/`; process `i > 0` of a multi-process JAX run writes its backup there and the rest to a
scratch folder that the run deletes):
    backup/worker_<i>/     keras.callbacks.BackupAndRestore, kept until the run's files are saved (a run stopped
                           in its final evaluation resumes there); on restart every worker or process takes
                           process 0's restored state; config.json, the config it is made with; lock, held by the
                           run (all in resume.py)
    checkpoints/last.weights.h5, checkpoints/best.weights.h5 (recipes with a best metric)
    tensorboard/           TensorBoard scalars
    history.csv            one row per epoch, appended across restarts
    train_log.jsonl        one line per (re)start: first epoch and optimizer iterations
    model.eval.json        the summary; plus the recipe's files (model.keras, ...)
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import logging
import math
import os
import shutil
from typing import NamedTuple, Sequence

import keras
import numpy as np
import tensorflow as tf

from keras_vit.atomic import atomic_write, check_room, variables_bytes

from . import data as data_lib
from . import distribute, masked, multihost, preemption, resume, supervised
from .configs import Config
from .recipe import Recipe, architecture, build_backbone

# `Config.recipe` -> what that recipe adds to the run.
RECIPES: dict[str, Recipe] = {"pretrain": supervised.PRETRAIN, "finetune": supervised.FINETUNE,
                              "masked_patches": masked.MASKED_PATCHES}

PRECISIONS = {"float32": "float32", "bfloat16": "mixed_bfloat16"}


class NaNLossError(FloatingPointError):
    """Training produced a non-finite loss."""


def optimizer_iterations(model: keras.Model) -> int:
    """The optimizer's update count. (With gradient accumulation on JAX, `iterations` is an array computed from
    the micro-step count, not a variable with `.numpy()`.)"""
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


# === Optimizer ===


@keras.saving.register_keras_serializable(package="keras_vit_training")
class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup from 0 to `peak` over `warmup_steps`, then cosine or linear decay to 0 at `total_steps`."""

    def __init__(self, peak: float, warmup_steps: int, total_steps: int, decay: str = "cosine"):
        if decay not in ("cosine", "linear"):
            raise ValueError(f"Unknown decay {decay!r}. Expected 'cosine' or 'linear'.")
        self.peak, self.warmup_steps, self.total_steps, self.decay = peak, warmup_steps, total_steps, decay

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        warmup = step / max(self.warmup_steps, 1)
        progress = keras.ops.clip((step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1), 0., 1.)
        decayed = 0.5 * (1.0 + keras.ops.cos(math.pi * progress)) if self.decay == "cosine" else 1.0 - progress
        return self.peak * keras.ops.where(step < self.warmup_steps, warmup, decayed)

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


def optimizer_classes() -> tuple[type, type]:
    """(AdamW, SGD) for this backend: on TensorFlow the ones above; elsewhere Keras' own, whose update is the
    fused kernel's formula and whose clipping already sees the whole batch's gradient (a keras.distribution
    step is one program over the global batch, with no per-replica share to clip)."""
    if keras.backend.backend() == "tensorflow":
        return AdamW, SGD
    return keras.optimizers.AdamW, keras.optimizers.SGD


def make_optimizer(config: Config, total_steps: int) -> keras.optimizers.Optimizer:
    """AdamW or SGD with momentum, warmup + decay schedule, global-norm clipping, gradient accumulation."""
    schedule = WarmupDecay(config.lr, config.warmup_steps, total_steps, config.decay)
    common = dict(learning_rate=schedule, global_clipnorm=config.global_clipnorm or None,
                  gradient_accumulation_steps=config.grad_accum_steps if config.grad_accum_steps > 1 else None)
    adamw, sgd = optimizer_classes()
    if config.optimizer == "adamw":
        return adamw(weight_decay=config.weight_decay, beta_1=config.b1, beta_2=config.b2, **common)
    if config.optimizer == "sgd":
        return sgd(momentum=config.momentum, weight_decay=config.weight_decay or None, **common)
    raise ValueError(f"Unknown optimizer {config.optimizer!r}. Expected 'adamw' or 'sgd'.")


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


def state_bytes(model: keras.Model) -> int:
    """About the bytes of a `.weights.h5` file of `model` (its weights and its optimizer's, as `save_weights` writes
    them), with HDF5's overhead of a few KiB a variable."""
    optimizer = getattr(model, "optimizer", None)  # None, or no such attribute, before `compile`
    variables = [*model.weights, *(optimizer.variables if optimizer is not None else ())]
    return variables_bytes(variables, per_variable=4096)


MIN_FREE_BYTES = 2 ** 20  # a run's logs, lock and backup config: checked before it writes anything


class DiskSpaceGuard(keras.callbacks.Callback):
    """Raises `keras_vit.atomic.DiskSpaceError` before the run's next writes where a disk lacks the room for them
    (the backup, written twice: its copy, then itself; the last and best weights and a MiB for the logs), and
    `keras_vit.atomic.NotWritableError` where their folder cannot be written (a read-only mount, no permission).

    It runs before every writer (`make_callbacks`), so on a full disk the backup and the checkpoints stay as they
    were, whole, and the rerun resumes from them. Left to fail, h5py crashes the process inside its `close`
    (TensorFlow 2.21, h5py 3.15: a segmentation fault after ENOSPC) and leaves a truncated file behind.
    """

    def __init__(self, backup_dir: str, outdir: str, backup_every_steps: int):
        super().__init__()
        self.backup_dir, self.outdir, self.backup_every_steps = backup_dir, outdir, backup_every_steps
        self._state_bytes = None  # measured at the first check, once the optimizer has built its variables

    def _check(self, with_checkpoints: bool) -> None:
        if self._state_bytes is None:
            self._state_bytes = state_bytes(self.model)
        state = self._state_bytes
        needs = {self.backup_dir: 2 * state}
        if with_checkpoints:
            needs[self.outdir] = 2 * state + 2 ** 20
        check_room(needs, "the training backup and checkpoints" if with_checkpoints else "the training backup")

    def on_train_batch_end(self, batch, logs=None):
        if self.backup_every_steps:
            self._check(with_checkpoints=False)

    def on_epoch_end(self, epoch, logs=None):
        self._check(with_checkpoints=True)

    def on_train_end(self, logs=None):
        if self.backup_every_steps:  # the backup saves the end of training once more (`SyncedBackupAndRestore`)
            self._check(with_checkpoints=False)


class WeightsCheckpoint(keras.callbacks.Callback):
    """Saves the weights (and the optimizer's state) to `path` at each epoch's end, or with `monitor` at the epochs
    whose metric is the best so far (higher is better), whole: written beside `path`, then renamed over it
    (`keras_vit.atomic.atomic_write`), so a crash or a full disk leaves the previous file."""

    def __init__(self, path: str, monitor: str | None = None):
        super().__init__()
        self.path, self.monitor, self.best = path, monitor, -math.inf

    def on_epoch_end(self, epoch, logs=None):
        if self.monitor is not None:
            value = (logs or {}).get(self.monitor)
            if value is None:
                logging.warning("%s is not among the epoch's metrics (%s): %s not saved.", self.monitor,
                                ", ".join(sorted(logs or {})), self.path)
                return
            if not float(value) > self.best:
                return
            self.best = float(value)
        with atomic_write(self.path) as partial:
            self.model.save_weights(partial)


class RunLog(keras.callbacks.Callback):
    """Appends the first epoch and optimizer iterations of every (re)start to `train_log.jsonl`."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self._logged = False

    def on_epoch_begin(self, epoch, logs=None):
        if not self._logged:
            self._log(epoch, "Training starts at epoch %d, optimizer iteration %d.")

    def on_train_end(self, logs=None):
        if not self._logged:  # Restored from a backup of the finished training: no epoch ran.
            self._log(self.params["epochs"], "Training had ended (epoch %d, optimizer iteration %d): evaluating.")

    def _log(self, epoch: int, message: str) -> None:
        self._logged = True
        entry = {"initial_epoch": epoch, "optimizer_iterations": optimizer_iterations(self.model)}
        logging.info(message, epoch, entry["optimizer_iterations"])
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")


def make_callbacks(config: Config, workdir: str, outdir: str, worker: int,
                   best_metric: str | None = "top1") -> list[keras.callbacks.Callback]:
    """NaN guard (first), disk-space guard, backup per worker, run log, last/best weights, CSV history, TensorBoard.

    `best_metric`: the metric (higher is better) whose best epoch `checkpoints/best.weights.h5` keeps;
    `None` for no best checkpoint (e.g. masked-patch pre-training, which has no labels).
    """
    checkpoints = os.path.join(outdir, "checkpoints")
    os.makedirs(checkpoints, exist_ok=True)
    best = [] if best_metric is None else [WeightsCheckpoint(
        os.path.join(checkpoints, "best.weights.h5"), monitor=f"val_{best_metric}" if config.validate else best_metric)]
    backup = resume.backup_dir(workdir, worker)
    return [
        StopOnNaN(outdir),
        DiskSpaceGuard(backup, outdir, config.backup_every_steps),
        resume.SyncedBackupAndRestore(backup, save_freq=config.backup_every_steps or "epoch"),
        RunLog(os.path.join(outdir, "train_log.jsonl")),
        WeightsCheckpoint(os.path.join(checkpoints, "last.weights.h5")),
        *best,
        keras.callbacks.CSVLogger(os.path.join(outdir, "history.csv"), append=True),
        keras.callbacks.TensorBoard(os.path.join(outdir, "tensorboard")),
    ]


# === The run ===


def _schedule(config: Config, num_train_examples: int | None) -> tuple[int, int]:
    """(steps_per_epoch, epochs) from the config and the training split size."""
    if not config.steps_per_epoch and num_train_examples is None:
        raise ValueError(f"The size of {config.dataset!r} split {config.train_split!r} is unknown: "
                         "set steps_per_epoch.")
    steps = config.steps_per_epoch or max(num_train_examples // config.batch_size, 1)
    epochs = math.ceil(config.total_steps / steps) if config.total_steps else config.epochs
    return steps, epochs


class Run(NamedTuple):
    """What `prepare_run` sets up for this worker (or process)."""
    worker: int
    outdir: str  # `distribute.output_dir`
    datasets: data_lib.Datasets
    steps_per_epoch: int
    epochs: int


def prepare_run(config: Config, workdir: str, strategy: distribute.Strategy) -> Run:
    """Checks the workdir, and the config against the strategy; seeds, makes this worker's output folder and the
    datasets."""
    resume.check_workdir(workdir)
    recipe = recipe_of(config)
    if config.precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {config.precision!r}. Expected one of {sorted(PRECISIONS)}.")
    distribute.check_global_batch(config.batch_size, strategy)
    distribute.check_model_parallel(strategy, architecture(config))
    if keras.backend.backend() == "jax":
        distribute.keep_tensorflow_on_cpu()
    worker = multihost.process_index()
    outdir = distribute.output_dir(workdir)
    # Before the run's first file (its folders, lock, logs): a read-only or nearly full disk ends it with nothing
    # written. The room for the weights is checked before each save (`DiskSpaceGuard`), once the model is built.
    check_room({workdir: MIN_FREE_BYTES, outdir: MIN_FREE_BYTES}, "the run's files")
    os.makedirs(outdir, exist_ok=True)
    keras.utils.set_random_seed(config.seed)
    datasets = data_lib.make_datasets(config, architecture(config)["patch_size"] if config.max_num_patches else None)
    if not recipe.exact_eval:  # the others pad the last eval batch (`evaluation_data`)
        distribute.check_eval_split(datasets.eval_shard_sizes, strategy, config.dataset, config.eval_split)
    steps_per_epoch, epochs = _schedule(config, datasets.num_train_examples)
    logging.info("Config: %s", dataclasses.asdict(config))
    return Run(worker, outdir, datasets, steps_per_epoch, epochs)


def recipe_of(config: Config) -> Recipe:
    """The recipe `config.recipe` names."""
    if config.recipe not in RECIPES:
        raise ValueError(f"Unknown recipe {config.recipe!r}. Expected one of {sorted(RECIPES)}.")
    return RECIPES[config.recipe]


def _build(config: Config, num_classes: int) -> tuple[keras.Model, keras.Model]:
    """(the model the recipe trains, the config's ViT inside it)."""
    recipe = recipe_of(config)
    backbone = build_backbone(config, **recipe.backbone(config, num_classes))
    return recipe.model(config, backbone, num_classes), backbone


def build_model(config: Config, num_classes: int) -> keras.Model:
    """The model `config`'s recipe trains, with `weights=config.weights` passed to the builder: for
    `pretrain` and `finetune`, a classifier returning logits (`training/supervised.py`)."""
    return _build(config, num_classes)[0]


def _current_strategy() -> distribute.Strategy:
    """The strategy in effect: tf.distribute's current one on TensorFlow, the global keras.distribution
    (None: one device) on JAX."""
    if keras.backend.backend() == "jax":
        return keras.distribution.distribution()
    return tf.distribute.get_strategy()


def evaluation_data(config: Config, datasets: data_lib.Datasets) -> tf.data.Dataset:
    """The eval split as `fit` and `evaluate` read it: for the recipes with `exact_eval`, batches of the global size
    whose padding rows weigh 0 (`data.exact_batches`), so each example counts once on any number of devices."""
    recipe = recipe_of(config)
    if recipe.exact_eval:
        return data_lib.exact_batches(recipe.inputs(datasets.eval), datasets.batch_size, datasets.eval_batches,
                                      datasets.eval_padding)
    return recipe.inputs(datasets.eval)


def exact_results(results: dict) -> dict[str, float]:
    """`evaluate`'s results with `loss` the weighted mean over the examples (`eval_loss`) where it was computed."""
    results = {name: float(value) for name, value in results.items()}
    if supervised.EVAL_LOSS in results:
        results["loss"] = results.pop(supervised.EVAL_LOSS)
    return results


def train_and_evaluate(config: Config, workdir: str, *, strategy: distribute.Strategy = None,
                       callbacks: Sequence[keras.callbacks.Callback] = (), verbose: str | int = "auto",
                       preemption_grace_s: float = preemption.DEFAULT_GRACE_S) -> dict:
    """Trains `config` in `workdir` (resuming from its backup), evaluates, saves the recipe's files.

    Args:
        config: Config. The run (`training.configs.get_config(name)` plus overrides).
        workdir: str. Output folder; the same folder resumes an interrupted run.
        strategy: how the run is distributed (`distribute.get_strategy`): a tf.distribute strategy on
            TensorFlow, a keras.distribution (`DataParallel`, `ModelParallel`) or None (one device) on JAX.
            Defaults to the current one (`tf.distribute.get_strategy()`, `keras.distribution.distribution()`).
        callbacks: extra Keras callbacks, run after the NaN guard.
        verbose: `model.fit` verbosity (the progress bar). Defaults to `"auto"`.
        preemption_grace_s: seconds a SIGTERM leaves the run (called in the main thread) to end its step and
            back it up (`preemption`); past them it exits, keeping the last backup. Defaults to 25.

    Returns:
        dict with the eval split's metrics (`top1`, `top5`, `loss` for the supervised recipes; the masked
        `loss` and, for classification targets, `masked_accuracy` for `masked_patches`), `num_eval_examples`,
        `skipped_examples` (corrupt files left out), `optimizer_iterations`, `eval_path` and the paths of
        the recipe's files (`model_path`; `encoder_path` and `encoder_weights_path` for `masked_patches`).

    Raises:
        NaNLossError: at the first non-finite loss; KeyboardInterrupt: on Ctrl-C. The backup keeps the last good
            state, and the same call resumes from it.
        preemption.Preempted: on a SIGTERM, after the step it arrived in, whose backup it wrote: the same call
            resumes from that step (the data too: `Datasets.train_after`). With several processes, a SIGTERM to
            any of them stops all after the same step (`multihost.any_process` at each update).
        resume.ResumeConfigError: the workdir's backup is of another model or optimizer
            (`resume.check_resume_config`).
        resume.RunInProgressError: another process is training in the workdir as this worker
            (`resume.exclusive_backup`).
    """
    strategy = strategy or _current_strategy()
    run = prepare_run(config, workdir, strategy)
    logging.info("Recipe %s, strategy %s with %d replicas; %s train / %s eval examples, %d classes; %d epochs x %d "
                 "steps.", config.recipe, distribute.describe(strategy), distribute.num_replicas(strategy),
                 run.datasets.num_train_examples, run.datasets.num_eval_examples, run.datasets.num_classes,
                 run.epochs, run.steps_per_epoch)
    with resume.exclusive_backup(workdir, run.worker):
        resume.check_resume_config(config, workdir, run.worker)
        model, backbone, results = _fit_and_evaluate(config, workdir, strategy, run, callbacks, verbose,
                                                     preemption_grace_s)
        summary = _save(config, workdir, run, model, backbone, results)
        shutil.rmtree(resume.backup_dir(workdir, run.worker), ignore_errors=True)  # The run is complete.
    return summary


def fit_plan(trained: int, steps_per_epoch: int, epochs: int) -> list[tuple[int, int]]:
    """(epochs, steps_per_epoch) of each `fit` of a run that has trained `trained` batches: the rest of a partly
    trained epoch first (a run stopped mid-epoch, by a SIGTERM or after a step backup), then the whole ones."""
    first_epoch, into_epoch = divmod(trained, steps_per_epoch)
    rest = [(first_epoch + 1, steps_per_epoch - into_epoch)] if into_epoch and first_epoch < epochs else []
    return [*rest, (epochs, steps_per_epoch)]


def _fit_and_evaluate(config: Config, workdir: str, strategy: distribute.Strategy, run: Run,
                      callbacks: Sequence[keras.callbacks.Callback], verbose: str | int, grace_s: float
                      ) -> tuple[keras.Model, keras.Model, dict]:
    """Builds, fits (resuming from the backup at the batch it was written after) and evaluates: (model, backbone,
    eval results). A NaN stop, Ctrl-C or a SIGTERM raises its error afresh, once the stopped input pipeline is
    freed."""
    recipe = recipe_of(config)
    previous_policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(PRECISIONS[config.precision])
    stopped = None
    try:
        with distribute.build_scope(strategy):
            model, backbone = _build(config, run.datasets.num_classes)
            model.compile(optimizer=make_optimizer(config, run.epochs * run.steps_per_epoch),
                          **recipe.compile(config, run.datasets.num_classes))
        nan_guard, *standard = make_callbacks(config, workdir, run.outdir, run.worker, best_metric=recipe.best_metric)
        backup = next(callback for callback in standard if isinstance(callback, resume.SyncedBackupAndRestore))
        eval_data = evaluation_data(config, run.datasets)
        accumulation = max(1, config.grad_accum_steps)
        with distribute.build_scope(strategy):
            backup.restore_now(model)  # first, to know the batches trained
        trained = optimizer_iterations(model) * accumulation
        # With several processes, all stop after the step in which any of them got the SIGTERM.
        agree = functools.partial(multihost.any_process, strategy=strategy) if multihost.process_count() > 1 else bool
        with distribute.run_scope(strategy), preemption.sigterm_requests(grace_s) as request:
            for epochs, steps in fit_plan(trained, run.steps_per_epoch, run.epochs):
                stop = preemption.StopAtStep(request, backup.save_now, trained, accumulation, agree=agree)
                model.fit(recipe.inputs(run.datasets.train_after(trained)),
                          initial_epoch=trained // run.steps_per_epoch, epochs=epochs, steps_per_epoch=steps,
                          shuffle=False,  # tf.data shuffles.
                          validation_data=eval_data if config.validate else None,
                          callbacks=[nan_guard, *callbacks, *standard, stop], verbose=verbose)
                trained = epochs * run.steps_per_epoch
            results = model.evaluate(eval_data, return_dict=True, verbose=0)
    except preemption.Preempted as error:
        stopped = error
    except NaNLossError as error:
        stopped = NaNLossError(str(error))
    except KeyboardInterrupt:
        stopped = KeyboardInterrupt(f"Training interrupted. train_and_evaluate with the same workdir ({workdir}) "
                                    f"resumes from its last backup in {os.path.join(workdir, 'backup')}.")
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)
    if stopped:
        # Stopped mid-epoch, Keras' epoch iterator and its suspended generator hold each other, and with them the
        # input pipeline's iterator (its threads and prefetched batches), until a garbage collection; collected
        # at some later point, that iterator has waited 40-57 s for its tf.data autotuning thread (TensorFlow
        # 2.21, in the test suite). The caught error's frames reach it too: free it now, and raise the stop
        # afresh (other errors keep their traceback, and with it the pipeline, for as long as it is kept).
        gc.collect()
        raise stopped
    return model, backbone, results


def _save(config: Config, workdir: str, run: Run, model: keras.Model, backbone: keras.Model, results: dict) -> dict:
    """Saves the recipe's files and `model.eval.json`; returns the summary (no paths from a scratch folder)."""
    results = exact_results(results)
    # The recipe's files hold at most three copies of the weights (the masked recipe's model, encoder, weights).
    check_room({run.outdir: 3 * state_bytes(backbone) + 2 ** 20}, "the run's model files")
    summary = {**results,
               "num_eval_examples": run.datasets.num_eval_examples, "skipped_examples": run.datasets.skipped,
               "optimizer_iterations": optimizer_iterations(model),
               **recipe_of(config).save(model, backbone, run.outdir),
               "eval_path": os.path.join(run.outdir, "model.eval.json")}
    if distribute.is_scratch(run.outdir, workdir):  # Process 0 saved the same files in workdir.
        shutil.rmtree(run.outdir, ignore_errors=True)
        return {name: value for name, value in summary.items() if not name.endswith("_path")}
    with open(summary["eval_path"], "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    shown = ", ".join(f"{name} {value:.4f}" for name, value in results.items())
    logging.info("Eval: %s. Saved %s", shown, summary["model_path"])
    return summary
