"""`training/` on JAX: keras.distribution sharding and the command line (crash-safe resume on JAX: the killed
process of tests/training/test_multihost.py).

The test session runs on TensorFlow and Keras fixes its backend at import, so every JAX run is a
subprocess with KERAS_BACKEND=jax and 4 CPU host devices (`tests.testing.xla_flags`).
The checks that need no JAX devices (options that exist on one backend only) run here, on TensorFlow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from tests.testing import REPO, TRAIN_VIT_OVERRIDES, subprocess_env, xla_flags
from keras_vit.training import configs, distribute, recipe

DEVICES = 4
TINY = [*TRAIN_VIT_OVERRIDES, "image_size=16", "batch_size=16", "epochs=2", "steps_per_epoch=3", "warmup_steps=2",
        "validate=false", "shuffle_buffer=64"]


def _jax_env() -> dict[str, str]:
    return subprocess_env(KERAS_BACKEND="jax", XLA_FLAGS=xla_flags(DEVICES))


def _run_jax(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=REPO, env=_jax_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def _report(stdout: str) -> dict:
    """The JSON the script printed after `REPORT:`."""
    return json.loads(stdout.split("REPORT:", 1)[1])


def _model_weights(path: str) -> list[np.ndarray]:
    return keras.saving.load_model(path, compile=False).get_weights()


# === Sharding: 4-device DataParallel and 2x2 ModelParallel equal one device ===

# SGD with global-norm clipping active: Adam's m / sqrt(v) would turn float rounding in near-zero gradients
# into full-size steps.
FIXED_BATCH = [*TINY, "optimizer=sgd", "lr=1.0", "weight_decay=0", "warmup_steps=0", "global_clipnorm=0.05"]

SHARDING_SCRIPT = textwrap.dedent("""
    import json, sys
    import keras, numpy as np
    from keras_vit.training import configs, distribute, supervised, trainer

    workdir, names, *overrides = sys.argv[1:]
    config = configs.apply_overrides(configs.get_config("digits"), overrides)
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, (16, 16, 16, 3)).astype("float32")
    y = np.eye(10, dtype="float32")[rng.integers(0, 10, 16)]
    report = {"devices": keras.distribution.list_devices()}
    strategies = {"one_device": distribute.get_strategy("default"), "data_parallel": distribute.get_strategy("auto"),
                  "model_parallel": distribute.get_strategy("auto", model_parallel=2)}
    for name in names.split(","):
        strategy = strategies[name]
        keras.utils.set_random_seed(config.seed)
        with distribute.build_scope(strategy):
            model = trainer.build_model(config, 10)
            model.compile(trainer.make_optimizer(config, total_steps=10), supervised.make_loss(config))
        initial = model.get_weights()
        with distribute.run_scope(strategy):
            losses = [float(model.train_on_batch(x, y)) for _ in range(4)]
        mlp = model.get_layer("encoderblock_0").mlp.dense_0.kernel
        report[name] = {"losses": losses, "optimizer": type(model.optimizer).__name__,
                        "mlp_kernel_devices": len(mlp.value.sharding.device_set),
                        "mlp_kernel_shard": list(mlp.value.sharding.shard_shape(mlp.shape)),
                        "replicas": distribute.num_replicas(strategy)}
        np.savez(f"{workdir}/{name}.npz", *model.get_weights())
    np.savez(f"{workdir}/initial.npz", *initial)
    errors = {}
    for key, call in {"mirrored": lambda: distribute.get_strategy("mirrored"),
                      "tpu": lambda: distribute.get_strategy("auto", tpu="local"),
                      "model_parallel_3": lambda: distribute.get_strategy("auto", model_parallel=3),
                      "heads": lambda: distribute.check_model_parallel(
                          distribute.get_strategy("auto", model_parallel=4), {"num_heads": 2, "mlp_dim": 32}),
                      "eval_split": lambda: distribute.check_eval_split([361], strategies["data_parallel"]),
                      "eval_folder": lambda: distribute.check_eval_split([449], strategies["data_parallel"], "folder",
                                                                         "test")}.items():
        try:
            call()
            errors[key] = None
        except ValueError as error:
            errors[key] = str(error)
    report["errors"] = errors
    print("REPORT:", json.dumps(report))
""")


def _run_sharding(workdir, names: str) -> dict:
    """Four steps on one fixed batch with each strategy in `names` (comma-separated), weights saved to
    `workdir/<name>.npz`; plus the errors of options that do not exist on JAX."""
    result = _run_jax([sys.executable, "-c", SHARDING_SCRIPT, str(workdir), names, *FIXED_BATCH], timeout=240)
    return _report(result.stdout)


@pytest.fixture(scope="module")
def sharding(tmp_path_factory):
    """The three strategies in one JAX process (each starts from the same seed), for the tests below."""
    workdir = tmp_path_factory.mktemp("sharding")
    return workdir, _run_sharding(workdir, "one_device,data_parallel,model_parallel")


def _weights(path) -> list[np.ndarray]:
    with np.load(path) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def _assert_equals_one_device(workdir, report: dict, name: str, replicas: int, mlp_shard: list[int]) -> None:
    """The run `name` had `replicas` batch shards and the first MLP kernel in `mlp_shard` pieces on all 4
    devices, and its losses and weights equal the one-device run's to float32 summation order."""
    one = _weights(workdir / "one_device.npz")
    moved = max(float(np.abs(a - b).max()) for a, b in zip(one, _weights(workdir / "initial.npz")))
    assert moved > 1e-2, moved  # The steps did train.
    run = report[name]
    assert (run["replicas"], run["mlp_kernel_devices"], run["mlp_kernel_shard"]) == (replicas, DEVICES, mlp_shard)
    assert run["optimizer"] == "SGD"  # Keras' own: its clipping sees the whole batch's gradient.
    np.testing.assert_allclose(run["losses"], report["one_device"]["losses"], rtol=0, atol=1e-5, err_msg=name)
    for got, want in zip(_weights(workdir / f"{name}.npz"), one):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.slow  # one JAX subprocess with 4 host devices (about 20 s)
def test_data_parallel_on_4_devices_equals_one_device(sharding):
    workdir, report = sharding
    assert len(report["devices"]) == DEVICES
    assert report["one_device"]["losses"][-1] < report["one_device"]["losses"][0] - 0.1
    _assert_equals_one_device(workdir, report, "data_parallel", replicas=4, mlp_shard=[16, 32])


@pytest.mark.slow  # one JAX subprocess with 4 host devices, shared with the tests beside it
def test_model_parallel_2x2_equals_one_device(sharding):
    """A (2 batch, 2 model) mesh: the MLP and attention kernels are split in two, each half on 2 devices."""
    workdir, report = sharding
    _assert_equals_one_device(workdir, report, "model_parallel", replicas=2, mlp_shard=[16, 16])


@pytest.mark.slow  # one JAX subprocess with 4 host devices (about 20 s)
def test_jax_rejects_tensorflow_only_and_uneven_options(sharding):
    errors = sharding[1]["errors"]
    assert "strategy='mirrored' is a tf.distribute strategy" in errors["mirrored"] and "'auto'" in errors["mirrored"]
    assert "tpu='local' is the address of TensorFlow's TPUStrategy" in errors["tpu"]
    assert errors["model_parallel_3"].startswith("model_parallel=3 does not divide the 4 devices")
    assert errors["heads"].startswith("model_parallel=4 does not divide num_heads=2")
    assert errors["eval_split"].startswith("The eval split has 361 examples, which do not split evenly over the 4 "
                                           "replicas") and "eval_split=validation[:360]" in errors["eval_split"]
    assert "move 1 image(s) out of the folder data_dir/test/" in errors["eval_folder"]
    assert "validation[" not in errors["eval_folder"]


def test_tensorflow_rejects_model_parallel():
    with pytest.raises(ValueError, match="model_parallel=2 splits the model with keras.distribution.*"
                                         "Expected model_parallel=1 on TensorFlow"):
        distribute.get_strategy("default", model_parallel=2)


PROJECTIONS = ("query", "key", "value")


def test_vit_layout_map_splits_heads_and_mlp_only():
    """Every encoder block's attention and MLP matmuls are split over "model"; everything else is replicated."""
    mesh = keras.distribution.DeviceMesh((2, 2), (distribute.BATCH_AXIS, distribute.MODEL_AXIS),
                                         [f"cpu:{i}" for i in range(4)])
    layout_map = distribute.vit_layout_map(mesh)
    config = configs.apply_overrides(configs.get_config("digits"), [*TINY, "num_layers=2"])
    model = recipe.build_backbone(config, classes=10)
    split = {}
    for variable in model.variables:
        layout = layout_map[variable.path]
        assert layout is None or len(layout.axes) == len(variable.shape), variable.path
        if layout is not None:
            split[variable.path.split("/", 1)[1]] = tuple(layout.axes)
    assert split == {
        **{f"MultiHeadDotProductAttention_1/{name}/kernel": (None, "model", None) for name in PROJECTIONS},
        **{f"MultiHeadDotProductAttention_1/{name}/bias": ("model", None) for name in PROJECTIONS},
        "MultiHeadDotProductAttention_1/attention_output/kernel": ("model", None, None),
        "MlpBlock_3/Dense_0/kernel": (None, "model"), "MlpBlock_3/Dense_0/bias": ("model",),
        "MlpBlock_3/Dense_1/kernel": ("model", None)}
    assert sum(layout_map[v.path] is not None for v in model.variables) == 2 * 10  # 10 per block


# === Crash-safe resume ===

# === The command line ===


@pytest.mark.slow
def test_cli_on_jax_trains_evaluates_and_saves(tmp_path):
    """A 2x2 ModelParallel run of the command line (its DataParallel run is tests/training/test_multihost.py's, on 2
    processes)."""
    flags = ["--model_parallel=2"]
    command = [sys.executable, "-m", "keras_vit.cli.train", "--config=digits", f"--workdir={tmp_path}", "--verbose=0",
               *flags, *[f"--override={item}" for item in TINY]]
    result = _run_jax(command, timeout=240)
    assert "top-1 " in result.stdout and f"model saved to {tmp_path / 'model.keras'}" in result.stdout, result.stdout
    summary = json.loads((tmp_path / "model.eval.json").read_text())
    assert summary["optimizer_iterations"] == 6 and summary["num_eval_examples"] == 360
    assert 0.0 <= summary["top1"] <= summary["top5"] <= 1.0 and np.isfinite(summary["loss"])
    assert os.path.exists(tmp_path / "checkpoints" / "last.weights.h5") and os.listdir(tmp_path / "tensorboard")
    assert _model_weights(str(tmp_path / "model.keras"))[0].shape == (8, 8, 3, 16)
