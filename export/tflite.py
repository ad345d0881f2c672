"""Exports a keras_vit classifier to LiteRT (`.tflite`) in four modes and checks each one.

    keras-vit-tflite --model vit.keras --out exports/tflite [--images DIR | --dataset digits]

(`python -m export.tflite` in a clone; the command line is `keras_vit/cli/tflite.py`.)

Modes: `float32`; `float16` (float16 weights); `dynamic_int8` (int8 weights, float activations);
`int8` (full integer: int8 weights and activations, uint8 pixels in and uint8 probabilities out,
calibrated on real images). All use TFLite built-in ops only. Each file is run with the LiteRT
interpreter (`ai_edge_litert`) on held-out real images and compared with the Keras model; the
report (`report.json`, `report.md`) gives size, latency at 1 and 2 threads, max abs difference and top-1
agreement.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import keras
import numpy as np
import tensorflow as tf
from ai_edge_litert.interpreter import Interpreter

from . import ALL_MODES, data, model_io

# Max abs difference of the probabilities allowed per mode; int8 modes are judged by top-1 agreement.
MAX_ABS_DIFF = {"float32": 1e-4, "float16": 1e-2}
MIN_TOP1_AGREEMENT = {"int8": 0.98}


def converter_options(mode: str, calibration: np.ndarray | None = None) -> dict[str, Any]:
    """TFLiteConverter settings for `mode`: attributes, and `target_spec` attributes."""
    builtins = {"supported_ops": [tf.lite.OpsSet.TFLITE_BUILTINS]}
    if mode == "float32":
        return {"target_spec": builtins}
    if mode == "float16":
        return {"optimizations": [tf.lite.Optimize.DEFAULT],
                "target_spec": {**builtins, "supported_types": [tf.float16]}}
    if mode == "dynamic_int8":
        return {"optimizations": [tf.lite.Optimize.DEFAULT], "target_spec": builtins}
    if mode == "int8":
        if calibration is None or not len(calibration):
            raise ValueError("Full int8 quantization needs calibration images. Received none.")

        def representative_dataset() -> Iterator[list[np.ndarray]]:
            for image in calibration:
                yield [image[np.newaxis].astype(np.float32)]

        return {"optimizations": [tf.lite.Optimize.DEFAULT], "representative_dataset": representative_dataset,
                "target_spec": {"supported_ops": [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]},
                "inference_input_type": tf.uint8, "inference_output_type": tf.uint8}
    raise ValueError(f"Unknown TFLite mode {mode!r}. Expected one of {ALL_MODES}.")


def convert(model: keras.Model, path: str | os.PathLike, mode: str,
            calibration: np.ndarray | None = None) -> Path:
    """Writes `model` (taking [0, 255] pixels, batch 1) as a `.tflite` file in `mode`."""
    pixel_model = model_io.with_pixel_input(model)
    height, width = model_io.image_size(model)
    # Keras' ExportArchive to a SavedModel, then TensorFlow's converter: what `Model.export(format="litert")`
    # does from Keras 3.12, on every Keras release this package supports.
    with tempfile.TemporaryDirectory() as saved_model_dir:
        archive = keras.export.ExportArchive()
        archive.track(pixel_model)
        archive.add_endpoint("serve", functools.partial(pixel_model.__call__, training=False),
                             input_signature=[tf.TensorSpec((1, height, width, 3), tf.float32, name="image")])
        archive.write_out(saved_model_dir, verbose=False)
        converter = tf.lite.TFLiteConverter.from_saved_model(saved_model_dir)
        converter.experimental_enable_resource_variables = True
        for option, value in converter_options(mode, calibration).items():
            if option == "target_spec":
                for attribute, setting in value.items():
                    setattr(converter.target_spec, attribute, setting)
            else:
                setattr(converter, option, value)
        flatbuffer = converter.convert()
    Path(path).write_bytes(flatbuffer)
    return Path(path)


def _ops(path: str | os.PathLike) -> list[tuple[str, list[str]]]:
    """(op name, input dtype names) of every op in a `.tflite` file."""
    interpreter = Interpreter(model_path=str(path))
    dtypes = {tensor["index"]: tensor["dtype"].__name__ for tensor in interpreter.get_tensor_details()}
    # `_get_ops_details` is the interpreter's only op listing.
    return [(op["op_name"], [dtypes[i] for i in op["inputs"] if i >= 0]) for op in interpreter._get_ops_details()]


def non_builtin_ops(path: str | os.PathLike) -> list[str]:
    """Ops of a `.tflite` file that are not TFLite built-ins (Flex / custom ops)."""
    return sorted({name for name, _ in _ops(path) if name.startswith("Flex") or name == "CUSTOM"})


def float_ops(path: str | os.PathLike) -> list[str]:
    """Compute ops that take float32 tensors (besides the (de)quantize ops at their edges)."""
    return sorted({name for name, inputs in _ops(path)
                   if "float32" in inputs and name not in ("QUANTIZE", "DEQUANTIZE")})


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


def evaluate(path: str | os.PathLike, mode: str, reference: np.ndarray, images: np.ndarray) -> dict[str, Any]:
    """Size, latency (1 and 2 threads) and agreement of a `.tflite` file with the Keras outputs `reference` on
    `images`."""
    classifier = LiteRTClassifier(path)
    outputs, seconds = [], []
    for image in images:
        start = time.perf_counter()
        outputs.append(classifier(image))
        seconds.append(time.perf_counter() - start)
    outputs = np.stack(outputs)
    one_thread = 1000 * float(np.median(seconds))
    two_threads = median_latency_ms(path, images[:LATENCY_IMAGES], num_threads=2)
    result = {
        "mode": mode,
        "file": Path(path).name,
        "size_bytes": os.path.getsize(path),
        "latency_ms_median": one_thread,
        "latency_ms_median_by_threads": {"1": one_thread, "2": two_threads},
        "max_abs_diff": float(np.abs(outputs - reference).max()),
        "mean_abs_diff": float(np.abs(outputs - reference).mean()),
        "top1_agreement": float(np.mean(outputs.argmax(-1) == reference.argmax(-1))),
        "images": len(images),
        "reference_classes_predicted": int(len(np.unique(reference.argmax(-1)))),
        "non_builtin_ops": non_builtin_ops(path),
        "float_ops": float_ops(path),
    }
    result["passed"] = _passed(result)
    return result


def _passed(result: dict[str, Any]) -> bool:
    mode = result["mode"]
    ok = not result["non_builtin_ops"]
    if mode in MAX_ABS_DIFF:
        ok = ok and result["max_abs_diff"] <= MAX_ABS_DIFF[mode]
    if mode in MIN_TOP1_AGREEMENT:
        ok = ok and result["top1_agreement"] >= MIN_TOP1_AGREEMENT[mode]
    return ok


def split_images(images: np.ndarray, calibration_count: int, evaluation_count: int,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint random calibration and evaluation subsets of `images`."""
    if len(images) < 2:
        raise ValueError(f"Expected at least 2 images (calibration and evaluation). Received {len(images)}.")
    order = np.random.default_rng(seed).permutation(len(images))
    calibration_count = min(calibration_count, len(images) // 2)
    evaluation = order[calibration_count:calibration_count + evaluation_count]
    return images[order[:calibration_count]], images[evaluation]


def export_tflite(model: keras.Model, out_dir: str | os.PathLike, *, images: np.ndarray | None = None,
                  dataset: str | os.PathLike = "digits", modes: Sequence[str] = ALL_MODES,
                  calibration_count: int = 200, evaluation_count: int = 400) -> dict[str, Any]:
    """Writes one `.tflite` file per mode and `report.json` / `report.md` into `out_dir`; returns the report.

    Args:
        model: a keras_vit classifier.
        out_dir: output directory (created if needed).
        images: optional float32 (count, height, width, 3) pixels in [0, 255] at the model size.
            Defaults to images loaded from `dataset`.
        dataset: "digits", "photos" or a directory of images, used when `images` is None.
        modes: the modes to write. Defaults to all of `ALL_MODES`.
        calibration_count, evaluation_count: images used to calibrate full int8 and to evaluate.
    """
    unknown = [mode for mode in modes if mode not in ALL_MODES]
    if unknown:
        raise ValueError(f"Unknown TFLite modes {unknown}. Expected a subset of {ALL_MODES}.")
    size = model_io.image_size(model)
    transform = model_io.resize_transform(model_io.input_fields(model))
    source = "given" if images is not None else "directory" if os.path.isdir(str(dataset)) else str(dataset)
    images = data.load(dataset, size, transform) if images is None else np.asarray(images, np.float32)
    if images.shape[1:] != (*size, 3):
        raise ValueError(f"Expected images of shape (count, {size[0]}, {size[1]}, 3). Received {images.shape}.")
    calibration, evaluation = split_images(images, calibration_count, evaluation_count)
    reference = model_io.with_pixel_input(model).predict(evaluation, verbose=0, batch_size=32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for mode in modes:
        path = convert(model, out / f"{model.name}_{mode}.tflite", mode, calibration)
        results.append(evaluate(path, mode, reference, evaluation))
    report = {"model": model.name, "input_size": list(size), "calibration_images": len(calibration),
              "images": {"source": source, "yours": source in ("given", "directory")},
              "thresholds": {"max_abs_diff": MAX_ABS_DIFF, "min_top1_agreement": MIN_TOP1_AGREEMENT},
              "modes": results}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(markdown_report(report), encoding="utf-8")
    return report


def markdown_report(report: dict[str, Any]) -> str:
    """The report as a Markdown table."""
    lines = [f"# TFLite export of `{report['model']}` ({report['input_size'][0]}x{report['input_size'][1]})", "",
             f"Compared with the Keras model on {report['modes'][0]['images']} held-out images; full int8 "
             f"calibrated on {report['calibration_images']} others. Latency: median per image with the LiteRT "
             f"interpreter's default delegate (XNNPACK), 1 thread over every image, 2 threads over the first "
             f"{LATENCY_IMAGES}.", "",
             "| mode | size (KiB) | latency, 1 thread (ms) | latency, 2 threads (ms) | max abs diff | top-1 agreement "
             "| check |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in report["modes"]:
        check = _check_text(r)
        two = r["latency_ms_median_by_threads"]["2"]
        lines.append(f"| {r['mode']} | {r['size_bytes'] / 1024:.1f} | {r['latency_ms_median']:.3f} | {two:.3f} | "
                     f"{r['max_abs_diff']:.2e} | {100 * r['top1_agreement']:.1f}% | {check} |")
    lines.append("")
    first = report["modes"][0]
    predicted = first["reference_classes_predicted"]
    lines.append(f"The Keras model predicts {predicted} distinct classes on these images"
                 + ("; top-1 agreement means little here." if predicted < 2 else "."))
    if not report.get("images", {}).get("yours", True):
        lines.append(f"These checks ran on the embedded `{report['images']['source']}` images, not on images of your "
                     "model's domain: they show that each file agrees with the Keras model on those images, not that "
                     "it keeps its accuracy on yours (nor was full int8 calibrated on them). Pass --images DIR "
                     "(your own held-out images) for that.")
    for r in report["modes"]:
        if r["mode"] == "int8" and r["float_ops"]:
            lines.append(f"Full int8 keeps these built-in ops in float32: {', '.join(r['float_ops'])}.")
    return "\n".join(lines) + "\n"


def _check_text(result: dict[str, Any]) -> str:
    mode = result["mode"]
    if mode in MAX_ABS_DIFF:
        rule = f"max diff <= {MAX_ABS_DIFF[mode]:g}"
    elif mode in MIN_TOP1_AGREEMENT:
        rule = f"top-1 >= {100 * MIN_TOP1_AGREEMENT[mode]:g}%"
    else:
        rule = "reported only"
    return f"{'PASS' if result['passed'] else 'FAIL'} ({rule}, built-in ops only)"


if __name__ == "__main__":  # `python -m export.tflite` in a clone: the `keras-vit-tflite` command.
    from keras_vit.cli.tflite import main

    raise SystemExit(main())
