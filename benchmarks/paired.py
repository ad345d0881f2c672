"""keras_vit against keras-hub's ViT on this machine: one process, calls interleaved.

    python -m benchmarks.paired [--arch B/16] [--batches 1,16] [--train-arch Ti/16] [--train-batch 32]
                                [--calls 10] [--check 1.1]

`benchmarks.run` times each implementation in its own processes, minutes apart: on a machine whose speed drifts
(a shared VM) its ratios can measure the drift (run AF: 0.94x keras-hub at batch 1 from the harness, 1.22x in one
process). Here one process builds both models (random weights, the architecture of `benchmarks.cases.ARCHS`) and
calls them alternately, so that noise hits both alike: `predict_on_batch` at each batch size, and `train_on_batch`
(keras_vit with training.trainer.AdamW, keras-hub with Keras' AdamW, as in `benchmarks.run`). Each case prints the
medians, the ratio, and in how many of the pairs keras_vit was the faster. `--check R` exits 1 where keras-hub /
keras_vit is below R in any case. timm stays out: PyTorch's and TensorFlow's thread pools in one process would
measure each other. Needs keras-hub (`pip install keras-hub`); TensorFlow backend.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.cases import ARCHS  # noqa: E402
from benchmarks.run import _cpu  # noqa: E402
from benchmarks.worker import KERAS_BUILDERS  # noqa: E402


def images(arch: str, batch: int, seed: int = 0) -> np.ndarray:
    """`batch` random images in [-1, 1] of the size of `arch`."""
    image = ARCHS[arch]["image"]
    return np.random.default_rng(seed).uniform(-1, 1, (batch, image, image, 3)).astype("float32")


def alternate(calls: dict, n: int) -> dict:
    """Each callable's call times in ms, called in turn `n` times (the order reversed every other time)."""
    times = {name: [] for name in calls}
    for i in range(n):
        for name in (list(calls) if i % 2 == 0 else list(calls)[::-1]):
            start = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def medians(times: dict) -> dict:
    """The median of each callable's times."""
    return {name: statistics.median(samples) for name, samples in times.items()}


def _row(case: str, times: dict) -> dict:
    """The medians of both, and in how many pairs keras_vit was the faster."""
    faster = sum(ours < theirs for ours, theirs in zip(times["keras_vit"], times["keras_hub"]))
    return {"case": case, **medians(times), "faster": f"{faster} of {len(times['keras_vit'])}"}


def compiled_model(impl: str, arch: str, train: bool) -> keras.Model:
    """`impl`'s model of `arch` from `benchmarks.worker` (seed 0); for training compiled with its AdamW."""
    keras.utils.set_random_seed(0)
    model = KERAS_BUILDERS[impl](arch, train)
    if train:
        if impl == "keras_vit":  # keras_vit's training recipes' AdamW, as in benchmarks.run
            from training.trainer import AdamW
        else:
            AdamW = keras.optimizers.AdamW
        model.compile(optimizer=AdamW(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


IMPLS = ("keras_vit", "keras_hub")


def measure_inference(arch: str, batches: list[int], n: int) -> list[dict]:
    inputs = {batch: images(arch, batch) for batch in batches}
    models = {impl: compiled_model(impl, arch, train=False) for impl in IMPLS}
    for model in models.values():
        for x in inputs.values():  # each batch size traced before the timing
            model.predict_on_batch(x)
    return [_row(f"{arch} predict_on_batch, batch {batch}",
                 alternate({impl: (lambda m=model: m.predict_on_batch(x)) for impl, model in models.items()}, n))
            for batch, x in inputs.items()]


def measure_training(arch: str, batch: int, n: int) -> dict:
    x = images(arch, batch)
    y = np.random.default_rng(2).integers(0, ARCHS[arch]["classes"], batch)
    models = {impl: compiled_model(impl, arch, train=True) for impl in IMPLS}
    for model in models.values():
        model.train_on_batch(x, y)  # traced before the timing
    times = alternate({impl: (lambda m=model: m.train_on_batch(x, y)) for impl, model in models.items()}, n)
    return _row(f"{arch} train_on_batch, batch {batch}", times)


def case_parser(prog: str, description: str, check: str, example: str) -> argparse.ArgumentParser:
    """The options of a one-process comparison: the models, the batch sizes, the calls, and `--check` (`check`
    names the ratio it compares, `example` a value and what it means)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--arch", default="B/16", help="the inference model, of benchmarks.cases.ARCHS")
    parser.add_argument("--batches", default="1,16", help="inference batch sizes (empty: none)")
    parser.add_argument("--train-arch", default="Ti/16", help="the training model (empty: no training case)")
    parser.add_argument("--train-batch", type=int, default=32)
    parser.add_argument("--calls", type=int, default=10, help="calls of each model per case, alternating")
    parser.add_argument("--check", type=float, default=None,
                        help=f"exit 1 if {check} is below this in any case (e.g. {example})")
    return parser


def run_cases(args: argparse.Namespace, inference, training) -> list[dict]:
    """The rows of `inference(arch, batches, calls)` and `training(arch, batch, calls)` that `args` asks for."""
    rows = []
    if args.batches:
        rows += inference(args.arch, [int(b) for b in args.batches.split(",")], args.calls)
    if args.train_arch:
        rows.append(training(args.train_arch, args.train_batch, args.calls))
    return rows


def require_keras_hub(parser: argparse.ArgumentParser, needs: str | None = None):
    """keras_hub, for a comparison on TensorFlow (with the model class `needs`, if given); else `parser.error`."""
    if keras.backend.backend() != "tensorflow":
        parser.error(f"the comparison runs on TensorFlow (the backend is {keras.backend.backend()!r})")
    try:
        import keras_hub
    except ImportError:
        parser.error("keras-hub is not installed: pip install keras-hub (see README, Benchmarks)")
    if needs is not None and not hasattr(keras_hub.models, needs):
        parser.error(f"keras-hub {keras_hub.__version__} has no {needs}")
    return keras_hub


def main(argv: list[str] | None = None) -> int:
    parser = case_parser("python -m benchmarks.paired", __doc__.split("\n\n")[0], "keras-hub/keras_vit", "1.1")
    args = parser.parse_args(argv)
    keras_hub = require_keras_hub(parser)
    cpu, isa = _cpu()
    print(f"CPU: {cpu}; ISA: {', '.join(isa)}; {os.cpu_count()} CPUs; keras {keras.__version__}, "
          f"keras-hub {keras_hub.__version__}; {args.calls} alternating calls per case")
    rows = run_cases(args, measure_inference, measure_training)
    print("\n| case | keras_vit (ms) | keras-hub (ms) | keras-hub / keras_vit | keras_vit faster in |")
    print("|---|---:|---:|---:|---|")
    failed = False
    for row in rows:
        ratio = row["keras_hub"] / row["keras_vit"]
        failed |= args.check is not None and ratio < args.check
        print(f"| {row['case']} | {row['keras_vit']:.2f} | {row['keras_hub']:.2f} | {ratio:.3f}x | "
              f"{row['faster']} pairs |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
