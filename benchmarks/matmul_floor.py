"""The matmul floor of a ViT forward pass: its matmuls alone, each timed at its own shape, summed.

    python -m benchmarks.matmul_floor [--arch B/16] [--batches 1,16] [--predict]

Each distinct shape of `benchmarks.cases.forward_matmuls` runs as a TensorFlow function (MatMul + BiasAdd for
the projections, BatchMatMulV2 for the attention's two products), the best of 5 timed loops; the floor is
the sum over the forward's ops. No ViT forward in TensorFlow on this CPU can take less than its matmuls take
(it could only overlap them, and 2 cores leave no room for that). `--predict` also times keras_vit's
`predict_on_batch` in the same process and prints the share of its time that is matmuls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks import cases


def _best_seconds(run, loops: int = 5, target_s: float = 0.3) -> float:
    run()
    start = time.perf_counter()
    run()
    reps = max(1, int(target_s / max(time.perf_counter() - start, 1e-6)))
    best = float("inf")
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(reps):
            out = run()
        for tensor in out:  # waits for every product
            tensor.numpy()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def matmul_seconds(batched: int, m: int, k: int, n: int, chain: int = 10) -> float:
    """Seconds of one (m, k) @ (k, n) MatMul + BiasAdd, or of one BatchMatMulV2 of `batched` such products: a
    function of `chain` of them on distinct left operands (so none is deduplicated), one after another (control
    dependencies, every output returned), so the call's own overhead is spread over `chain` ops as the forward's
    graph spreads it."""
    import tensorflow as tf
    lefts = [tf.random.normal((m, k) if batched == 1 else (batched, m, k)) for _ in range(chain)]
    right = tf.random.normal((k, n) if batched == 1 else (batched, k, n))
    bias = tf.random.normal((n,)) if batched == 1 else None

    def product(a):
        return tf.linalg.matmul(a, right) if bias is None else tf.nn.bias_add(tf.linalg.matmul(a, right), bias)

    @tf.function
    def chained(*tensors):
        outs = [product(tensors[0])]
        for a in tensors[1:]:
            with tf.control_dependencies(outs[-1:]):
                outs.append(product(a))
        return outs  # all returned: an op only a control dependency needs would be pruned

    return _best_seconds(lambda: chained(*lefts)) / chain


def floor(arch: str, batch: int) -> tuple[float, float]:
    """(seconds, FLOPs) of the forward's matmuls for `batch` images."""
    seconds = flops = 0.0
    for count, batched, m, k, n in cases.forward_matmuls(arch, batch):
        seconds += count * matmul_seconds(batched, m, k, n)
        flops += 2.0 * count * batched * m * k * n
    return seconds, flops


def predict_seconds(arch: str, batch: int) -> float:
    """Median seconds of keras_vit's float32 `predict_on_batch`, timed as `benchmarks.run` times it."""
    from benchmarks import worker
    case = cases.Case(f"predict_bs{batch}", "inference", arch, batch, "float32", warmup=2, iters=5)
    return statistics.median(worker._keras_case("keras_vit", case, os.cpu_count())["latencies"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.matmul_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="B/16", choices=sorted(cases.ARCHS))
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes (default: 1,16)")
    parser.add_argument("--predict", action="store_true", help="also time keras_vit's predict_on_batch")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from benchmarks.run import _cpu
    cpu, isa = _cpu()
    print(f"CPU: {cpu}; ISA: {', '.join(isa)}; {os.cpu_count()} CPUs")
    print("\n| arch | batch | matmul floor (ms) | floor GFLOP/s |" + (" predict (ms) | matmul share |" if args.predict
                                                                  else ""))
    print("|---|---:|---:|---:|" + ("---:|---:|" if args.predict else ""))
    for batch in (int(b) for b in args.batches.split(",")):
        seconds, flops = floor(args.arch, batch)
        row = f"| {args.arch} | {batch} | {seconds * 1e3:.1f} | {flops / seconds / 1e9:.0f} |"
        if args.predict:
            predicted = predict_seconds(args.arch, batch)
            row += f" {predicted * 1e3:.1f} | {seconds / predicted:.0%} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
