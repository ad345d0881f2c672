"""OpenVINO IR files of keras_vit models: `export_openvino(model, base_dir)` writes `base_dir/<version>/model.xml` and
`model.bin` (OpenVINO Model Server's layout) with the model's preprocessing inside: float32 [0, 255] RGB pixels in
(N, H, W, 3), the model's outputs out (a classifier's probabilities, a tower's embedding), the batch dynamic, and for
a model built for any size height and width too. Each file is checked against the Keras model with OpenVINO's CPU
plugin in float32 before it is moved into place, and what was measured is written beside it (`REPORT_FILE`).

The file is Keras' own `Model.export(format="openvino")`, which on TensorFlow converts the traced function with
OpenVINO's `convert_model`. OpenVINO's CPU plugin computes in bfloat16 by default on CPUs with AVX512-BF16 or AMX
(its `INFERENCE_PRECISION_HINT`): the report gives that default, its difference from Keras and its latency beside
float32's; compile with `{"INFERENCE_PRECISION_HINT": "f32"}` for float32's numbers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import keras

from keras_vit.atomic import atomic_write

from . import model_io, runtime_files
from .runtime_files import INPUT_NAME, MAX_RELATIVE_DIFF, check_images

XML_FILE = "model.xml"
REPORT_FILE = "keras_vit_openvino.json"
DISTRIBUTIONS = ("openvino",)  # keras_vit[openvino]
FLOAT32 = {"INFERENCE_PRECISION_HINT": "f32"}


class OpenVinoMismatchError(runtime_files.MismatchError):
    """The OpenVINO file computes other numbers than the Keras model: nothing was written."""


def export_openvino(model: keras.Model, base_dir: str | os.PathLike, *, version: int | None = None,
                    overwrite: bool = False, max_relative_diff: float = MAX_RELATIVE_DIFF) -> Path:
    """Writes `base_dir/<version>/model.xml`, `model.bin` and the report, checked against `model` with OpenVINO's CPU
    plugin in float32, whole or not at all; returns the version folder.

    Args:
        model: a keras_vit model: a classifier, an image tower (`include_top=False` with a `pooling`) or a
            zero-shot classifier (`keras_vit.zero_shot_classifier`).
        base_dir: the model's folder (OpenVINO Model Server's `<model_base_path>`).
        version: positive int. Defaults to one more than the largest existing version.
        overwrite: replace an existing `<version>/`. Defaults to `False` (FileExistsError).
        max_relative_diff: the most |OpenVINO - Keras| / max(1, max |Keras|) allowed on the check images
            (`runtime_files.check_images`), compiled in float32. Defaults to `MAX_RELATIVE_DIFF` (1e-4).

    Raises:
        ImportError: keras_vit[openvino] is not installed (naming what to install).
        OpenVinoMismatchError: OpenVINO's float32 outputs are over `max_relative_diff` from Keras' (nothing is
            written).
        FileExistsError: `<version>/` exists and `overwrite` is False.
    """
    version, target, pixel_model, spec = runtime_files.begin(model, base_dir, version, overwrite, "OpenVINO",
                                                             "openvino", DISTRIBUTIONS)
    import openvino

    core = openvino.Core()
    with atomic_write(target, folder=True) as partial:
        path = os.path.join(partial, XML_FILE)
        pixel_model.export(path, format="openvino", verbose=False, input_signature=[spec])
        images = check_images(model)
        runs = {"f32": _runner(core.compile_model(path, "CPU", FLOAT32))}
        default = core.get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()  # "bf16", "f32", ...
        measured = runtime_files.compare(runs["f32"], pixel_model, images, "OpenVINO", OpenVinoMismatchError)
        runtime_files.require_within(measured, max_relative_diff, "OpenVINO", version, OpenVinoMismatchError)
        runs["default"] = _runner(core.compile_model(path, "CPU"))
        by_default = runtime_files.compare(runs["default"], pixel_model, images, "OpenVINO", OpenVinoMismatchError)
        report = {"file": XML_FILE, "input": INPUT_NAME, "input_shape": list(spec.shape),
                  "image_size": list(model_io.image_size(model)), "any_size_stride": model_io.patch_stride(model),
                  "preprocessing": model_io.preprocessing_config(model).to_dict(),
                  "openvino": openvino.__version__, **measured, "max_relative_diff_allowed": max_relative_diff,
                  "latency_ms_median_batch_1": runtime_files.median_latency_ms(runs["f32"], images[1]),
                  "cpu_default_precision": default,
                  "cpu_default_max_relative_diff": by_default["max_relative_diff"],
                  "cpu_default_latency_ms_median_batch_1": runtime_files.median_latency_ms(runs["default"],
                                                                                           images[1])}
        Path(partial, REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return target


def _runner(compiled):
    """One batch of pixels -> the compiled model's first output."""
    return lambda batch: compiled(batch)[0]


def read_report(version_dir: str | os.PathLike) -> dict:
    """The report `export_openvino` wrote beside the file."""
    return json.loads(Path(version_dir, REPORT_FILE).read_text(encoding="utf-8"))
