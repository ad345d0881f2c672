"""What single ops cost in a full-int8 LiteRT file at ViT-B/16's shapes: on XNNPACK, or in the interpreter.

    python -m benchmarks.litert_ops [--tokens 197] [--width 768] [--heads 12] [--runs 40]

Each case is a tf.function of one op (or one LayerNorm) converted to full int8 (int8 in and out) as
`keras_vit.export.tflite_conversion` converts the `int8` mode, calibrated on 8 standard-normal draws: "plain" by
`TFLiteConverter.convert()`, "keras_vit" with the right operand of each BATCH_MATMUL on a symmetric range (zero
point 0), "int8_cpu" as that mode writes it (softmax and GELU in float32, between a DEQUANTIZE and a QUANTIZE).
Each file runs in LiteRT's interpreter with its default delegate (XNNPACK); the table gives the median of `--runs`
invokes at 1 and 2 threads, and the ops that ran outside XNNPACK. This is how the full-int8 file's time was taken
apart (issue 35): the ops outside run in the interpreter's own kernels, on one thread. The last rows ask whether an
integer-only softmax could run on XNNPACK's int8 kernels instead: XNNPACK has int8 LOGISTIC, but not EXP.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from ai_edge_litert.interpreter import Interpreter  # noqa: E402

from benchmarks.run import _cpu  # noqa: E402
from keras_vit.export import tflite, tflite_conversion  # noqa: E402


def cases(tokens: int, width: int, heads: int) -> list[tuple[str, str, object, list[tuple[int, ...]]]]:
    """(name, conversion, function, input shapes) of every timed case."""
    rng = np.random.default_rng(0)
    head_dim = width // heads
    per_head, scores = (1, heads, tokens, head_dim), (1, heads, tokens, tokens)
    gamma, beta = (tf.constant(rng.standard_normal(width), tf.float32) for _ in range(2))
    kernel = tf.constant(rng.standard_normal((width, 4 * width)) * width ** -0.5, tf.float32)

    def layer_norm(square):
        def normed(x):
            centered = x - tf.reduce_mean(x, -1, keepdims=True)
            variance = tf.reduce_mean(square(centered), -1, keepdims=True)
            return centered * tf.math.rsqrt(variance + 1e-6) * gamma + beta
        return normed

    def gelu(x):
        return tf.nn.gelu(x, approximate=True)

    def softmax_by_reciprocal(x):
        numerator = tf.exp(x - tf.reduce_max(x, -1, keepdims=True))
        return numerator * (1.0 / tf.reduce_sum(numerator, -1, keepdims=True))

    def q_kt(q, k):
        return tf.matmul(q, k, transpose_b=True)

    return [
        ("q k^T (BATCH_MATMUL)", "plain", q_kt, [per_head, per_head]),
        ("q k^T (BATCH_MATMUL)", "keras_vit", q_kt, [per_head, per_head]),
        ("A V (BATCH_MATMUL)", "plain", tf.matmul, [scores, per_head]),
        ("A V (BATCH_MATMUL)", "keras_vit", tf.matmul, [scores, per_head]),
        ("LayerNorm, square(x - mean)", "plain", layer_norm(tf.square), [(1, tokens, width)]),
        ("LayerNorm, (x - mean)(x - mean)", "plain", layer_norm(lambda c: c * c), [(1, tokens, width)]),
        ("softmax", "plain", tf.nn.softmax, [scores]),
        ("softmax", "int8_cpu", tf.nn.softmax, [scores]),
        ("GELU (tanh)", "plain", gelu, [(1, tokens, 4 * width)]),
        ("GELU (tanh)", "int8_cpu", gelu, [(1, tokens, 4 * width)]),
        # What an integer-only softmax or GELU could be built from: XNNPACK's int8 unary ops, and a softmax of them
        # (written with a division, the converter fuses it back into SOFTMAX).
        ("exp (softmax's numerator)", "plain", tf.math.exp, [scores]),
        ("sigmoid (LOGISTIC)", "plain", tf.math.sigmoid, [(1, tokens, 4 * width)]),
        ("softmax as exp(x - max) * (1 / sum)", "plain", softmax_by_reciprocal, [scores]),
        ("dense, width -> 4 x width (FULLY_CONNECTED)", "plain",
         lambda x: tf.matmul(tf.reshape(x, (tokens, width)), kernel), [(1, tokens, width)]),
    ]


def full_int8_converter(function, shapes: list[tuple[int, ...]], draw=None) -> tf.lite.TFLiteConverter:
    """A converter of `function` of float32 inputs of `shapes` to full int8 (int8 in and out), calibrated on 8
    draws of `draw(rng, shape)` (default: standard normal)."""
    draw = draw or (lambda rng, shape: rng.standard_normal(shape))
    specs = [tf.TensorSpec(shape, tf.float32) for shape in shapes]
    traced = tf.function(function)
    converter = tf.lite.TFLiteConverter.from_concrete_functions([traced.get_concrete_function(*specs)], traced)
    rng = np.random.default_rng(1)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: ([draw(rng, shape).astype(np.float32) for shape in shapes]
                                                for _ in range(8))
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = converter.inference_output_type = tf.int8
    return converter


def convert(function, shapes: list[tuple[int, ...]], conversion: str, draw=None) -> bytes:
    """`function` of float32 inputs of `shapes` as a full-int8 flatbuffer (`full_int8_converter`), "plain" by
    `TFLiteConverter.convert()`, otherwise as `keras_vit.export.tflite_conversion` writes `conversion`."""
    converter = full_int8_converter(function, shapes, draw)
    if conversion == "plain":
        return converter.convert()
    return tflite_conversion._full_int8(converter, "int8_cpu" if conversion == "int8_cpu" else "int8")


def time_file(path: Path, threads: int, runs: int) -> tuple[float, dict[str, int]]:
    """(median ms of `runs` invokes after 5 untimed, {op: count} outside XNNPACK)."""
    interpreter = Interpreter(model_path=str(path), num_threads=threads)
    interpreter.allocate_tensors()
    rng = np.random.default_rng(2)
    for detail in interpreter.get_input_details():
        interpreter.set_tensor(detail["index"], rng.integers(-100, 100, detail["shape"]).astype(np.int8))
    seconds = []
    for _ in range(runs + 5):
        start = time.perf_counter()
        interpreter.invoke()
        seconds.append(time.perf_counter() - start)
    return 1000 * float(np.median(seconds[5:])), tflite.outside_delegates(interpreter)[0]


def machine() -> str:
    """The CPU, its ISA flags, the CPU count and TensorFlow's version: the first words of a table's header."""
    cpu, isa = _cpu()
    return f"{cpu} ({', '.join(isa)}), {os.cpu_count()} CPUs; TensorFlow {tf.__version__}"


def timed_cells(path: Path, runs: int) -> str:
    """"| 1 thread | 2 threads | outside XNNPACK |" cells of a file: `time_file` at 1 and 2 threads."""
    (one, outside), (two, _) = (time_file(path, threads, runs) for threads in (1, 2))
    listed = ", ".join(f"{op} {count}" for op, count in outside.items()) or "none"
    return f"{one:.3f} | {two:.3f} | {listed}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=197)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args(argv)
    print(f"{machine()}; {args.tokens} tokens, width {args.width}, {args.heads} heads; full int8, "
          f"median of {args.runs}")
    print("| op | conversion | 1 thread (ms) | 2 threads (ms) | outside XNNPACK |")
    print("|---|---|---:|---:|---|")
    with tempfile.TemporaryDirectory() as folder:
        for i, (name, conversion, function, shapes) in enumerate(cases(args.tokens, args.width, args.heads)):
            path = Path(folder) / f"{i}.tflite"
            path.write_bytes(convert(function, shapes, conversion))
            print(f"| {name} | {conversion} | {timed_cells(path, args.runs)} |", flush=True)


if __name__ == "__main__":
    main()
