"""What makes a training run resumable, and safe to resume: the backup of each worker (or process) in
`workdir/backup/worker_<i>/`, the same on every worker after a restore (`SyncedBackupAndRestore`), the config it
was made with (`check_resume_config`), and the lock one run holds on it (`exclusive_backup`). `trainer.py` runs
`model.fit` with them; the workdir is a local path (`check_workdir`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from typing import Iterator

import keras
import numpy as np

from keras_vit.atomic import write_json

from . import configs, multihost
from .configs import Config


class ResumeConfigError(ValueError):
    """The workdir's backup was made with another config than the one given to resume it."""


class RunInProgressError(RuntimeError):
    """Another process is training in the same workdir, as the same worker."""


def check_workdir(workdir: str) -> None:
    """Raises ValueError for a URL: the workdir is written with local file operations (os.makedirs would make a
    local folder named after its scheme, e.g. `gs:`, and the outputs would stay on this machine)."""
    if "://" in str(workdir):
        raise ValueError(f"workdir {workdir!r} is a URL; the training workdir is a local path (backups, locks and "
                         "files are written with local file operations). Train in a local folder (on a TPU VM, e.g. "
                         "$HOME/run) and copy it to the bucket afterwards; data_dir may be a gs:// path.")


def backup_dir(workdir: str, worker: int) -> str:
    """The folder of worker (or process) `worker`'s backup."""
    return os.path.join(workdir, "backup", f"worker_{worker}")


@contextlib.contextmanager
def exclusive_backup(workdir: str, worker: int) -> Iterator[None]:
    """Holds worker `worker`'s backup in `workdir` for this run: an exclusive `fcntl.flock` on its `lock` file, which
    the OS releases when the process ends (SIGKILL too). Raises `RunInProgressError` while another process holds it:
    two runs of one workdir would overwrite each other's backups and files. Where there is no `fcntl` (Windows), no
    lock is taken."""
    folder = backup_dir(workdir, worker)
    os.makedirs(folder, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(os.path.join(folder, "lock"), "a+", encoding="utf-8") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.seek(0)
            raise RunInProgressError(
                f"Another process ({lock.read().strip() or 'unknown'}) is training in {workdir}: its backup {folder} "
                "is locked. Wait for that run to end or stop it, or train in another workdir.") from None
        lock.truncate(0)
        lock.write(f"process {os.getpid()} on {socket.gethostname()}")
        lock.flush()
        yield


# Config fields that fix what a backup holds (the model's and the optimizer's variables): a resume keeps them.
# The others (learning rate, schedule, regularization, data options) may change, e.g. a lower learning rate after
# a NaN stop; a warning names them.
RESUME_FIXED = frozenset({"recipe", "variant", "patch_size", "hidden_dim", "mlp_dim", "num_heads", "num_layers",
                          "classifier", "representation_size", "image_size", "dataset", "optimizer",
                          "grad_accum_steps", "masked_target", "target_bits", "max_num_patches"})


def check_resume_config(config: Config, workdir: str, worker: int) -> None:
    """Checks `config` against the config that worker `worker`'s backup in `workdir` was made with, before anything
    is loaded, and records it there for the next resume.

    Raises `ResumeConfigError`, naming the fields, where a `RESUME_FIXED` field differs: Keras would fail to load the
    backup into another model (an error about objects that could not be loaded), and into another optimizer would
    drop the optimizer's state with a warning (its step count, and with it the schedule, back to 0). Other changed
    fields are logged as a warning.
    """
    folder = backup_dir(workdir, worker)
    path = os.path.join(folder, "config.json")
    current = configs.as_json(config)
    saved = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    changed = {name: f"{name} {saved.get(name)!r} -> {value!r}" for name, value in current.items()
               if saved and saved.get(name) != value}
    fixed = [change for name, change in changed.items() if name in RESUME_FIXED]
    if fixed:
        raise ResumeConfigError(
            f"{workdir} holds the backup of a run with another model or optimizer ({'; '.join(fixed)}). Resume it "
            f"with the config it was made with, or train in a new workdir (with the same model, "
            f"weights={os.path.join(workdir, 'checkpoints', 'last.weights.h5')} starts from this run's weights).")
    if changed:
        logging.warning("Resuming the backup in %s with a changed config: %s.", folder, "; ".join(changed.values()))
    if changed or not saved:
        write_json(path, current)


class SyncedBackupAndRestore(keras.callbacks.BackupAndRestore):
    """BackupAndRestore whose restored state is process 0's on every process of a multi-process run (tf.distribute's
    multi-worker, or JAX's; `multihost.process_index`).

    Each worker backs up to its own folder (a shared one crashes on an HDF5 file lock; the hosts of a pod slice
    may have no shared disk). A worker killed between the workers' writes of the same backup leaves the backups
    one save apart; restored as they are, the workers would start from different weights and epochs, and their
    collectives fail on the first step. After restoring, every worker takes process 0's weights,
    optimizer state and first epoch (`multihost.broadcast_from_process_0`). In a one-process run it is Keras'
    BackupAndRestore.

    The first epoch is Keras' private `model._initial_epoch` (`INITIAL_EPOCH`), which the parent sets from the
    backup and `fit` reads. Where a Keras release has no such attribute, the workers keep their own backups, as
    with Keras' BackupAndRestore, and a warning says so.

    The backup outlives `fit` (`train_and_evaluate` deletes it once the run's files are saved), so a run stopped in
    its final evaluation resumes with no epoch left to train. It then holds the trained state: with a `save_freq`
    in steps, the end of training saves it once more with the parent's private `_save_model` (`SAVE`). Where a
    Keras release has no such method, the backup stays the last one of the steps, and such a resume trains the last
    epoch again, as after a stop in that epoch.
    """

    INITIAL_EPOCH = "_initial_epoch"
    SAVE = "_save_model"

    def __init__(self, backup_dir: str, save_freq: str | int = "epoch"):
        # double_checkpoint: a kill while the backup is written leaves the previous one to restore.
        super().__init__(backup_dir, save_freq=save_freq, double_checkpoint=True, delete_checkpoint=False)
        self._epochs_ended = 0

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._epochs_ended += 1

    def on_train_end(self, logs=None):
        super().on_train_end(logs)  # Keeps the backup (delete_checkpoint=False).
        if self.save_freq == "epoch" or not self._epochs_ended:  # Saved at the last epoch's end, or nothing new.
            return
        self.save_now()

    def save_now(self) -> bool:
        """Writes the backup of the model's state now (a preempted run's step); False where this Keras has no
        `SAVE`, whose backup stays the last one written."""
        save = getattr(self, self.SAVE, None)
        if save is None:
            logging.warning("This Keras (%s) has no BackupAndRestore.%s: the backup stays the last one written.",
                            keras.__version__, self.SAVE)
            return False
        save()
        return True

    def restore_now(self, model: keras.Model) -> None:
        """Restores `model` (weights, optimizer state and first epoch) from the backup before `fit`, as `fit`'s
        start does again, so that the run knows its step first (`train_and_evaluate` skips the batches trained)."""
        self.set_model(model)
        self.on_train_begin()

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        if multihost.process_count() == 1:
            return
        if not hasattr(self.model, self.INITIAL_EPOCH):  # Keras' Trainer sets it (None) in __init__
            logging.warning("This Keras (%s) has no model.%s: each worker restores its own backup, which may be one "
                            "save apart from the others'.", keras.__version__, self.INITIAL_EPOCH)
            return
        variables = [*self.model.variables, *self.model.optimizer.variables]
        restored = getattr(self.model, self.INITIAL_EPOCH)  # Set by the parent from the backup.
        epoch = -1 if restored is None else restored
        strategy = getattr(self.model, "distribute_strategy", None)  # TensorFlow's trainer only.
        *values, first_epoch = multihost.broadcast_from_process_0(
            [v.value for v in variables] + [np.array(epoch, np.int64)], strategy)
        for variable, value in zip(variables, values):
            variable.assign(value)
        first_epoch = int(first_epoch)
        if first_epoch != epoch:
            logging.warning("This process's backup (epoch %d) is replaced by process 0's (epoch %d).", epoch,
                            first_epoch)
        setattr(self.model, self.INITIAL_EPOCH, first_epoch if first_epoch >= 0 else None)
