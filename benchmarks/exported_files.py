"""Full-size models through `keras-vit-export --format onnx | openvino`, checked on JPEG-decoded photographs.

    python -m benchmarks.exported_files --out DIR [--models b16,r50_b16,dinov2] [--formats onnx,openvino]
                                        [--dinov2-folder FOLDER]
    python -m benchmarks.exported_files --make-dinov2 FOLDER   (needs transformers and torch)

Each model is exported by the command line as a user runs it, in its own process, and the written file is then run
in its runtime (ONNX Runtime, OpenVINO's CPU plugin in float32) beside the Keras model it came from:

- `b16`, `r50_b16`: ViT-B/16 and R50+ViT-B/16 at 224 px with random weights and a random 1000-class head
  (`worker.randomize_head`), saved as `.keras` and exported with `--model`; read their top-1 agreement with the
  classes the Keras model predicts;
- `dinov2`: a transformers `Dinov2Model` folder of DINOv2-B/14's size (`--make-dinov2` writes one with random
  weights and dinov2-base's processor), exported with `--weights FOLDER --any-size`: the pooled embedding, the
  height and width dynamic; its agreement is 1 - cos.

The photographs: the 128 crops of scikit-learn's two JPEG photos the int8 checks use (`export.data.photos`,
decoded by PIL) at the model's size, and this repository's four JPEG photos (tests/data/families/photo*.jpg)
decoded and fitted as the serving signature does (`export.data.directory`); the any-size model also takes the four
photos at a second and a third size (a portrait and a landscape grid) through the same file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHOTO_FOLDER = os.path.join(REPO, "tests", "data", "families")
MODELS = ("b16", "r50_b16", "dinov2")
FORMATS = ("onnx", "openvino")
VARIANTS = {"b16": "B/16", "r50_b16": "R50+B/16"}
ANY_SIZES = ((224, 224), (322, 238), (196, 378))  # (height, width), multiples of DINOv2's 14-pixel patches
# DINOv2-B/14 as facebook/dinov2-base declares it (config.json and preprocessor_config.json).
DINOV2_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                   patch_size=14, image_size=518, layerscale_value=1.0, layer_norm_eps=1e-6, hidden_act="gelu")
DINOV2_PROCESSOR = {"crop_size": {"height": 224, "width": 224}, "do_center_crop": True, "do_convert_rgb": True,
                    "do_normalize": True, "do_rescale": True, "do_resize": True,
                    "image_mean": [0.485, 0.456, 0.406], "image_processor_type": "BitImageProcessor",
                    "image_std": [0.229, 0.224, 0.225], "resample": 3, "rescale_factor": 1 / 255,
                    "size": {"shortest_edge": 256}}


def make_dinov2(folder: str) -> None:
    """Writes a random `Dinov2Model` of DINOv2-B/14's size, and dinov2-base's processor file, to `folder`."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Dinov2Model(transformers.Dinov2Config(**DINOV2_BASE)).eval()
    model.save_pretrained(folder)
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump(DINOV2_PROCESSOR, f, indent=2)


def export(name: str, fmt: str, source: list[str], out: str) -> dict:
    """Runs keras-vit-export for one model and format; (seconds, its last output line, the version folder)."""
    command = [sys.executable, "-m", "keras_vit.cli.export", *source, "--out", os.path.join(out, f"{name}_{fmt}"),
               "--format", fmt, "--version", "1", "--overwrite"]  # a rerun into the same --out replaces version 1
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    folder = os.path.join(out, f"{name}_{fmt}", "1")
    return {"command": "keras-vit-export " + " ".join(command[3:]), "export_seconds": round(seconds, 1),
            "output": done.stdout.strip().splitlines()[-1], "folder": folder}


def keras_model(name: str, out: str, dinov2_folder: str | None):
    """The Keras model of `name` and keras-vit-export's arguments for it (b16 and r50_b16 are saved first)."""
    import keras_vit
    from benchmarks import worker
    from keras_vit import model_files

    if name == "dinov2":  # built by the function keras-vit-export builds it with: a tower, pooled as its file says
        return model_files.load_or_build(None, weights=dinov2_folder, input_shape=(None, None, 3)), [
            "--weights", dinov2_folder, "--any-size"]
    model = worker.randomize_head(keras_vit.VisionTransformer(VARIANTS[name], weights=None, classes=1000))
    path = os.path.join(out, f"{name}.keras")
    model.save(path)
    return model, ["--model", path]


def photographs(sizes) -> dict:
    """{label: [0, 255] pixels} of the JPEG photographs at each of `sizes`."""
    from keras_vit.export import data

    batches = {}
    for size in sizes:
        batches[f"128 crops at {size[0]}x{size[1]}"] = data.photos(tuple(size), count=128)
        batches[f"4 JPEGs at {size[0]}x{size[1]}"] = data.directory(PHOTO_FOLDER, tuple(size))
    return batches


def check(run, pixel_model, batches: dict, classifier: bool) -> list[dict]:
    """Each batch through `run` (the runtime) and the Keras `pixel_model`, 16 images at a time."""
    import numpy as np

    from benchmarks.runtimes import _batched
    from keras_vit.export import precision

    rows = []
    for label, images in batches.items():
        want = precision.outputs(pixel_model, images)  # float64, (images, features)
        ours = _batched(run, images).astype(np.float64).reshape(want.shape)
        row = {"images": label, "max_abs_diff": float(np.abs(ours - want).max()),
               "max_relative_diff": float(np.abs(ours - want).max() / max(1.0, np.abs(want).max()))}
        if classifier:
            row["top1_agreement"] = float(np.mean(ours.argmax(-1) == want.argmax(-1)))
        else:
            cos = (ours * want).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(want, axis=-1)
            row["max_one_minus_cos"] = float((1 - cos).max())
        rows.append(row)
    return rows


def markdown(results: list[dict]) -> str:
    lines = ["| model | format | export s | images | max abs diff | max rel diff | top-1 agreement / max 1 - cos |",
             "|---|---|---:|---|---:|---:|---:|"]
    for result in results:
        for row in result["checks"]:
            agreement = (f"{100 * row['top1_agreement']:.1f}%" if "top1_agreement" in row
                         else f"{row['max_one_minus_cos']:.1e}")
            lines.append(f"| {result['model']} | {result['format']} | {result['export_seconds']} | {row['images']} | "
                         f"{row['max_abs_diff']:.2e} | {row['max_relative_diff']:.2e} | {agreement} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.exported_files", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the models, the exported files and results.json")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--dinov2-folder", help="a Dinov2Model folder (made by --make-dinov2) for the dinov2 model")
    parser.add_argument("--make-dinov2", metavar="FOLDER", help="write a random DINOv2-B/14 folder and stop")
    args = parser.parse_args(argv)
    if args.make_dinov2:
        make_dinov2(args.make_dinov2)
        return
    models, formats = args.models.split(","), args.formats.split(",")
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(formats) - set(FORMATS))
    if unknown or not args.out:
        parser.error(f"Expected --out, models of {MODELS} and formats of {FORMATS}. Received: {unknown or 'no --out'}")
    if "dinov2" in models and not args.dinov2_folder:
        parser.error("the dinov2 model needs --dinov2-folder (write one with --make-dinov2 FOLDER)")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    from benchmarks.runtimes import runner
    from keras_vit import features
    from keras_vit.export import model_io, runtime_files

    os.makedirs(args.out, exist_ok=True)
    results = []
    for name in models:
        model, source = keras_model(name, args.out, args.dinov2_folder)
        pixel_model, _ = runtime_files.pixel_model_and_spec(model)
        sizes = ANY_SIZES if name == "dinov2" else [model_io.image_size(model)]
        batches = photographs(sizes)
        for fmt in formats:
            result = {"model": name, "format": fmt, **export(name, fmt, source, args.out)}
            path = os.path.join(result["folder"], "model.onnx" if fmt == "onnx" else "model.xml")
            run = runner(f"{fmt}_fp32", path, threads=os.cpu_count())
            result["checks"] = check(run, pixel_model, batches, features.classifier_head(model) is not None)
            results.append(result)
            print(markdown([result]), flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(markdown(results))


if __name__ == "__main__":
    main()
