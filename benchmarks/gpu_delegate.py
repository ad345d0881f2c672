"""The LiteRT GPU-delegate check of each family's float files, as written and in the form before the GPU tracing.

    python -m benchmarks.gpu_delegate [--out DIR] [--families hf_vit_256,...]

For each family (a plain ViT and an R+ViT hybrid built tiny here, and every image-model folder of
tests/data/families: transformers and timm files of ViT, DeiT, CLIP, SigLIP, DINOv2 with and without registers,
DINOv3 and EVA-02), the float32 and float16 LiteRT files are converted twice: as `keras-vit-tflite` writes them
(traced for the GPU delegate, `tflite_conversion.conversion_source(gpu_delegate=True)`), and in the form the int8
modes use (`gpu_delegate=False`: q k^T as BATCH_MATMUL with `adj_y`, what every float file was before the GPU
tracing). Each file gets `export.litert_file.gpu_delegate_pitfalls` (every op on the delegate's list
`GPU_DELEGATE_OPS`; BATCH_MATMUL transpose flags, BROADCAST_TO, GATHER_ND, tensors of rank 5 or more, sizes known
only at run time) and TensorFlow's own `tf.lite.experimental.Analyzer(gpu_compatibility=True)` verdict
(`export.litert_file.gpu_analyzer_verdict`); and the int8 file (`int8`, the integer-only one) the ops that take or give
float32 tensors, which an integer-only NPU would reject. A static check of the files, not a run on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILY_FOLDER = os.path.join(REPO, "tests", "data", "families")
TINY = dict(patch_size=8, hidden_dim=48, mlp_dim=96, num_heads=3, num_layers=2, classes=10)
BUILT = {"plain_vit_32": dict(TINY, input_shape=(32, 32, 3)),
         "hybrid_r_vit_32": dict(TINY, patch_size=1, num_layers=1, resnet_stages=(1, 1), input_shape=(32, 32, 3))}


def families() -> list[str]:
    """The built families, then every folder of tests/data/families that keras-vit-tflite converts."""
    folders = sorted(name for name in os.listdir(FAMILY_FOLDER) if os.path.isdir(os.path.join(FAMILY_FOLDER, name)))
    return [*BUILT, *(name for name in folders if "naflex" not in name)]


def model_of(family: str):
    import keras_vit
    from keras_vit import model_files

    if family in BUILT:
        return keras_vit.VisionTransformer(weights=None, **BUILT[family])
    return model_files.load_or_build(None, weights=os.path.join(FAMILY_FOLDER, family))


def check_family(family: str, out: str) -> list[dict]:
    """The rows of one family: float32 and float16, as written and before the GPU tracing; then int8's float ops."""
    from keras_vit.export import data, litert_file, model_io, tflite, tflite_conversion

    model = model_of(family)
    rows = []
    for traced in (True, False):
        with tflite_conversion.conversion_source(model, gpu_delegate=traced) as source:
            for mode in ("float32", "float16"):
                path = os.path.join(out, f"{family}_{mode}_{'gpu' if traced else 'before'}.tflite")
                tflite.convert(model, path, mode, source=source)
                rows.append({"family": family, "file": mode, "form": "as written" if traced else "before",
                             "pitfalls": litert_file.gpu_delegate_pitfalls(path),
                             "analyzer": litert_file.gpu_analyzer_verdict(path) or "not available"})
    calibration = data.photos(model_io.image_size(model), count=8)
    path = os.path.join(out, f"{family}_int8.tflite")
    tflite.convert(model, path, "int8", calibration=calibration)
    rows.append({"family": family, "file": "int8", "form": "as written", "float_ops": litert_file.float_ops(path)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| family | file | form | GPU-delegate pitfalls | TF GPU analyzer | float ops (int8 file) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        pitfalls = ", ".join(f"{name} {count}" for name, count in row.get("pitfalls", {}).items()) or "none"
        if row["file"] == "int8":
            lines.append(f"| {row['family']} | int8 | {row['form']} | | | {', '.join(row['float_ops']) or 'none'} |")
        else:
            lines.append(f"| {row['family']} | {row['file']} | {row['form']} | {pitfalls} | {row['analyzer']} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_delegate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the files (default: a temporary one, removed)")
    parser.add_argument("--families", help=f"comma-separated (default: all of {', '.join(families())})")
    args = parser.parse_args(argv)
    chosen = args.families.split(",") if args.families else families()
    unknown = sorted(set(chosen) - set(families()))
    if unknown:
        parser.error(f"unknown families {unknown}. Expected some of {families()}")
    rows = []
    with contextlib.ExitStack() as stack:
        out = args.out or stack.enter_context(tempfile.TemporaryDirectory())
        os.makedirs(out, exist_ok=True)
        for family in chosen:
            rows.extend(check_family(family, out))
            print(markdown(rows[-5:]).split("\n", 2)[2], flush=True)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
