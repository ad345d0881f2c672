"""Keras' JAX predict path against the model's own compiled forward pass, on the same batch.

    KERAS_BACKEND=jax python -m benchmarks.jax_predict [--impls keras_vit,keras_hub] [--archs Ti/16,B/16]
                                                       [--batch 8] [--iters 10] [--check 1.15]

For each (implementation, architecture): `model.predict_on_batch(x)` (what Keras' JAX trainer runs: its
compiled predict step, or an eager pass first while any layer is unbuilt) and
`jax.jit(model.stateless_call)` on the same weights and batch, timed alternately in one process so that
machine noise hits both alike. Prints the medians and their ratio; `--check R` exits 1 if a keras_vit ratio
exceeds R (issue 23: within about 15%).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from benchmarks.cases import ARCHS
from benchmarks.run import _cpu
from benchmarks.worker import KERAS_BUILDERS


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def measure(impl: str, arch: str, batch: int, iters: int) -> dict:
    """Median latency of predict_on_batch and of the jitted stateless call, and the model's unbuilt layers."""
    import jax

    model = KERAS_BUILDERS[impl](arch, False)
    image = ARCHS[arch]["image"]
    x = np.random.default_rng(0).uniform(-1, 1, (batch, image, image, 3)).astype("float32")
    unbuilt = [layer.path for layer in model._flatten_layers(include_self=False) if not layer.built]
    forward = jax.jit(lambda t, n, x: model.stateless_call(t, n, x, training=False)[0])

    def jit_call():  # the variables' current arrays: Keras' predict step may donate the previous ones
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        start = time.perf_counter()
        forward(trainable, non_trainable, x).block_until_ready()
        return time.perf_counter() - start

    def predict_call():
        start = time.perf_counter()
        np.asarray(model.predict_on_batch(x))
        return time.perf_counter() - start

    for _ in range(2):  # compile and warm both
        predict_call(), jit_call()
    predict, jitted = [], []
    for _ in range(iters):
        predict.append(predict_call())
        jitted.append(jit_call())
    return {"predict_ms": _median_ms(predict), "jit_ms": _median_ms(jitted), "unbuilt_layers": len(unbuilt)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.jax_predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default="keras_vit,keras_hub")
    parser.add_argument("--archs", default="Ti/16,B/16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--check", type=float, default=None, help="fail if a keras_vit predict/jit ratio exceeds it")
    args = parser.parse_args(argv)
    import keras
    if keras.backend.backend() != "jax":
        parser.error(f"run with KERAS_BACKEND=jax (the backend is {keras.backend.backend()!r})")
    cpu, isa = _cpu()
    print(f"CPU: {cpu}; ISA: {', '.join(isa)}; batch {args.batch}; {args.iters} alternating iterations; "
          f"keras {keras.__version__}; {os.environ.get('PYTHONPATH', '') or 'keras_vit of this tree'}")
    print("\n| implementation | model | unbuilt layers | predict_on_batch (ms) | jit(stateless_call) (ms) | ratio |")
    print("|---|---|---:|---:|---:|---:|")
    failed = False
    for impl in args.impls.split(","):
        for arch in args.archs.split(","):
            r = measure(impl, arch, args.batch, args.iters)
            ratio = r["predict_ms"] / r["jit_ms"]
            failed |= impl == "keras_vit" and args.check is not None and ratio > args.check
            print(f"| {impl} | {arch} | {r['unbuilt_layers']} | {r['predict_ms']:.2f} | {r['jit_ms']:.2f} | "
                  f"{ratio:.2f}x |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
