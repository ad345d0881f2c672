"""keras_vit on the JAX and PyTorch Keras backends (each in its own process, as Keras fixes its
backend at import): the same logits as on TensorFlow for original-layout and timm / Hugging Face
checkpoints, the same attention scores, rollout and digits few-shot accuracy, the layer and config
round trips of `tests/layers/test_layers.py`, and `fit` steps that lower the loss. PyTorch is not in the README's
environment: its tests skip there, naming the install, and `.ci/torch` runs them in a venv of their own."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import keras_vit
import keras_vit.fewshot
from keras_vit import inspection as vit_inspect
from tests.testing import (REPO, TINY_HYBRID, TINY_VIT, hf_state_dict, needs, save_checkpoint, save_safetensors,
                           timm_family_state_dict, timm_state_dict, vit_checkpoint, xla_flags)

BACKENDS = [pytest.param("jax", id="jax"),
            pytest.param("torch", id="torch", marks=needs("torch", "the PyTorch Keras backend"))]

# (name, checkpoint file, builder arguments, images): plain and hybrid at their native size, a
# resized rectangular input, and both PyTorch-world layouts (exact GELU, their LayerNorm epsilon;
# no preprocessing layer, so [-1, 1] images).
LOGITS = dict(classifier_activation=None, classes=10)
CASES = [
    ("vit", "vit.npz", dict(TINY_VIT, input_shape=(32, 32, 3), **LOGITS), "square"),
    ("vit_resized", "vit.npz", dict(TINY_VIT, input_shape=(40, 56, 3), **LOGITS), "rectangle"),
    ("hybrid", "hybrid.npz", dict(TINY_HYBRID, input_shape=(32, 32, 3), **LOGITS), "square"),
    ("timm", "timm.safetensors", dict(TINY_VIT, input_shape=(32, 32, 3), include_preprocessing=False, **LOGITS),
     "square_unit"),
    ("hugging_face", "hf.safetensors",
     dict(TINY_VIT, input_shape=(40, 56, 3), include_preprocessing=False, **LOGITS), "rectangle_unit"),
    # The ViT family: SigLIP's attention pooling (cross-attention, no class token, no patch bias) and DINOv2's
    # registers and layer scale, the options read from the files.
    ("timm_siglip", "siglip.safetensors",
     dict(TINY_VIT, input_shape=(32, 32, 3), include_preprocessing=False, **LOGITS), "square_unit"),
    ("timm_dinov2_registers", "dinov2.safetensors",
     dict(TINY_VIT, input_shape=(40, 56, 3), include_preprocessing=False, **LOGITS), "rectangle_unit"),
]
TRAIN = dict(TINY_VIT, input_shape=(32, 32, 3), classes=4)
EPOCHS = 8


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Checkpoints, images and the TensorFlow logits of every case."""
    path = tmp_path_factory.mktemp("backends")
    save_checkpoint(path / "vit.npz", vit_checkpoint(seed=3))
    save_checkpoint(path / "hybrid.npz", vit_checkpoint(TINY_HYBRID, seed=4))
    save_safetensors(timm_state_dict(seed=5), path / "timm.safetensors")
    save_safetensors(hf_state_dict(seed=6), path / "hf.safetensors")
    save_safetensors(timm_family_state_dict(seed=7, map_head=True, patch_bias=False), path / "siglip.safetensors")
    save_safetensors(timm_family_state_dict(seed=8, registers=4, layer_scale=True, no_embed_class=True),
                     path / "dinov2.safetensors")
    rng = np.random.default_rng(0)
    images = {"square": rng.uniform(0, 255, (4, 32, 32, 3)).astype("float32"),
              "rectangle": rng.uniform(0, 255, (4, 40, 56, 3)).astype("float32")}
    images.update({f"{key}_unit": value / 127.5 - 1 for key, value in list(images.items())})  # No preprocessing
    np.savez(path / "images.npz", **images)
    spec = {"cases": [dict(name=n, file=f, build=b, images=i) for n, f, b, i in CASES], "train": TRAIN,
            "epochs": EPOCHS}
    (path / "spec.json").write_text(json.dumps(spec))
    tensorflow_logits, models = {}, []
    for name, file, build, image_key in CASES:
        models.append(keras_vit.VisionTransformer(**build, weights=str(path / file)))
        tensorflow_logits[name] = np.asarray(models[-1](images[image_key], training=False))
        assert np.ptp(tensorflow_logits[name]) > 0.5, f"{name}: degenerate logits"
    model, image_key = models[0], CASES[0][3]  # As the worker: attention and few-shot of the first case.
    tensorflow_logits["attention"] = np.stack(
        [np.asarray(scores) for scores in keras_vit.attention_model(model)(images[image_key])["attention"]])
    tensorflow_logits["rollout"] = vit_inspect.attention_rollout(model, images[image_key])
    fewshot = keras_vit.fewshot.digits_accuracy(model, shots=(2,), seeds=1)[2][0]
    return path, tensorflow_logits, fewshot


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_tensorflow_and_trains(workdir, backend):
    path, tensorflow_logits, tensorflow_fewshot = workdir
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2", "XLA_FLAGS": xla_flags()}
    done = subprocess.run([sys.executable, "-m", "tests.backend_worker", str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((path / "report.json").read_text())
    assert report["backend"] == backend
    assert not report["tensorflow_imported"], "import keras_vit imported TensorFlow on another backend"
    logits = np.load(path / "logits.npz")
    for name, expected in tensorflow_logits.items():
        np.testing.assert_allclose(logits[name], expected, atol=1e-5, rtol=0, err_msg=f"{backend}: {name}")
    assert report["model.keras max difference"] <= 1e-6 and report["model.weights.h5 max difference"] <= 1e-6
    # The same features up to float32 rounding: at most a near-tie among the 899 test digits may flip.
    assert abs(report["fewshot"] - tensorflow_fewshot) <= 2 / 899, (report["fewshot"], tensorflow_fewshot)
    # keras_vit.export is TensorFlow-only, keras_vit.training TensorFlow or JAX: elsewhere a clear error, not a
    # crash later (tests/training/test_training_jax.py trains on JAX).
    if backend == "jax":
        assert report["keras_vit.training"] == "imported", report["keras_vit.training"]
    else:
        assert report["keras_vit.training"].startswith("keras_vit.training runs on TensorFlow or JAX") and \
            "KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax" in report["keras_vit.training"], \
            report["keras_vit.training"]
    assert report["keras_vit.export"].startswith("keras_vit.export runs on TensorFlow") and "KERAS_BACKEND=tensorflow" \
        in report["keras_vit.export"], report["keras_vit.export"]
    losses = report["losses"]
    assert losses[-1] < losses[0] - 0.2, losses


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_naflex_tests_pass_on_backend(backend):
    """SigLIP 2 NaFlex on the backend: tests/checkpoints/test_naflex.py but its command-line test (a TensorFlow
    tool's refusal): the processor's rule and the model against transformers at every budget, a batch of aspect
    ratios equal to each alone, the padding changing nothing, the position table's per-image resize, the config
    round trip."""
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2", "XLA_FLAGS": xla_flags()}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-rs",
                           "-k", "not command_line_tools", "tests/checkpoints/test_naflex.py"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout and "skipped" not in done.stdout, \
        done.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_and_keras_tool_tests_pass_on_backend(backend):
    """The layer tests, the head-rows twin of `predict` (`tests/models/test_head_rows.py`), and quantization and LoRA
    through Keras' tools (the trained digits int8 check, slow, runs on TensorFlow only: the quantized numerics of
    every projection are checked on each backend). Left to TensorFlow, for the suite's time (each model built on
    JAX compiles its initializers): the layers' `built` flags (Python, the same on every backend), the head-rows
    model's outputs against the whole model's (its slicing is keras.ops, the same on every backend; `predict`
    running the twin is checked here, and the logits of every family on JAX against TensorFlow's by
    `test_backend_matches_tensorflow_and_trains`), and the ResNet bottleneck unit (the hybrid's logits, there)."""
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2", "XLA_FLAGS": xla_flags()}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           "-k", "not every_layer_of_a_built_model and not head_rows_model_computes and not "
                           "block_output_tokens and not bottleneck_unit",
                           "tests/layers/test_layers.py", "tests/models/test_vit_model.py",
                           "tests/models/test_head_rows.py"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
