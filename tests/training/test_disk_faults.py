"""Disk faults during a training run, made for real: a small tmpfs mounted for the test fills up mid-run, or the
run's backup folder becomes a read-only mount.

The run stops before its next write with one line (`keras_vit.atomic.DiskSpaceError`: the bytes needed and free;
`keras_vit.atomic.NotWritableError`: the folder it cannot write); every file it had written is unchanged and whole,
nothing half-written is left, and once space is freed (the folder writable again) the same run resumes from its
backup and finishes. Mounting needs root (CI runs as root); elsewhere the test skips, naming the missing privilege.
The runs are `trainer.train_and_evaluate` in this process (the ones of the command line, `keras-vit-train`'s
`main`): a fault is raised as an `OSError` before anything is written, so no process needs to be given up on it.
"""

import hashlib
import json
import os
import re
import subprocess

import h5py
import keras
import pytest

from tests.testing import TRAIN_TINY, fill, mounted_tmpfs, run_train_cli, unmount

OVERRIDES = [*TRAIN_TINY, "epochs=3", "steps_per_epoch=3", "validate=true"]
LEFT_FREE = 64 * 1024


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs at tmp_path / "disk"."""
    yield mounted_tmpfs(tmp_path / "disk", "16m")
    unmount(tmp_path / "disk")


def checksums(folder) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under `folder` (but the lock and the filler)."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if name not in ("lock", "filler"):
                with open(path, "rb") as file:
                    found[os.path.relpath(path, folder)] = hashlib.sha256(file.read()).hexdigest()
    return found


class FaultAtStep(keras.callbacks.Callback):
    """As optimizer step `step` begins, records the checksums of every file in `workdir` (`before`), then makes
    the fault: `fault(workdir)`."""

    def __init__(self, step: int, workdir, fault):
        super().__init__()
        self.step, self.workdir, self.fault, self.before = step, workdir, fault, None

    def on_train_batch_begin(self, batch, logs=None):
        from keras_vit.training import trainer
        if self.before is None and trainer.optimizer_iterations(self.model) == self.step:
            self.before = checksums(self.workdir)
            self.fault(self.workdir)


class FaultAtTrainEnd(keras.callbacks.Callback):
    """As training ends (before the final evaluation and save), records the checksums of every file in `workdir`
    (`before`), then makes the fault: `fault(workdir)`."""

    def __init__(self, workdir, fault):
        super().__init__()
        self.workdir, self.fault, self.before = workdir, fault, None

    def on_train_end(self, logs=None):
        self.before = checksums(self.workdir)
        self.fault(self.workdir)


def _train(workdir, callbacks=()) -> dict:
    from keras_vit.training import configs, trainer
    config = configs.apply_overrides(configs.get_config("digits"), OVERRIDES)
    return trainer.train_and_evaluate(config, str(workdir), callbacks=list(callbacks), verbose=0)


def _stopped_at_step_4_and_resumes(workdir, fault, undo, message: str) -> None:
    """The run meets `fault` in epoch 2 of 3 (epoch 1's backup and checkpoints exist) and stops with `message`
    (a regular expression) before its next write, every file as it was; after `undo` the same run resumes after
    epoch 1 and finishes."""
    at_step_4 = FaultAtStep(4, workdir, fault)
    with pytest.raises(OSError) as stopped:
        _train(workdir, [at_step_4])
    assert re.fullmatch(message, str(stopped.value)), str(stopped.value)
    before, after = at_step_4.before, checksums(workdir)
    assert {"backup/worker_0/latest.weights.h5", "checkpoints/last.weights.h5", "checkpoints/best.weights.h5",
            "history.csv"} <= set(before)
    # Every file as it was when the fault came, but TensorBoard's event logs, which only grow (appended records).
    kept = [name for name in before if not name.startswith("tensorboard/")]
    assert {name: after.get(name) for name in kept} == {name: before[name] for name in kept}
    assert [name for name in after if name not in before and not name.startswith("tensorboard/")] == []
    for name in ("backup/worker_0/latest.weights.h5", "checkpoints/last.weights.h5"):
        with h5py.File(os.path.join(workdir, name), "r"):  # whole HDF5 files
            pass
    with open(os.path.join(workdir, "history.csv"), encoding="utf-8") as history:
        assert len(history.read().splitlines()) == 2  # the header and epoch 1

    undo(workdir)
    assert _train(workdir)["optimizer_iterations"] == 9
    log = [json.loads(line) for line in open(os.path.join(workdir, "train_log.jsonl"), encoding="utf-8")]
    assert [entry["initial_epoch"] for entry in log] == [0, 1]  # the rerun began after epoch 1, from its backup
    assert not [name for name in checksums(workdir) if ".partial" in name]


@pytest.mark.slow
def test_a_disk_full_mid_run_stops_in_one_line_keeps_every_file_and_the_rerun_resumes(small_disk):
    _stopped_at_step_4_and_resumes(
        small_disk, lambda workdir: fill(workdir, leave=LEFT_FREE),
        lambda workdir: os.remove(workdir / "filler"),
        re.escape(f"[Errno 28] Not enough free space for the training backup and checkpoints in {small_disk}/backup/"
                  "worker_0: about ") + r"\d+\.\d MiB needed, 0\.\d MiB free\. " + re.escape(
            "Nothing was written and the files there before are whole: free some space and run the same command "
            "again"))


@pytest.mark.slow
def test_a_backup_folder_made_read_only_mid_run_stops_in_one_line_and_the_rerun_resumes(small_disk):
    """The backup folder becomes a read-only mount (a bind mount of itself: the TensorBoard files the run holds
    open elsewhere on the disk keep the disk itself from being remounted read-only)."""
    backup = small_disk / "backup"

    def read_only(workdir):
        subprocess.run(["mount", "--bind", str(backup), str(backup)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(backup)], check=True)

    _stopped_at_step_4_and_resumes(
        small_disk, read_only, lambda workdir: unmount(backup),
        re.escape(f"[Errno 30] Cannot write the training backup and checkpoints in {backup}/worker_0: read-only "
                  "file system. Nothing was written and the files there before are whole: make the folder writable "
                  "(or choose another) and run the same command again"))


@pytest.mark.slow
@pytest.mark.parametrize("left", [256 * 1024, 2 * 1024 * 1024])
def test_keras_vit_train_on_a_full_disk_ends_in_one_line_and_writes_no_weights(small_disk, capsys, left):
    """The disk is full from the start: `keras-vit-train` ends with one line and exit status 1. With less than a
    MiB left (`trainer.MIN_FREE_BYTES`), before it writes any file; with 2 MiB, at its first save, before any
    weights file is begun (its logs, lock and backup config are written, whole)."""
    fill(small_disk, leave=left)
    status, _, err = run_train_cli(capsys, "--config=digits", f"--workdir={small_disk / 'run'}", "--verbose=0",
                                   *[f"--override={item}" for item in TRAIN_TINY])
    assert status == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    what = "the run's files in " if left < 2 ** 20 else "the training backup and checkpoints in "
    where = small_disk / "run" if left < 2 ** 20 else small_disk / "run" / "backup" / "worker_0"
    assert last.startswith(f"keras-vit-train: error: [Errno 28] Not enough free space for {what}{where}: about "), last
    assert "Traceback" not in err
    written = checksums(small_disk)
    assert not [name for name in written if name.endswith(".h5") or ".partial" in name]
    assert (written == {}) == (left < 2 ** 20), written  # nothing at all where it was refused at the start


@pytest.mark.slow
def test_keras_vit_train_into_a_read_only_folder_ends_in_one_line_and_writes_nothing(small_disk, capsys):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        status, _, err = run_train_cli(capsys, "--config=digits", f"--workdir={small_disk / 'run'}", "--verbose=0",
                                       *[f"--override={item}" for item in TRAIN_TINY])
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    assert (status, err.strip().splitlines()[-1]) == (1, (
        f"keras-vit-train: error: [Errno 30] Cannot write the run's files in {small_disk / 'run'}: read-only file "
        "system. Nothing was written and the files there before are whole: make the folder writable (or choose "
        "another) and run the same command again")), err[-3000:]
    assert os.listdir(small_disk) == []


@pytest.mark.slow
def test_a_disk_full_at_the_final_save_stops_in_one_line_and_the_rerun_only_evaluates_and_saves(small_disk):
    """The disk fills as the last epoch ends: the run's model files are refused before any is begun; the backup of
    the finished training stays, and once space is freed the same run trains nothing again and saves them."""
    at_end = FaultAtTrainEnd(small_disk, lambda workdir: fill(workdir, leave=LEFT_FREE))
    with pytest.raises(OSError) as stopped:
        _train(small_disk, [at_end])
    assert re.fullmatch(re.escape(f"[Errno 28] Not enough free space for the run's model files in {small_disk}: "
                                  "about ") + r"\d+\.\d MiB needed, 0\.\d MiB free\. .*", str(stopped.value)), (
        str(stopped.value))
    after = checksums(small_disk)
    kept = [name for name in at_end.before if not name.startswith("tensorboard/")]
    assert {name: after.get(name) for name in kept} == {name: at_end.before[name] for name in kept}
    assert "backup/worker_0/latest.weights.h5" in after and not [
        name for name in after if name not in at_end.before and not name.startswith("tensorboard/")]
    os.remove(small_disk / "filler")
    summary = _train(small_disk)
    assert summary["optimizer_iterations"] == 9 and os.path.exists(summary["model_path"])
    log = [json.loads(line) for line in open(small_disk / "train_log.jsonl", encoding="utf-8")]
    assert log[-1] == {"initial_epoch": 3, "optimizer_iterations": 9}  # nothing left to train
