"""`keras-vit-export`, `keras-vit-convert` and `keras-vit-tflite` on a disk that is full or read-only, made for real
on a small tmpfs (root only, as CI runs; skips elsewhere): one line, exit status 1, the files there before
unchanged, nothing half-written. The commands run through their `main` in this process, as the console scripts
call it (an input error is a `SystemExit(1)` after the one line on stderr)."""

import hashlib
import importlib
import os
import re
import subprocess

import pytest

from keras_vit.atomic import NotWritableError, atomic_write
from tests.testing import TINY_VIT, fill, mounted_tmpfs, save_checkpoint, tiny_model, unmount, vit_checkpoint


def _tree(folder) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under `folder` (but the filler), and "folder" for each folder (a hidden
    partial one too)."""
    found = {}
    for root, folders, names in os.walk(folder):
        found.update({os.path.relpath(os.path.join(root, name), folder): "folder" for name in folders})
        for name in names:
            if name != "filler":
                path = os.path.join(root, name)
                with open(path, "rb") as file:
                    found[os.path.relpath(path, folder)] = hashlib.sha256(file.read()).hexdigest()
    return found


def _command(capsys, name: str, *arguments: str) -> tuple[int, str]:
    """keras-vit-<name> with `arguments`, through its `main`: the exit status and stderr's last line."""
    main = importlib.import_module(f"keras_vit.cli.{name}").main
    capsys.readouterr()
    try:
        status = main(list(arguments))
    except SystemExit as stop:
        status = stop.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return status, (err.strip().splitlines() or [""])[-1]


@pytest.fixture
def small_disk(tmp_path):
    yield mounted_tmpfs(tmp_path / "disk", "4m")
    unmount(tmp_path / "disk")


@pytest.mark.slow
def test_export_on_a_full_disk_keeps_the_served_versions_and_leaves_nothing(small_disk, tmp_path, capsys):
    model_file = tmp_path / "tiny.keras"
    tiny_model("plain").save(model_file)
    export = ("export", "--model", str(model_file), "--out", str(small_disk / "served"))
    assert _command(capsys, *export) == (0, "")
    before = _tree(small_disk)
    assert "served/1/saved_model.pb" in before
    fill(small_disk, leave=64 * 1024)  # less than the variables: refused before writing
    status, early = _command(capsys, *export)
    assert status == 1 and early.startswith(
        "keras-vit-export: error: [Errno 28] Not enough free space for SavedModel version 2 in "
        f"{small_disk}/served: about 0."), early
    os.remove(small_disk / "filler")
    fill(small_disk, leave=400 * 1024)  # room for the variables, not the whole SavedModel: the writer fails
    status, late = _command(capsys, *export)
    assert status == 1 and late.startswith(
        "keras-vit-export: error: [Errno 28] The disk filled up while SavedModel version 2 was "
        f"written in {small_disk}/served (No space left on device"), late
    assert late.endswith("Nothing was written and the versions there before are whole: free some space and export "
                         "again")
    assert _tree(small_disk) == before  # version 1 byte for byte, and no version 2 or partial folder
    assert sorted(os.listdir(small_disk / "served")) == ["1"]


@pytest.mark.slow
def test_convert_and_tflite_on_a_full_disk_refuse_before_writing_or_as_the_disk_fills(
        small_disk, tmp_path, capsys, monkeypatch):
    from keras_vit.export import tflite

    checkpoint = save_checkpoint(tmp_path / "tiny.npz", vit_checkpoint(TINY_VIT, classes=10))
    convert = ("convert", str(checkpoint), str(small_disk / "tiny.weights.h5"))
    lite = ("tflite", "--weights", str(checkpoint), "--out", str(small_disk / "lite"), "--modes", "float32",
            "float16")
    assert _command(capsys, *convert) == (0, "") and _command(capsys, *lite) == (0, "")
    before = _tree(small_disk)
    assert {"tiny.weights.h5", "lite/report.json"} <= set(before) and len(os.listdir(small_disk / "lite")) == 4
    fill(small_disk, leave=64 * 1024)
    status, refused = _command(capsys, *convert)
    assert status == 1 and refused.startswith(
        f"keras-vit-convert: error: [Errno 28] Not enough free space for tiny.weights.h5 in {small_disk}: about 1."
    ) and refused.endswith("Nothing was written and the files there before are whole: free some space and run the "
                           "same command again"), refused
    status, early = _command(capsys, *lite)
    assert status == 1 and early.startswith(
        f"keras-vit-tflite: error: [Errno 28] Not enough free space for the LiteRT files in {small_disk}/lite: "
        "about 1."), early
    monkeypatch.setattr(tflite, "check_room", lambda needs, what: None)  # as if the disk filled after the check
    status, late = _command(capsys, *lite)
    assert status == 1 and late.startswith(
        "keras-vit-tflite: error: [Errno 28] The disk filled up while vision_transformer_float32.tflite was written in "
        f"{small_disk}/lite. It was not written and the files there before are whole"), late
    assert _tree(small_disk) == before  # byte for byte, and no hidden partial file


@pytest.mark.slow
def test_export_convert_and_tflite_into_a_read_only_folder_end_in_one_line(small_disk, tmp_path, capsys):
    """A read-only mount (root's writes obey it, unlike a chmod): each command names the folder it cannot write."""
    checkpoint = save_checkpoint(tmp_path / "tiny.npz", vit_checkpoint(TINY_VIT, classes=10))
    commands = {"export": ("--weights", str(checkpoint), "--out", str(small_disk / "served")),
                "convert": (str(checkpoint), str(small_disk / "tiny.weights.h5")),
                "tflite": ("--weights", str(checkpoint), "--out", str(small_disk / "lite"), "--modes", "float32")}
    for name, arguments in commands.items():
        assert _command(capsys, name, *arguments) == (0, ""), name
    before = _tree(small_disk)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        for name, what, where in (("export", "SavedModel version 2", small_disk / "served"),
                                  ("convert", "tiny.weights.h5", small_disk), ("tflite", "the LiteRT files",
                                                                              small_disk / "lite")):
            assert _command(capsys, name, *commands[name]) == (1, (
                f"keras-vit-{name}: error: [Errno 30] Cannot write {what} in {where}: read-only file system. Nothing "
                "was written and the files there before are whole: make the folder writable (or choose another) and "
                "run the same command again")), name
        # A writer that did not ask first: the hidden file `atomic_write` begins with is refused, named as its target.
        with pytest.raises(NotWritableError, match=re.escape(
                f"[Errno 30] Cannot write report.json in {small_disk / 'lite'}: read-only file system.")):
            with atomic_write(small_disk / "lite" / "report.json"):
                pass
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    assert _tree(small_disk) == before
