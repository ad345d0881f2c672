"""ONNX files of keras_vit models for ONNX Runtime: `export_onnx(model, base_dir)` writes
`base_dir/<version>/model.onnx` (the layout of Triton's model repository) with the model's preprocessing inside:
float32 [0, 255] RGB pixels in (N, H, W, 3), the model's outputs out (a classifier's probabilities, a tower's
embedding), the batch dynamic, and for a model built for any size (`input_shape=(None, None, 3)`) height and width
too. Each file is checked against the Keras model with ONNX Runtime before it is moved into place, and what was
measured is written beside it (`REPORT_FILE`).

The file is Keras' own `Model.export(format="onnx")`, which on TensorFlow converts the traced graph with tf2onnx.
Images are not decoded or resized in the graph (ONNX has no image decoder): give it pixels at the model's size
(`report["image_size"]`), resized as `report["preprocessing"]` says.

`precision="int8"` writes that file after ONNX Runtime's post-training dynamic quantization (`quantize_dynamic`:
int8 weights (in 7 bits, for CPUs without VNNI: `SEVEN_BIT_WEIGHTS`), activations quantized per batch at run time;
the form ONNX Runtime recommends for transformers, with no calibration images). Each batch's activations share one
int8 scale, so an image's outputs depend slightly on the other images of its batch. `precision="int8_static"`
writes ONNX Runtime's static quantization instead (`quantize_static`, QDQ, of the matmuls and convolutions: int8
weights per output channel, in 7 bits too, uint8 activations with
scales calibrated on images, yours (`calibration_images`) or photo crops; an image's outputs are its own). Either
is checked first as float32 against Keras, then on real photographs against the Keras model's top-1
(`export.precision.agreement`, in batches of 16), refused past `max_top1_drop` points.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import keras
import numpy as np

from keras_vit.atomic import atomic_write
from keras_vit.kernels import scope

from . import model_io, precision as precisions, runtime_files
from .runtime_files import INPUT_NAME, MAX_RELATIVE_DIFF, check_images

ONNX_FILE = "model.onnx"
PRECISIONS = ("float32", "int8", "int8_static")
INT8_METHODS = {
    "int8": "onnxruntime.quantization.quantize_dynamic (int8 weights in 7 bits, reduce_range; activations quantized "
            "at run time)",
    "int8_static": "onnxruntime.quantization.quantize_static (QDQ; the matmuls and convolutions: int8 weights per "
                   "channel in 7 bits, reduce_range; uint8 activations calibrated with MinMax)",
}
# The ops int8_static quantizes (their inputs and outputs); softmax, GELU and LayerNorm compute in float32. Quantizing
# every op gave a ViT-B/16's 1000 probabilities (about 1e-3 each) one uint8 step: top-1 agreement 0% (run BB).
STATIC_INT8_OPS = ("MatMul", "Conv", "Gemm")
# int8 weights in 7 bits ([-64, 64], ONNX Runtime's `reduce_range`), for every CPU the file may be served on: without
# VNNI (AVX2; AVX-512 before Cascade Lake) ONNX Runtime multiplies uint8 activations by int8 weights with VPMADDUBSW,
# whose 16-bit sum of two products saturates past 32767 (2 x 255 x 127 = 64770; 2 x 255 x 64 = 32640 fits). With 8
# bits, ViT-B/16's file agreed with Keras' top-1 on 66% of photo crops on an AVX2-only EPYC, with 7 bits on 91%
# (benchmarks/RESULTS.md run BG). The CPU that serves a file is not known when it is written.
SEVEN_BIT_WEIGHTS = True
INT8_METHOD = INT8_METHODS["int8"]
REPORT_FILE = "keras_vit_onnx.json"
DISTRIBUTIONS = ("onnx", "onnxruntime", "tf2onnx")  # keras_vit[onnx]


class OnnxMismatchError(runtime_files.MismatchError):
    """The ONNX file computes other numbers than the Keras model: nothing was written."""


def missing_modules() -> list[str]:
    """The modules of keras_vit[onnx] that are not installed (empty when all are)."""
    return runtime_files.missing_modules(DISTRIBUTIONS)


def export_onnx(model: keras.Model, base_dir: str | os.PathLike, *, version: int | None = None,
                overwrite: bool = False, opset_version: int | None = None,
                max_relative_diff: float = MAX_RELATIVE_DIFF, precision: str = "float32",
                max_top1_drop: float = precisions.DEFAULT_MAX_TOP1_DROP,
                calibration_images: np.ndarray | None = None) -> Path:
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
            (`check_images`), of the float32 file. Defaults to `MAX_RELATIVE_DIFF` (1e-4).
        precision: `"float32"` (default), `"int8"` (ONNX Runtime's dynamic quantization of the checked float32
            file) or `"int8_static"` (its static quantization, calibrated).
        max_top1_drop: for int8 and int8_static, the most points of top-1 agreement with the Keras model it may
            lose on `precision.CHECK_PHOTOS` crops of real photographs. Defaults to 1.
        calibration_images: for int8_static, float32 [0, 255] RGB pixels (N, H, W, 3) at the model's size, e.g.
            your held-out images. Defaults to `runtime_files.CALIBRATION_PHOTOS` crops of real photographs.

    Raises:
        ImportError: keras_vit[onnx] is not installed (naming what to install).
        ValueError: an unknown precision, or calibration images of another shape.
        OnnxMismatchError: ONNX Runtime's outputs are over `max_relative_diff` from Keras' (nothing is written).
        export.precision.Top1DropError: the int8 file loses more than `max_top1_drop` points (nothing is written).
        FileExistsError: `<version>/` exists and `overwrite` is False.
    """
    runtime_files.check_precision(precision, PRECISIONS, "ONNX", max_top1_drop)
    calibration = runtime_files.calibration_images(model, calibration_images) if precision == "int8_static" else None
    version, target, pixel_model, spec = runtime_files.begin(model, base_dir, version, overwrite, "ONNX", "onnx",
                                                             DISTRIBUTIONS)
    import onnxruntime

    options = {} if opset_version is None else {"opset_version": opset_version}
    with atomic_write(target, folder=True) as partial:
        path = os.path.join(partial, ONNX_FILE)
        with warnings.catch_warnings():  # tf2onnx's own use of deprecated NumPy names
            warnings.filterwarnings("ignore", category=FutureWarning)
            with scope.for_onnx():  # the exact GELU without Erfc, which ONNX lacks
                pixel_model.export(path, format="onnx", verbose=False, input_signature=[spec], **options)
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])

        def run(batch):
            return session.run(None, {INPUT_NAME: batch})[0]

        images = check_images(model)
        measured = runtime_files.compare(run, pixel_model, images, "ONNX", OnnxMismatchError)
        runtime_files.require_within(measured, max_relative_diff, "ONNX Runtime", version, OnnxMismatchError)
        quantization = {}
        if precision in INT8_METHODS:
            if precision == "int8_static":
                quantize_static_in_place(path, calibration[0])
                quantization["calibration_images"] = calibration[1]
            else:
                quantize_in_place(path)
            session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
            quantization.update({"quantization": INT8_METHODS[precision], "float32_check": measured,
                                 "int8_check": runtime_files.int8_check(run, model, pixel_model, max_top1_drop,
                                                                        f"The {precision} ONNX file")})
            measured = runtime_files.compare(run, pixel_model, images, "ONNX", OnnxMismatchError)
        report = {"file": ONNX_FILE, "precision": precision, "input": INPUT_NAME, "input_shape": list(spec.shape),
                  "image_size": list(model_io.image_size(model)), "any_size_stride": model_io.patch_stride(model),
                  "outputs": [output.name for output in session.get_outputs()],
                  "preprocessing": model_io.preprocessing_config(model).to_dict(),
                  "onnxruntime": onnxruntime.__version__, **measured, **quantization,
                  "max_relative_diff_allowed": max_relative_diff,
                  "latency_ms_median_batch_1": runtime_files.median_latency_ms(run, images[1])}
        Path(partial, REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return target


def quantize_in_place(path: str) -> None:
    """Replaces the ONNX file at `path` with ONNX Runtime's dynamic int8 quantization of it (weights in 7 bits:
    `SEVEN_BIT_WEIGHTS`)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantized = path + ".int8"
    quantize_dynamic(path, quantized, weight_type=QuantType.QInt8, reduce_range=SEVEN_BIT_WEIGHTS)
    os.replace(quantized, path)


def quantize_static_in_place(path: str, images: np.ndarray) -> None:
    """Replaces the ONNX file at `path` with ONNX Runtime's static int8 quantization of it (QDQ), its activations'
    scales calibrated on `images` in batches of 16."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{INPUT_NAME: images[start:start + 16]} for start in range(0, len(images), 16)])

        def get_next(self):
            return next(self.batches, None)

    quantized = path + ".int8"
    quantize_static(path, quantized, Batches(), quant_format=QuantFormat.QDQ, per_channel=True,
                    reduce_range=SEVEN_BIT_WEIGHTS, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    op_types_to_quantize=list(STATIC_INT8_OPS))
    os.replace(quantized, path)


def read_report(version_dir: str | os.PathLike) -> dict:
    """The report `export_onnx` wrote beside the file."""
    return json.loads(Path(version_dir, REPORT_FILE).read_text(encoding="utf-8"))
