"""The command lines when stopped: Ctrl-C ends each in one line and exit status 130, bad input in one line and exit
status 1, and the files they write are whole or absent (`keras_vit.atomic.atomic_write`). `keras-vit-train`'s own
lines and resume: tests/training/test_training_runs.py."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import cli, convert
from keras_vit.atomic import atomic_write
from keras_vit.cli import convert as convert_cli
from tests.project.test_dependencies import SETUP
from tests.testing import TINY_VIT, save_checkpoint, vit_checkpoint

# Arguments each command parses; the interrupt comes at its first step after parsing (`cli.require`).
ARGUMENTS = {
    "keras-vit-export": ["--variant", "Ti/16", "--out", "x"],
    "keras-vit-tflite": ["--variant", "Ti/16", "--out", "x"],
    "keras-vit-inspect": ["--variant", "Ti/16", "--out", "x", "--image", "a.png"],
    "keras-vit-convert": ["a.npz", "b.weights.h5"],
    "keras-vit-fewshot": ["--variant", "Ti/16"],
    "keras-vit-masked-digits": ["--workdir", "x"],
}
WRITE_ATOMICALLY = {"keras-vit-export", "keras-vit-tflite", "keras-vit-inspect", "keras-vit-convert"}
NOTES = {**{command: " No file is left half-written." for command in WRITE_ATOMICALLY},
         "keras-vit-masked-digits": " The same command goes on where it stopped: runs that completed are not run "
                                    "again, and the stopped one resumes from its backup."}


def _console_scripts() -> dict[str, str]:
    """setup.py's console scripts: command -> module."""
    entries = (entry.split("=") for entry in SETUP["entry_points"]["console_scripts"])
    return {command: target.split(":")[0] for command, target in entries}


def test_every_command_but_train_is_covered():
    assert set(_console_scripts()) - set(ARGUMENTS) == {"keras-vit-train"}  # Its own line says how to resume.


# The packages that make a command's start slow (seconds): `--help` imports none of them.
HEAVY = {"keras", "tensorflow", "jax", "jaxlib", "torch"}


def _help_command(command: str, target: str) -> list[str]:
    """The installed console script, or (a source tree that was never installed) what its wrapper runs."""
    script = Path(sys.executable).with_name(command)
    if script.exists():
        return [str(script), "--help"]
    module, entry = target.split(":")
    return [sys.executable, "-c", f"import sys; sys.argv[0] = {command!r}; from {module} import {entry}; {entry}()",
            "--help"]


@pytest.mark.parametrize("command", sorted(SETUP["entry_points"]["console_scripts"]),
                         ids=lambda entry: entry.split("=")[0])
def test_help_is_instant_it_imports_no_keras_tensorflow_or_jax(command):
    """Every command's `--help` prints its help without importing Keras or a backend (`import keras_vit` is lazy and
    each command imports its tools after parsing): `-X importtime` lists every module the process imported."""
    command, target = command.split("=")
    done = subprocess.run(_help_command(command, target), capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert command in done.stdout and "--" in done.stdout, done.stdout
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert "keras_vit" in imported, done.stderr[-2000:]  # the import times were listed
    assert imported & HEAVY == set(), f"{command} --help imports {sorted(imported & HEAVY)}"


def _stopped(command: str, raised: BaseException, monkeypatch) -> int:
    """Runs `command`'s main with `raised` coming at its first step after parsing; returns its exit status."""
    def stops(*args):
        raise raised

    monkeypatch.setattr(cli, "require", stops)
    with pytest.raises(SystemExit) as done:
        importlib.import_module(_console_scripts()[command]).main(ARGUMENTS[command])
    return done.value.code


@pytest.mark.parametrize("command", sorted(ARGUMENTS))
def test_ctrl_c_ends_a_command_in_one_line_with_status_130(command, monkeypatch, capsys):
    assert _stopped(command, KeyboardInterrupt(), monkeypatch) == 130
    assert capsys.readouterr().err == f"{command}: interrupted.{NOTES.get(command, '')}\n"


@pytest.mark.parametrize("error", [ValueError("Unknown thing 'x'. Expected one of ['y']."),
                                   FileNotFoundError(2, "No such file or directory", "a.png")])
@pytest.mark.parametrize("command", sorted(ARGUMENTS))
def test_bad_input_ends_a_command_in_one_line_with_status_1(command, error, monkeypatch, capsys):
    assert _stopped(command, error, monkeypatch) == 1
    assert capsys.readouterr().err == f"{command}: error: {error}\n"
    monkeypatch.setenv(cli.TRACEBACK_VARIABLE, "1")  # The traceback instead, for a bug report.
    with pytest.raises(type(error)):
        _stopped(command, error, monkeypatch)


@pytest.mark.parametrize("command, arguments, message", [
    ("keras-vit-export", ["--variant", "X/99", "--out", "{tmp}/x"], "Unknown variant 'X/99'. Expected one of ["),
    ("keras-vit-fewshot", ["--model", "{tmp}/missing.keras"],
     "Expected an existing `.keras` model file. Received: '{tmp}/missing.keras'"),
    ("keras-vit-convert", ["{tmp}/missing.npz", "{tmp}/out.weights.h5"], "weights='{tmp}/missing.npz': no such file"),
])
def test_commands_given_bad_input_say_what_is_wrong_in_one_line(command, arguments, message, tmp_path, capsys):
    main = importlib.import_module(_console_scripts()[command]).main
    with pytest.raises(SystemExit) as done:
        main([argument.format(tmp=tmp_path) for argument in arguments])
    error = capsys.readouterr().err
    assert done.value.code == 1 and error.startswith(f"{command}: error: {message.format(tmp=tmp_path)}"), error
    assert error.count("\n") == 1 and os.listdir(tmp_path) == [], error


def test_atomic_write_replaces_only_a_whole_file(tmp_path):
    target = tmp_path / "figure.png"
    target.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(target) as partial:
            assert partial.endswith(".png") and Path(partial).parent == tmp_path
            Path(partial).write_bytes(b"ne")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == ["figure.png"] and target.read_bytes() == b"old"
    with atomic_write(target) as partial:
        Path(partial).write_bytes(b"new")
    assert os.listdir(tmp_path) == ["figure.png"] and target.read_bytes() == b"new"
    with atomic_write(tmp_path / "new" / "model.weights.h5") as partial:  # Its folder is made.
        assert partial.endswith(".weights.h5")
        Path(partial).write_bytes(b"weights")
    assert os.listdir(tmp_path / "new") == ["model.weights.h5"]


def test_atomic_write_replaces_only_a_whole_folder(tmp_path):
    target = tmp_path / "base" / "3"  # a SavedModel version folder; its parent is made
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(target, folder=True) as partial:
            (Path(partial) / "saved_model.pb").write_bytes(b"half")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path / "base") == []
    with atomic_write(target, folder=True) as partial:
        (Path(partial) / "marker").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_write(target, folder=True) as partial:
            raise RuntimeError
    assert os.listdir(tmp_path / "base") == ["3"] and os.listdir(target) == ["marker"]
    with atomic_write(target, folder=True) as partial:  # an older folder is replaced whole
        (Path(partial) / "saved_model.pb").write_bytes(b"new")
    assert os.listdir(tmp_path / "base") == ["3"] and os.listdir(target) == ["saved_model.pb"]


@pytest.mark.parametrize("output", ["vit.weights.h5", "vit.keras"])
def test_converter_stopped_while_writing_leaves_the_older_file_whole(output, tmp_path, monkeypatch, capsys):
    """Ctrl-C while Keras writes the file: the command ends in one line, and the file there before is untouched."""
    checkpoint = save_checkpoint(tmp_path / "vit.npz", vit_checkpoint(TINY_VIT, classes=10))
    target = tmp_path / output
    target.write_bytes(b"an older conversion")
    method = "save" if output.endswith(".keras") else "save_weights"
    write = getattr(keras.Model, method)

    def stopped_mid_write(self, path, *args, **kwargs):
        write(self, path, *args, **kwargs)
        with open(path, "r+b") as half:
            half.truncate(os.path.getsize(path) // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(keras.Model, method, stopped_mid_write)
    with pytest.raises(SystemExit) as done:
        convert_cli.main([checkpoint, str(target)])
    assert done.value.code == 130
    assert capsys.readouterr().err == "keras-vit-convert: interrupted. No file is left half-written.\n"
    assert sorted(os.listdir(tmp_path)) == sorted(["vit.npz", output]) and target.read_bytes() == b"an older conversion"

    monkeypatch.setattr(keras.Model, method, write)
    model, difference = convert.convert_checkpoint(checkpoint, str(target))
    assert difference == 0 and sorted(os.listdir(tmp_path)) == sorted(["vit.npz", output])
    x = np.random.default_rng(0).uniform(0, 255, (1, 32, 32, 3)).astype("float32")
    if output.endswith(".keras"):
        written = keras.saving.load_model(target)
    else:
        written = keras_vit.ViTModel.from_config(model.get_config())
        written.load_weights(target)
    np.testing.assert_array_equal(np.asarray(written(x)), np.asarray(model(x)))
