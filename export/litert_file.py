"""What a LiteRT (`.tflite`) file holds, read from its flatbuffer without running it: its ops and their input
dtypes, and what LiteRT's GPU delegate would not take of them.

`export.tflite`'s report uses all of it; `benchmarks.gpu_delegate` checks every family's files with it. The GPU
check is static (an allowlist with attribute rules, `GPU_DELEGATE_OPS`), not a run on a GPU; TensorFlow's own
analyzer is asked too (`gpu_analyzer_verdict`), and reported, not relied on.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
from pathlib import Path
from typing import NamedTuple

import tensorflow as tf
from ai_edge_litert import schema_py_generated as schema

from .tflite_conversion import _BUILTIN_NAMES, builtin_code


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


def ops(path: str | os.PathLike) -> list[_Op]:
    """Every op of a `.tflite` file's main subgraph, read from its flatbuffer."""
    model = schema.Model.GetRootAs(Path(path).read_bytes(), 0)
    graph = model.Subgraphs(0)
    found = []
    for i in range(graph.OperatorsLength()):
        op = graph.Operators(i)
        name, builtin = _op_name(model, op)
        found.append(_Op(name, [_DTYPE_NAMES[graph.Tensors(t).Type()] for t in op.InputsAsNumpy() if t >= 0],
                         builtin))
    return found


def non_builtin_ops(path: str | os.PathLike) -> list[str]:
    """Ops of a `.tflite` file that are not TFLite built-ins (Flex / custom ops)."""
    return sorted({op.name for op in ops(path) if not op.builtin})


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
    """A `.tflite` file's main subgraph as LiteRT's GPU delegate would see it (`gpu_review`)."""

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


def gpu_review(path: str | os.PathLike) -> _GpuReview:
    """Each op of a `.tflite` file's main subgraph with what LiteRT's GPU delegate would not take of it (None where
    it takes it; `OFF_GPU_LIST`; else `_attribute_problem`'s), Flex and custom ops by their code; and the numbers of
    tensors of rank over 4 and of tensors whose size is known only at run time beyond the batch."""
    model = schema.Model.GetRootAs(Path(path).read_bytes(), 0)
    graph = model.Subgraphs(0)
    reviewed, wide, dynamic = [], set(), set()
    for i in range(graph.OperatorsLength()):
        op = graph.Operators(i)
        name, builtin = _op_name(model, op)
        off_list = not builtin or name not in GPU_DELEGATE_OPS
        reviewed.append((name, OFF_GPU_LIST if off_list else _attribute_problem(name, op, graph, model)))
        for t in (*op.InputsAsNumpy(), *op.OutputsAsNumpy()):
            if t < 0:
                continue
            tensor = graph.Tensors(t)
            if tensor.ShapeLength() > 4:
                wide.add(t)
            if tensor.ShapeSignatureLength() > 1 and (tensor.ShapeSignatureAsNumpy()[1:] < 0).any():
                dynamic.add(t)
    return _GpuReview(reviewed, len(wide), len(dynamic))


def gpu_delegate_problems(path: str | os.PathLike) -> list[str]:
    """Every op of a `.tflite` file's main subgraph that LiteRT's GPU delegate would not take, one line each
    ("ARG_MAX: not on the GPU delegate's list", "STRIDED_SLICE: shrink_axis mask", ...), sorted and without
    repeats: ops off `GPU_DELEGATE_OPS`, and ops on it with attributes it does not take. A static check, not a run
    on a GPU."""
    return gpu_review(path).problems()


def gpu_delegate_pitfalls(path: str | os.PathLike) -> dict[str, int]:
    """{pitfall: count} of the `GPU_DELEGATE_PITFALLS` in a `.tflite` file's main subgraph (none: {}): a static
    check, not a run on a GPU. The ops off `GPU_DELEGATE_OPS` that have a pitfall of their own (BROADCAST_TO,
    GATHER_ND) are counted under it, the others under `not_gpu_ops`; ops on it with attributes it does not take
    under `gpu_op_attributes` (a transposed BATCH_MATMUL under its own name)."""
    return gpu_review(path).pitfalls()


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
    return sorted({op.name for op in ops(path)
                   if "float32" in op.input_dtypes and op.name not in ("QUANTIZE", "DEQUANTIZE")})
