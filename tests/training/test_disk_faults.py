"""Disk faults during a training run, made for real: a small tmpfs mounted for the test fills up mid-run.

The run stops before its next write with one line (`keras_vit.atomic.DiskSpaceError`: the bytes needed and free);
every file it had written is unchanged and whole, nothing half-written is left, and once space is freed the same
run resumes from its backup and finishes. Mounting needs root (CI runs as root); elsewhere the test skips, naming
the missing privilege.
"""

import json
import os
import re
import subprocess
import sys

import h5py
import pytest

from tests.full_disk_run import checksums
from tests.testing import REPO, TRAIN_TINY, fill, mounted_tmpfs, subprocess_env, unmount


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs at tmp_path / "disk"."""
    yield mounted_tmpfs(tmp_path / "disk", "16m")
    unmount(tmp_path / "disk")


def _run(workdir, fill_at: int, record) -> subprocess.CompletedProcess:
    overrides = [*TRAIN_TINY, "epochs=3", "steps_per_epoch=3", "validate=true"]
    return subprocess.run([sys.executable, "-m", "tests.full_disk_run", str(workdir), str(fill_at), str(record),
                           *overrides], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_disk_full_mid_run_stops_in_one_line_keeps_every_file_and_the_rerun_resumes(small_disk, tmp_path):
    record = tmp_path / "before_fill.json"
    stopped = _run(small_disk, fill_at=4, record=record)  # epoch 2 of 3: epoch 1's backup and checkpoints exist
    assert stopped.returncode == 3, stopped.stdout[-2000:] + stopped.stderr[-3000:]
    line = stopped.stdout.split("STOPPED: ")[1].splitlines()[0]
    assert line.startswith("[Errno 28] Not enough free space for the training backup and checkpoints in "
                           f"{small_disk}/backup/worker_0: about "), line
    assert re.search(r"about \d+\.\d MiB needed, 0\.\d MiB free\. Nothing was written and the files there before "
                     r"are whole: free some space and run the same command again$", line), line

    before = json.loads(record.read_text())
    assert {"backup/worker_0/latest.weights.h5", "checkpoints/last.weights.h5", "checkpoints/best.weights.h5",
            "history.csv"} <= set(before)
    after = checksums(small_disk)
    # Every file as it was when the disk filled, but TensorBoard's event logs, which only grow (appended records).
    kept = [name for name in before if not name.startswith("tensorboard/")]
    assert {name: after.get(name) for name in kept} == {name: before[name] for name in kept}
    assert [name for name in after if name not in before and not name.startswith("tensorboard/")] == []
    for name in ("backup/worker_0/latest.weights.h5", "checkpoints/last.weights.h5"):
        with h5py.File(small_disk / name, "r"):  # whole HDF5 files
            pass
    with open(small_disk / "history.csv", encoding="utf-8") as history:
        assert len(history.read().splitlines()) == 2  # the header and epoch 1

    os.remove(small_disk / "filler")
    resumed = _run(small_disk, fill_at=4, record=record)  # the record exists: no second fill
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.split("REPORT: ")[1].splitlines()[0])
    assert summary["optimizer_iterations"] == 9
    log = [json.loads(line) for line in (small_disk / "train_log.jsonl").read_text().splitlines()]
    assert [entry["initial_epoch"] for entry in log] == [0, 1]  # the rerun began after epoch 1, from its backup
    assert not [name for name in checksums(small_disk) if ".partial" in name]


@pytest.mark.slow
def test_keras_vit_train_on_a_full_disk_ends_in_one_line_and_writes_no_weights(small_disk):
    """The disk is full from the start: `keras-vit-train` stops at its first save with one line and exit status 1,
    before any weights file is begun."""
    fill(small_disk, leave=256 * 1024)
    done = subprocess.run([sys.executable, "-m", "keras_vit.cli.train", "--config=digits", f"--workdir={small_disk}",
                           "--verbose=0", *[f"--override={item}" for item in TRAIN_TINY]],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("keras-vit-train: error: [Errno 28] Not enough free space for the training backup and "
                           f"checkpoints in {small_disk}/backup/worker_0: about "), last
    assert "Traceback" not in done.stderr
    assert not [name for name in checksums(small_disk) if name.endswith(".h5") or ".partial" in name]
