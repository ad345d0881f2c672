"""OpenVINO IR files of keras_vit models: `export_openvino(model, base_dir)` writes `base_dir/<version>/model.xml` and
`model.bin` (OpenVINO Model Server's layout) with the model's preprocessing inside: float32 [0, 255] RGB pixels in
(N, H, W, 3), the model's outputs out (a classifier's probabilities, a tower's embedding), the batch dynamic, and for
a model built for any size height and width too. Each file is checked against the Keras model with OpenVINO's CPU
plugin in float32 before it is moved into place, and what was measured is written beside it (`REPORT_FILE`).

The file is Keras' own `Model.export(format="openvino")`, which on TensorFlow converts the traced function with
OpenVINO's `convert_model`. OpenVINO's CPU plugin computes in bfloat16 by default on CPUs with AVX512-BF16 or AMX
(its `INFERENCE_PRECISION_HINT`): the report gives that default, its difference from Keras and its latency beside
float32's; compile with `{"INFERENCE_PRECISION_HINT": "f32"}` for float32's numbers.

`precision="int8"` writes that file after NNCF's post-training quantization (`nncf.quantize`, OpenVINO's own tool:
int8 matmuls and convolutions with scales calibrated on images, yours (`calibration_images`) or
`runtime_files.CALIBRATION_PHOTOS` photo crops, transformer-aware: `model_type=TRANSFORMER`; weights in 7 bits, which
CPUs without VNNI do not saturate), checked first as
float32 against Keras, then on other crops of real photographs against the Keras model's top-1
(`runtime_files.int8_check`), refused past `max_top1_drop` points.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import keras
import numpy as np

from keras_vit.atomic import atomic_write

from . import model_io, precision as precisions, runtime_files
from .runtime_files import INPUT_NAME, MAX_RELATIVE_DIFF, check_images

XML_FILE = "model.xml"
REPORT_FILE = "keras_vit_openvino.json"
DISTRIBUTIONS = ("openvino",)  # keras_vit[openvino]
INT8_DISTRIBUTIONS = ("nncf",)  # keras_vit[openvino] too, needed for int8 only
FLOAT32 = {"INFERENCE_PRECISION_HINT": "f32"}
PRECISIONS = ("float32", "int8")
INT8_METHOD = "nncf.quantize (post-training, model_type=TRANSFORMER, calibrated, overflow_fix=ENABLE: 7-bit weights)"


class OpenVinoMismatchError(runtime_files.MismatchError):
    """The OpenVINO file computes other numbers than the Keras model: nothing was written."""


def export_openvino(model: keras.Model, base_dir: str | os.PathLike, *, version: int | None = None,
                    overwrite: bool = False, max_relative_diff: float = MAX_RELATIVE_DIFF, precision: str = "float32",
                    max_top1_drop: float = precisions.DEFAULT_MAX_TOP1_DROP,
                    calibration_images: np.ndarray | None = None) -> Path:
    """Writes `base_dir/<version>/model.xml`, `model.bin` and the report, checked against `model` with OpenVINO's CPU
    plugin in float32, whole or not at all; returns the version folder.

    Args:
        model: a keras_vit model: a classifier, an image tower (`include_top=False` with a `pooling`) or a
            zero-shot classifier (`keras_vit.zero_shot_classifier`).
        base_dir: the model's folder (OpenVINO Model Server's `<model_base_path>`).
        version: positive int. Defaults to one more than the largest existing version.
        overwrite: replace an existing `<version>/`. Defaults to `False` (FileExistsError).
        max_relative_diff: the most |OpenVINO - Keras| / max(1, max |Keras|) allowed on the check images
            (`runtime_files.check_images`), compiled in float32, of the float32 file. Defaults to
            `MAX_RELATIVE_DIFF` (1e-4).
        precision: `"float32"` (default) or `"int8"` (NNCF's post-training quantization of the checked float32
            file).
        max_top1_drop: for int8, the most points of top-1 agreement with the Keras model it may lose on
            `precision.CHECK_PHOTOS` crops of real photographs. Defaults to 1.
        calibration_images: for int8, float32 [0, 255] RGB pixels (N, H, W, 3) at the model's size, e.g. your
            held-out images. Defaults to `runtime_files.CALIBRATION_PHOTOS` crops of real photographs.

    Raises:
        ImportError: keras_vit[openvino] is not installed (naming what to install).
        ValueError: an unknown precision, or calibration images of another shape.
        OpenVinoMismatchError: OpenVINO's float32 outputs are over `max_relative_diff` from Keras' (nothing is
            written).
        export.precision.Top1DropError: the int8 file loses more than `max_top1_drop` points (nothing is written).
        FileExistsError: `<version>/` exists and `overwrite` is False.
    """
    runtime_files.check_precision(precision, PRECISIONS, "OpenVINO", max_top1_drop)
    calibration = runtime_files.calibration_images(model, calibration_images) if precision == "int8" else None
    modules = DISTRIBUTIONS + (INT8_DISTRIBUTIONS if precision == "int8" else ())
    version, target, pixel_model, spec = runtime_files.begin(model, base_dir, version, overwrite,
                                                             f"{'int8 ' if precision == 'int8' else ''}OpenVINO",
                                                             "openvino", modules)
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
        quantization = {}
        if precision == "int8":
            quantize_in_place(core, path, calibration[0])
            runs["f32"] = _runner(core.compile_model(path, "CPU", FLOAT32))
            quantization = {"quantization": INT8_METHOD, "calibration_images": calibration[1],
                            "float32_check": measured,
                            "int8_check": runtime_files.int8_check(runs["f32"], model, pixel_model, max_top1_drop,
                                                                   "The int8 OpenVINO file")}
            measured = runtime_files.compare(runs["f32"], pixel_model, images, "OpenVINO", OpenVinoMismatchError)
        runs["default"] = _runner(core.compile_model(path, "CPU"))
        by_default = runtime_files.compare(runs["default"], pixel_model, images, "OpenVINO", OpenVinoMismatchError)
        report = {"file": XML_FILE, "precision": precision, "input": INPUT_NAME, "input_shape": list(spec.shape),
                  "image_size": list(model_io.image_size(model)), "any_size_stride": model_io.patch_stride(model),
                  "preprocessing": model_io.preprocessing_config(model).to_dict(),
                  "openvino": openvino.__version__, **measured, **quantization,
                  "max_relative_diff_allowed": max_relative_diff,
                  "latency_ms_median_batch_1": runtime_files.median_latency_ms(runs["f32"], images[1]),
                  "cpu_default_precision": default,
                  "cpu_default_max_relative_diff": by_default["max_relative_diff"],
                  "cpu_default_latency_ms_median_batch_1": runtime_files.median_latency_ms(runs["default"],
                                                                                           images[1])}
        Path(partial, REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return target


def quantize_in_place(core, path: str, images: np.ndarray) -> None:
    """Replaces the OpenVINO file at `path` (and its weights) with NNCF's int8 quantization of it, calibrated on
    `images` (float32 [0, 255] pixels at the model's size), one at a time."""
    import nncf
    import openvino

    # 7-bit weights in every layer (NNCF's overflow fix; its default fixes the first layer only): CPUs without VNNI
    # saturate 8-bit ones (`onnx_file.SEVEN_BIT_WEIGHTS`), and the CPU that serves the file is not known here.
    quantized = nncf.quantize(core.read_model(path), nncf.Dataset([image[None] for image in images]),
                              model_type=nncf.ModelType.TRANSFORMER, subset_size=len(images),
                              advanced_parameters=nncf.AdvancedQuantizationParameters(
                                  overflow_fix=nncf.OverflowFix.ENABLE))
    stem = path[:-len(".xml")]
    openvino.save_model(quantized, stem + "_int8.xml")
    for suffix in (".xml", ".bin"):  # the float32 file's weights may still be mapped: replaced, not rewritten
        os.replace(stem + "_int8" + suffix, stem + suffix)


def _runner(compiled):
    """One batch of pixels -> the compiled model's first output."""
    return lambda batch: compiled(batch)[0]


def read_report(version_dir: str | os.PathLike) -> dict:
    """The report `export_openvino` wrote beside the file."""
    return json.loads(Path(version_dir, REPORT_FILE).read_text(encoding="utf-8"))
