"""Can a softmax of ops that XNNPACK runs take the place of LiteRT's int8 SOFTMAX? Times and errors side by side.

    python -m benchmarks.int8_softmax [--tokens 197] [--heads 3] [--runs 40]

LiteRT's int8 SOFTMAX is the interpreter's own kernel, on one thread: in ViT-Ti/16's strict `int8` file its 12
softmaxes keep the file under 2x float32 at 2 threads (benchmarks/RESULTS.md, runs AG, AH). XNNPACK has no int8
EXP, but it runs ELU, and exp(x) = ELU(x) + 1 where x <= 0, as x - max is. Each form below is a softmax over
the last axis of (1, heads, tokens, tokens) logits, converted to full int8 (int8 in and out) as
`benchmarks.litert_ops` converts its "plain" cases, and calibrated and checked on logits whose rows each have a
temperature of their own (standard normal times one of `TEMPERATURES`, drawn per row): flat and peaked rows in one
tensor, as the heads of a trained model give them.

The table gives the median of `--runs` invokes at 1 and 2 threads, the ops that ran outside XNNPACK, the largest
error of a probability against float32's softmax of the same (quantized) logits over 4 other draws, the range
of the rows' sums, and the ops that compute in float32 (the converter quantizes no ELU: it leaves ELU in float32
between a DEQUANTIZE and a QUANTIZE, which XNNPACK runs too, so no ELU form is integer-only). The ELU forms divide
by the row's sum, which int8 holds on one scale for every row.

The forms marked "ranges set" are converted with three calibrated ranges replaced (`exact_exp_ranges`) before the
converter quantizes: x - max on the logits' own scale (exact in int8), ELU's output on [-1, 0] (so that the exp of a
far logit is exactly 0: calibration gives ELU [-1, 1], whose int8 grid misses -1 and leaves every far logit 1/255),
and, in the two-pass form, the second pass's sum and its reciprocal on [0, `SECOND_PASS_MAX`] (calibrated in float
they are exactly 1). The two-pass form normalises twice: by the first sum, held on the one coarse scale of all
rows, and then by the sum of the result, which is near 1 in every row and so is held finely.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from ai_edge_litert import schema_py_generated as schema  # noqa: E402
from ai_edge_litert.interpreter import Interpreter  # noqa: E402

from benchmarks import litert_ops  # noqa: E402
from keras_vit import _tf_internals  # noqa: E402
from keras_vit.export import litert_file, tflite, tflite_conversion  # noqa: E402

TEMPERATURES = (0.3, 1.0, 3.0, 8.0, 20.0)
CHECKS = 4  # draws the error is taken over
SECOND_PASS_MAX = 1.6  # the second pass's row sums are 0.75 to 1.35 where the first pass's reciprocal rounds


def mixed_logits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Standard-normal logits, each row (last axis) times a temperature drawn from `TEMPERATURES`."""
    return rng.standard_normal(shape) * rng.choice(TEMPERATURES, size=(*shape[:-1], 1))


def softmax_by_elu(x):
    """(ELU(x - max) + 1) * (1 / sum): exp by ELU, on XNNPACK's int8 kernels but for the reciprocal."""
    numerator = tf.nn.elu(x - tf.reduce_max(x, -1, keepdims=True)) + 1.0
    return numerator * (1.0 / tf.reduce_sum(numerator, -1, keepdims=True))


def softmax_by_elu_log_sum(x):
    """ELU(x - max - log(sum)) + 1: the sum's logarithm subtracted before the exp, instead of a product after it."""
    shifted = x - tf.reduce_max(x, -1, keepdims=True)
    total = tf.reduce_sum(tf.nn.elu(shifted) + 1.0, -1, keepdims=True)
    return tf.nn.elu(shifted - tf.math.log(total)) + 1.0


def softmax_by_elu_two_passes(x):
    """`softmax_by_elu`, then the result divided by its own row sums: a second pass whose sums are all near 1."""
    first = softmax_by_elu(x)
    return first * (1.0 / tf.reduce_sum(first, -1, keepdims=True))


# (name, function, whether `exact_exp_ranges` sets its ranges)
FORMS = (("SOFTMAX (built-in)", tf.nn.softmax, False),
         ("(ELU(x - max) + 1) * (1 / sum)", softmax_by_elu, False),
         ("ELU(x - max - log(sum)) + 1", softmax_by_elu_log_sum, False),
         ("(ELU(x - max) + 1) * (1 / sum), ranges set", softmax_by_elu, True),
         ("the same, two passes, ranges set", softmax_by_elu_two_passes, True))


def exact_exp_ranges(calibrated: bytes) -> bytes:
    """A calibrated float `.tflite` model (each tensor's range in its `min` / `max`) with the ranges of every ELU
    softmax set: x - max on [-(max - min) of x, 0], the logits' own int8 scale with zero point 127, so that the
    subtraction is exact; ELU's output on [-1, 0]; and where a second pass follows (a SUM of the first pass's
    product), that sum and its reciprocal (DIV) on [0, `SECOND_PASS_MAX`]."""
    buffer = bytearray(calibrated)  # edited in place, as `tflite_conversion.symmetric_matmul_operands` does
    model = schema.Model.GetRootAs(buffer, 0)
    graph = model.Subgraphs(0)
    ops = [graph.Operators(i) for i in range(graph.OperatorsLength())]
    names = [tflite_conversion.op_name(model, op) for op in ops]
    producer = {int(tensor): op for op in ops for tensor in op.OutputsAsNumpy()}
    consumers: dict[int, list] = {}
    for op, name in zip(ops, names):
        for tensor in op.InputsAsNumpy():
            consumers.setdefault(int(tensor), []).append((op, name))

    def set_range(tensor: int, low: float, high: float) -> None:
        quantization = graph.Tensors(tensor).Quantization()
        quantization.MinAsNumpy()[:], quantization.MaxAsNumpy()[:] = low, high  # views into `buffer`

    def only(tensor: int, name: str):
        return next(op for op, op_name in consumers[tensor] if op_name == name)

    for elu, name in zip(ops, names):
        if name != "ELU":
            continue
        difference = producer[int(elu.Inputs(0))]  # x - max
        logits = graph.Tensors(int(difference.Inputs(0))).Quantization()
        set_range(int(difference.Outputs(0)), -float(logits.MaxAsNumpy()[0] - logits.MinAsNumpy()[0]), 0.0)
        set_range(int(elu.Outputs(0)), -1.0, 0.0)
        first_pass = only(int(only(int(elu.Outputs(0)), "ADD").Outputs(0)), "MUL")
        second_sums = [op for op, op_name in consumers.get(int(first_pass.Outputs(0)), []) if op_name == "SUM"]
        for total in second_sums:
            set_range(int(total.Outputs(0)), 0.0, SECOND_PASS_MAX)
            set_range(int(only(int(total.Outputs(0)), "DIV").Outputs(0)), 0.0, SECOND_PASS_MAX)
    return bytes(buffer)


def convert(function, shape: tuple[int, ...], set_ranges: bool) -> bytes:
    """`function` as full int8, as `litert_ops.convert` writes a "plain" case, calibrated on `mixed_logits`; with
    `set_ranges`, quantized from the calibrated model with `exact_exp_ranges`."""
    if not set_ranges:
        return litert_ops.convert(function, [shape], "plain", draw=mixed_logits)
    calibrated = _tf_internals.calibrated_tflite(litert_ops.full_int8_converter(function, [shape], mixed_logits))
    return _tf_internals.quantize_calibrated(exact_exp_ranges(calibrated), tf.int8, tf.int8)


def errors(path: Path, shape: tuple[int, ...]) -> tuple[float, float, float]:
    """(largest |probability error|, smallest row sum, largest row sum) of the file over `CHECKS` draws of
    `mixed_logits`, against float32's softmax of the logits as the file's int8 input holds them."""
    interpreter = Interpreter(model_path=str(path))
    interpreter.allocate_tensors()
    (inputs,), (outputs,) = interpreter.get_input_details(), interpreter.get_output_details()
    rng = np.random.default_rng(3)
    largest, sums = 0.0, []
    for _ in range(CHECKS):
        quantized = tflite._quantize(mixed_logits(rng, shape), inputs)
        interpreter.set_tensor(inputs["index"], quantized)
        interpreter.invoke()
        probabilities = tflite._dequantize(interpreter.get_tensor(outputs["index"]), outputs)
        reference = tf.nn.softmax(tflite._dequantize(quantized, inputs)).numpy()
        largest = max(largest, float(np.abs(probabilities - reference).max()))
        sums.append(probabilities.sum(-1))
    return largest, float(np.min(sums)), float(np.max(sums))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=197)
    parser.add_argument("--heads", type=int, default=3, help="default: ViT-Ti/16's")
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args(argv)
    shape = (1, args.heads, args.tokens, args.tokens)
    print(f"{litert_ops.machine()}; softmax of {shape} logits, full int8, temperatures {TEMPERATURES} by row; "
          f"median of {args.runs}")
    print("| softmax | 1 thread (ms) | 2 threads (ms) | outside XNNPACK | largest error | row sums | float32 ops |")
    print("|---|---:|---:|---|---:|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for i, (name, function, set_ranges) in enumerate(FORMS):
            path = Path(folder) / f"{i}.tflite"
            path.write_bytes(convert(function, shape, set_ranges))
            largest, low, high = errors(path, shape)
            print(f"| {name} | {litert_ops.timed_cells(path, args.runs)} | {largest:.4f} | {low:.3f} to {high:.3f} | "
                  f"{', '.join(litert_file.float_ops(path)) or 'none'} |", flush=True)


if __name__ == "__main__":
    main()
