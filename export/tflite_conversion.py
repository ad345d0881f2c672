"""How `keras-vit-tflite` writes each LiteRT mode: the converter's settings, the calibrated int8 quantizations
(`mixed_int8` by TensorFlow's selective quantization; full `int8`, and `int8_cpu` with its softmax and GELU in
float32, both with K and V on symmetric ranges), and the quantization debugger's ranking of the tensors int8
perturbs most. `export.tflite` checks and reports the files.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import keras
import numpy as np
import tensorflow as tf
from ai_edge_litert import schema_py_generated as schema

from keras_vit import _tf_internals
from keras_vit.head_rows import head_rows_model
from keras_vit.kernels import scope

from . import ALL_MODES, model_io

# The ops that mixed_int8 runs in int8 (XNNPACK's int8 kernels); it keeps every other op in float32.
MIXED_INT8_OPS = ("FULLY_CONNECTED", "CONV_2D", "DEPTHWISE_CONV_2D")
# The ops that int8_cpu keeps in float32: LiteRT's int8 kernels for them are the interpreter's own, on one thread;
# XNNPACK runs them, and the DEQUANTIZE and QUANTIZE around them, in float32 (at ViT-B/16's shape the int8 softmax
# takes 1.45 ms at 1 and at 2 threads, the float32 one with its (de)quantize 0.32 / 0.16 ms: RESULTS.md, run S).
INT8_CPU_FLOAT_OPS = ("SOFTMAX", "GELU")
SENSITIVE_LAYERS = 3  # tensors named when a mode is refused
# The modes traced for LiteRT's GPU delegate (`conversion_source(gpu_delegate=True)`), which runs float files: q k^T
# transposes K with an op of its own (the delegate ignores BATCH_MATMUL's adj_y). The int8 modes keep the flag,
# which XNNPACK's int8 BATCH_MATMUL runs without a transpose.
GPU_DELEGATE_MODES = ("float32", "float16")
# Ops whose int8 output shares its input's scale and zero point: a range set on one end holds for the other.
SAME_SCALE_OPS = ("RESHAPE", "TRANSPOSE", "SQUEEZE", "EXPAND_DIMS", "UNPACK", "SPLIT", "SLICE", "STRIDED_SLICE")
_BUILTIN_NAMES = {code: name for name, code in vars(schema.BuiltinOperator).items() if not name.startswith("_")}


def builtin_code(operator_code) -> int:
    """The builtin op of a flatbuffer `OperatorCode`: codes over 127 are in `BuiltinCode` only;
    `DeprecatedBuiltinCode` holds the older ones."""
    return max(operator_code.BuiltinCode(), operator_code.DeprecatedBuiltinCode())


def op_name(model, op) -> str:
    """The builtin name ("BATCH_MATMUL") of `op`, an `Operator` of the flatbuffer `model`; "" for an unknown code."""
    return _BUILTIN_NAMES.get(builtin_code(model.OperatorCodes(op.OpcodeIndex())), "")


def converter_options(mode: str, calibration: np.ndarray | None = None) -> dict[str, Any]:
    """TFLiteConverter settings for `mode`: attributes, and `target_spec` attributes."""
    builtins = {"supported_ops": [tf.lite.OpsSet.TFLITE_BUILTINS]}
    if mode == "float32":
        return {"target_spec": builtins}
    if mode == "float16":
        return {"optimizations": [tf.lite.Optimize.DEFAULT],
                "target_spec": {**builtins, "supported_types": [tf.float16]}}
    if mode == "dynamic_int8":
        return {"optimizations": [tf.lite.Optimize.DEFAULT], "target_spec": builtins}
    if mode in ("mixed_int8", "int8", "int8_cpu"):
        if calibration is None or not len(calibration):
            raise ValueError(f"{mode} quantization needs calibration images. Received none.")

        def representative_dataset() -> Iterator[list[np.ndarray]]:
            for image in calibration:
                yield [image[np.newaxis].astype(np.float32)]

        calibrated = {"optimizations": [tf.lite.Optimize.DEFAULT], "representative_dataset": representative_dataset}
        if mode == "mixed_int8":  # Quantized by `_mixed_int8` from the calibrated float model.
            return {**calibrated, "target_spec": builtins}
        return {**calibrated, "target_spec": {"supported_ops": [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]},
                "inference_input_type": tf.uint8, "inference_output_type": tf.uint8}
    raise ValueError(f"Unknown TFLite mode {mode!r}. Expected one of {ALL_MODES}.")


@contextlib.contextmanager
def conversion_source(model: keras.Model, pixel_input: bool = True, gpu_delegate: bool = False) -> Iterator[str]:
    """The SavedModel that modes of `model` are converted from, written once into a temporary folder (its path),
    removed on exit: `model` at batch 1, taking [0, 255] pixels through the model's preprocessing, or with
    `pixel_input=False` the model's own input (any Keras image model). What is written is
    `keras_vit.head_rows_model(model)`: the same outputs, the last encoder block computing only the rows the head
    reads (for a model that is not a keras_vit classifier on a token, `model` itself). Traced for LiteRT
    (`keras_vit.kernels.scope.for_litert`), and with `gpu_delegate` for LiteRT's GPU delegate
    (`keras_vit.kernels.scope.for_gpu_delegate`): the float modes' form (`GPU_DELEGATE_MODES`)."""
    twin = head_rows_model(model)
    pixel_model = model_io.with_pixel_input(twin, model_io.preprocessing_config(model)) if pixel_input else twin
    height, width = model_io.image_size(model) if pixel_input else model.input_shape[1:3]
    # Keras' ExportArchive to a SavedModel, then TensorFlow's converter: what `Model.export(format="litert")`
    # does from Keras 3.12, on every Keras release this package supports.
    with tempfile.TemporaryDirectory() as saved_model_dir:
        with scope.for_litert(), scope.for_gpu_delegate() if gpu_delegate else contextlib.nullcontext():
            archive = model_io.export_archive(pixel_model)
            archive.add_endpoint("serve", functools.partial(pixel_model.__call__, training=False),
                                 input_signature=[tf.TensorSpec((1, height, width, 3), tf.float32, name="image")])
            archive.write_out(saved_model_dir, verbose=False)
        yield saved_model_dir


@contextlib.contextmanager
def _converter(model: keras.Model, options: dict[str, Any], pixel_input: bool = True,
               source: str | None = None) -> Iterator[tf.lite.TFLiteConverter]:
    """A TFLiteConverter with `options` (`converter_options`) of `source`, a `conversion_source` of `model`
    (written here where None is given, in the int8 modes' form)."""
    with contextlib.ExitStack() as stack:
        if source is None:
            source = stack.enter_context(conversion_source(model, pixel_input))
        converter = tf.lite.TFLiteConverter.from_saved_model(source)
        converter.experimental_enable_resource_variables = True
        for option, value in options.items():
            if option == "target_spec":
                for attribute, setting in value.items():
                    setattr(converter.target_spec, attribute, setting)
            else:
                setattr(converter, option, value)
        yield converter


def convert(model: keras.Model, path: str | os.PathLike, mode: str, calibration: np.ndarray | None = None,
            pixel_input: bool = True, source: str | None = None) -> Path:
    """Writes `model` (taking [0, 255] pixels, batch 1; its own input with `pixel_input=False`) as a `.tflite`
    file in `mode`, the int8 modes calibrated on `calibration` (inputs as the file takes them). `source`: the
    model's `conversion_source` in `mode`'s form (`gpu_delegate=mode in GPU_DELEGATE_MODES`), where one is open for
    several modes (written here otherwise)."""
    options = converter_options(mode, calibration)
    with contextlib.ExitStack() as stack:
        if source is None:
            source = stack.enter_context(conversion_source(model, pixel_input, mode in GPU_DELEGATE_MODES))
        converter = stack.enter_context(_converter(model, options, pixel_input, source))
        if mode == "mixed_int8":
            flatbuffer = _mixed_int8(converter, options["representative_dataset"])
        elif mode in ("int8", "int8_cpu"):
            flatbuffer = _full_int8(converter, mode)
        else:
            flatbuffer = converter.convert()
    Path(path).write_bytes(flatbuffer)
    return Path(path)


def _quantization_debugger() -> type | None:
    """TensorFlow's `tf.lite.experimental.QuantizationDebugger`, or None where this TensorFlow has none."""
    return getattr(getattr(tf.lite, "experimental", None), "QuantizationDebugger", None)


def available_modes() -> tuple[str, ...]:
    """The modes this TensorFlow can write: all of `ALL_MODES`, less `mixed_int8` where TensorFlow has no
    quantization debugger (its selective quantization is how that mode is made)."""
    return tuple(mode for mode in ALL_MODES if mode != "mixed_int8" or _quantization_debugger() is not None)


@contextlib.contextmanager
def _debugger(converter: tf.lite.TFLiteConverter, representative_dataset, purpose: str,
              denylisted_ops: Sequence[str] = (), instead: str = "") -> Iterator[Any]:
    """TensorFlow's quantization debugger on `converter` (its own deprecation warning silenced), or a RuntimeError
    naming `purpose` (and what to do `instead`) where this TensorFlow has none."""
    debugger_class = _quantization_debugger()
    if debugger_class is None:
        raise RuntimeError(f"{purpose} needs tf.lite.experimental.QuantizationDebugger, which TensorFlow "
                           f"{tf.__version__} lacks. {instead}".strip())
    options = tf.lite.experimental.QuantizationDebugOptions(denylisted_ops=list(denylisted_ops)) \
        if denylisted_ops else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tf.lite.Interpreter is deprecated")  # the debugger's own
        yield debugger_class(converter=converter, debug_dataset=representative_dataset, debug_options=options)


def _mixed_int8(converter: tf.lite.TFLiteConverter, representative_dataset) -> bytes:
    """The calibrated model with only `MIXED_INT8_OPS` quantized (TensorFlow's selective quantization: every other
    built-in op is on the quantization debugger's deny list), float32 at its ends."""
    float_ops = sorted(name for name in _BUILTIN_NAMES.values() if name not in MIXED_INT8_OPS)
    with _debugger(converter, representative_dataset, "mixed_int8", float_ops,
                   instead="Write dynamic_int8, int8 or int8_cpu instead.") as debugger:
        return debugger.get_nondebug_quantized_model()


def _float_ops(mode: str) -> tuple[str, ...]:
    """The built-in ops that a full-int8 `mode` (`int8` or `int8_cpu`) leaves in float32."""
    return INT8_CPU_FLOAT_OPS if mode == "int8_cpu" else ()


def _full_int8(converter: tf.lite.TFLiteConverter, mode: str = "int8") -> bytes:
    """Full integer (`int8`), as `converter.convert()` writes it, except that the right operand of every attention
    product (K in q k^T, V in A V) is quantized on a symmetric range, zero point 0: XNNPACK runs an int8
    BATCH_MATMUL only so, and otherwise the interpreter's own single-threaded kernel does (at ViT-B/16's shape
    about 20x slower than XNNPACK's; benchmarks/RESULTS.md, run Q). `int8_cpu` also keeps `INT8_CPU_FLOAT_OPS` in
    float32. Where this TensorFlow lacks the converter internals that split calibration from quantization, the
    plain `convert()`, every op int8 (a warning says so)."""
    float_ops = _float_ops(mode)
    try:
        calibrated = _tf_internals.calibrated_tflite(converter)
        return _tf_internals.quantize_calibrated(symmetric_matmul_operands(calibrated), converter.inference_input_type,
                                                 converter.inference_output_type, float_ops)
    except _tf_internals.Unavailable as error:
        warnings.warn(f"Writing {mode} by TFLiteConverter.convert(): {error}. Its attention products"
                      + (f" and {', '.join(float_ops)} (int8 here)" if float_ops else "")
                      + " will run outside XNNPACK, several times slower.", stacklevel=3)
        return converter.convert()


def symmetric_matmul_operands(calibrated: bytes) -> bytes:
    """A calibrated `.tflite` model (float, each tensor's range in its `min` / `max`) with the range of the right
    operand of every BATCH_MATMUL, and of every tensor tied to it by `SAME_SCALE_OPS`, widened to
    [-128 a / 127, a], which int8 quantizes with zero point 0; a = max(|min| 127 / 128, |max|), the smallest such
    range that holds the calibrated one (so a range widened once stays as it is).

    Symmetric ranges cost at most one bit where the calibrated range was lopsided; the export's report measures
    what that does to agreement with the Keras model."""
    buffer = bytearray(calibrated)  # edited in place: the ranges are float vectors of fixed length
    model = schema.Model.GetRootAs(buffer, 0)
    graph = model.Subgraphs(0)
    ops = [graph.Operators(i) for i in range(graph.OperatorsLength())]
    same_scale = [{int(op.Inputs(0)), *map(int, op.OutputsAsNumpy())} for op in ops
                  if op_name(model, op) in SAME_SCALE_OPS]
    tied = {int(op.Inputs(1)) for op in ops if op_name(model, op) == "BATCH_MATMUL"}
    grown = True
    while grown:  # the tensors joined to the operands through same-scale ops, in either direction
        joined = set().union(tied, *(ends for ends in same_scale if ends & tied))
        grown, tied = joined != tied, joined
    for index in tied:
        quantization = graph.Tensors(index).Quantization()
        if quantization is None or not quantization.MinLength() or not quantization.MaxLength():
            continue
        low, high = quantization.MinAsNumpy(), quantization.MaxAsNumpy()  # views into `buffer`
        magnitude = np.maximum(np.abs(low) * np.float32(127 / 128), np.abs(high)).astype(np.float32)
        low[:], high[:] = -magnitude * np.float32(128 / 127), magnitude
    return bytes(buffer)


def sensitive_layers(model: keras.Model, calibration: np.ndarray, count: int = SENSITIVE_LAYERS,
                     mode: str = "int8", source: str | None = None) -> list[dict]:
    """The `count` tensors that full int8 quantization of `model` perturbs most, largest first, by TensorFlow's
    quantization debugger (the int8 converter, calibrated and run on `calibration`; for `mode="int8_cpu"` with
    `INT8_CPU_FLOAT_OPS` in float32): `{"tensor", "op", "rmse_over_scale"}`, the root mean square error of the
    tensor in units of its quantization step. `source`: as `convert`'s."""
    options = converter_options("int8", calibration)
    with _converter(model, options, source=source) as converter, \
            _debugger(converter, options["representative_dataset"], "Naming the sensitive layers",
                      _float_ops(mode)) as debugger:
        debugger.run()
        dump = io.StringIO()
        debugger.layer_statistics_dump(dump)
    layers = []
    for row in csv.DictReader(io.StringIO(dump.getvalue())):
        scale, error = float(row["scale"]), math.sqrt(float(row["mean_squared_error"]))
        if scale > 0 and math.isfinite(error):
            layers.append({"tensor": row["tensor_name"], "op": row["op_name"], "rmse_over_scale": error / scale})
    return sorted(layers, key=lambda layer: -layer["rmse_over_scale"])[:count]
