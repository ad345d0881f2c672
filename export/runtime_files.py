"""What the files for other runtimes (ONNX Runtime: `onnx_file`; OpenVINO: `openvino_file`) share: the model they
hold (the keras_vit model with its pixel normalization, float32 [0, 255] RGB pixels in (N, H, W, 3), the batch
dynamic, and for a model of any size height and width too), the images each file is checked on, and the check
against the Keras model that decides whether it is written."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import keras
import numpy as np

from keras_vit import features
from keras_vit.atomic import check_room, variables_bytes
from keras_vit.vit_model import model_input_signature

from . import model_io, precision
from .saved_model import version_folder

INPUT_NAME = "image"
# The most |runtime - Keras| allowed, relative to max(1, max |Keras|), on the check images: float32 round-off of
# another engine's kernels, not a wrong op.
MAX_RELATIVE_DIFF = 1e-4
# Photo crops an int8 file is calibrated on where no images are given (seed 1: others than the check's).
CALIBRATION_PHOTOS = 128


class MismatchError(ValueError):
    """A runtime's file computes other numbers than the Keras model: nothing was written."""


def missing_modules(modules: Sequence[str]) -> list[str]:
    """The `modules` that are not installed (empty when all are)."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def check_precision(asked: str, precisions: Sequence[str], what: str, max_top1_drop: float) -> None:
    """Raises ValueError for a precision `asked` not among `precisions` of a `what` file, or a negative
    `max_top1_drop`."""
    if asked not in precisions:
        raise ValueError(f"Unknown {what} precision {asked!r}. Expected one of {', '.join(precisions)}.")
    precision.check_max_top1_drop(max_top1_drop)


def begin(model: keras.Model, base_dir, version: int | None, overwrite: bool, what: str, extra: str,
          modules: Sequence[str]) -> tuple[int, Path, keras.Model, keras.InputSpec]:
    """The checks before a file for another runtime is written, and what it holds: ImportError naming
    `keras_vit[extra]` where one of its `modules` is missing; the version folder (`saved_model.version_folder`);
    room for the weights. Returns (version, `<base>/<version>`, the pixel model, its input spec)."""
    missing = missing_modules(modules)
    if missing:
        raise ImportError(f"Writing {what} files needs {', '.join(missing)}, which is not installed: "
                          f"pip install \"keras_vit[{extra}]\"")
    base, version, target = version_folder(base_dir, version, overwrite)
    pixel_model, spec = pixel_model_and_spec(model)
    check_room({str(base): variables_bytes(model.weights)}, f"{what} version {version}")
    return version, target, pixel_model, spec


def pixel_model_and_spec(model: keras.Model) -> tuple[keras.Model, keras.InputSpec]:
    """The model of [0, 255] pixels a file holds, and its input: float32, named `INPUT_NAME`, the batch (and for a
    model of any size, height and width) dynamic."""
    pixel_model = model_io.with_pixel_input(model)
    (spec,) = model_input_signature(pixel_model)
    return pixel_model, keras.InputSpec(shape=spec.shape, dtype="float32", name=INPUT_NAME)


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


def compare(run: Callable[[np.ndarray], np.ndarray], pixel_model: keras.Model, images: list[np.ndarray],
            runtime: str, error: type[MismatchError] = MismatchError) -> dict[str, Any]:
    """Runs `run` (the runtime on one batch) and the Keras `pixel_model` on each batch of `images`: the largest
    |difference| relative to max(1, max |Keras|), and its absolute value."""
    worst_relative, worst_absolute = 0.0, 0.0
    for batch in images:
        expected = np.asarray(pixel_model(batch, training=False))
        output = run(batch)
        if output.shape != expected.shape:
            raise error(f"The {runtime} file gives outputs of shape {output.shape} for images of shape {batch.shape}; "
                        f"the Keras model gives {expected.shape}. Nothing was written.")
        absolute = float(np.abs(output - expected).max())
        worst_absolute = max(worst_absolute, absolute)
        worst_relative = max(worst_relative, absolute / max(1.0, float(np.abs(expected).max())))
    return {"max_abs_diff": worst_absolute, "max_relative_diff": worst_relative,
            "checked_shapes": [list(batch.shape) for batch in images]}


def require_within(measured: dict[str, Any], max_relative_diff: float, runtime: str, version: int,
                   error: type[MismatchError] = MismatchError) -> None:
    """Raises `error` when `compare`'s `measured` difference is over `max_relative_diff`."""
    if not measured["max_relative_diff"] <= max_relative_diff:
        raise error(f"{runtime}'s outputs are {measured['max_relative_diff']:.2e} from the Keras model's (relative "
                    f"to max(1, max |Keras|)), over max_relative_diff={max_relative_diff:g}: version {version} was "
                    "not written.")


def int8_check(run: Callable[[np.ndarray], np.ndarray], model: keras.Model, pixel_model: keras.Model,
               max_top1_drop: float, what: str) -> dict[str, Any]:
    """An int8 file (`run`, one batch) against the Keras model on `precision.CHECK_PHOTOS` crops of real photographs
    at the model's size, in batches of 16 (`precision.agreement`); for a classifier, raises
    `precision.Top1DropError` naming `what` past `max_top1_drop` points of top-1."""
    from . import data

    photos = data.photos(model_io.image_size(model), count=precision.CHECK_PHOTOS)
    reference = precision.outputs(pixel_model, photos)
    ours = np.concatenate([run(photos[start:start + 16]) for start in range(0, len(photos), 16)])
    check = precision.agreement(reference, ours.astype(np.float64).reshape(len(photos), -1), max_top1_drop,
                                classifier=features.classifier_head(model) is not None)
    if check["refused"]:
        raise precision.Top1DropError(precision.refusal(check, what))
    return check


def calibration_images(model: keras.Model, images: np.ndarray | None) -> tuple[np.ndarray, str]:
    """The images an int8 file is calibrated on, and what they are: `images` (the user's: float32 [0, 255] RGB
    pixels, (N, H, W, 3) at the model's size) or, where None, `CALIBRATION_PHOTOS` crops of real photographs."""
    size = tuple(model_io.image_size(model))
    if images is None:
        from . import data

        return data.photos(size, count=CALIBRATION_PHOTOS, seed=1), f"{CALIBRATION_PHOTOS} photo crops"
    images = np.asarray(images, dtype=np.float32)
    if images.ndim != 4 or tuple(images.shape[1:]) != (*size, 3) or not len(images):
        raise ValueError(f"Expected calibration images of shape (N, {size[0]}, {size[1]}, 3), N >= 1, pixels in "
                         f"[0, 255] at the model's size. Received shape {images.shape}.")
    return images, f"{len(images)} given images"


def median_latency_ms(run: Callable[[np.ndarray], Any], image: np.ndarray, runs: int = 10) -> float:
    """Median milliseconds of one `run(image)` (after one warm-up run)."""
    run(image)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run(image)
        times.append(1000 * (time.perf_counter() - start))
    return float(np.median(times))
