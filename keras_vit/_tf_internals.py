"""Every TensorFlow internal keras_vit touches, each behind a guard.

TensorFlow has no public API for these, and a release may move or change them. Each function
here either works or raises `Unavailable`, and `keras_vit.kernels` then turns off the one
fast kernel that needed it (the portable ops compute the same result); `export.tflite` writes
its full-int8 files by the converter's plain `convert()` (every op int8, its attention products
outside XNNPACK). Nothing else in keras_vit imports from `tensorflow.python` or `tensorflow.core`.
"""

from __future__ import annotations

from typing import Sequence


class Unavailable(RuntimeError):
    """A TensorFlow internal is missing or behaves differently in this release."""


def op_registered(op_type: str) -> bool:
    """Whether an op (public or internal, e.g. `_MklLayerNorm`) is registered in this TensorFlow build."""
    try:
        from tensorflow.python.framework import op_def_registry
        return op_def_registry.get(op_type) is not None
    except (ImportError, AttributeError) as error:
        raise Unavailable(f"op_def_registry.get: {error}") from error


def onednn_enabled() -> bool:
    """Whether TensorFlow runs its CPU ops through oneDNN (on by default for x86 Linux builds)."""
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError) as error:
        raise Unavailable(f"_pywrap_util_port.IsMklEnabled: {error}") from error


def create_op(op_type: str, inputs, output_dtype, attrs: dict, name: str, kernel_label: str | None = None):
    """Adds an op that has no Python wrapper to the graph being traced; returns its first output.

    `attrs` maps attribute names to a TensorFlow dtype, a bool or a float. `kernel_label` picks a
    kernel registered under that label (oneDNN's `_Mkl*` kernels are, as "MklNameChangeOp").
    """
    try:
        import tensorflow as tf
        from tensorflow.core.framework import attr_value_pb2

        def proto(value):
            if isinstance(value, tf.DType):
                return attr_value_pb2.AttrValue(type=value.as_datatype_enum)
            if isinstance(value, bool):
                return attr_value_pb2.AttrValue(b=value)
            return attr_value_pb2.AttrValue(f=value)

        protos = {key: proto(value) for key, value in attrs.items()}
        if kernel_label is not None:
            protos["_kernel"] = attr_value_pb2.AttrValue(s=kernel_label.encode())
        graph = tf.compat.v1.get_default_graph()
        return graph._create_op_internal(op_type, inputs, [output_dtype], name=name, attrs=protos).outputs[0]
    except (ImportError, AttributeError, TypeError) as error:
        raise Unavailable(f"Graph._create_op_internal: {error}") from error


def calibrated_tflite(converter) -> bytes:
    """`converter`'s float `.tflite` model with the range each tensor took on the representative dataset recorded
    in its quantization parameters (`min`, `max`), nothing quantized yet: `TFLiteConverter`'s
    `_experimental_calibrate_only`, the first half of what `convert()` does for integer quantization."""
    if not hasattr(converter, "_experimental_calibrate_only"):
        raise Unavailable("TFLiteConverter._experimental_calibrate_only is gone")
    converter._experimental_calibrate_only = True
    try:
        return converter.convert()
    finally:
        converter._experimental_calibrate_only = False


def quantize_calibrated(calibrated: bytes, input_type, output_type, float_ops: Sequence[str] = ()) -> bytes:
    """The calibrated model (`calibrated_tflite`) quantized by the converter's own MLIR quantizer, as `convert()`
    does with `inference_input_type=input_type` and `inference_output_type=output_type`: the second half. The
    built-in ops named in `float_ops` (e.g. "SOFTMAX") stay float32, between a DEQUANTIZE and a QUANTIZE."""
    try:
        from tensorflow.lite.python import convert
        return convert.mlir_quantize(bytes(calibrated), input_data_type=input_type, output_data_type=output_type,
                                     denylisted_ops=list(float_ops) or None)
    except (ImportError, AttributeError, TypeError) as error:
        raise Unavailable(f"tensorflow.lite.python.convert.mlir_quantize: {error}") from error
