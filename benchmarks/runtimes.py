"""One keras_vit model in each runtime it is deployed on, in float32 and in its reduced form, side by side in one run.

    python -m benchmarks.runtimes [--arch B/16] [--batches 1,16] [--rounds 2] [--runs 5] [--threads 2]
                                  [--forms savedmodel_fp32,onnx_fp32,...]

The model (random weights and a random head, as `benchmarks.serving`'s) is written by keras_vit's own exporters,
each file taking [0, 255] pixels at the model's size with the preprocessing inside and giving probabilities:

- `savedmodel_fp32`, `savedmodel_bf16`: `export_saved_model` (`precision="bfloat16"`: bfloat16 weights and layers),
  run through TF1's loader (`serving_default`), as TF Serving runs it; `savedmodel_int8`: the model after Keras'
  `model.quantize("int8")` (int8 weights of every projection, activations quantized per row at run time), written by
  the same `export_saved_model`;
- `onnx_fp32`: `export_onnx`, in ONNX Runtime; `onnx_int8`: that file through ONNX Runtime's post-training
  `quantize_dynamic` (`onnx_file.quantize_in_place`, as `--precision int8` writes it: int8 weights, activations
  quantized at run time); `onnx_int8_static`: that file through `quantize_static` (`onnx_file.quantize_static_in_place`,
  as `--precision int8_static` writes it: QDQ, uint8 activations calibrated on the photo crops the command uses);
- `openvino_fp32`, `openvino_default`: `export_openvino`, compiled in float32 and at the CPU's default precision
  (bfloat16 on CPUs with AVX512-BF16 or AMX); `openvino_int8`: that file through NNCF's post-training quantization
  (`openvino_file.quantize_in_place`, as `--precision int8` writes it), compiled at the CPU's default precision;
- `litert_fp32`, `litert_dynamic_int8`: `keras_vit.export.tflite_conversion.convert`, in LiteRT's interpreter
  (XNNPACK). Its files take batch 1: a batch of 16 is 16 calls;
- `keras_hub_onnx_fp32`: keras-hub's `ViTBackbone` of the same size with a Dense head on its class token (as
  `benchmarks.run` builds it), the same [0, 255] -> [-1, 1] rescaling before it and softmax after, written by Keras'
  own `model.export(format="onnx")`, in ONNX Runtime; its agreement is with keras-hub's own Keras model (needs
  keras-hub).

Each form runs in a fresh process per round with `--threads` threads, the forms interleaved within every round,
and times `--runs` calls per batch size after one warm-up; the median is reported. Each form's top-1 agreement
with the Keras float32 model on 64 photo crops, and its largest probability difference, are measured in the same
process (random weights: read the agreement with the classes the Keras model predicts there).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import shutil
import sys
import tempfile
import time

RESULT_PREFIX = "RUNTIME_RESULT "
# form: (runtime, precision)
FORM_KINDS = {"savedmodel_fp32": ("savedmodel", "fp32"), "savedmodel_bf16": ("savedmodel", "bf16"),
              "savedmodel_int8": ("savedmodel", "int8"), "onnx_fp32": ("onnx", "fp32"), "onnx_int8": ("onnx", "int8"),
              "onnx_int8_static": ("onnx", "int8_static"), "openvino_fp32": ("openvino", "fp32"),
              "openvino_default": ("openvino", "default"),
              "openvino_int8": ("openvino", "int8"), "litert_fp32": ("litert", "fp32"),
              "litert_dynamic_int8": ("litert", "dynamic_int8"), "keras_hub_onnx_fp32": ("onnx", "keras_hub")}
FORMS = tuple(FORM_KINDS)
CHECK_IMAGES = 64


def write_files(arch: str, out: str, forms: list[str]) -> tuple[dict[str, str], str]:
    """Writes each form's file of `arch` into `out`, and the check images with the Keras model's probabilities;
    returns ({form: path}, the images' .npz)."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import numpy as np

    from benchmarks import worker
    from keras_vit.export import (data, model_io, onnx_file, openvino_file, runtime_files, saved_model,
                                  tflite_conversion)

    import keras
    keras.utils.set_random_seed(0)  # the same random model in every run (its agreements differed from run to run)
    model = worker.randomize_head(worker._keras_vit_model(arch, train=False, served=True))
    images = data.photos(model_io.image_size(model), count=CHECK_IMAGES, seed=5)
    references = {"keras_vit": _batched(lambda batch: model(batch, training=False), images)}
    paths, written = {}, {}
    # savedmodel_int8 last: Keras' quantize changes the model in place.
    for form in sorted(forms, key=lambda name: name == "savedmodel_int8"):
        kind, precision = FORM_KINDS[form]
        if kind == "savedmodel":
            if precision == "int8":
                model.quantize("int8")
            paths[form] = str(saved_model.export_saved_model(
                model, os.path.join(out, form), version=1, precision="bfloat16" if precision == "bf16" else "float32",
                max_top1_drop=100.0))  # random weights: measured here, not gated
        elif precision == "keras_hub":
            hub_model = _served_keras_hub_model(arch)
            references["keras_hub"] = _batched(lambda batch: hub_model(batch, training=False), images)
            paths[form] = os.path.join(out, "keras_hub.onnx")
            hub_model.export(paths[form], format="onnx", verbose=False)
        elif kind == "onnx":
            if kind not in written:
                written[kind] = str(onnx_file.export_onnx(model, os.path.join(out, kind)) / onnx_file.ONNX_FILE)
            paths[form] = written[kind]
            if precision in onnx_file.INT8_METHODS:  # what `keras-vit-export --format onnx --precision ...` writes
                paths[form] = os.path.join(out, kind, f"model_{precision}.onnx")
                shutil.copyfile(written[kind], paths[form])
                if precision == "int8":
                    onnx_file.quantize_in_place(paths[form])
                else:
                    onnx_file.quantize_static_in_place(paths[form], runtime_files.calibration_images(model, None)[0])
        elif kind == "openvino":
            if kind not in written:
                written[kind] = str(openvino_file.export_openvino(model, os.path.join(out, kind))
                                    / openvino_file.XML_FILE)
            paths[form] = written[kind]
            if precision == "int8":  # what `keras-vit-export --format openvino --precision int8` writes
                import openvino
                folder = os.path.join(out, form)
                os.makedirs(folder)
                for name in (openvino_file.XML_FILE, "model.bin"):
                    shutil.copyfile(os.path.join(os.path.dirname(written[kind]), name), os.path.join(folder, name))
                paths[form] = os.path.join(folder, openvino_file.XML_FILE)
                openvino_file.quantize_in_place(openvino.Core(), paths[form],
                                                runtime_files.calibration_images(model, None)[0])
        else:
            paths[form] = str(tflite_conversion.convert(model, os.path.join(out, f"{form}.tflite"),
                                                        "float32" if precision == "fp32" else precision))
    checks = os.path.join(out, "checks.npz")
    np.savez(checks, images=images, **references)
    return {form: paths[form] for form in forms}, checks


def _batched(predict, images):
    """`predict`'s outputs on `images`, 16 at a time (the Keras references and every form's check alike)."""
    import numpy as np
    return np.concatenate([np.asarray(predict(images[i:i + 16])) for i in range(0, len(images), 16)])


def _served_keras_hub_model(arch: str):
    """keras-hub's ViT of `arch` (`benchmarks.worker`'s) as keras_vit's file serves: [0, 255] pixels in, probabilities
    out; called once, as Keras' ONNX export needs."""
    import keras
    from benchmarks import worker
    logits_model = worker._keras_hub_model(arch, train=False)
    pixels = keras.Input(logits_model.input_shape[1:])
    scaled = keras.layers.Rescaling(1 / 127.5, offset=-1.0)(pixels)
    model = keras.Model(pixels, keras.layers.Softmax(dtype="float32")(logits_model(scaled)))
    model(keras.ops.zeros((1, *logits_model.input_shape[1:])))
    return model


def runner(form: str, path: str, threads: int):
    """One batch of [0, 255] pixels -> probabilities, in `form`'s runtime with `threads` threads."""
    import numpy as np

    kind = FORM_KINDS[form][0]
    if kind == "savedmodel":
        import tensorflow as tf
        graph = tf.Graph()
        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=1)
        session = tf.compat.v1.Session(graph=graph, config=config)
        with graph.as_default():
            signature = tf.compat.v1.saved_model.loader.load(session, ["serve"], path).signature_def[
                "serving_default"]
        (given,) = signature.inputs.values()
        fetch = signature.outputs["probabilities"].name
        return lambda batch: session.run(fetch, {given.name: batch})
    if kind == "onnx":
        import onnxruntime
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda batch: session.run(None, {name: batch})[0]
    if kind == "openvino":
        import openvino
        config = {"INFERENCE_NUM_THREADS": threads}
        if form == "openvino_fp32":
            config["INFERENCE_PRECISION_HINT"] = "f32"
        compiled = openvino.Core().compile_model(path, "CPU", config)
        return lambda batch: compiled(batch)[0]
    from keras_vit.export.tflite import LiteRTClassifier
    classifier = LiteRTClassifier(path, num_threads=threads)
    return lambda batch: np.stack([classifier(image) for image in batch])


def run_form(form: str, path: str, checks: str, batches: list[int], runs: int, threads: int) -> dict:
    """Agreement on the check images, then the median ms of `runs` calls per batch size."""
    import numpy as np

    predict = runner(form, path, threads)
    with np.load(checks) as arrays:
        images = arrays["images"]
        reference = arrays["keras_hub" if FORM_KINDS[form][1] == "keras_hub" else "keras_vit"]
    outputs = _batched(predict, images)
    result = {"top1_agreement": float(np.mean(outputs.argmax(-1) == reference.argmax(-1))),
              "max_abs_diff": float(np.abs(outputs - reference).max()),
              "classes_predicted": int(len(np.unique(reference.argmax(-1))))}
    for batch in batches:
        pixels = np.resize(images, (batch, *images.shape[1:])).astype("float32")
        predict(pixels)
        seconds = []
        for _ in range(runs):
            start = time.perf_counter()
            predict(pixels)
            seconds.append(time.perf_counter() - start)
        result[f"bs{batch}"] = 1000 * statistics.median(seconds)
    return result


def _megabytes(path: str) -> float:
    """A file's size, or a SavedModel folder's; an OpenVINO `.xml` with its `.bin`."""
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path)
                   for name in names) / 2**20
    files = [path] + ([path[:-4] + ".bin"] if path.endswith(".xml") else [])
    return sum(os.path.getsize(name) for name in files) / 2**20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.runtimes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="B/16")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated, of {', '.join(FORMS)}")
    parser.add_argument("--run", nargs=3, metavar=("FORM", "PATH", "CHECKS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batches = [int(batch) for batch in args.batches.split(",")]
    if args.run:
        print(RESULT_PREFIX + json.dumps(run_form(*args.run, batches, args.runs, args.threads)))
        return
    forms = args.forms.split(",")
    unknown = [form for form in forms if form not in FORMS]
    if unknown:
        parser.error(f"unknown form(s) {', '.join(unknown)}. Expected some of {', '.join(FORMS)}")
    from benchmarks.run import _cpu
    print(f"CPU: {_cpu()}; {args.threads} threads; {args.arch}; random weights", flush=True)
    out = tempfile.mkdtemp(prefix="runtimes_bench_")
    paths, checks = write_files(args.arch, out, forms)
    results, failures = collections.defaultdict(list), {}
    for round_index in range(args.rounds):
        for form in (forms if round_index % 2 == 0 else forms[::-1]):
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS=str(args.threads))
            command = [sys.executable, "-m", "benchmarks.runtimes", "--run", form, paths[form], checks,
                       "--batches", args.batches, "--runs", str(args.runs), "--threads", str(args.threads)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
            lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
            if not lines:  # The runtime refused the file (or crashed): a row that says so, and the other forms run.
                failures[form] = _last_error(done.stderr) or f"exited {done.returncode}"
                print(f"[round {round_index + 1}/{args.rounds}] {form}: failed: {failures[form]}", flush=True)
                continue
            result = json.loads(lines[0][len(RESULT_PREFIX):])
            results[form].append(result)
            print(f"[round {round_index + 1}/{args.rounds}] {form}: "
                  + ", ".join(f"bs{b} {result[f'bs{b}']:.1f} ms" for b in batches), flush=True)
    print(f"\n| form | {' | '.join(f'bs{b} (ms)' for b in batches)} | top-1 agreement with Keras | max abs prob diff "
          f"| file MB |\n|---|{'---:|' * len(batches)}---:|---:|---:|")
    for form in forms:
        if form in failures:
            print(f"| {form} | {' | '.join('failed' for _ in batches)} | {failures[form]} | | "
                  f"{_megabytes(paths[form]):.0f} |")
            continue
        first = results[form][0]
        timing = " | ".join(f"{statistics.median(r[f'bs{b}'] for r in results[form]):.1f}" for b in batches)
        print(f"| {form} | {timing} | {100 * first['top1_agreement']:.1f}% | {first['max_abs_diff']:.1e} | "
              f"{_megabytes(paths[form]):.0f} |")
    predicted = next((results[form][0]["classes_predicted"] for form in forms if results[form]), None)
    print(f"\n(the Keras model predicts {predicted} distinct classes on the {CHECK_IMAGES} check images)")


def _last_error(stderr: str) -> str:
    """The line of a failed form's stderr that says why: its last line naming an error, shortened."""
    named = [line.strip() for line in stderr.splitlines() if "Error" in line or "error" in line]
    line = (named or [""])[-1].replace("|", "/")
    return line if len(line) <= 120 else "..." + line[-120:]


if __name__ == "__main__":
    main()
