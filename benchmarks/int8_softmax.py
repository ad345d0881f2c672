"""Can a softmax of XNNPACK's int8 ops take the place of LiteRT's int8 SOFTMAX? Their times and errors side by side.

    python -m benchmarks.int8_softmax [--tokens 197] [--heads 3] [--runs 40]

LiteRT's int8 SOFTMAX is the interpreter's own kernel, on one thread: in ViT-Ti/16's strict `int8` file its 12
softmaxes keep the file under 2x float32 at 2 threads (benchmarks/RESULTS.md, runs AG, AH). XNNPACK has no int8
EXP, but it runs int8 ELU, and exp(x) = ELU(x) + 1 where x <= 0, as x - max is. Each form below is a softmax over
the last axis of (1, heads, tokens, tokens) logits, converted to full int8 (int8 in and out) as
`benchmarks.litert_ops` converts its "plain" cases, and calibrated and checked on logits whose rows each have a
temperature of their own (standard normal times one of `TEMPERATURES`, drawn per row): flat and peaked rows in one
tensor, as the heads of a trained model give them.

The table gives the median of `--runs` invokes at 1 and 2 threads, the ops that ran outside XNNPACK, the largest
error of a probability against float32's softmax of the same (quantized) logits over 4 other draws, and the range
of the rows' sums. The ELU forms divide by the row's sum, which int8 holds on one scale for every row.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from ai_edge_litert.interpreter import Interpreter  # noqa: E402

from benchmarks import litert_ops  # noqa: E402
from keras_vit.export import tflite  # noqa: E402

TEMPERATURES = (0.3, 1.0, 3.0, 8.0, 20.0)
CHECKS = 4  # draws the error is taken over


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


FORMS = (("SOFTMAX (built-in)", tf.nn.softmax),
         ("(ELU(x - max) + 1) * (1 / sum)", softmax_by_elu),
         ("ELU(x - max - log(sum)) + 1", softmax_by_elu_log_sum))


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
    print("| softmax | 1 thread (ms) | 2 threads (ms) | outside XNNPACK | largest error | row sums |")
    print("|---|---:|---:|---|---:|---|")
    with tempfile.TemporaryDirectory() as folder:
        for i, (name, function) in enumerate(FORMS):
            path = Path(folder) / f"{i}.tflite"
            path.write_bytes(litert_ops.convert(function, [shape], "plain", draw=mixed_logits))
            largest, low, high = errors(path, shape)
            print(f"| {name} | {litert_ops.timed_cells(path, args.runs)} | {largest:.4f} | {low:.3f} to {high:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
