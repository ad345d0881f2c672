"""Exports a keras_vit classifier to LiteRT (`.tflite`) in six modes and checks each one.

    keras-vit-tflite --model vit.keras --out exports/tflite [--images DIR | --dataset digits] [--max-top1-drop 1]

(`python -m export.tflite` in a clone; the command line is `keras_vit/cli/tflite.py`.)

Modes: `float32`; `float16` (float16 weights); `dynamic_int8` (int8 weights, float activations); `mixed_int8` (int8
weights and calibrated int8 activations in every matmul and convolution, float32 LayerNorm, softmax, GELU and
attention products, float32 pixels in and probabilities out: every op on XNNPACK, the CPU mode); `int8` (full
integer: every op int8, uint8 pixels in and uint8 probabilities out, for integer-only accelerators; K and V on
symmetric ranges, so that XNNPACK runs the attention products); `int8_cpu` (`int8` with its softmax and GELU in
float32, which XNNPACK runs, as LiteRT's int8 ones run single-threaded outside it: the fastest CPU mode). The
calibrated modes are calibrated on real images.
All use TFLite built-in ops only. Each file is run with the LiteRT interpreter (`ai_edge_litert`) on held-out real
images and compared with the Keras model; the report (`report.json`, `report.md`) gives size, latency at 1 and 2
threads, the ops that run outside the interpreter's default delegate (XNNPACK), max abs difference, top-1 agreement
and, where the images have labels, top-1 accuracy. An int8 mode whose top-1 drop (100 x (1 - agreement), in points)
is over `max_top1_drop` is not written: the report marks it refused, names the tensors that TensorFlow's
quantization debugger finds most perturbed, and `export_tflite` raises `Top1DropError`.

How each mode is converted (the converter's settings, the int8 quantizations) is `export.tflite_conversion`.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import json
import math
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import keras
import numpy as np
import tensorflow as tf
from ai_edge_litert import schema_py_generated as schema
from ai_edge_litert.interpreter import Interpreter

from keras_vit import datasets, features
from keras_vit.atomic import DiskSpaceError, atomic_write, check_room

from . import ALL_MODES, data, model_io, precision
from .tflite_conversion import (GPU_DELEGATE_MODES, INT8_CPU_FLOAT_OPS, MIXED_INT8_OPS, _BUILTIN_NAMES,
                                available_modes, builtin_code, conversion_source, convert, sensitive_layers)

# Max abs difference of the probabilities allowed per mode; the int8 modes are held to `max_top1_drop` instead.
MAX_ABS_DIFF = {"float32": 1e-4, "float16": 1e-2}
INT8_MODES = ("dynamic_int8", "mixed_int8", "int8", "int8_cpu")
# Bytes a weight takes in each mode's file, for the room a conversion needs: mixed_int8 at most all float32.
BYTES_PER_WEIGHT = {"float32": 4, "float16": 2, "mixed_int8": 4, "dynamic_int8": 1, "int8": 1, "int8_cpu": 1}
DEFAULT_MAX_TOP1_DROP = precision.DEFAULT_MAX_TOP1_DROP  # points of top-1 an int8 mode may lose
Top1DropError = precision.Top1DropError  # an int8 mode lost more; raised with the written report as `report`


class _Op(NamedTuple):
    name: str  # the builtin name, or a custom op's code (e.g. "FlexErf")
    input_dtypes: list[str]
    builtin: bool


_DTYPE_NAMES = {code: name.lower() for name, code in vars(schema.TensorType).items() if not name.startswith("_")}


def _op_name(model, op) -> tuple[str, bool]:
    """(the builtin name, or a custom op's code such as "FlexErf"; whether it is a builtin) of a flatbuffer op."""
    builtin = builtin_code(model.OperatorCodes(op.OpcodeIndex()))
    if builtin == schema.BuiltinOperator.CUSTOM:
        return model.OperatorCodes(op.OpcodeIndex()).CustomCode().decode(), False
    return _BUILTIN_NAMES.get(builtin, str(builtin)), True


def _ops(path: str | os.PathLike) -> list[_Op]:
    """Every op of a `.tflite` file's main subgraph, read from its flatbuffer."""
    model = schema.Model.GetRootAs(Path(path).read_bytes(), 0)
    graph = model.Subgraphs(0)
    ops = []
    for i in range(graph.OperatorsLength()):
        op = graph.Operators(i)
        name, builtin = _op_name(model, op)
        ops.append(_Op(name, [_DTYPE_NAMES[graph.Tensors(t).Type()] for t in op.InputsAsNumpy() if t >= 0], builtin))
    return ops


def non_builtin_ops(path: str | os.PathLike) -> list[str]:
    """Ops of a `.tflite` file that are not TFLite built-ins (Flex / custom ops)."""
    return sorted({op.name for op in _ops(path) if not op.builtin})


# The built-in ops LiteRT's GPU delegate takes, each under conditions on its attributes
# (`CheckGpuDelegateCompatibility` in tensorflow/lite/tools/versioning/gpu_compatibility.cc, the list
# TensorFlow's GPU analyzer checks). Any other op (BROADCAST_TO, GATHER_ND, a Flex or custom op) runs on the CPU,
# splitting the graph, or makes the delegate refuse the model.
GPU_DELEGATE_OPS = frozenset({
    "ABS", "ADD", "ADD_N", "AVERAGE_POOL_2D", "BATCH_MATMUL", "CAST", "CONCATENATION", "CONV_2D", "COS", "CUMSUM",
    "DENSIFY", "DEPTHWISE_CONV_2D", "DEPTH_TO_SPACE", "DEQUANTIZE", "DIV", "ELU", "EQUAL", "EXP", "FLOOR",
    "FLOOR_DIV", "FLOOR_MOD", "FULLY_CONNECTED", "GATHER", "GELU", "GREATER", "GREATER_EQUAL", "HARD_SWISH",
    "LEAKY_RELU", "LESS", "LESS_EQUAL", "LOG", "LOGICAL_AND", "LOGISTIC", "LSTM", "MAXIMUM", "MAX_POOL_2D", "MEAN",
    "MINIMUM", "MIRROR_PAD", "MUL", "NEG", "NOT_EQUAL", "ONE_HOT", "PACK", "PAD", "PADV2", "POW", "PRELU",
    "QUANTIZE", "REDUCE_MAX", "REDUCE_MIN", "REDUCE_PROD", "RELU", "RELU6", "RELU_N1_TO_1", "RESHAPE",
    "RESIZE_BILINEAR", "RESIZE_NEAREST_NEIGHBOR", "RSQRT", "SELECT", "SELECT_V2", "SIGN", "SIN", "SLICE", "SOFTMAX",
    "SPACE_TO_DEPTH", "SPLIT", "SPLIT_V", "SQRT", "SQUARE", "SQUARED_DIFFERENCE", "STRIDED_SLICE", "SUB", "SUM",
    "TANH", "TILE", "TRANSPOSE", "TRANSPOSE_CONV",
})
# What LiteRT's GPU delegate rejects or computes wrongly, found in a file's flatbuffer. TensorFlow's own
# `tf.lite.experimental.Analyzer(gpu_compatibility=True)` (TF 2.21; LiteRT 2.3's alike) passed files with transposed
# BATCH_MATMULs, rank-5 tensors, GATHER_ND, ARG_MAX and TOPK_V2: its verdict is reported, this check decides.
GPU_DELEGATE_PITFALLS = {
    "transposed_batch_matmul": "BATCH_MATMUL with adj_x or adj_y set: the GPU delegate ignores the flags and "
                               "computes wrong numbers (LiteRT issue 8913)",
    "broadcast_to": "BROADCAST_TO: one such op makes the GPU delegate refuse the whole model (LiteRT issue 9191)",
    "gather_nd": "GATHER_ND: not supported by the GPU delegate (litert-torch issue 925)",
    "rank_over_4": "tensors of rank 5 or more: refused by the GPU delegate (LiteRT issue 2540)",
    "dynamic_shape": "tensors whose size is known only at run time beyond the batch (shape_signature -1): the GPU "
                     "delegate needs every shape fixed when it is applied",
    "not_gpu_ops": "ops not on the GPU delegate's list (GPU_DELEGATE_OPS), which run on the CPU",
    "gpu_op_attributes": "ops on the GPU delegate's list with attributes it does not take (a STRIDED_SLICE's "
                         "shrink-axis mask, a SLICE of rank 2, ...), which run on the CPU",
}
_NAMED_OFF_LIST = {"BROADCAST_TO": "broadcast_to", "GATHER_ND": "gather_nd"}


def _options(op, kind):
    """An op's builtin options table as `kind` (e.g. `schema.StridedSliceOptions`)."""
    options, table = kind(), op.BuiltinOptions()
    options.Init(table.Bytes, table.Pos)
    return options


def _attribute_problem(name: str, op, graph, model) -> str | None:
    """What of an op on `GPU_DELEGATE_OPS` the delegate does not take, by `CheckGpuDelegateCompatibility`'s rules
    (tensorflow/lite/tools/versioning/gpu_compatibility.cc) for the ops a ViT's files hold, else None."""
    tensors = [graph.Tensors(t) if t >= 0 else None for t in op.InputsAsNumpy()]
    rank = [tensor.ShapeLength() if tensor is not None else 0 for tensor in tensors]
    constant = [tensor is not None and model.Buffers(tensor.Buffer()).DataLength() + model.Buffers(
        tensor.Buffer()).Offset() > 0 for tensor in tensors]
    if name == "BATCH_MATMUL":
        options = _options(op, schema.BatchMatMulOptions)
        # Taken by the analyzer, ignored by the delegate (LiteRT issue 8913).
        return "adj_x / adj_y" if options.AdjX() or options.AdjY() else None
    if name in ("SLICE", "STRIDED_SLICE") and rank[0] not in (3, 4):
        return f"input of rank {rank[0]} (3 or 4 only)"
    if name == "STRIDED_SLICE":
        options = _options(op, schema.StridedSliceOptions)
        masks = [mask for mask, value in (("ellipsis", options.EllipsisMask()), ("new_axis", options.NewAxisMask()),
                                          ("shrink_axis", options.ShrinkAxisMask())) if value]
        return f"{', '.join(masks)} mask" if masks else None
    if name == "SOFTMAX" and _options(op, schema.SoftmaxOptions).Beta() != 1:
        return "beta other than 1"
    if name == "FULLY_CONNECTED":
        options = _options(op, schema.FullyConnectedOptions)
        if options.WeightsFormat() != 0 or constant[0]:
            return "shuffled weights or a constant input"
        if options.KeepNumDims() and rank[0] != graph.Tensors(op.Outputs(0)).ShapeLength():
            return "keep_num_dims with another output rank"
    if name in ("MEAN", "SUM", "REDUCE_MAX", "REDUCE_MIN", "REDUCE_PROD") and not constant[1]:
        return "axes that are not constant"
    if name == "GATHER" and (rank[1] != 1 or tensors[1].Type() != schema.TensorType.INT32):
        return "indices that are not one int32 axis"
    if name == "MUL" and len(tensors) == 2 and rank[0] == rank[1] > 0:
        shapes = [tensor.ShapeAsNumpy() for tensor in tensors]
        if (shapes[0] < shapes[1]).any() and (shapes[1] < shapes[0]).any():
            return "inputs each smaller than the other in some axis"
    if name in ("PAD", "PADV2", "MIRROR_PAD") and not (constant[1] and rank[1] == 2 and
                                                       tensors[1].ShapeAsNumpy()[0] in (3, 4)):
        return "paddings that are not a constant 3x2 or 4x2 tensor"
    return None


OFF_GPU_LIST = "not on the GPU delegate's list"


class _GpuReview(NamedTuple):
    """A `.tflite` file's main subgraph as LiteRT's GPU delegate would see it (`_gpu_review`)."""

    ops: list[tuple[str, str | None]]  # each op's name and what the delegate would not take of it (None: nothing)
    wide: int  # tensors of rank over 4
    dynamic: int  # tensors whose size is known only at run time beyond the batch

    def problems(self) -> list[str]:
        return sorted({f"{name}: {problem}" for name, problem in self.ops if problem is not None})

    def pitfalls(self) -> dict[str, int]:
        found = collections.Counter()
        for name, problem in self.ops:
            if problem == OFF_GPU_LIST:
                found[_NAMED_OFF_LIST.get(name, "not_gpu_ops")] += 1
            elif problem is not None:
                found["transposed_batch_matmul" if name == "BATCH_MATMUL" else "gpu_op_attributes"] += 1
        found["rank_over_4"], found["dynamic_shape"] = self.wide, self.dynamic
        return {pitfall: count for pitfall, count in found.items() if count}


def _gpu_review(path: str | os.PathLike) -> _GpuReview:
    """Each op of a `.tflite` file's main subgraph with what LiteRT's GPU delegate would not take of it (None where
    it takes it; `OFF_GPU_LIST`; else `_attribute_problem`'s), Flex and custom ops by their code; and the numbers of
    tensors of rank over 4 and of tensors whose size is known only at run time beyond the batch."""
    model = schema.Model.GetRootAs(Path(path).read_bytes(), 0)
    graph = model.Subgraphs(0)
    ops, wide, dynamic = [], set(), set()
    for i in range(graph.OperatorsLength()):
        op = graph.Operators(i)
        name, builtin = _op_name(model, op)
        off_list = not builtin or name not in GPU_DELEGATE_OPS
        ops.append((name, OFF_GPU_LIST if off_list else _attribute_problem(name, op, graph, model)))
        for t in (*op.InputsAsNumpy(), *op.OutputsAsNumpy()):
            if t < 0:
                continue
            tensor = graph.Tensors(t)
            if tensor.ShapeLength() > 4:
                wide.add(t)
            if tensor.ShapeSignatureLength() > 1 and (tensor.ShapeSignatureAsNumpy()[1:] < 0).any():
                dynamic.add(t)
    return _GpuReview(ops, len(wide), len(dynamic))


def gpu_delegate_problems(path: str | os.PathLike) -> list[str]:
    """Every op of a `.tflite` file's main subgraph that LiteRT's GPU delegate would not take, one line each
    ("ARG_MAX: not on the GPU delegate's list", "STRIDED_SLICE: shrink_axis mask", ...), sorted and without
    repeats: ops off `GPU_DELEGATE_OPS`, and ops on it with attributes it does not take. A static check, not a run
    on a GPU."""
    return _gpu_review(path).problems()


def gpu_delegate_pitfalls(path: str | os.PathLike) -> dict[str, int]:
    """{pitfall: count} of the `GPU_DELEGATE_PITFALLS` in a `.tflite` file's main subgraph (none: {}): a static
    check, not a run on a GPU. The ops off `GPU_DELEGATE_OPS` that have a pitfall of their own (BROADCAST_TO,
    GATHER_ND) are counted under it, the others under `not_gpu_ops`; ops on it with attributes it does not take
    under `gpu_op_attributes` (a transposed BATCH_MATMUL under its own name)."""
    return _gpu_review(path).pitfalls()


def gpu_analyzer_verdict(path: str | os.PathLike) -> str | None:
    """TensorFlow's own GPU compatibility check of a file (`tf.lite.experimental.Analyzer` with
    `gpu_compatibility=True`, which checks each op's attributes too): "compatible", its warnings in one line, or
    None where this TensorFlow has no such analyzer or it fails (an experimental API: the export goes on)."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            tf.lite.experimental.Analyzer.analyze(model_path=str(path), gpu_compatibility=True)
    except Exception:  # gone, renamed or failing: the verdict is unknown
        return None
    warnings_found = [line.strip() for line in printed.getvalue().splitlines() if "GPU COMPATIBILITY WARNING" in line]
    if warnings_found:
        return "; ".join(warnings_found)
    return "compatible" if "looks compatible with GPU delegate" in printed.getvalue() else None


def float_ops(path: str | os.PathLike) -> list[str]:
    """Compute ops that take float32 tensors (besides the (de)quantize ops at their edges)."""
    return sorted({op.name for op in _ops(path)
                   if "float32" in op.input_dtypes and op.name not in ("QUANTIZE", "DEQUANTIZE")})


def outside_delegates(interpreter: Interpreter) -> tuple[dict[str, int], int]:
    """({op name: count} of the ops that run outside every delegate, the number of delegate partitions) of an
    interpreter after `allocate_tensors()`.

    `_get_ops_details()` (private; raises AttributeError where it is gone) then lists the model's ops followed by
    one DELEGATE node per partition, not the execution plan. As every op leads to an output (the converter drops
    the others), an op runs outside the delegates exactly when a tensor that the plan needs (a model output, or an
    input of a delegate or of an op outside) comes from it.
    """
    nodes = interpreter._get_ops_details()
    delegates = [node for node in nodes if node["op_name"] == "DELEGATE"]
    from_delegates = {tensor for node in delegates for tensor in node["outputs"]}
    producer = {tensor: node for node in nodes if node["op_name"] != "DELEGATE" for tensor in node["outputs"]}
    needed = [output["index"] for output in interpreter.get_output_details()]
    needed += [tensor for node in delegates for tensor in node["inputs"]]
    outside = {}
    while needed:
        tensor = needed.pop()
        node = None if tensor in from_delegates else producer.get(tensor)
        if node is not None and node["index"] not in outside:
            outside[node["index"]] = node["op_name"]
            needed.extend(node["inputs"])
    counts = collections.Counter(outside.values())
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0]))), len(delegates)


def op_coverage(path: str | os.PathLike, interpreter: Interpreter) -> dict[str, Any]:
    """`ops_total` of a `.tflite` file, and `ops_outside_delegate` ({name: count}) and `delegate_partitions` of
    `interpreter` (running it, allocated), both None where the interpreter cannot tell."""
    try:
        outside, partitions = outside_delegates(interpreter)
    except Exception:  # A private method: gone or changed, the coverage is unknown; the export goes on.
        outside, partitions = None, None
    return {"ops_total": len(_ops(path)), "ops_outside_delegate": outside, "delegate_partitions": partitions}


class LiteRTClassifier:
    """Runs a batch-1 `.tflite` classifier image by image, (de)quantizing uint8/int8 ends."""

    def __init__(self, path: str | os.PathLike, num_threads: int = 1):
        self.interpreter = Interpreter(model_path=str(path), num_threads=num_threads)
        self.interpreter.allocate_tensors()
        self.input = self.interpreter.get_input_details()[0]
        self.output = self.interpreter.get_output_details()[0]

    def __call__(self, image: np.ndarray) -> np.ndarray:
        """float32 (height, width, 3) pixels in [0, 255] -> float32 (classes,) outputs."""
        self.interpreter.set_tensor(self.input["index"], _quantize(image[np.newaxis], self.input))
        self.interpreter.invoke()
        return _dequantize(self.interpreter.get_tensor(self.output["index"]), self.output)[0]


def _quantize(values: np.ndarray, details: dict) -> np.ndarray:
    scale, zero_point = details["quantization"]
    dtype = details["dtype"]
    if not scale:
        return values.astype(dtype)
    info = np.iinfo(dtype)
    return np.clip(np.round(values / scale + zero_point), info.min, info.max).astype(dtype)


def _dequantize(values: np.ndarray, details: dict) -> np.ndarray:
    scale, zero_point = details["quantization"]
    if not scale:
        return values.astype(np.float32)
    return ((values.astype(np.float32) - zero_point) * scale).astype(np.float32)


LATENCY_IMAGES = 32  # images timed with 2 threads (all of them with 1)


def median_latency_ms(path: str | os.PathLike, images: np.ndarray, num_threads: int) -> float:
    """The median milliseconds of one image through the `.tflite` file with `num_threads` threads (one untimed
    warm-up image first)."""
    classifier = LiteRTClassifier(path, num_threads=num_threads)
    classifier(images[0])
    seconds = []
    for image in images:
        start = time.perf_counter()
        classifier(image)
        seconds.append(time.perf_counter() - start)
    return 1000 * float(np.median(seconds))


def evaluate(path: str | os.PathLike, mode: str, reference: np.ndarray, images: np.ndarray, *,
             labels: np.ndarray | None = None, max_top1_drop: float = DEFAULT_MAX_TOP1_DROP,
             classifier: bool = True) -> dict[str, Any]:
    """Size, op coverage, latency (1 and 2 threads) and agreement of a `.tflite` file with the Keras outputs
    `reference` on `images` (and top-1 accuracy on `labels`, if given); an int8 mode of a `classifier` whose top-1
    drop is over `max_top1_drop` points is `refused`. A tower's embedding has no top-1 (its largest entry is no
    class): its files are reported by the least cosine with Keras' embeddings, the top-1 fields None."""
    run = LiteRTClassifier(path)
    outputs, seconds = [], []
    for image in images:
        start = time.perf_counter()
        outputs.append(run(image))
        seconds.append(time.perf_counter() - start)
    outputs = np.stack(outputs)
    one_thread = 1000 * float(np.median(seconds))
    two_threads = median_latency_ms(path, images[:LATENCY_IMAGES], num_threads=2)
    check = precision.agreement(reference.reshape(len(images), -1), outputs.reshape(len(images), -1), max_top1_drop,
                                classifier=classifier)
    has_top1 = "top1_agreement" in check
    result = {
        "mode": mode,
        "file": Path(path).name,
        "size_bytes": os.path.getsize(path),
        **op_coverage(path, run.interpreter),
        "latency_ms_median": one_thread,
        "latency_ms_median_by_threads": {"1": one_thread, "2": two_threads},
        "max_abs_diff": float(np.abs(outputs - reference).max()),
        "mean_abs_diff": float(np.abs(outputs - reference).mean()),
        "min_cosine": check["min_cosine"],
        "top1_agreement": check.get("top1_agreement"),
        "top1_drop": check.get("top1_drop"),
        "top1_accuracy": float(np.mean(outputs.argmax(-1) == labels)) if labels is not None and has_top1 else None,
        "images": len(images),
        "reference_classes_predicted": int(len(np.unique(reference.argmax(-1)))) if has_top1 else None,
        "non_builtin_ops": non_builtin_ops(path),
        "float_ops": float_ops(path),
        **(_gpu_check(path) if mode in GPU_DELEGATE_MODES else
           {"gpu_delegate_pitfalls": None, "gpu_delegate_problems": None, "gpu_analyzer": None}),
    }
    result["refused"] = mode in INT8_MODES and check["refused"]
    result["sensitive_layers"] = None  # ranked by `export_tflite` for a refused mode only: the debugger is slow
    result["passed"] = _passed(result)
    return result


def _gpu_check(path: str | os.PathLike) -> dict[str, Any]:
    """A float file's GPU-delegate check: `gpu_delegate_pitfalls`, the ops the delegate would not take
    (`gpu_delegate_problems`), and TensorFlow's analyzer's verdict (`gpu_analyzer_verdict`)."""
    review = _gpu_review(path)  # the file read once for both
    return {"gpu_delegate_pitfalls": review.pitfalls(), "gpu_delegate_problems": review.problems(),
            "gpu_analyzer": gpu_analyzer_verdict(path)}


def _passed(result: dict[str, Any]) -> bool:
    mode = result["mode"]
    ok = not result["non_builtin_ops"] and not result["refused"]
    if mode in MAX_ABS_DIFF:
        ok = ok and result["max_abs_diff"] <= MAX_ABS_DIFF[mode]
    return ok


def split_indices(count: int, calibration_count: int, evaluation_count: int,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint random calibration and evaluation indices into `count` images."""
    if count < 2:
        raise ValueError(f"Expected at least 2 images (calibration and evaluation). Received {count}.")
    order = np.random.default_rng(seed).permutation(count)
    calibration_count = min(calibration_count, count // 2)
    return order[:calibration_count], order[calibration_count:calibration_count + evaluation_count]


def _load_images(model: keras.Model, images: np.ndarray | None, labels: np.ndarray | None,
                 dataset: str | os.PathLike) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(images, labels or None, source name) of `export_tflite`'s arguments."""
    size = model_io.image_size(model)
    if images is not None:
        images, source = np.asarray(images, np.float32), "given"
    elif labels is not None:
        raise ValueError("Expected labels only with images: a dataset brings its own labels (the digits) or none.")
    else:
        transform = model_io.preprocessing_config(model).resize_arguments
        images = data.load(dataset, size, transform)
        source = "directory" if os.path.isdir(str(dataset)) else str(dataset)
        labels = datasets.digits("all")[1] if source == "digits" else None  # data.digits' order
    if images.shape[1:] != (*size, 3):
        raise ValueError(f"Expected images of shape (count, {size[0]}, {size[1]}, 3). Received {images.shape}.")
    if labels is not None and len(labels) != len(images):
        raise ValueError(f"Expected one label per image ({len(images)}). Received {len(labels)}.")
    return images, None if labels is None else np.asarray(labels), source


def _export_mode(model: keras.Model, source: str, out: Path, mode: str, calibration: np.ndarray,
                 reference: np.ndarray, evaluation: np.ndarray, labels: np.ndarray | None,
                 max_top1_drop: float, classifier: bool) -> dict[str, Any]:
    """Converts (from `source`, the model's `conversion_source`) and evaluates (`evaluate`, of a `classifier` or a
    tower) one mode in a hidden file of `out`, moved into place unless refused (then an older file of that name is
    removed: the folder holds what its report says)."""
    final = out / f"{model.name}_{mode}.tflite"
    handle, partial = tempfile.mkstemp(dir=out, prefix=f".{final.name}.", suffix=".partial")
    os.close(handle)
    try:
        try:
            convert(model, partial, mode, calibration, source=source)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            raise DiskSpaceError(errno.ENOSPC, f"The disk filled up while {final.name} was written in {out}. It was "
                                 "not written and the files there before are whole: free some space and convert "
                                 "again") from None
        result = evaluate(partial, mode, reference, evaluation, labels=labels, max_top1_drop=max_top1_drop,
                          classifier=classifier)
        if result["refused"]:
            final.unlink(missing_ok=True)
        else:
            os.replace(partial, final)
    finally:
        Path(partial).unlink(missing_ok=True)
    result["file"] = None if result["refused"] else final.name
    if result["refused"]:
        try:
            result["sensitive_layers"] = sensitive_layers(model, calibration, mode=mode, source=source)
        except Exception as error:  # A diagnosis only: its failure must not hide the refusal.
            result["sensitive_layers_error"] = f"{type(error).__name__}: {' '.join(str(error).split())}"
    return result


def export_tflite(model: keras.Model, out_dir: str | os.PathLike, *, images: np.ndarray | None = None,
                  labels: np.ndarray | None = None, dataset: str | os.PathLike = "digits",
                  modes: Sequence[str] | None = None, calibration_count: int = 200, evaluation_count: int = 400,
                  max_top1_drop: float = DEFAULT_MAX_TOP1_DROP) -> dict[str, Any]:
    """Writes one `.tflite` file per mode and `report.json` / `report.md` into `out_dir`; returns the report.

    Args:
        model: a keras_vit classifier.
        out_dir: output directory (created if needed).
        images: optional float32 (count, height, width, 3) pixels in [0, 255] at the model size.
            Defaults to images loaded from `dataset`.
        labels: optional int class of each of `images`, for top-1 accuracy. `dataset="digits"` brings its own.
        dataset: "digits", "photos" or a directory of images, used when `images` is None.
        modes: the modes to write. Defaults to `available_modes()`: all of `ALL_MODES` (less `mixed_int8`, with
            a warning, where TensorFlow has no quantization debugger).
        calibration_count, evaluation_count: images used to calibrate mixed_int8, int8 and int8_cpu, and to
            evaluate.
        max_top1_drop: float. The most top-1 agreement with the Keras model, in points (100 x (1 - agreement)),
            that an int8 mode may lose on the evaluation images. Defaults to `DEFAULT_MAX_TOP1_DROP` (1.0).

    Raises:
        Top1DropError: after writing the other modes and the report, if an int8 mode was over `max_top1_drop`
            (that mode's file is not written, and an older one of its name is removed).
    """
    available = available_modes()
    if modes is None:
        modes = available
        if modes != ALL_MODES:
            warnings.warn(f"Writing {', '.join(modes)}: mixed_int8 needs tf.lite.experimental.QuantizationDebugger, "
                          f"which TensorFlow {tf.__version__} lacks.", stacklevel=2)
    unknown = [mode for mode in modes if mode not in ALL_MODES]
    if unknown:
        raise ValueError(f"Unknown TFLite modes {unknown}. Expected a subset of {ALL_MODES}.")
    unavailable = [mode for mode in modes if mode not in available]
    if unavailable:
        raise ValueError(f"TensorFlow {tf.__version__} cannot write {unavailable}: mixed_int8 needs "
                         f"tf.lite.experimental.QuantizationDebugger. Expected a subset of {available}.")
    precision.check_max_top1_drop(max_top1_drop)
    check_room({str(out_dir): files_bytes(model, modes)}, "the LiteRT files")
    images, labels, source = _load_images(model, images, labels, dataset)
    calibration_index, evaluation_index = split_indices(len(images), calibration_count, evaluation_count)
    calibration, evaluation = images[calibration_index], images[evaluation_index]
    evaluation_labels = None if labels is None else labels[evaluation_index]
    reference = model_io.with_pixel_input(model).predict(evaluation, verbose=0, batch_size=32)
    classifier = features.classifier_head(model) is not None  # a tower's embedding has no top-1
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:  # one SavedModel for the float modes and one for the int8 modes
        sources = {}
        for gpu_form in sorted({mode in GPU_DELEGATE_MODES for mode in modes}):
            sources[gpu_form] = stack.enter_context(conversion_source(model, gpu_delegate=gpu_form))
        results = [_export_mode(model, sources[mode in GPU_DELEGATE_MODES], out, mode, calibration, reference,
                                evaluation, evaluation_labels, max_top1_drop, classifier) for mode in modes]
    report = {"model": model.name, "input_size": list(model_io.image_size(model)),
              "calibration_images": len(calibration),
              "images": {"source": source, "yours": source in ("given", "directory")},
              "keras_top1_accuracy": (None if evaluation_labels is None or not classifier
                                      else float(np.mean(reference.argmax(-1) == evaluation_labels))),
              "thresholds": {"max_abs_diff": MAX_ABS_DIFF, "max_top1_drop": max_top1_drop},
              "modes": results}
    for name, text in (("report.json", json.dumps(report, indent=2) + "\n"), ("report.md", markdown_report(report))):
        with atomic_write(out / name) as partial:
            Path(partial).write_text(text, encoding="utf-8")
    refused = [result for result in results if result["refused"]]
    if refused:
        raise Top1DropError("Refused " + "; ".join(_refusal(result, max_top1_drop) for result in refused) + ".",
                            report)
    return report


def files_bytes(model: keras.Model, modes: Sequence[str]) -> int:
    """About the bytes of the LiteRT files of `modes` and their report: each mode's weights at its width."""
    parameters = sum(math.prod(variable.shape) for variable in model.weights)
    return sum(parameters * BYTES_PER_WEIGHT[mode] for mode in modes) + 2 ** 20


def _refusal(result: dict[str, Any], max_top1_drop: float) -> str:
    """One line: the refused mode, its drop, the limit and the most sensitive layers."""
    layers = ", ".join(f"{layer['tensor']} ({layer['op']}, {layer['rmse_over_scale']:.3g})"
                       for layer in result["sensitive_layers"] or [])
    if "sensitive_layers_error" in result:
        layers = f"unknown ({result['sensitive_layers_error']})"
    return (f"{result['mode']}: top-1 drop of {result['top1_drop']:.2f} points on {result['images']} held-out "
            f"images is over max_top1_drop={max_top1_drop:g}, so it was not written; most sensitive layers "
            f"(quantization debugger, RMSE / scale): {layers or 'none found'}")


def markdown_report(report: dict[str, Any]) -> str:
    """The report as a Markdown table."""
    accuracy = report.get("keras_top1_accuracy") is not None
    lines = [f"# TFLite export of `{report['model']}` ({report['input_size'][0]}x{report['input_size'][1]})", "",
             f"Compared with the Keras model on {report['modes'][0]['images']} held-out images; mixed_int8, int8 and "
             f"int8_cpu calibrated on {report['calibration_images']} others. Latency: median per image with the LiteRT "
             f"interpreter's default delegate (XNNPACK), 1 thread over every image, 2 threads over the first "
             f"{LATENCY_IMAGES}. Outside XNNPACK: the ops that the interpreter runs itself, and the number of "
             "XNNPACK partitions.", "",
             "| mode | size (KiB) | latency, 1 thread (ms) | latency, 2 threads (ms) | outside XNNPACK | max abs diff "
             "| top-1 agreement |" + (" top-1 accuracy |" if accuracy else "") + " check |",
             "|---|---:|---:|---:|---|---:|---:|" + ("---:|" if accuracy else "") + "---|"]
    for r in report["modes"]:
        two = r["latency_ms_median_by_threads"]["2"]
        agreement = (f"{100 * r['top1_agreement']:.1f}%" if r["top1_agreement"] is not None
                     else f"n/a (least cosine {r['min_cosine']:.4f})")
        lines.append(f"| {r['mode']} | {r['size_bytes'] / 1024:.1f} | {r['latency_ms_median']:.3f} | {two:.3f} | "
                     f"{_coverage_text(r)} | {r['max_abs_diff']:.2e} | {agreement} |"
                     + (f" {100 * r['top1_accuracy']:.1f}% |" if accuracy else "")
                     + f" {_check_text(r, report['thresholds'])} |")
    lines.append("")
    first = report["modes"][0]
    predicted = first["reference_classes_predicted"]
    if predicted is None:
        lines.append("The model is a tower (its output an embedding, no classes): each file is reported by the least "
                     "cosine of its embeddings with Keras', and no int8 file is refused on a top-1.")
    else:
        lines.append(f"The Keras model predicts {predicted} distinct classes on these images"
                     + ("; top-1 agreement means little here." if predicted < 2 else "."))
    if accuracy:
        lines.append(f"The Keras model's top-1 accuracy on these images is {100 * report['keras_top1_accuracy']:.1f}%.")
    if not report.get("images", {}).get("yours", True):
        lines.append(f"These checks ran on the embedded `{report['images']['source']}` images, not on images of your "
                     "model's domain: they show that each file agrees with the Keras model on those images, not that "
                     "it keeps its accuracy on yours (nor were the int8 modes calibrated on them). Pass --images DIR "
                     "(your own held-out images) for that.")
    for r in report["modes"]:
        if r["mode"] == "int8" and r["float_ops"]:
            lines.append(f"Full int8 keeps these built-in ops in float32: {', '.join(r['float_ops'])}.")
        if r["mode"] == "mixed_int8":
            lines.append(f"mixed_int8 runs {', '.join(MIXED_INT8_OPS)} in int8 and every other op in float32.")
        if r["mode"] == "int8_cpu":
            lines.append(f"int8_cpu runs {', '.join(INT8_CPU_FLOAT_OPS)} in float32 (on XNNPACK) and every other op "
                         "in int8.")
        if r["refused"]:
            lines.append(f"Refused {_refusal(r, report['thresholds']['max_top1_drop'])}.")
        if r.get("gpu_delegate_pitfalls") is not None:
            lines.append(_gpu_text(r))
    return "\n".join(lines) + "\n"


def _gpu_text(result: dict[str, Any]) -> str:
    """The GPU-delegate check of a float file in one line (a check of the file, not a run on a GPU)."""
    analyzer = result.get("gpu_analyzer")
    said = ("TensorFlow's GPU analyzer was not available" if analyzer is None else
            f"TensorFlow's GPU analyzer: {analyzer}")
    pitfalls = result["gpu_delegate_pitfalls"]
    if not pitfalls:
        return (f"{result['mode']} for LiteRT's GPU delegate: every op on its list, no known pitfall; {said} (a check "
                "of the file, not a run on a GPU).")
    found = "; ".join(f"{GPU_DELEGATE_PITFALLS[name]}: {count}" for name, count in pitfalls.items())
    problems = result.get("gpu_delegate_problems")
    named = f" ({'; '.join(problems)})" if problems else ""
    return (f"Not for LiteRT's GPU delegate as it is: {result['mode']} has {found}{named}; {said} (a check of the "
            "file, not a run on a GPU).")


def _coverage_text(result: dict[str, Any]) -> str:
    """E.g. "3 of 90 (UNPACK 2, STRIDED_SLICE 1); 4 partitions"."""
    outside = result["ops_outside_delegate"]
    if outside is None:
        return f"unknown (of {result['ops_total']})"
    listed = f" ({', '.join(f'{name} {count}' for name, count in outside.items())})" if outside else ""
    return f"{sum(outside.values())} of {result['ops_total']}{listed}; {result['delegate_partitions']} partitions"


def _check_text(result: dict[str, Any], thresholds: dict[str, Any]) -> str:
    mode = result["mode"]
    if mode in MAX_ABS_DIFF:
        rule = f"max diff <= {MAX_ABS_DIFF[mode]:g}"
    elif result["top1_drop"] is None:
        rule = "a tower: reported, not judged"
    else:
        rule = f"top-1 drop <= {thresholds['max_top1_drop']:.1f} points"
    verdict = "REFUSED, not written" if result["refused"] else "PASS" if result["passed"] else "FAIL"
    return f"{verdict} ({rule}, built-in ops only)"
