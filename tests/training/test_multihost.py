"""Several JAX processes as one run (`training/multihost.py`), tested the way JAX tests itself: N local processes
with a `localhost` coordinator, each with 2 host CPU devices, CPU collectives (gloo).

The checks of the join itself (Keras' environment variables, the rendezvous and its errors) run in this process;
the runs are JAX subprocesses.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import keras
import numpy as np
import pytest

from keras_vit import datasets
from keras_vit.training import configs, data, distribute, multihost
from tests.training.test_training_jax import FIXED_BATCH, REPO, TINY, _report
from tests.testing import free_ports, subprocess_env, xla_flags

DEVICES_PER_PROCESS = 2


def _cluster_flags(port: int, *extra: str) -> list[str]:
    """keras-vit-train's flags for a 2-process run meeting at localhost:`port`, then `extra`."""
    return [f"--coordinator_address=localhost:{port}", "--num_processes=2", *extra]


def _env(process_id: int | None, port: int, devices: int = DEVICES_PER_PROCESS, num_processes: int = 2) -> dict:
    """A JAX process's environment: `devices` host devices, and with a `process_id`, Keras' variables that make it
    process `process_id` of `num_processes` meeting at localhost:`port`."""
    env = subprocess_env(KERAS_BACKEND="jax", XLA_FLAGS=xla_flags(devices))
    for name in (multihost.ENV_ADDRESSES, multihost.ENV_NUM_PROCESSES, multihost.ENV_PROCESS_ID):
        env.pop(name, None)
    if process_id is not None:
        env.update({multihost.ENV_ADDRESSES: f"localhost:{port}", multihost.ENV_NUM_PROCESSES: str(num_processes),
                    multihost.ENV_PROCESS_ID: str(process_id)})
    return env


def _run_processes(commands: list[list[str]], envs: list[dict], timeout: float) -> list[subprocess.CompletedProcess]:
    """Runs the commands at once (one per process) and waits for all of them. A process still running after
    `timeout` seconds fails the test with every process's Python stacks (SIGABRT to faulthandler) and output."""
    procs = [subprocess.Popen(c, cwd=REPO, env={**e, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for c, e in zip(commands, envs)]
    deadline = time.monotonic() + timeout
    results = []
    for command, proc in zip(commands, procs):
        try:
            stdout, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _fail_with_stacks(procs, timeout)
        results.append(subprocess.CompletedProcess(command, proc.returncode, stdout, stderr))
    return results


def _fail_with_stacks(procs: list[subprocess.Popen], timeout: float) -> None:
    """Ends the processes, those still running with SIGABRT (faulthandler prints their threads' stacks), and fails
    with what each printed."""
    running = [proc.poll() is None for proc in procs]
    for proc, alive in zip(procs, running):
        if alive:
            proc.send_signal(signal.SIGABRT)
    reports = []
    for index, (proc, alive) in enumerate(zip(procs, running)):
        try:
            stdout, stderr = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        state = "still running (stacks below)" if alive else f"exited with {proc.returncode}"
        reports.append(f"--- process {index}: {state}\nstdout: {stdout[-2000:]}\nstderr: {stderr[-6000:]}")
    pytest.fail(f"Not every process ended within {timeout:.0f} s.\n" + "\n".join(reports), pytrace=False)


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


# === Joining: Keras' environment variables and the rendezvous, in this process ===


def test_cluster_reads_keras_environment_variables_as_keras_does(monkeypatch):
    monkeypatch.setenv(multihost.ENV_ADDRESSES, "10.0.0.1:1234,10.0.0.2:2345")
    monkeypatch.setenv(multihost.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(multihost.ENV_PROCESS_ID, "1")
    assert multihost.Cluster.from_flags_and_env() == multihost.Cluster("10.0.0.1:1234", 2, 1)
    # Explicit values win over the environment.
    assert multihost.Cluster.from_flags_and_env("h:1", 4, 3) == multihost.Cluster("h:1", 4, 3)
    monkeypatch.setenv(multihost.ENV_NUM_PROCESSES, "3")
    with pytest.raises(ValueError, match=r"The job addresses name 2 processes .* but the process count is 3"):
        multihost.Cluster.from_flags_and_env()
    monkeypatch.setenv(multihost.ENV_PROCESS_ID, "one")
    with pytest.raises(ValueError, match="KERAS_DISTRIBUTION_PROCESS_ID='one' is not an integer"):
        multihost.Cluster.from_flags_and_env()


def test_cluster_without_anything_set_is_one_process(monkeypatch):
    for name in (multihost.ENV_ADDRESSES, multihost.ENV_NUM_PROCESSES, multihost.ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    cluster = multihost.Cluster.from_flags_and_env()
    assert not cluster.given and (multihost.process_index(), multihost.process_count()) == (0, 1)
    assert multihost.shard() == multihost.Shard(0, 1) and multihost.gather_counts(7) == [7]


@pytest.mark.parametrize("cluster, message", [
    (multihost.Cluster("h:1", 2, 2), "The process id is 2, outside 0..1 for 2 processes"),
    (multihost.Cluster("h:1", 2, -1), "The process id is -1, outside 0..1"),
    (multihost.Cluster("h:1", 0, 0), "The process count is 0. Expected 1 or more"),
    (multihost.Cluster("h", 2, 0), "The coordinator address 'h' has no port"),
])
def test_impossible_clusters_are_refused_before_joining(cluster, message):
    with pytest.raises(ValueError, match=message):
        cluster.check()


def test_a_split_model_is_refused_in_a_run_of_several_processes():
    with pytest.raises(ValueError, match=r"model_parallel=2 with 2 processes: keras_vit saves a split model from one "
                                         r"process only\. Expected model_parallel=1 \(DataParallel\)"):
        distribute.check_model_parallel_processes(2, 2)
    for model_parallel, processes in ((1, 2), (2, 1), (2, None)):  # DataParallel, or one process: nothing raised
        distribute.check_model_parallel_processes(model_parallel, processes)


def _rendezvous_all(clusters: list[multihost.Cluster], timeout_s: float) -> list[str | None]:
    """Each cluster's `rendezvous` in a thread: None where it joined, else its JoinError's message."""
    outcomes: list[str | None] = [None] * len(clusters)

    def join(i):
        try:
            multihost.rendezvous(clusters[i], timeout_s)
        except multihost.JoinError as error:
            outcomes[i] = str(error)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(clusters))]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # Process 0 first, so the others find it listening (they retry anyway).
    for thread in threads:
        thread.join(timeout_s + 10)
    return outcomes


def test_rendezvous_of_three_processes_joins_and_frees_the_port():
    port = free_ports(1)[0]
    assert _rendezvous_all([multihost.Cluster(f"localhost:{port}", 3, i) for i in (0, 2, 1)], 20) == [None] * 3
    with socket.create_server(("", port)):  # JAX's coordinator binds it next.
        pass


def test_rendezvous_names_a_process_count_that_differs_on_both_sides():
    port = free_ports(1)[0]
    outcomes = _rendezvous_all([multihost.Cluster(f"localhost:{port}", 2, 0),
                                multihost.Cluster(f"localhost:{port}", 3, 1)], 20)
    expected = "Process 1 was started with 3 processes, process 0 with 2. Expected the same process count"
    assert all(outcome and outcome.startswith(expected) for outcome in outcomes), outcomes


def test_rendezvous_names_an_id_given_twice():
    port = free_ports(1)[0]
    outcomes = _rendezvous_all([multihost.Cluster(f"localhost:{port}", 3, i) for i in (0, 1, 1)], 20)
    assert outcomes[0].startswith("Two processes have process id 1. Expected a distinct id from 0 to 2"), outcomes
    assert outcomes.count(outcomes[0]) >= 2  # The second process 1 is told; the first may be told or time out.


def test_rendezvous_times_out_with_what_is_missing():
    port = free_ports(1)[0]
    start = time.monotonic()
    assert _rendezvous_all([multihost.Cluster(f"localhost:{port}", 3, 0), multihost.Cluster(f"localhost:{port}", 3, 2)],
                           1.5)[0].startswith("Process(es) [1] of 3 did not join within 2 s")
    alone = _rendezvous_all([multihost.Cluster(f"localhost:{free_ports(1)[0]}", 2, 1)], 1.0)[0]
    assert alone.startswith("Process 0 at localhost:") and "did not answer within 1 s" in alone
    assert time.monotonic() - start < 10


def test_a_port_in_use_is_named():
    with socket.create_server(("", 0)) as holder:
        port = holder.getsockname()[1]
        with pytest.raises(multihost.JoinError, match=f"Process 0 cannot listen on port {port}.*another process 0"):
            multihost.rendezvous(multihost.Cluster(f"localhost:{port}", 2, 0), 1.0)


def test_shards_cover_the_split_once_and_the_global_batch_splits_evenly():
    shards = [multihost.Shard(i, 3) for i in range(3)]
    assert [s.size(449) for s in shards] == [150, 150, 149]
    images, _ = datasets.digits("test")
    parts = [data.digits_source("test", shard=s) for s in shards]
    assert [p.num_examples for p in parts] == [120, 120, 120]
    seen = np.concatenate([np.stack([x for x, _ in p.dataset.as_numpy_iterator()]) for p in parts])
    assert sorted(map(bytes, seen)) == sorted(map(bytes, images))
    assert shards[0].per_process_batch(48) == 16
    with pytest.raises(ValueError, match="The global batch of 16 does not split over the 3 processes"):
        shards[0].per_process_batch(16)


# === Runs of 2 processes x 2 devices ===

# One run of the fixed global batch (4 updates of the tiny digits model) under the "auto" strategy: process 0 saves
# the weights before and after, and the losses, to OUT.{npz,initial.npz,json}.
FIXED_BATCH_RUN = textwrap.dedent("""
    import json, sys
    import keras, numpy as np
    from keras_vit.training import configs, distribute, multihost, supervised, trainer

    def fixed_batch_run(out, overrides):
        config = configs.apply_overrides(configs.get_config("digits"), overrides)
        rng = np.random.default_rng(0)
        x = rng.uniform(0, 255, (16, 16, 16, 3)).astype("float32")
        y = np.eye(10, dtype="float32")[rng.integers(0, 10, 16)]
        shard = multihost.shard()  # This process's rows of the fixed global batch.
        rows = slice(shard.index * 16 // shard.count, (shard.index + 1) * 16 // shard.count)
        strategy = distribute.get_strategy("auto")
        keras.utils.set_random_seed(config.seed)
        with distribute.build_scope(strategy):
            model = trainer.build_model(config, 10)
            model.compile(trainer.make_optimizer(config, total_steps=10), supervised.make_loss(config))
        initial = model.get_weights()
        with distribute.run_scope(strategy):
            losses = [float(model.train_on_batch(x[rows], y[rows])) for _ in range(4)]
        if multihost.is_writer():
            np.savez(out + ".npz", *model.get_weights())
            np.savez(out + ".initial.npz", *initial)
            with open(out + ".json", "w") as f:
                json.dump({"losses": losses, "devices": len(keras.distribution.list_devices()),
                           "processes": multihost.process_count(), "replicas": distribute.num_replicas(strategy)}, f)
""")
# One process of 4 devices: python -c ONE_PROCESS_SCRIPT OUT OVERRIDE...
ONE_PROCESS_SCRIPT = FIXED_BATCH_RUN + textwrap.dedent("""
    fixed_batch_run(sys.argv[1], sys.argv[2:])
""")
# Each of 2 processes of 2 devices: python -c TWO_PROCESS_SCRIPT WORKDIR FIXED_BATCH_OVERRIDES_JSON OVERRIDE...: the
# fixed batch (WORKDIR/two.*); a digits run (WORKDIR/sigterm) that a SIGTERM to process 0 alone as step 5 begins
# stops, resumed by the same call, and the same run never stopped (WORKDIR/straight); then masked patch prediction
# (WORKDIR/masked) and the bfloat16 fine-tuning of its encoder with 2 accumulated micro-batches (WORKDIR/finetune),
# the overrides common to the last two. The command line's own multi-process run is the uninterrupted run of the
# kill test below.
TWO_PROCESS_SCRIPT = FIXED_BATCH_RUN + textwrap.dedent("""
    import signal
    from keras_vit.training import preemption
    from tests.killable_run import SignalOnce

    workdir, fixed, *common = sys.argv[1:]
    multihost.initialize(multihost.Cluster.from_flags_and_env(), join_timeout_s=60, heartbeat_timeout_s=10)
    fixed_batch_run(workdir + "/two", json.loads(fixed))
    digits = configs.apply_overrides(configs.get_config("digits"), [*json.loads(fixed), "epochs=2",
                                                                    "steps_per_epoch=4"])
    process = multihost.process_index()
    term = SignalOnce(5 if process == 0 else -1, signal.SIGTERM, f"{workdir}/termed_{process}")
    try:
        trainer.train_and_evaluate(digits, workdir + "/sigterm", verbose=0, callbacks=[term],
                                   strategy=distribute.get_strategy("auto"))
        preempted = None
    except preemption.Preempted as stop:
        preempted = {"step": stop.step, "here": stop.here}
    summaries = {"preempted": preempted,
                 "resumed": trainer.train_and_evaluate(digits, workdir + "/sigterm", verbose=0,
                                                       strategy=distribute.get_strategy("auto")),
                 "straight": trainer.train_and_evaluate(digits, workdir + "/straight", verbose=0,
                                                        strategy=distribute.get_strategy("auto"))}
    masked = configs.apply_overrides(configs.get_config("masked_patches"), common)
    summaries["masked"] = trainer.train_and_evaluate(masked, workdir + "/masked", verbose=0,
                                                     strategy=distribute.get_strategy("auto"))
    multihost.broadcast_from_process_0([np.zeros(1)])  # Every process waits for process 0's encoder file.
    finetune = configs.apply_overrides(configs.get_config("finetune"), [
        *common, f"weights={workdir}/masked/encoder.weights.h5", "precision=bfloat16", "grad_accum_steps=2"])
    summaries["finetune"] = trainer.train_and_evaluate(finetune, workdir + "/finetune", verbose=0,
                                                       strategy=distribute.get_strategy("auto"))
    print("REPORT:", json.dumps({"process": multihost.process_index(), **summaries}))
""")


def _weights(path) -> list[np.ndarray]:
    with np.load(path) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


@pytest.mark.slow  # one JAX process of 4 devices, then 2 of 2 devices (about 50 s)
def test_2_processes_x_2_devices_equal_1_process_x_4_devices_stop_together_and_run_the_other_recipes(tmp_path):
    """On a fixed global batch, 2 processes x 2 devices train as 1 process x 4 devices. In the same 2 processes, a
    SIGTERM to process 0 alone as step 5 of 8 begins stops both after step 6 (they agree at each update), each with
    its backup of it; the same call resumes at step 6 and ends with the weights and loss of the run never stopped.
    Then the recipes besides the supervised float32 one: masked patch prediction, then fine-tuning its encoder in
    mixed bfloat16 with 2 accumulated micro-batches per update."""
    port = free_ports(1)[0]
    _ok(_run_processes([[sys.executable, "-c", ONE_PROCESS_SCRIPT, str(tmp_path / "one"), *FIXED_BATCH]],
                       [_env(None, port, devices=4)], 240)[0])
    common = [*TINY, "epochs=1", "steps_per_epoch=4", "total_steps=0", "dataset=digits", "train_split=train",
              "eval_split=test"]
    runs = [_report(_ok(run).stdout) for run in _run_processes(
        [[sys.executable, "-c", TWO_PROCESS_SCRIPT, str(tmp_path), json.dumps(FIXED_BATCH), *common]] * 2,
        [_env(0, port), _env(1, port)], 240)]
    one, two = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "two"))
    assert (one["devices"], one["processes"], one["replicas"]) == (4, 1, 4)
    assert (two["devices"], two["processes"], two["replicas"]) == (4, 2, 4)
    assert one["losses"][-1] < one["losses"][0] - 0.1  # It trains.
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=0, atol=1e-5)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(_weights(tmp_path / "one.npz"),
                                                           _weights(tmp_path / "one.initial.npz")))
    assert moved > 1e-2, moved
    for got, want in zip(_weights(tmp_path / "two.npz"), _weights(tmp_path / "one.npz")):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)

    assert [run["process"] for run in runs] == [0, 1]
    assert [run["preempted"] for run in runs] == [{"step": 6, "here": True}, {"step": 6, "here": False}]
    starts = [json.loads(line) for line in (tmp_path / "sigterm" / "train_log.jsonl").read_text().splitlines()]
    assert starts == [{"initial_epoch": 0, "optimizer_iterations": 0}, {"initial_epoch": 1, "optimizer_iterations": 6}]
    resumed, straight = runs[0]["resumed"], runs[0]["straight"]
    assert resumed["optimizer_iterations"] == straight["optimizer_iterations"] == 8
    assert abs(resumed["loss"] - straight["loss"]) <= 1e-6 and runs[1]["resumed"]["loss"] == resumed["loss"]
    for got, want in zip(*(keras.saving.load_model(summary["model_path"], compile=False).get_weights()
                           for summary in (resumed, straight))):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)

    masked, finetune = runs[0]["masked"], runs[0]["finetune"]
    assert np.isfinite(masked["loss"]) and "masked_accuracy" in masked
    assert os.path.exists(tmp_path / "masked" / "encoder.weights.h5")
    assert finetune["optimizer_iterations"] == 2 and finetune["num_eval_examples"] == 360  # 4 micro-steps / 2
    assert runs[1]["finetune"]["optimizer_iterations"] == 2 and "model_path" not in runs[1]["finetune"]
    assert json.loads((tmp_path / "finetune" / "model.eval.json").read_text())["num_eval_examples"] == 360


def _cli(workdir, *flags: str) -> list[str]:
    return [sys.executable, "-m", "keras_vit.cli.train", "--config=digits", f"--workdir={workdir}", "--verbose=0",
            *flags]


def _numpy_top1(model_path: str, overrides: list[str]) -> int:
    """Correct predictions of the saved model on the digits test split, preprocessed as the run evaluates it."""
    config = configs.apply_overrides(configs.get_config("digits"), overrides)
    images, labels = datasets.digits("test")
    inputs = np.stack([data._eval_map(config, 10)(x, 0)[0] for x in images.astype("float32")])
    logits = keras.saving.load_model(model_path, compile=False).predict(inputs, verbose=0)
    return int((logits.argmax(1) == labels).sum())


@pytest.mark.slow  # JAX processes that fail at the batch check or before joining (about 15 s)
def test_cli_setups_that_cannot_run_end_in_one_line(tmp_path):
    port = free_ports(1)[0]
    # These two join, then stop at the batch check: 60 s to join, as a loaded machine can start one 3 s late.
    flags = _cluster_flags(port, "--join_timeout=60", *[f"--override={o}" for o in TINY], "--override=batch_size=6")
    for result in _run_processes([_cli(tmp_path, *flags, f"--process_id={i}") for i in (0, 1)],
                                 [_env(None, port)] * 2, 120):
        assert result.returncode == 1, result.stderr[-3000:]
        assert result.stderr.strip().splitlines()[-1] == (
            "keras-vit-train: error: Global batch size 6 is not divisible by the 4 replicas of DataParallel over 2 "
            "processes. Expected a positive multiple of 4."), result.stderr[-3000:]
    port = free_ports(1)[0]
    flags = _cluster_flags(port, "--model_parallel=2", "--join_timeout=3", *[f"--override={o}" for o in TINY])
    split = subprocess.run(_cli(tmp_path, *flags, "--process_id=1"), cwd=REPO, env=_env(None, port),
                           capture_output=True, text=True, timeout=120)  # Refused before joining: no process 0.
    assert split.returncode == 1 and split.stderr.strip().splitlines()[-1] == (
        "keras-vit-train: error: model_parallel=2 with 2 processes: keras_vit saves a split model from one process "
        "only. Expected model_parallel=1 (DataParallel) in a multi-process run."), split.stderr[-3000:]
    flags = _cluster_flags(port, "--join_timeout=3")
    alone = subprocess.run(_cli(tmp_path, *flags, "--process_id=1"), cwd=REPO, env=_env(None, free_ports(1)[0]),
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode == 1 and "Traceback" not in alone.stderr, alone.stderr[-3000:]
    assert alone.stderr.strip().splitlines()[-1].startswith(
        f"keras-vit-train: error: Process 0 at localhost:{port} did not answer within 3 s."), alone.stderr[-3000:]


KILLABLE_RUN = [sys.executable, "-m", "tests.killable_run"]  # WORKDIR KILL_AT STRATEGY OVERRIDES...


@pytest.mark.slow  # three 2-process runs (about 100 s)
def test_a_killed_process_stops_the_run_which_resumes_and_equals_an_uninterrupted_run(tmp_path):
    """Process 1 SIGKILLs itself at step 20 (epoch 2 of 3); process 0 stops on its own instead of waiting forever.
    The same commands again resume both from process 0's epoch-1 state (rerunning epoch 2 from its first batch) and
    end with the weights and evaluation of the run never killed, which runs through the command line: it evaluates
    the 360 test digits exactly (global batches of 32: each process pads its last one), and process 0 alone saves."""
    overrides = [*TINY, "train_split=train[:29%]", "batch_size=32", "steps_per_epoch=0", "epochs=3",
                 "shuffle_buffer=0", "inception_crop=false", "warmup_steps=5", "validate=true"]
    killed, port = tmp_path / "killed", free_ports(1)[0]
    envs = [_env(0, port), _env(1, port)]
    procs = [subprocess.Popen([*KILLABLE_RUN, str(killed), kill_at, "auto", *overrides], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for kill_at, env in zip(("-1", "20"), envs)]
    assert procs[1].wait(timeout=240) == -9
    died = time.monotonic()
    assert procs[0].wait(timeout=60) != 0  # It stopped (heartbeat timeout: 10 s).
    stopped_after = time.monotonic() - died
    for proc in procs:
        proc.communicate()
    assert stopped_after < 30, stopped_after
    for worker in (0, 1):
        assert json.loads((killed / "backup" / f"worker_{worker}" / "training_metadata.json").read_text()) == {
            "epoch": 1, "batch": 0}
    port = free_ports(1)[0]
    resumed = [_report(_ok(r).stdout) for r in _run_processes(
        [[*KILLABLE_RUN, str(killed), "-1", "auto", *overrides]] * 2, [_env(0, port), _env(1, port)], 240)]
    port, straight_dir = free_ports(1)[0], tmp_path / "straight"
    flags = _cluster_flags(port, *[f"--override={o}" for o in overrides])
    first, second = map(_ok, _run_processes([_cli(straight_dir, *flags, f"--process_id={i}") for i in (0, 1)],
                                            [_env(None, port)] * 2, 240))
    straight = json.loads((straight_dir / "model.eval.json").read_text())
    assert f"model saved to {straight_dir / 'model.keras'}" in first.stdout
    assert second.stdout.strip().endswith("process 1: eval done, process 0 saved the model")
    assert straight["num_eval_examples"] == 360
    assert round(straight["top1"] * 360) == _numpy_top1(str(straight_dir / "model.keras"), overrides)
    assert sorted(os.listdir(straight_dir)) == ["backup", "checkpoints", "history.csv", "model.eval.json",
                                                "model.keras", "tensorboard", "train_log.jsonl"]  # No worker_1 folder.
    assert not os.listdir(straight_dir / "backup")  # Both processes' backups are deleted when the run completes.
    assert len((straight_dir / "history.csv").read_text().splitlines()) == 4  # header + 3 epochs, from process 0
    starts = [json.loads(line) for line in (killed / "train_log.jsonl").read_text().splitlines()]
    assert starts == [{"initial_epoch": 0, "optimizer_iterations": 0}, {"initial_epoch": 1, "optimizer_iterations": 13}]
    assert resumed[0]["optimizer_iterations"] == straight["optimizer_iterations"] == 39
    assert "model_path" in resumed[0] and "model_path" not in resumed[1]
    for key in ("loss", "top1", "top5"):
        assert resumed[0][key] == resumed[1][key]
        assert abs(resumed[0][key] - straight[key]) <= 1e-6, (key, resumed[0][key], straight[key])
    assert not (killed / "backup").exists() or not os.listdir(killed / "backup")
    weights = [keras.saving.load_model(path, compile=False).get_weights()
               for path in (resumed[0]["model_path"], straight_dir / "model.keras")]
    for got, want in zip(*weights):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    print(f"kill -9 of process 1: process 0 stopped {stopped_after:.1f} s later; resumed at iteration 13")


def test_each_process_reads_only_its_even_split_of_a_tfds_split(monkeypatch):
    """A TFDS split is read as `tfds.even_splits` parts, one per process: process i asks TFDS for part i only."""
    import tensorflow as tf
    import tensorflow_datasets as tfds

    asked = []

    class Splits(dict):
        def __getitem__(self, split):
            return type("SplitInfo", (), {"num_examples": 10})()

    class Builder:
        data_dir = "/nowhere"
        info = type("Info", (), {"splits": Splits(), "features": {"label": type("L", (), {"num_classes": 3})()}})()

        def as_dataset(self, split, shuffle_files, as_supervised):
            asked.append(split)
            return tf.data.Dataset.from_tensors((tf.zeros((2, 2, 3), tf.uint8), 0))

    monkeypatch.setattr(tfds, "list_builders", lambda: ["cifar10"])
    monkeypatch.setattr(tfds, "builder", lambda name, data_dir=None: Builder())
    for index in range(3):
        data.tfds_source("cifar10", "train[:98%]", None, False, True, shard=multihost.Shard(index, 3))
    data.tfds_source("cifar10", "train[:98%]", None, False, True)
    assert asked == [*tfds.even_splits("train[:98%]", n=3, drop_remainder=False), "train[:98%]"]
    assert len(set(asked[:3])) == 3
