"""Exports a keras_vit classifier to LiteRT (`.tflite`) in six modes and checks each one.

    keras-vit-tflite --model vit.keras --out exports/tflite [--images DIR | --dataset digits] [--max-top1-drop 1]

(`python -m export.tflite` in a clone; the command line is `keras_vit/cli/tflite.py`.)

Modes: `float32`; `float16` (float16 weights); `dynamic_int8` (int8 weights, float activations); `mixed_int8` (int8
weights and calibrated int8 activations in every matmul and convolution, float32 LayerNorm, softmax, GELU and
attention products, float32 pixels in and probabilities out: every op on XNNPACK, the CPU mode); `int8` (full
integer: every op int8, uint8 pixels in and uint8 probabilities out, for integer-only accelerators; K and V on
symmetric ranges, so that XNNPACK runs the attention products); `int8_cpu` (`int8` with its softmax and GELU in
float32, which XNNPACK runs, as LiteRT's int8 ones run single-threaded outside it: the fastest CPU mode). The
calibrated modes are calibrated on real images.
All use TFLite built-in ops only. Each file is run with the LiteRT interpreter (`ai_edge_litert`) on held-out real
images and compared with the Keras model; the report (`report.json`, `report.md`) gives size, latency at 1 and 2
threads, the ops that run outside the interpreter's default delegate (XNNPACK), max abs difference, top-1 agreement
and, where the images have labels, top-1 accuracy. An int8 mode whose top-1 drop (100 x (1 - agreement), in points)
is over `max_top1_drop` is not written: the report marks it refused, names the tensors that TensorFlow's
quantization debugger finds most perturbed, and `export_tflite` raises `Top1DropError`.

How each mode is converted (the converter's settings, the int8 quantizations) is `export.tflite_conversion`; what a
written file holds (its ops and their dtypes, what LiteRT's GPU delegate would not take) is `export.litert_file`.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import math
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf
from ai_edge_litert.interpreter import Interpreter

from keras_vit import datasets, features
from keras_vit.atomic import DiskSpaceError, atomic_write, check_room

from . import ALL_MODES, data, model_io, precision
from .litert_file import GPU_DELEGATE_PITFALLS, float_ops, gpu_analyzer_verdict, gpu_review, non_builtin_ops, ops
from .tflite_conversion import (GPU_DELEGATE_MODES, INT8_CPU_FLOAT_OPS, MIXED_INT8_OPS, available_modes,
                                conversion_source, convert, sensitive_layers)

# Max abs difference of the probabilities allowed per mode; the int8 modes are held to `max_top1_drop` instead.
MAX_ABS_DIFF = {"float32": 1e-4, "float16": 1e-2}
INT8_MODES = ("dynamic_int8", "mixed_int8", "int8", "int8_cpu")
# Bytes a weight takes in each mode's file, for the room a conversion needs: mixed_int8 at most all float32.
BYTES_PER_WEIGHT = {"float32": 4, "float16": 2, "mixed_int8": 4, "dynamic_int8": 1, "int8": 1, "int8_cpu": 1}
DEFAULT_MAX_TOP1_DROP = precision.DEFAULT_MAX_TOP1_DROP  # points of top-1 an int8 mode may lose
Top1DropError = precision.Top1DropError  # an int8 mode lost more; raised with the written report as `report`


def outside_delegates(interpreter: Interpreter) -> tuple[dict[str, int], int]:
    """({op name: count} of the ops that run outside every delegate, the number of delegate partitions) of an
    interpreter after `allocate_tensors()`.

    `_get_ops_details()` (private; raises AttributeError where it is gone) then lists the model's ops followed by
    one DELEGATE node per partition, not the execution plan. As every op leads to an output (the converter drops
    the others), an op runs outside the delegates exactly when a tensor that the plan needs (a model output, or an
    input of a delegate or of an op outside) comes from it.
    """
    nodes = interpreter._get_ops_details()
    delegates = [node for node in nodes if node["op_name"] == "DELEGATE"]
    from_delegates = {tensor for node in delegates for tensor in node["outputs"]}
    producer = {tensor: node for node in nodes if node["op_name"] != "DELEGATE" for tensor in node["outputs"]}
    needed = [output["index"] for output in interpreter.get_output_details()]
    needed += [tensor for node in delegates for tensor in node["inputs"]]
    outside = {}
    while needed:
        tensor = needed.pop()
        node = None if tensor in from_delegates else producer.get(tensor)
        if node is not None and node["index"] not in outside:
            outside[node["index"]] = node["op_name"]
            needed.extend(node["inputs"])
    counts = collections.Counter(outside.values())
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0]))), len(delegates)


def op_coverage(path: str | os.PathLike, interpreter: Interpreter) -> dict[str, Any]:
    """`ops_total` of a `.tflite` file, and `ops_outside_delegate` ({name: count}) and `delegate_partitions` of
    `interpreter` (running it, allocated), both None where the interpreter cannot tell."""
    try:
        outside, partitions = outside_delegates(interpreter)
    except Exception:  # A private method: gone or changed, the coverage is unknown; the export goes on.
        outside, partitions = None, None
    return {"ops_total": len(ops(path)), "ops_outside_delegate": outside, "delegate_partitions": partitions}


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


def evaluate(path: str | os.PathLike, mode: str, reference: np.ndarray, images: np.ndarray, *,
             labels: np.ndarray | None = None, max_top1_drop: float = DEFAULT_MAX_TOP1_DROP,
             classifier: bool = True) -> dict[str, Any]:
    """Size, op coverage, latency (1 and 2 threads) and agreement of a `.tflite` file with the Keras outputs
    `reference` on `images` (and top-1 accuracy on `labels`, if given); an int8 mode of a `classifier` whose top-1
    drop is over `max_top1_drop` points is `refused`. A tower's embedding has no top-1 (its largest entry is no
    class): its files are reported by the least cosine with Keras' embeddings, the top-1 fields None."""
    run = LiteRTClassifier(path)
    outputs, seconds = [], []
    for image in images:
        start = time.perf_counter()
        outputs.append(run(image))
        seconds.append(time.perf_counter() - start)
    outputs = np.stack(outputs)
    one_thread = 1000 * float(np.median(seconds))
    two_threads = median_latency_ms(path, images[:LATENCY_IMAGES], num_threads=2)
    check = precision.agreement(reference.reshape(len(images), -1), outputs.reshape(len(images), -1), max_top1_drop,
                                classifier=classifier)
    has_top1 = "top1_agreement" in check
    result = {
        "mode": mode,
        "file": Path(path).name,
        "size_bytes": os.path.getsize(path),
        **op_coverage(path, run.interpreter),
        "latency_ms_median": one_thread,
        "latency_ms_median_by_threads": {"1": one_thread, "2": two_threads},
        "max_abs_diff": float(np.abs(outputs - reference).max()),
        "mean_abs_diff": float(np.abs(outputs - reference).mean()),
        "min_cosine": check["min_cosine"],
        "top1_agreement": check.get("top1_agreement"),
        "top1_drop": check.get("top1_drop"),
        "top1_accuracy": float(np.mean(outputs.argmax(-1) == labels)) if labels is not None and has_top1 else None,
        "images": len(images),
        "reference_classes_predicted": int(len(np.unique(reference.argmax(-1)))) if has_top1 else None,
        "non_builtin_ops": non_builtin_ops(path),
        "float_ops": float_ops(path),
        **(_gpu_check(path) if mode in GPU_DELEGATE_MODES else
           {"gpu_delegate_pitfalls": None, "gpu_delegate_problems": None, "gpu_analyzer": None}),
    }
    result["refused"] = mode in INT8_MODES and check["refused"]
    result["sensitive_layers"] = None  # ranked by `export_tflite` for a refused mode only: the debugger is slow
    result["passed"] = _passed(result)
    return result


def _gpu_check(path: str | os.PathLike) -> dict[str, Any]:
    """A float file's GPU-delegate check: `gpu_delegate_pitfalls`, the ops the delegate would not take
    (`gpu_delegate_problems`), and TensorFlow's analyzer's verdict (`gpu_analyzer_verdict`)."""
    review = gpu_review(path)  # the file read once for both
    return {"gpu_delegate_pitfalls": review.pitfalls(), "gpu_delegate_problems": review.problems(),
            "gpu_analyzer": gpu_analyzer_verdict(path)}


def _passed(result: dict[str, Any]) -> bool:
    mode = result["mode"]
    ok = not result["non_builtin_ops"] and not result["refused"]
    if mode in MAX_ABS_DIFF:
        ok = ok and result["max_abs_diff"] <= MAX_ABS_DIFF[mode]
    return ok


def split_indices(count: int, calibration_count: int, evaluation_count: int,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint random calibration and evaluation indices into `count` images."""
    if count < 2:
        raise ValueError(f"Expected at least 2 images (calibration and evaluation). Received {count}.")
    order = np.random.default_rng(seed).permutation(count)
    calibration_count = min(calibration_count, count // 2)
    return order[:calibration_count], order[calibration_count:calibration_count + evaluation_count]


def _load_images(model: keras.Model, images: np.ndarray | None, labels: np.ndarray | None,
                 dataset: str | os.PathLike) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(images, labels or None, source name) of `export_tflite`'s arguments."""
    size = model_io.image_size(model)
    if images is not None:
        images, source = np.asarray(images, np.float32), "given"
    elif labels is not None:
        raise ValueError("Expected labels only with images: a dataset brings its own labels (the digits) or none.")
    else:
        transform = model_io.preprocessing_config(model).resize_arguments
        images = data.load(dataset, size, transform)
        source = "directory" if os.path.isdir(str(dataset)) else str(dataset)
        labels = datasets.digits("all")[1] if source == "digits" else None  # data.digits' order
    if images.shape[1:] != (*size, 3):
        raise ValueError(f"Expected images of shape (count, {size[0]}, {size[1]}, 3). Received {images.shape}.")
    if labels is not None and len(labels) != len(images):
        raise ValueError(f"Expected one label per image ({len(images)}). Received {len(labels)}.")
    return images, None if labels is None else np.asarray(labels), source


def _export_mode(model: keras.Model, source: str, out: Path, mode: str, calibration: np.ndarray,
                 reference: np.ndarray, evaluation: np.ndarray, labels: np.ndarray | None,
                 max_top1_drop: float, classifier: bool) -> dict[str, Any]:
    """Converts (from `source`, the model's `conversion_source`) and evaluates (`evaluate`, of a `classifier` or a
    tower) one mode in a hidden file of `out`, moved into place unless refused (then an older file of that name is
    removed: the folder holds what its report says)."""
    final = out / f"{model.name}_{mode}.tflite"
    handle, partial = tempfile.mkstemp(dir=out, prefix=f".{final.name}.", suffix=".partial")
    os.close(handle)
    try:
        try:
            convert(model, partial, mode, calibration, source=source)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            raise DiskSpaceError(errno.ENOSPC, f"The disk filled up while {final.name} was written in {out}. It was "
                                 "not written and the files there before are whole: free some space and convert "
                                 "again") from None
        result = evaluate(partial, mode, reference, evaluation, labels=labels, max_top1_drop=max_top1_drop,
                          classifier=classifier)
        if result["refused"]:
            final.unlink(missing_ok=True)
        else:
            os.replace(partial, final)
    finally:
        Path(partial).unlink(missing_ok=True)
    result["file"] = None if result["refused"] else final.name
    if result["refused"]:
        try:
            result["sensitive_layers"] = sensitive_layers(model, calibration, mode=mode, source=source)
        except Exception as error:  # A diagnosis only: its failure must not hide the refusal.
            result["sensitive_layers_error"] = f"{type(error).__name__}: {' '.join(str(error).split())}"
    return result


def export_tflite(model: keras.Model, out_dir: str | os.PathLike, *, images: np.ndarray | None = None,
                  labels: np.ndarray | None = None, dataset: str | os.PathLike = "digits",
                  modes: Sequence[str] | None = None, calibration_count: int = 200, evaluation_count: int = 400,
                  max_top1_drop: float = DEFAULT_MAX_TOP1_DROP) -> dict[str, Any]:
    """Writes one `.tflite` file per mode and `report.json` / `report.md` into `out_dir`; returns the report.

    Args:
        model: a keras_vit classifier.
        out_dir: output directory (created if needed).
        images: optional float32 (count, height, width, 3) pixels in [0, 255] at the model size.
            Defaults to images loaded from `dataset`.
        labels: optional int class of each of `images`, for top-1 accuracy. `dataset="digits"` brings its own.
        dataset: "digits", "photos" or a directory of images, used when `images` is None.
        modes: the modes to write. Defaults to `available_modes()`: all of `ALL_MODES` (less `mixed_int8`, with
            a warning, where TensorFlow has no quantization debugger).
        calibration_count, evaluation_count: images used to calibrate mixed_int8, int8 and int8_cpu, and to
            evaluate.
        max_top1_drop: float. The most top-1 agreement with the Keras model, in points (100 x (1 - agreement)),
            that an int8 mode may lose on the evaluation images. Defaults to `DEFAULT_MAX_TOP1_DROP` (1.0).

    Raises:
        Top1DropError: after writing the other modes and the report, if an int8 mode was over `max_top1_drop`
            (that mode's file is not written, and an older one of its name is removed).
    """
    available = available_modes()
    if modes is None:
        modes = available
        if modes != ALL_MODES:
            warnings.warn(f"Writing {', '.join(modes)}: mixed_int8 needs tf.lite.experimental.QuantizationDebugger, "
                          f"which TensorFlow {tf.__version__} lacks.", stacklevel=2)
    unknown = [mode for mode in modes if mode not in ALL_MODES]
    if unknown:
        raise ValueError(f"Unknown TFLite modes {unknown}. Expected a subset of {ALL_MODES}.")
    unavailable = [mode for mode in modes if mode not in available]
    if unavailable:
        raise ValueError(f"TensorFlow {tf.__version__} cannot write {unavailable}: mixed_int8 needs "
                         f"tf.lite.experimental.QuantizationDebugger. Expected a subset of {available}.")
    precision.check_max_top1_drop(max_top1_drop)
    check_room({str(out_dir): files_bytes(model, modes)}, "the LiteRT files")
    images, labels, source = _load_images(model, images, labels, dataset)
    calibration_index, evaluation_index = split_indices(len(images), calibration_count, evaluation_count)
    calibration, evaluation = images[calibration_index], images[evaluation_index]
    evaluation_labels = None if labels is None else labels[evaluation_index]
    reference = model_io.with_pixel_input(model).predict(evaluation, verbose=0, batch_size=32)
    classifier = features.classifier_head(model) is not None  # a tower's embedding has no top-1
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:  # one SavedModel for the float modes and one for the int8 modes
        sources = {}
        for gpu_form in sorted({mode in GPU_DELEGATE_MODES for mode in modes}):
            sources[gpu_form] = stack.enter_context(conversion_source(model, gpu_delegate=gpu_form))
        results = [_export_mode(model, sources[mode in GPU_DELEGATE_MODES], out, mode, calibration, reference,
                                evaluation, evaluation_labels, max_top1_drop, classifier) for mode in modes]
    report = {"model": model.name, "input_size": list(model_io.image_size(model)),
              "calibration_images": len(calibration),
              "images": {"source": source, "yours": source in ("given", "directory")},
              "keras_top1_accuracy": (None if evaluation_labels is None or not classifier
                                      else float(np.mean(reference.argmax(-1) == evaluation_labels))),
              "thresholds": {"max_abs_diff": MAX_ABS_DIFF, "max_top1_drop": max_top1_drop},
              "modes": results}
    for name, text in (("report.json", json.dumps(report, indent=2) + "\n"), ("report.md", markdown_report(report))):
        with atomic_write(out / name) as partial:
            Path(partial).write_text(text, encoding="utf-8")
    refused = [result for result in results if result["refused"]]
    if refused:
        raise Top1DropError("Refused " + "; ".join(_refusal(result, max_top1_drop) for result in refused) + ".",
                            report)
    return report


def files_bytes(model: keras.Model, modes: Sequence[str]) -> int:
    """About the bytes of the LiteRT files of `modes` and their report: each mode's weights at its width."""
    parameters = sum(math.prod(variable.shape) for variable in model.weights)
    return sum(parameters * BYTES_PER_WEIGHT[mode] for mode in modes) + 2 ** 20


def _refusal(result: dict[str, Any], max_top1_drop: float) -> str:
    """One line: the refused mode, its drop, the limit and the most sensitive layers."""
    layers = ", ".join(f"{layer['tensor']} ({layer['op']}, {layer['rmse_over_scale']:.3g})"
                       for layer in result["sensitive_layers"] or [])
    if "sensitive_layers_error" in result:
        layers = f"unknown ({result['sensitive_layers_error']})"
    return (f"{result['mode']}: top-1 drop of {result['top1_drop']:.2f} points on {result['images']} held-out "
            f"images is over max_top1_drop={max_top1_drop:g}, so it was not written; most sensitive layers "
            f"(quantization debugger, RMSE / scale): {layers or 'none found'}")


def markdown_report(report: dict[str, Any]) -> str:
    """The report as a Markdown table."""
    accuracy = report.get("keras_top1_accuracy") is not None
    lines = [f"# TFLite export of `{report['model']}` ({report['input_size'][0]}x{report['input_size'][1]})", "",
             f"Compared with the Keras model on {report['modes'][0]['images']} held-out images; mixed_int8, int8 and "
             f"int8_cpu calibrated on {report['calibration_images']} others. Latency: median per image with the LiteRT "
             f"interpreter's default delegate (XNNPACK), 1 thread over every image, 2 threads over the first "
             f"{LATENCY_IMAGES}. Outside XNNPACK: the ops that the interpreter runs itself, and the number of "
             "XNNPACK partitions.", "",
             "| mode | size (KiB) | latency, 1 thread (ms) | latency, 2 threads (ms) | outside XNNPACK | max abs diff "
             "| top-1 agreement |" + (" top-1 accuracy |" if accuracy else "") + " check |",
             "|---|---:|---:|---:|---|---:|---:|" + ("---:|" if accuracy else "") + "---|"]
    for r in report["modes"]:
        two = r["latency_ms_median_by_threads"]["2"]
        agreement = (f"{100 * r['top1_agreement']:.1f}%" if r["top1_agreement"] is not None
                     else f"n/a (least cosine {r['min_cosine']:.4f})")
        lines.append(f"| {r['mode']} | {r['size_bytes'] / 1024:.1f} | {r['latency_ms_median']:.3f} | {two:.3f} | "
                     f"{_coverage_text(r)} | {r['max_abs_diff']:.2e} | {agreement} |"
                     + (f" {100 * r['top1_accuracy']:.1f}% |" if accuracy else "")
                     + f" {_check_text(r, report['thresholds'])} |")
    lines.append("")
    first = report["modes"][0]
    predicted = first["reference_classes_predicted"]
    if predicted is None:
        lines.append("The model is a tower (its output an embedding, no classes): each file is reported by the least "
                     "cosine of its embeddings with Keras', and no int8 file is refused on a top-1.")
    else:
        lines.append(f"The Keras model predicts {predicted} distinct classes on these images"
                     + ("; top-1 agreement means little here." if predicted < 2 else "."))
    if accuracy:
        lines.append(f"The Keras model's top-1 accuracy on these images is {100 * report['keras_top1_accuracy']:.1f}%.")
    if not report.get("images", {}).get("yours", True):
        lines.append(f"These checks ran on the embedded `{report['images']['source']}` images, not on images of your "
                     "model's domain: they show that each file agrees with the Keras model on those images, not that "
                     "it keeps its accuracy on yours (nor were the int8 modes calibrated on them). Pass --images DIR "
                     "(your own held-out images) for that.")
    for r in report["modes"]:
        if r["mode"] == "int8" and r["float_ops"]:
            lines.append(f"Full int8 keeps these built-in ops in float32: {', '.join(r['float_ops'])}.")
        if r["mode"] == "mixed_int8":
            lines.append(f"mixed_int8 runs {', '.join(MIXED_INT8_OPS)} in int8 and every other op in float32.")
        if r["mode"] == "int8_cpu":
            lines.append(f"int8_cpu runs {', '.join(INT8_CPU_FLOAT_OPS)} in float32 (on XNNPACK) and every other op "
                         "in int8.")
        if r["refused"]:
            lines.append(f"Refused {_refusal(r, report['thresholds']['max_top1_drop'])}.")
        if r.get("gpu_delegate_pitfalls") is not None:
            lines.append(_gpu_text(r))
    return "\n".join(lines) + "\n"


def _gpu_text(result: dict[str, Any]) -> str:
    """The GPU-delegate check of a float file in one line (a check of the file, not a run on a GPU)."""
    analyzer = result.get("gpu_analyzer")
    said = ("TensorFlow's GPU analyzer was not available" if analyzer is None else
            f"TensorFlow's GPU analyzer: {analyzer}")
    pitfalls = result["gpu_delegate_pitfalls"]
    if not pitfalls:
        return (f"{result['mode']} for LiteRT's GPU delegate: every op on its list, no known pitfall; {said} (a check "
                "of the file, not a run on a GPU).")
    found = "; ".join(f"{GPU_DELEGATE_PITFALLS[name]}: {count}" for name, count in pitfalls.items())
    problems = result.get("gpu_delegate_problems")
    named = f" ({'; '.join(problems)})" if problems else ""
    return (f"Not for LiteRT's GPU delegate as it is: {result['mode']} has {found}{named}; {said} (a check of the "
            "file, not a run on a GPU).")


def _coverage_text(result: dict[str, Any]) -> str:
    """E.g. "3 of 90 (UNPACK 2, STRIDED_SLICE 1); 4 partitions"."""
    outside = result["ops_outside_delegate"]
    if outside is None:
        return f"unknown (of {result['ops_total']})"
    listed = f" ({', '.join(f'{name} {count}' for name, count in outside.items())})" if outside else ""
    return f"{sum(outside.values())} of {result['ops_total']}{listed}; {result['delegate_partitions']} partitions"


def _check_text(result: dict[str, Any], thresholds: dict[str, Any]) -> str:
    mode = result["mode"]
    if mode in MAX_ABS_DIFF:
        rule = f"max diff <= {MAX_ABS_DIFF[mode]:g}"
    elif result["top1_drop"] is None:
        rule = "a tower: reported, not judged"
    else:
        rule = f"top-1 drop <= {thresholds['max_top1_drop']:.1f} points"
    verdict = "REFUSED, not written" if result["refused"] else "PASS" if result["passed"] else "FAIL"
    return f"{verdict} ({rule}, built-in ops only)"
