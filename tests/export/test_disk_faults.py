"""`keras-vit-export` and `keras-vit-convert` on a disk that is full, made for real on a small tmpfs (root only,
as CI runs; skips elsewhere): one line, exit status 1, the files there before unchanged, nothing half-written."""

import hashlib
import os
import subprocess
import sys

import pytest

from tests.testing import (REPO, TINY_VIT, fill, mounted_tmpfs, save_checkpoint, subprocess_env, tiny_model, unmount,
                           vit_checkpoint)


def _tree(folder) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under `folder` (but the filler)."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            if name != "filler":
                path = os.path.join(root, name)
                with open(path, "rb") as file:
                    found[os.path.relpath(path, folder)] = hashlib.sha256(file.read()).hexdigest()
    return found


def _command(name: str, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"keras_vit.cli.{name}", *arguments], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture
def small_disk(tmp_path):
    yield mounted_tmpfs(tmp_path / "disk", "4m")
    unmount(tmp_path / "disk")


@pytest.mark.slow
def test_export_on_a_full_disk_keeps_the_served_versions_and_leaves_nothing(small_disk, tmp_path):
    model_file = tmp_path / "tiny.keras"
    tiny_model("plain").save(model_file)
    first = _command("export", "--model", str(model_file), "--out", str(small_disk / "served"))
    assert first.returncode == 0, first.stderr[-3000:]
    before = _tree(small_disk)
    assert "served/1/saved_model.pb" in before
    fill(small_disk, leave=64 * 1024)  # less than the variables: refused before writing
    early = _command("export", "--model", str(model_file), "--out", str(small_disk / "served"))
    assert early.returncode == 1, early.stderr[-3000:]
    assert early.stderr.strip().splitlines()[-1].startswith(
        "keras-vit-export: error: [Errno 28] Not enough free space for SavedModel version 2 in "
        f"{small_disk}/served: about 0."), early.stderr[-2000:]
    os.remove(small_disk / "filler")
    fill(small_disk, leave=400 * 1024)  # room for the variables, not the whole SavedModel: the writer fails
    late = _command("export", "--model", str(model_file), "--out", str(small_disk / "served"))
    assert late.returncode == 1, late.stderr[-3000:]
    last = late.stderr.strip().splitlines()[-1]
    assert last.startswith("keras-vit-export: error: [Errno 28] The disk filled up while SavedModel version 2 was "
                           f"written in {small_disk}/served (No space left on device"), last
    assert last.endswith("Nothing was written and the versions there before are whole: free some space and export "
                         "again") and "Traceback" not in early.stderr + late.stderr
    assert _tree(small_disk) == before  # version 1 byte for byte, and no version 2 or partial folder
    assert sorted(os.listdir(small_disk / "served")) == ["1"]


@pytest.mark.slow
def test_convert_on_a_full_disk_refuses_before_writing(small_disk, tmp_path):
    checkpoint = save_checkpoint(tmp_path / "tiny.npz", vit_checkpoint(TINY_VIT, classes=10))
    output = small_disk / "tiny.weights.h5"
    first = _command("convert", str(checkpoint), str(output))
    assert first.returncode == 0, first.stderr[-3000:]
    before = _tree(small_disk)
    fill(small_disk, leave=64 * 1024)
    again = _command("convert", str(checkpoint), str(output))
    assert again.returncode == 1, again.stderr[-3000:]
    last = again.stderr.strip().splitlines()[-1]
    assert last.startswith(f"keras-vit-convert: error: [Errno 28] Not enough free space for tiny.weights.h5 in "
                           f"{small_disk}: about 1."), last
    assert _tree(small_disk) == before and "Traceback" not in again.stderr
