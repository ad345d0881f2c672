"""LiteRT latency of keras_vit against keras-hub's ViT, per export mode, side by side in one run.

    python -m benchmarks.litert [--archs Ti/16,B/16] [--impls keras_vit,keras_hub]
                                [--modes float32,dynamic_int8,mixed_int8,int8,int8_cpu] [--rounds 5] [--images 4]

Both models are built from `benchmarks.cases.ARCHS` with random weights (keras_vit's zero-initialised head drawn
like keras-hub's) and converted alike: Keras' ExportArchive, then TensorFlow's converter with the settings of
`keras_vit.export.tflite` (`mixed_int8` by its selective quantization), the calibrated int8 modes calibrated on the
same 16 photo crops. Each file runs in LiteRT's interpreter with its default delegate (XNNPACK) at 1 and 2
threads; the timed images are interleaved over `--rounds` rounds (every file and thread count in each round), and
the median of all per-image times is reported, with the ops outside XNNPACK.

Random weights have no accuracy: the table gives each file's top-1 agreement with its Keras model on 32 other
photo crops (and how many distinct classes the Keras model predicts there, which says whether that agreement
means anything) and its largest logit error in units of the logits' standard deviation. keras-hub is optional:
without it, its rows are skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks import worker  # noqa: E402
from benchmarks.cases import ARCHS  # noqa: E402
from keras_vit.export import data, tflite  # noqa: E402

MODES = ("float32", "dynamic_int8", "mixed_int8", "int8", "int8_cpu")
CALIBRATION, CHECK = 16, 32  # photo crops that calibrate the int8 modes, and others that check every file


def build(impl: str, arch: str) -> keras.Model:
    """A classifier with random weights taking [-1, 1] images; keras_vit's head is drawn as keras-hub's."""
    model = worker.KERAS_BUILDERS[impl](arch, train=False)
    if impl == "keras_vit":
        head = model.get_layer("head")
        head.kernel.assign(keras.initializers.GlorotUniform(seed=0)(head.kernel.shape))
    return model


def check(path: Path, reference: np.ndarray, images: np.ndarray) -> dict:
    classifier = tflite.LiteRTClassifier(path)
    outputs = np.stack([classifier(image) for image in images])
    error = np.abs(outputs - reference).max() / reference.std()
    return {"top1_agreement": float(np.mean(outputs.argmax(-1) == reference.argmax(-1))),
            "classes_predicted": int(len(np.unique(reference.argmax(-1)))),
            "max_logit_error_over_std": float(error),
            **tflite.op_coverage(path, classifier.interpreter)}


def time_files(files: dict, images: np.ndarray, rounds: int) -> dict:
    """{key: {threads: median ms}} of every file, interleaved: each round times every file at 1 and 2 threads."""
    classifiers = {(key, threads): tflite.LiteRTClassifier(path, num_threads=threads)
                   for key, path in files.items() for threads in (1, 2)}
    for classifier in classifiers.values():
        classifier(images[0])  # warm-up
    seconds = {name: [] for name in classifiers}
    for _ in range(rounds):
        for name, classifier in classifiers.items():
            for image in images:
                start = time.perf_counter()
                classifier(image)
                seconds[name].append(time.perf_counter() - start)
    medians = {}
    for (key, threads), values in seconds.items():
        medians.setdefault(key, {})[threads] = 1000 * float(np.median(values))
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.litert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="Ti/16,B/16")
    parser.add_argument("--impls", default="keras_vit,keras_hub")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, default=4, help="images timed per file, thread count and round")
    parser.add_argument("--out", default=None, help="folder for the files and results.json (default: a temp one)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    impls = []
    for impl in args.impls.split(","):
        try:
            if impl == "keras_hub":
                import keras_hub  # noqa: F401
            impls.append(impl)
        except ImportError:
            print(f"note: {impl} is not installed; its rows are skipped (pip install keras-hub)")
    out = Path(args.out or tempfile.mkdtemp(prefix="litert_bench_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; TensorFlow {tf.__version__}, "
          f"Keras {keras.__version__}; files in {out}")
    results = []
    for arch in args.archs.split(","):
        size = (ARCHS[arch]["image"],) * 2
        photos = data.photos(size, count=CALIBRATION + CHECK, seed=0) / 127.5 - 1.0
        calibration, images = photos[:CALIBRATION].astype("float32"), photos[CALIBRATION:].astype("float32")
        files, checks = {}, {}
        for impl in impls:
            keras.utils.set_random_seed(0)
            model = build(impl, arch)
            reference = model.predict(images, verbose=0, batch_size=8)
            for mode in modes:
                start = time.perf_counter()
                path = tflite.convert(model, out / f"{impl}_{arch.replace('/', '')}_{mode}.tflite", mode, calibration,
                                      pixel_input=False)
                checks[impl, mode] = {**check(path, reference, images), "size_mb": path.stat().st_size / 2**20,
                                      "convert_s": time.perf_counter() - start}
                files[impl, mode] = path
                print(f"{arch} {impl} {mode}: converted in {checks[impl, mode]['convert_s']:.0f} s", flush=True)
        latency = time_files(files, images[:args.images], args.rounds)
        for (impl, mode), result in checks.items():
            float_ms = latency[impl, "float32"] if (impl, "float32") in latency else None
            results.append({"arch": arch, "impl": impl, "mode": mode, **result,
                            "ms": latency[impl, mode],
                            "speedup_over_float32": None if float_ms is None else
                            {t: float_ms[t] / latency[impl, mode][t] for t in (1, 2)}})
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print("| arch | impl | mode | 1 thread (ms) | 2 threads (ms) | x float32 (1 / 2 threads) | outside XNNPACK "
          "| top-1 agreement (classes) | max logit error / std | size (MB) |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|---:|")
    for r in results:
        outside = r["ops_outside_delegate"]
        outside_text = "unknown" if outside is None else f"{sum(outside.values())} of {r['ops_total']}"
        speedup = r["speedup_over_float32"]
        speedup_text = "" if speedup is None else f"{speedup[1]:.2f}x / {speedup[2]:.2f}x"
        print(f"| {r['arch']} | {r['impl']} | {r['mode']} | {r['ms'][1]:.1f} | {r['ms'][2]:.1f} | {speedup_text} | "
              f"{outside_text} | {100 * r['top1_agreement']:.0f}% ({r['classes_predicted']}) | "
              f"{r['max_logit_error_over_std']:.3f} | {r['size_mb']:.1f} |")


if __name__ == "__main__":
    main()
