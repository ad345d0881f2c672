"""keras_vit's CPU kernels against its portable ops on this machine: one process, the same weights, calls interleaved.

    python -m benchmarks.kernel_choice [--arch B/16] [--batches 1,16] [--train-arch Ti/16] [--train-batch 32]
                                       [--calls 10] [--check 1.0]

`benchmarks.run --impls keras_vit,keras_vit_portable` times the two in separate processes, minutes apart: on a
machine whose speed drifts (a shared VM) that can measure the drift. Here one process builds two models with the
same weights, one traced with `KERAS_VIT_KERNELS=portable` and one with the machine's choice (`kernels.machine_choice`,
its cache cleared in between), and calls them alternately, so that noise hits both alike: `predict_on_batch` at each
batch size (with the largest output difference) and `train_on_batch` (with the first step's losses). `--check R`
exits 1 if the chosen kernels are slower than R times the portable ops in any case (TensorFlow backend only).
"""

from __future__ import annotations

import contextlib
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.cases import ARCHS  # noqa: E402
from benchmarks.paired import alternate, case_parser, compiled_model, images, medians, run_cases  # noqa: E402
from benchmarks.run import _cpu  # noqa: E402
from benchmarks.worker import randomize_head  # noqa: E402
from keras_vit import kernels  # noqa: E402


@contextlib.contextmanager
def _kernels(portable: bool):
    """The machine's choice (or the portable ops) for the models traced inside."""
    saved = os.environ.pop(kernels.ENV_SWITCH, None)
    if portable:
        os.environ[kernels.ENV_SWITCH] = "portable"
    kernels.machine_choice.cache_clear()
    try:
        yield
    finally:
        os.environ.pop(kernels.ENV_SWITCH, None)
        if saved is not None:
            os.environ[kernels.ENV_SWITCH] = saved
        kernels.machine_choice.cache_clear()


def _model(arch: str, train: bool) -> keras.Model:
    return randomize_head(compiled_model("keras_vit", arch, train), seed=1, stddev=0.05)


def measure_inference(arch: str, batches: list[int], n: int) -> list[dict]:
    inputs = {batch: images(arch, batch) for batch in batches}
    models, outputs = {}, {}
    for name in ("portable", "chosen"):
        with _kernels(portable=name == "portable"):
            models[name] = _model(arch, train=False)
            for batch, x in inputs.items():  # each batch size traced now, under this choice
                outputs[name, batch] = np.asarray(models[name].predict_on_batch(x))
    rows = []
    for batch, x in inputs.items():
        calls = {name: (lambda m=model: m.predict_on_batch(x)) for name, model in models.items()}
        times = medians(alternate(calls, n))
        difference = float(np.abs(outputs["chosen", batch] - outputs["portable", batch]).max())
        rows.append({"case": f"{arch} predict_on_batch, batch {batch}", **times,
                     "check": f"largest logit difference {difference:.2e}"})
    return rows


def measure_training(arch: str, batch: int, n: int) -> dict:
    x = images(arch, batch)
    y = np.random.default_rng(2).integers(0, ARCHS[arch]["classes"], batch)
    models, losses = {}, {}
    for name in ("portable", "chosen"):
        with _kernels(portable=name == "portable"):
            models[name] = _model(arch, train=True)
            losses[name] = float(models[name].train_on_batch(x, y))  # traced now, under this choice
    calls = {name: (lambda m=model: m.train_on_batch(x, y)) for name, model in models.items()}
    times = medians(alternate(calls, n))
    return {"case": f"{arch} train_on_batch, batch {batch}", **times,
            "check": f"first-step loss {losses['chosen']:.6f} (chosen), {losses['portable']:.6f} (portable)"}


def main(argv: list[str] | None = None) -> int:
    parser = case_parser("python -m benchmarks.kernel_choice", __doc__.split("\n\n")[0],
                         "portable/chosen", "1.0: never slower")
    args = parser.parse_args(argv)
    if keras.backend.backend() != "tensorflow":
        parser.error(f"the CPU kernels are TensorFlow's (the backend is {keras.backend.backend()!r})")
    cpu, isa = _cpu()
    with _kernels(portable=False):
        choice = kernels.machine_choice()
    print(f"CPU: {cpu}; ISA: {', '.join(isa)}; {os.cpu_count()} CPUs; keras {keras.__version__}; "
          f"{args.calls} alternating calls per case")
    print(f"keras_vit's choice here: {choice}")
    rows = run_cases(args, measure_inference, measure_training)
    print("\n| case | chosen kernels (ms) | portable ops (ms) | portable / chosen | check |")
    print("|---|---:|---:|---:|---|")
    failed = False
    for row in rows:
        ratio = row["portable"] / row["chosen"]
        failed |= args.check is not None and ratio < args.check
        print(f"| {row['case']} | {row['chosen']:.2f} | {row['portable']:.2f} | {ratio:.3f}x | {row['check']} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
