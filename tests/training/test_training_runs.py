"""Training runs as processes: the mirrored and multi-worker strategies, runs killed and resumed, and the command
line `keras-vit-train` (Ctrl-C as a process; its flags and one-line stops in this process, through its `main`).
Tiny digits runs (`tests.testing.TRAIN_TINY`); the in-process tests of `training/` are in
tests/training/test_training.py. No test touches the network.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest

import keras_vit
from tests.testing import REPO, TRAIN_TINY, free_ports, run_train_cli, subprocess_env


def _arguments(workdir, *overrides: str, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--config=digits", f"--workdir={workdir}", "--verbose=0", *extra,
            *[f"--override={item}" for item in [*TRAIN_TINY, *overrides]]]


def _stderr_tail(lines: list[str]) -> str:
    """The end of a process's stderr; of a fatal error, what precedes the interpreter's list of extension modules
    (the error and each thread's stack: the list alone is longer than an assertion message shows)."""
    text = "".join(lines)
    return text.split("\nExtension modules:")[0][-6000:]


def _cli(workdir, *overrides: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "keras_vit.cli.train", *_arguments(workdir, *overrides, extra=extra)]


def _weights(path: str) -> list[np.ndarray]:
    model = keras.saving.load_model(path, compile=False)  # `import keras_vit` registers the classes it names
    assert isinstance(model, keras_vit.ViTModel)
    return model.get_weights()


# === Strategies (subprocesses) ===

MIRRORED_SCRIPT = textwrap.dedent("""
    import sys, tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import numpy as np, keras
    from keras_vit.training import configs, distribute, trainer
    config = configs.apply_overrides(configs.get_config("digits"), sys.argv[2:])
    mirrored = distribute.get_strategy("mirrored")
    assert mirrored.num_replicas_in_sync == 2, mirrored.num_replicas_in_sync
    try:
        trainer.train_and_evaluate(configs.apply_overrides(config, ["batch_size=15"]), sys.argv[1] + "/odd",
                                   strategy=mirrored, verbose=0)
    except ValueError as error:
        print("BATCH ERROR:", error)
    weights = []
    for name, strategy in (("default", distribute.get_strategy("default")), ("mirrored", mirrored)):
        summary = trainer.train_and_evaluate(config, f"{sys.argv[1]}/{name}", strategy=strategy, verbose=0)
        weights.append(keras.saving.load_model(summary["model_path"], compile=False).get_weights())
    print("MAX DIFF:", max(float(np.max(np.abs(a - b))) for a, b in zip(*weights)))
    keras.utils.set_random_seed(config.seed)  # The initial weights of both runs.
    initial = trainer.build_model(config, 10).get_weights()
    print("MAX CHANGE:", max(float(np.max(np.abs(a - b))) for a, b in zip(weights[0], initial)))
    # The fused AdamW update on mirrored variables equals Keras' AdamW.
    values, start = [], np.linspace(-1, 1, 6, dtype="float32").reshape(2, 3)
    for make in (keras.optimizers.AdamW, trainer.AdamW):
        with mirrored.scope():
            variable = keras.Variable(start)
            optimizer = make(learning_rate=0.01, weight_decay=0.1)
        grads = [tf.constant(np.arange(6, dtype="float32").reshape(2, 3) - 2.5)]
        step = tf.function(lambda: mirrored.run(lambda: optimizer.apply_gradients(zip(grads, [variable]))))
        for _ in range(3):
            step()
        values.append(variable.numpy())
    moved = np.max(np.abs(values[0] - start))
    print("ADAMW DIFF:", float(np.max(np.abs(values[0] - values[1]))), "MOVED:", float(moved))
""")


@pytest.mark.slow
def test_mirrored_two_cpus_matches_default_and_checks_batch(tmp_path):
    # SGD: Adam's m / sqrt(v) would turn float rounding in near-zero gradients into full-size steps.
    overrides = [*TRAIN_TINY, "inception_crop=false", "shuffle_buffer=0", "epochs=1", "steps_per_epoch=4",
                 "optimizer=sgd", "lr=0.1", "weight_decay=0", "global_clipnorm=0.05"]  # Clipping active.
    result = subprocess.run([sys.executable, "-c", MIRRORED_SCRIPT, str(tmp_path), *overrides], env=subprocess_env(),
                            capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "BATCH ERROR: Global batch size 15 is not divisible by the 2 replicas of MirroredStrategy" in result.stdout
    max_diff = float(result.stdout.split("MAX DIFF:")[1].split()[0])
    assert max_diff < 1e-5, result.stdout  # Same float32 math, summed in another order.
    assert float(result.stdout.split("MAX CHANGE:")[1].split()[0]) > 1e-3  # Training did move the weights.
    assert float(result.stdout.split("ADAMW DIFF:")[1].split()[0]) < 1e-6, result.stdout  # ~1 ulp of values ~1
    assert float(result.stdout.split("MOVED:")[1].split()[0]) > 1e-2, result.stdout


KILLABLE_WORKER = [sys.executable, "-m", "tests.killable_run"]  # WORKDIR KILL_AT STRATEGY OVERRIDES...


def _start_workers(ports: list[int], commands: list[list[str]]) -> list[subprocess.Popen]:
    """One process per port: `commands[i]` as worker i, with its own TF_CONFIG on 127.0.0.1."""
    processes = []
    for index, command in enumerate(commands):
        tf_config = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                     "task": {"type": "worker", "index": index}}
        env = subprocess_env(TF_CONFIG=json.dumps(tf_config))
        processes.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    return processes


def _wait(process: subprocess.Popen, timeout: float) -> tuple[int | None, str]:
    """(return code, output); SIGKILLs the process when it is still running after `timeout` seconds."""
    try:
        output = process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        process.kill()
        output = process.communicate()[0]
        return None, output
    return process.returncode, output


@pytest.mark.slow
def test_multiworker_worker_killed_mid_epoch_both_resume_from_backups(tmp_path):
    """Worker 1 is SIGKILLed as step 7 begins (epoch 2 of 3, batch 3 of 4; backups every 2 steps).
    Worker 0 is left waiting in the step's all-reduce; it is killed too if it has not failed within
    60 s. Both restart with the same command, restore the step-6 backup and end identical.

    Worker 1's backup is then rolled back to its previous one (step 4, epoch 1), as a kill between the two
    workers' writes of the step-6 backup would leave it: the chief's state wins (with Keras' plain
    BackupAndRestore both workers fail at the first step on mismatched collectives). Backups that agree are
    the simpler case of the same restore (one run of this test: the suite's time). The restart is the command line's
    `--strategy=multiworker` run, which validates every epoch and ends with both workers' models identical."""
    ports = free_ports(2)
    run = ["epochs=3", "steps_per_epoch=4", "backup_every_steps=2", "validate=true"]
    first = _start_workers(ports, [[*KILLABLE_WORKER, str(tmp_path), kill_at, "multiworker", *TRAIN_TINY, *run]
                                   for kill_at in ("-1", "7")])
    killed_code, killed_output = _wait(first[1], timeout=200)
    assert killed_code == -signal.SIGKILL, killed_output[-3000:]
    start = time.time()
    survivor_code, survivor_output = _wait(first[0], timeout=60)
    survivor_s = time.time() - start
    errors = [line for line in survivor_output.splitlines() if "Error" in line][-1:]
    backups = {index: json.loads((tmp_path / "backup" / f"worker_{index}" / "training_metadata.json").read_text())
               for index in (0, 1)}
    print("\nSURVIVOR:", "killed by the test after 60 s" if survivor_code is None else
          f"exited {survivor_code} {survivor_s:.1f} s after the kill", errors, "BACKUPS:", backups)
    assert backups[0] == backups[1] == {"epoch": 1, "batch": 1}  # Written after step 6 (epoch 2, batch 2).
    backup = tmp_path / "backup" / "worker_1"  # the lagging backup of a kill between the two workers' writes
    for name in ("latest.weights.h5", "training_metadata.json"):
        os.replace(backup / f"{name}.bkp", backup / name)
    assert json.loads((backup / "training_metadata.json").read_text()) == {"epoch": 0, "batch": 3}

    second = _start_workers(ports, [_cli(tmp_path, *run, extra=("--strategy=multiworker",))] * 2)
    results = [_wait(process, timeout=200) for process in second]
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    assert f"model saved to {tmp_path / 'model.keras'}" in results[0][1], results[0][1][-3000:]
    for outdir in (tmp_path, tmp_path / "worker_1"):
        starts = [json.loads(line) for line in (outdir / "train_log.jsonl").read_text().splitlines()]
        # The restart begins exactly at the last backup, optimizer step 6 (epoch 2, index 1, after its second
        # batch): the last 2 steps of epoch 2 and the 4 of epoch 3 follow: 12 in all, as a run never stopped.
        assert starts == [{"initial_epoch": 0, "optimizer_iterations": 0},
                          {"initial_epoch": 1, "optimizer_iterations": 6}], (outdir, starts)
        assert json.load(open(outdir / "model.eval.json"))["optimizer_iterations"] == 12
    chief, other = _weights(str(tmp_path / "model.keras")), _weights(str(tmp_path / "worker_1" / "model.keras"))
    assert all(np.array_equal(a, b) for a, b in zip(chief, other))
    assert not (tmp_path / "backup" / "worker_0").exists() and not (tmp_path / "backup" / "worker_1").exists()


@pytest.mark.slow
def test_sigkill_mid_training_resumes_and_finishes(tmp_path):
    epochs, steps = 8, 4  # Killed after its second epoch: 6 epochs of 4 steps left to end alive.
    command = _cli(tmp_path, f"epochs={epochs}", f"steps_per_epoch={steps}")
    history = tmp_path / "history.csv"
    process = subprocess.Popen(command, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if history.exists() and len(history.read_text().splitlines()) >= 3:  # Header + 2 epochs.
            break
        time.sleep(0.05)
    assert process.poll() is None, "training ended before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    result = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    starts = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert starts[0] == {"initial_epoch": 0, "optimizer_iterations": 0}
    resumed = starts[1]
    assert resumed["initial_epoch"] >= 2 and resumed["optimizer_iterations"] == steps * resumed["initial_epoch"]
    assert json.load(open(tmp_path / "model.eval.json"))["optimizer_iterations"] == steps * epochs
    assert not os.path.exists(tmp_path / "backup" / "worker_0")  # Deleted once the run completes.


def test_cli_help_explains_every_flag_and_a_url_workdir_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["keras-vit-train", "--help"])
    from keras_vit.cli import train
    with pytest.raises(SystemExit) as stop:
        train.run()
    assert stop.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--config", "--override", "--workdir", "--strategy", "--tpu", "--model_parallel", "--verbose",
                 "--[no]print_config"):
        assert flag in help_text
    assert "multiworker" in help_text and "key=value" in help_text

    status, _, err = run_train_cli(capsys, "--config=digits", "--workdir=gs://bucket/run")
    assert status == 1 and err.strip().splitlines()[-1].startswith(
        "keras-vit-train: error: workdir 'gs://bucket/run' is a URL;") and "Traceback" not in err, err[-3000:]


@pytest.mark.slow
def test_cli_nan_stop_and_ctrl_c_end_in_one_line(tmp_path, capsys):
    """A NaN stop exits with 1 and its message, a second run of a workdir while it trains and a resume with another
    model with 1 and what is wrong, Ctrl-C (SIGINT) mid-training with 130 and how to resume, a SIGTERM with 143,
    the step it backed up and how to resume: one line each, no traceback."""
    status, _, err = run_train_cli(capsys, *_arguments(tmp_path / "nan", "optimizer=sgd", "lr=1e30"))
    assert status == 1, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("keras-vit-train: error: Loss became nan at epoch 1"), err[-3000:]

    workdir = tmp_path / "interrupted"
    process = subprocess.Popen(_cli(workdir, "epochs=1000", "steps_per_epoch=50"), env=subprocess_env(),
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # As a terminal.
    lines = []
    for line in process.stderr:  # Interrupted once training has started.
        lines.append(line)
        if "Training starts at epoch" in line:
            break
    process.send_signal(signal.SIGSTOP)  # Paused while the second run starts (its lock held), not training on.
    status, _, err = run_train_cli(capsys, *_arguments(workdir, "epochs=1000", "steps_per_epoch=50"))  # meanwhile
    assert status == 1 and err.strip().splitlines()[-1].startswith(
        f"keras-vit-train: error: Another process (process {process.pid} on ") and f"is training in {workdir}: its " \
        "backup" in err and "Traceback" not in err, err[-3000:]
    assert process.poll() is None, "training ended before it could be interrupted"
    process.send_signal(signal.SIGCONT)
    process.send_signal(signal.SIGINT)
    lines += process.stderr.readlines()
    assert process.wait(timeout=120) == 130, _stderr_tail(lines)
    assert lines[-1].strip() == (f"keras-vit-train: interrupted. Run the same command (--workdir={workdir}) to "
                                 f"resume from its last backup in {workdir}/backup/."), _stderr_tail(lines)
    assert not any("Traceback" in line for line in lines), _stderr_tail(lines)

    # The same command resumes; a SIGTERM (a preempted VM) ends it after its step, with that step's backup.
    process = subprocess.Popen(_cli(workdir, "epochs=1000", "steps_per_epoch=50"), env=subprocess_env(),
                               stderr=subprocess.PIPE, text=True)
    lines = []
    for line in process.stderr:
        lines.append(line)
        if "Training starts at epoch" in line:
            break
    time.sleep(1.0)  # some steps in
    process.send_signal(signal.SIGTERM)
    lines += process.stderr.readlines()
    assert process.wait(timeout=120) == 143, _stderr_tail(lines)
    step = int(re.fullmatch(r"keras-vit-train: Preempted \(SIGTERM\) after step (\d+): its backup is written\. Run the "
                            rf"same command \(--workdir={re.escape(str(workdir))}\) to resume from it\.",
                            lines[-1].strip()).group(1))
    assert not any("Traceback" in line for line in lines), _stderr_tail(lines)
    starts = [json.loads(line) for line in (workdir / "train_log.jsonl").read_text().splitlines()]
    assert starts[-1]["optimizer_iterations"] < step  # it trained on after its start

    status, _, err = run_train_cli(capsys, *_arguments(workdir, "epochs=1000", "steps_per_epoch=50", "hidden_dim=32"))
    assert status == 1 and err.strip().splitlines()[-1].startswith(
        f"keras-vit-train: error: {workdir} holds the backup of a run with another model or optimizer "
        "(hidden_dim 16 -> 32).") and "Traceback" not in err, err[-3000:]


def test_cli_print_config_applies_overrides(tmp_path, capsys):
    status, out, err = run_train_cli(capsys, "--config=finetune", f"--workdir={tmp_path}", "--override=lr=0.01",
                                   "--print_config")
    assert status == 0, err
    config = json.loads(out)
    assert (config["recipe"], config["optimizer"], config["lr"]) == ("finetune", "sgd", 0.01)


def test_cli_finetunes_a_dinov3_file_as_the_file_says_and_it_learns(tmp_path, capsys):
    """The digits recipe fine-tuning a transformers DINOv3 folder (tests/data/families/hf_dinov3_112: patch 16,
    width 32, 2 blocks, rotary positions, 4 registers, its processor's mean and std) at 32 px, a 2x2 grid: the
    recipe's architecture (patch 4, width 64, 4 blocks) gives way to the file's, which loads, trains, is saved, and
    learns (the zero head's ln(10) falls, top-1 on the 360 test digits far above chance); an override that
    contradicts the file is refused by name, nothing trained."""
    from tests.data.make_family_files import FOLDER

    folder = os.path.join(FOLDER, "hf_dinov3_112")
    workdir = tmp_path / "dinov3"
    overrides = ["recipe=finetune", f"weights={folder}", "image_size=32", "batch_size=32", "epochs=5",
                 "steps_per_epoch=10", "warmup_steps=3", "lr=2e-2", "weight_decay=0",
                 "inception_crop=false"]  # as docs/training.md shows it
    arguments = ["--config=digits", f"--workdir={workdir}", "--verbose=0",
                 *[f"--override={item}" for item in overrides]]
    status, out, err = run_train_cli(capsys, *arguments, "--print_config")
    assert status == 0, err[-3000:]
    printed = json.loads(out)
    from_file = dict(variant="", patch_size=0, hidden_dim=0, mlp_dim=0, num_heads=0, num_layers=0, classifier="")
    assert {name: printed[name] for name in from_file} == from_file  # the recipe's cleared: the file's
    start = time.time()
    status, out, err = run_train_cli(capsys, *arguments)
    seconds = time.time() - start
    assert status == 0, err[-3000:]
    assert f"model saved to {workdir / 'model.keras'}" in out, out[-3000:]
    model = keras.saving.load_model(workdir / "model.keras", compile=False)
    layers = [layer.name for layer in model.layers]
    assert tuple(model.get_layer("embedding").kernel.shape) == (16, 16, 3, 32)  # patch 16, width 32
    assert {"registers", "rope", "encoderblock_1"} <= set(layers) and "encoderblock_2" not in layers, layers
    with open(workdir / "history.csv") as file:
        losses = [float(row["loss"]) for row in csv.DictReader(file)]
    summary = json.loads((workdir / "model.eval.json").read_text())
    with capsys.disabled():
        print(f"\nDINOv3 file fine-tuned on digits at 32 px: {seconds:.1f} s, training loss per epoch "
              f"{[round(loss, 3) for loss in losses]}, test top-1 {summary['top1']:.3f}, loss {summary['loss']:.3f}")
    assert losses[-1] < np.log(10) - 0.3 and losses[-1] < losses[0] - 0.3, losses  # measured: 2.31 -> 1.85
    assert summary["top1"] > 0.3, summary  # chance: 0.1; measured 0.44

    status, _, err = run_train_cli(capsys, *arguments[:1], f"--workdir={tmp_path / 'wrong'}", *arguments[2:],
                                 "--override=hidden_dim=64")
    assert status == 1 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("keras-vit-train: error: hidden_dim=64 contradicts"), err[-3000:]
    assert not (tmp_path / "wrong" / "model.keras").exists()


def test_cli_bad_input_ends_in_one_line(tmp_path, capsys, monkeypatch):
    """An unknown override and a dataset that is not prepared: exit status 1 and the message, no traceback; with
    KERAS_VIT_TRACEBACK=1, the exception itself."""
    command = ["--config=finetune", f"--workdir={tmp_path / 'run'}"]
    unknown = ["--override=lr=0.01", "--override=learning_rate=0.01"]
    message = "Unknown config field 'learning_rate' in override 'learning_rate=0.01'. Expected one "
    for overrides, last_line in [
            (unknown, f"keras-vit-train: error: {message}"),
            ([f"--override=data_dir={tmp_path}"],
             f"keras-vit-train: error: TFDS dataset 'imagenet2012' is not prepared in '{tmp_path}/imagenet2012/")]:
        status, _, err = run_train_cli(capsys, *command, *overrides)
        assert status == 1 and "Traceback" not in err, err[-3000:]
        assert err.strip().splitlines()[-1].startswith(last_line), err[-3000:]
    monkeypatch.setenv("KERAS_VIT_TRACEBACK", "1")
    with pytest.raises(ValueError, match=message):
        run_train_cli(capsys, *command, *unknown)
