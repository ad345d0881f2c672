"""ONNX files of keras_vit models for ONNX Runtime: `export_onnx(model, base_dir)` writes
`base_dir/<version>/model.onnx` (the layout of Triton's model repository) with the model's preprocessing inside:
float32 [0, 255] RGB pixels in (N, H, W, 3), the model's outputs out (a classifier's probabilities, a tower's
embedding), the batch dynamic, and for a model built for any size (`input_shape=(None, None, 3)`) height and width
too. Each file is checked against the Keras model with ONNX Runtime before it is moved into place, and what was
measured is written beside it (`REPORT_FILE`).

The file is Keras' own `Model.export(format="onnx")`, which on TensorFlow converts the traced graph with tf2onnx.
Images are not decoded or resized in the graph (ONNX has no image decoder): give it pixels at the model's size
(`report["image_size"]`), resized as `report["preprocessing"]` says.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import keras
import numpy as np

from keras_vit.atomic import atomic_write, check_room, variables_bytes
from keras_vit.vit_model import model_input_signature

from . import model_io
from .saved_model import version_folder

ONNX_FILE = "model.onnx"
REPORT_FILE = "keras_vit_onnx.json"
INPUT_NAME = "image"
# The most |ONNX Runtime - Keras| allowed, relative to max(1, max |Keras|), on the check images: float32 round-off
# of another engine's kernels, not a wrong op.
MAX_RELATIVE_DIFF = 1e-4
DISTRIBUTIONS = ("onnx", "onnxruntime", "tf2onnx")  # keras_vit[onnx]


class OnnxMismatchError(ValueError):
    """The ONNX file computes other numbers than the Keras model: nothing was written."""


def missing_modules() -> list[str]:
    """The modules of keras_vit[onnx] that are not installed (empty when all are)."""
    return [name for name in DISTRIBUTIONS if importlib.util.find_spec(name) is None]


def check_images(model: keras.Model, count: int = 4, seed: int = 0) -> list[np.ndarray]:
    """Random [0, 255] pixels the file is checked on: `count` images at the model's size, one at batch 1, and for a
    model of any size `count` at a second size (two strides taller, one wider)."""
    rng = np.random.default_rng(seed)
    height, width = model_io.image_size(model)
    shapes = [(count, height, width, 3), (1, height, width, 3)]
    stride = model_io.patch_stride(model)
    if stride:  # any size: the height and width are dynamic
        shapes.append((count, height + 2 * stride, width + stride, 3))
    return [rng.uniform(0, 255, shape).astype("float32") for shape in shapes]


def compare(session, pixel_model: keras.Model, images: list[np.ndarray]) -> dict[str, Any]:
    """Runs ONNX Runtime's `session` and the Keras `pixel_model` on each batch of `images`: the largest
    |difference| relative to max(1, max |Keras|), and its absolute value."""
    worst_relative, worst_absolute = 0.0, 0.0
    for batch in images:
        expected = np.asarray(pixel_model(batch, training=False))
        (output,) = session.run(None, {INPUT_NAME: batch})
        if output.shape != expected.shape:
            raise OnnxMismatchError(f"The ONNX file gives outputs of shape {output.shape} for images of shape "
                                    f"{batch.shape}; the Keras model gives {expected.shape}. Nothing was written.")
        absolute = float(np.abs(output - expected).max())
        worst_absolute = max(worst_absolute, absolute)
        worst_relative = max(worst_relative, absolute / max(1.0, float(np.abs(expected).max())))
    return {"max_abs_diff": worst_absolute, "max_relative_diff": worst_relative,
            "checked_shapes": [list(batch.shape) for batch in images]}


def median_latency_ms(session, image: np.ndarray, runs: int = 10) -> float:
    """Median milliseconds of one `session.run` on `image` (after one warm-up run)."""
    session.run(None, {INPUT_NAME: image})
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, {INPUT_NAME: image})
        times.append(1000 * (time.perf_counter() - start))
    return float(np.median(times))


def export_onnx(model: keras.Model, base_dir: str | os.PathLike, *, version: int | None = None,
                overwrite: bool = False, opset_version: int | None = None,
                max_relative_diff: float = MAX_RELATIVE_DIFF) -> Path:
    """Writes `base_dir/<version>/model.onnx` and its report, checked against `model` with ONNX Runtime, whole or not
    at all; returns the version folder.

    Args:
        model: a keras_vit model: a classifier, an image tower (`include_top=False` with a `pooling`) or a
            zero-shot classifier (`keras_vit.zero_shot_classifier`).
        base_dir: the model's folder (Triton's `<model repository>/<model name>`).
        version: positive int. Defaults to one more than the largest existing version.
        overwrite: replace an existing `<version>/`. Defaults to `False` (FileExistsError).
        opset_version: the ONNX opset. Defaults to tf2onnx's.
        max_relative_diff: the most |ONNX Runtime - Keras| / max(1, max |Keras|) allowed on the check images
            (`check_images`). Defaults to `MAX_RELATIVE_DIFF` (1e-4).

    Raises:
        ImportError: keras_vit[onnx] is not installed (naming what to install).
        OnnxMismatchError: ONNX Runtime's outputs are over `max_relative_diff` from Keras' (nothing is written).
        FileExistsError: `<version>/` exists and `overwrite` is False.
    """
    missing = missing_modules()
    if missing:
        raise ImportError(f"Writing ONNX files needs {', '.join(missing)}, which is not installed: "
                          "pip install \"keras_vit[onnx]\"")
    import onnxruntime

    base, version, target = version_folder(base_dir, version, overwrite)
    pixel_model = model_io.with_pixel_input(model)
    (spec,) = model_input_signature(pixel_model)
    spec = keras.InputSpec(shape=spec.shape, dtype="float32", name=INPUT_NAME)
    check_room({str(base): variables_bytes(model.weights)}, f"ONNX version {version}")
    options = {} if opset_version is None else {"opset_version": opset_version}
    with atomic_write(target, folder=True) as partial:
        path = os.path.join(partial, ONNX_FILE)
        with warnings.catch_warnings():  # tf2onnx's own use of deprecated NumPy names
            warnings.filterwarnings("ignore", category=FutureWarning)
            pixel_model.export(path, format="onnx", verbose=False, input_signature=[spec], **options)
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        images = check_images(model)
        measured = compare(session, pixel_model, images)
        if not measured["max_relative_diff"] <= max_relative_diff:
            raise OnnxMismatchError(f"ONNX Runtime's outputs are {measured['max_relative_diff']:.2e} from the Keras "
                                    f"model's (relative to max(1, max |Keras|)), over max_relative_diff="
                                    f"{max_relative_diff:g}: version {version} was not written.")
        report = {"file": ONNX_FILE, "input": INPUT_NAME, "input_shape": list(spec.shape),
                  "image_size": list(model_io.image_size(model)), "any_size_stride": model_io.patch_stride(model),
                  "outputs": [output.name for output in session.get_outputs()],
                  "preprocessing": model_io.preprocessing_config(model).to_dict(),
                  "onnxruntime": onnxruntime.__version__, **measured,
                  "max_relative_diff_allowed": max_relative_diff,
                  "latency_ms_median_batch_1": median_latency_ms(session, images[1])}
        Path(partial, REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return target


def read_report(version_dir: str | os.PathLike) -> dict:
    """The report `export_onnx` wrote beside the file."""
    return json.loads(Path(version_dir, REPORT_FILE).read_text(encoding="utf-8"))
