"""keras-vit-export: a keras_vit classifier as a TF Serving SavedModel, an ONNX file or an OpenVINO file, in
`OUT/<version>/`, written atomically.

    keras-vit-export --model vit.keras --out /models/vit [--version N] [--overwrite]
    keras-vit-export --model vit.keras --format onnx --out /models/vit  # OUT/<version>/model.onnx, checked
    keras-vit-export --model vit.keras --format onnx --precision int8 --out /models/vit  # ONNX Runtime's int8
    keras-vit-export --model vit.keras --format onnx --precision int8_static --calibration-images photos/ --out m
    keras-vit-export --model vit.keras --format openvino --out /models/vit  # OUT/<version>/model.xml, checked
    keras-vit-export --model vit.keras --format openvino --precision int8 --out /models/vit  # NNCF's int8
    keras-vit-export --variant B/16 --weights vit.weights.h5 --out /models/vit
    keras-vit-export --variant B/16 --weights imagenet --any-size --out /models/vit
    keras-vit-export --weights hf://facebook/dinov2-base --out /models/dinov2 --signatures embed,features
    keras-vit-export --variant B/16 --weights imagenet --out /models/vit --precision auto  # bfloat16 on AMX/AVX512-BF16
    keras-vit-export --weights siglip2_naflex/ --max-num-patches 256 --out /models/siglip2  # each image's own grid
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from keras_vit import cli
from keras_vit.cli import common

if TYPE_CHECKING:  # --help imports nothing heavy
    from keras_vit.checkpoints import naflex_file

# keras_vit.export.serving's defaults, spelled here so that --help needs no TensorFlow (a test checks that
# they agree).
DEFAULT_MAX_PIXELS = 40_000_000
DEFAULT_MAX_BATCH = 256
SIGNATURES = ("embed", "features", "explain")  # serving.EXTRA_SIGNATURES
SERVING_KERNELS = ("onednn", "eigen")  # keras_vit.kernels.SERVING_KERNELS
FORMATS = ("saved_model", "onnx", "openvino")
FILE_FORMATS = {"onnx": "ONNX", "openvino": "OpenVINO"}  # pixels in, the model's own outputs out
# The precisions of each format (keras_vit.export.precision.PRECISIONS, onnx_file.PRECISIONS,
# openvino_file.PRECISIONS).
FORMAT_PRECISIONS = {"saved_model": ("float32", "bfloat16", "auto"), "onnx": ("float32", "int8", "int8_static"),
                     "openvino": ("float32", "int8")}
CALIBRATED = {"onnx": "int8_static", "openvino": "int8"}  # the precisions --calibration-images calibrates
PRECISIONS = tuple(dict.fromkeys(name for names in FORMAT_PRECISIONS.values() for name in names))
DEFAULT_MAX_TOP1_DROP = 1.0  # keras_vit.export.precision.DEFAULT_MAX_TOP1_DROP
# The flags of the SavedModel's serving signatures, which an ONNX file (pixels in, the model's outputs out) has not.
SAVED_MODEL_ONLY = {"class_names": "--class-names", "signatures": "--signatures", "l2_normalize": "--l2-normalize"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-vit-export", description=__doc__.split("\n\n")[0])
    common.add_model_arguments(parser)
    parser.add_argument("--class-names", help="text file with one class name per line, in class order")
    parser.add_argument("--out", required=True, help="base directory; the export goes to OUT/<version>/")
    parser.add_argument("--format", choices=FORMATS, default="saved_model",
                        help="saved_model (default): TF Serving's, from encoded images; onnx: OUT/<version>/model.onnx "
                             "for ONNX Runtime (keras_vit[onnx]): float32 [0, 255] pixels at the model's size in, "
                             "the preprocessing inside, the batch dynamic (and height and width with --any-size), "
                             "checked against the Keras model before it is written; openvino: OUT/<version>/model.xml "
                             "and model.bin for OpenVINO (keras_vit[openvino]), the same input, checked likewise")
    parser.add_argument("--version", type=int, help="version number (default: next free)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing version")
    parser.add_argument("--top-k", type=int, default=5, help="classes/scores returned per image (default: 5)")
    parser.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                        help="largest height*width per image; larger ones are refused with INVALID_ARGUMENT "
                             f"before decoding (default: {DEFAULT_MAX_PIXELS:,})")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                        help=f"most images per request (default: {DEFAULT_MAX_BATCH})")
    parser.add_argument("--any-size", action="store_true",
                        help="build --variant / --weights for any input size (instead of --image-size): "
                             "serving_default then takes images at their own size, multiples of the patch stride, "
                             "without resizing (a .keras model built with input_shape=(None, None, 3) is exported so "
                             "by itself)")
    parser.add_argument("--signatures", default="",
                        help="extra signatures from encoded images, comma-separated: embed (the pooled image "
                             "embedding), features (blocks' token maps, --feature-blocks), explain (the attention "
                             "rollout at the model's size, with the top class)")
    parser.add_argument("--feature-blocks", default="-1",
                        help="blocks of the features signature, comma-separated, negative from the end "
                             "(default: -1, the last)")
    parser.add_argument("--embedding", choices=("pooled", "head"), default="pooled",
                        help="the embedding served by embed (and by a model without a head): the head's input "
                             "(default), or its output (a CLIP tower's projection, loaded as its head)")
    parser.add_argument("--l2-normalize", action="store_true",
                        help="L2-normalize the embedding (CLIP and SigLIP embeddings are compared by cosine)")
    parser.add_argument("--class-embeddings",
                        help=".npy file of (classes, D) class embeddings (e.g. a CLIP text tower's prompts): serve a "
                             "zero-shot classifier whose head is their cosine with the --embedding, times "
                             "--logit-scale, plus --logit-bias")
    parser.add_argument("--logit-scale", type=float, default=100.0,
                        help="zero-shot logit scale (default: 100, CLIP's)")
    parser.add_argument("--logit-bias", type=float, default=0.0, help="zero-shot logit bias (default: 0; SigLIP's "
                                                                      "is negative)")
    parser.add_argument("--serving-kernels", choices=SERVING_KERNELS, default="onednn",
                        help="the CPU kernels of the TensorFlow that will serve it (default: onednn, x86 TensorFlow "
                             "on CPUs with AVX512-VNNI, AVX512-BF16 or AMX); eigen for AVX2-only or ARM servers and "
                             "TF_ENABLE_ONEDNN_OPTS=0: the GELU in fewer ops, the attention head by head, a "
                             "request's images run in groups small enough for malloc to reuse their buffers. Same "
                             "outputs either way")
    parser.add_argument("--precision", choices=PRECISIONS, default="float32",
                        help="what the file computes in: float32 (default); for a SavedModel bfloat16 (weights and "
                             "layers, float32 in and out; about 2x faster on CPUs with AVX512-BF16 or AMX, slower "
                             "on others), checked against float32 on real photographs first, or auto: bfloat16 "
                             "where this machine's CPU has AVX512-BF16 or AMX, else float32; for --format onnx "
                             "int8: ONNX Runtime's dynamic quantization of the checked float32 file, or "
                             "int8_static: its static quantization, calibrated; for --format openvino int8: NNCF's "
                             "post-training quantization, calibrated; each checked on real photographs")
    parser.add_argument("--calibration-images", metavar="DIR",
                        help="for --format onnx --precision int8_static and --format openvino --precision int8: "
                             "a folder of images (jpg, png, bmp, gif; e.g. held-out images of your domain) to "
                             "calibrate the int8 file on, fitted to the model's size as its serving does (default: "
                             "128 crops of two embedded photographs)")
    parser.add_argument("--max-top1-drop", type=float, default=DEFAULT_MAX_TOP1_DROP, metavar="POINTS",
                        help="for bfloat16 and int8: the most points of top-1 agreement with the float32 model it "
                             "may lose on the check photographs, else nothing is written (default: %(default)s)")
    parser.add_argument("--max-num-patches", type=int,
                        help="SigLIP 2 NaFlex --weights only: the patch budget; each image keeps its aspect ratio, "
                             "resized inside the graph to the largest grid of at most this many patches (default: "
                             "its processor's max_num_patches, else 256)")
    return parser


def _one_of(names: Sequence[str]) -> str:
    """"a or b", "a, b or c"."""
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else list(names))


def _names(value: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in value.split(",") if name.strip())


@cli.one_line_exits("keras-vit-export", cli.NOTHING_HALF_WRITTEN)
def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.any_size and args.model:
        parser.error("--any-size builds a --variant or --weights; a .keras model keeps the input shape it was built "
                     "with.")
    if args.format in FILE_FORMATS:
        given = [flag for name, flag in SAVED_MODEL_ONLY.items() if getattr(args, name)]
        if args.embedding != "pooled" and not args.class_embeddings:
            given.append("--embedding head")  # it picks what `embed` serves; a zero-shot head still reads it
        if given:
            parser.error(f"{given[0]} shapes the SavedModel's serving signatures; --format {args.format} writes the "
                         "model's own outputs (drop the flag, or export a SavedModel).")

    if args.precision not in FORMAT_PRECISIONS[args.format]:
        takes = [f"--format {name}" for name, precisions in FORMAT_PRECISIONS.items() if args.precision in precisions]
        parser.error(f"--precision {args.precision} applies to {' and '.join(takes)}; --format {args.format} writes "
                     f"{_one_of(FORMAT_PRECISIONS[args.format])}.")
    if args.calibration_images and CALIBRATED.get(args.format) != args.precision:
        takes = " and ".join(f"--format {name} --precision {precision}" for name, precision in CALIBRATED.items())
        parser.error(f"--calibration-images calibrates {takes}; --format {args.format} --precision "
                     f"{args.precision} is not calibrated (drop the flag).")
    signatures = _names(args.signatures)
    unknown = [name for name in signatures if name not in SIGNATURES]
    if unknown:
        parser.error(f"--signatures: unknown signature {unknown[0]!r}; expected one of {', '.join(SIGNATURES)}.")
    try:
        feature_blocks = tuple(int(block) for block in _names(args.feature_blocks))
    except ValueError:
        parser.error(f"--feature-blocks: expected comma-separated ints, e.g. -1 or 3,7,11. Received: "
                     f"{args.feature_blocks!r}")
    cli.require("keras-vit-export", "export")
    from keras_vit.checkpoints import naflex_file

    naflex_weights = naflex_file.naflex_checkpoint(args.weights) if args.weights and not args.model else None
    if naflex_weights is not None:
        return _export_naflex(parser, args, signatures, naflex_weights)
    if args.max_num_patches is not None:
        parser.error("--max-num-patches is the patch budget of SigLIP 2 NaFlex weights; this model takes images "
                     "of one size (drop the flag).")
    if args.format in FILE_FORMATS:
        cli.require("keras-vit-export", args.format)
    import numpy as np

    from keras_vit import features

    model = common.model_from_args(parser, args, input_shape=(None, None, 3) if args.any_size else None)
    if args.class_embeddings:
        model = features.zero_shot_classifier(model, np.load(args.class_embeddings), source=args.embedding,
                                              logit_scale=args.logit_scale, logit_bias=args.logit_bias)
    if args.format == "onnx":
        return _write_onnx(model, args)
    if args.format == "openvino":
        return _write_openvino(model, args)
    from keras_vit.export import saved_model, serving

    class_names = Path(args.class_names).read_text(encoding="utf-8").splitlines() if args.class_names else None
    path = saved_model.export_saved_model(model, args.out, version=args.version, overwrite=args.overwrite,
                                          top_k=args.top_k, class_names=class_names, max_pixels=args.max_pixels,
                                          max_batch=args.max_batch, signatures=signatures,
                                          feature_blocks=feature_blocks, embedding=args.embedding,
                                          l2_normalize=args.l2_normalize, serving_kernels=args.serving_kernels,
                                          precision=args.precision, max_top1_drop=args.max_top1_drop)
    names = ", ".join(["serving_default", serving.BYTES_SIGNATURE, *signatures])
    print(f"Wrote SavedModel {path} (signatures: {names}; {_precision_line(saved_model.read_metadata(path))}).")
    return 0


def _precision_line(metadata: dict) -> str:
    """The export's precision, why, and for bfloat16 how it agrees with float32."""
    line = f"{metadata['precision']}, {metadata['precision_chosen']}"
    check = metadata["precision_check"]
    if check is None:
        return line
    agreement = f"top-1 agreement {100 * check['top1_agreement']:.1f}%, " if "top1_agreement" in check else ""
    return (f"{line}; against float32 on {check['images']} photographs: {agreement}least cosine "
            f"{check['min_cosine']:.4f}, max relative difference {check['max_relative_diff']:.1e}")


def _export_naflex(parser: argparse.ArgumentParser, args: argparse.Namespace, signatures: Sequence[str],
                   file: naflex_file.NaFlexFile) -> int:
    """SigLIP 2 NaFlex --weights (`file`, read once): its SavedModel from encoded images
    (`keras_vit.export.naflex_serving`); the flags of image models are refused by name."""
    if file.source == "timm":
        parser.error(f"{args.weights} is a timm NaFlexVit, whose images timm resizes with its own NaFlex transform "
                     "(ResizeToSequence: its size search, its pretrained_cfg's interpolation), which keras-vit-export "
                     "does not implement: it serves transformers' Siglip2ImageProcessor rule. The same weights "
                     "saved by transformers (Siglip2VisionModel) export; VisionTransformer(weights=...) builds this "
                     "file's model.")
    changed = [f"--{name.replace('_', '-')}" for name in ("top_k", "feature_blocks", "logit_scale", "logit_bias")
               if getattr(args, name) != parser.get_default(name)]
    head_flags = (["--class-names"] if args.class_names else []) + [flag for flag in changed
                                                                     if flag != "--feature-blocks"]
    refused = [flag for flag, given in (
        ("--variant", args.variant), ("--image-size", args.image_size), ("--classes", args.classes),
        ("--pooling", args.pooling), ("--any-size", args.any_size),
        (f"--format {args.format}", args.format in FILE_FORMATS),
        (f"--precision {args.precision}", args.precision != "float32"),
        ("--embedding head", args.embedding != "pooled"), ("--signatures explain", "explain" in signatures),
        ("--feature-blocks", "--feature-blocks" in changed)) if given]
    if refused:
        parser.error(f"{refused[0]} does not apply to SigLIP 2 NaFlex weights ({args.weights}): their SavedModel "
                     "takes encoded images, each resized to its own grid of at most --max-num-patches patches, and "
                     "serves the pooled embedding (serving_default, embed), or with --class-embeddings a zero-shot "
                     "classifier of it, and with --signatures features the tokens.")
    if head_flags and not args.class_embeddings:
        parser.error(f"{head_flags[0]} needs --class-embeddings: SigLIP 2 NaFlex weights serve their embedding, or "
                     "a zero-shot classifier of the class embeddings given.")
    from keras_vit import naflex
    from keras_vit.export import naflex_serving

    budget = args.max_num_patches
    if budget is None:
        budget = file.preprocessing.get("max_num_patches", 256)
    import numpy as np

    class_names = Path(args.class_names).read_text(encoding="utf-8").splitlines() if args.class_names else None
    class_embeddings = np.load(args.class_embeddings) if args.class_embeddings else None
    path = naflex_serving.export_naflex_saved_model(
        naflex.NaFlexViT(weights=file), args.out, max_num_patches=budget, version=args.version,
        overwrite=args.overwrite, max_pixels=args.max_pixels, max_batch=args.max_batch, signatures=signatures,
        l2_normalize=args.l2_normalize, serving_kernels=args.serving_kernels,
        class_embeddings=class_embeddings, logit_scale=args.logit_scale, logit_bias=args.logit_bias,
        top_k=args.top_k, class_names=class_names)
    names = ", ".join(naflex_serving.signature_names(signatures))
    head = "" if class_embeddings is None else (
        f"; serving_default a zero-shot classifier of {len(class_embeddings)} classes")
    print(f"Wrote SavedModel {path} (SigLIP 2 NaFlex, at most {budget} patches per image{head}; signatures: "
          f"{names}).")
    return 0


def _write_onnx(model, args: argparse.Namespace) -> int:
    from keras_vit.export import onnx_file

    path = onnx_file.export_onnx(model, args.out, version=args.version, overwrite=args.overwrite,
                                 precision=args.precision, max_top1_drop=args.max_top1_drop,
                                 calibration_images=_calibration_images(model, args))
    report = onnx_file.read_report(path)
    check = report.get("float32_check", report)  # an int8 file was checked as float32 before it was quantized
    line = (f"Wrote ONNX file {path / onnx_file.ONNX_FILE}: input {report['input']} {report['input_shape']}; ONNX "
            f"Runtime {report['onnxruntime']} agrees with Keras to {check['max_relative_diff']:.1e} (relative; "
            f"allowed {report['max_relative_diff_allowed']:g}) on {len(check['checked_shapes'])} batches")
    line += _int8_line(report, "ONNX Runtime's static quantization" if args.precision == "int8_static" else
                       "ONNX Runtime's dynamic quantization")
    print(f"{line}; {report['latency_ms_median_batch_1']:.1f} ms per image at batch 1 here.")
    return 0



def _write_openvino(model, args: argparse.Namespace) -> int:
    from keras_vit.export import openvino_file

    path = openvino_file.export_openvino(model, args.out, version=args.version, overwrite=args.overwrite,
                                         precision=args.precision, max_top1_drop=args.max_top1_drop,
                                         calibration_images=_calibration_images(model, args))
    report = openvino_file.read_report(path)
    check = report.get("float32_check", report)  # an int8 file was checked as float32 before it was quantized
    print(f"Wrote OpenVINO file {path / openvino_file.XML_FILE}: input {report['input']} {report['input_shape']}; "
          f"OpenVINO {report['openvino']} in float32 agrees with Keras to {check['max_relative_diff']:.1e} "
          f"(relative; allowed {report['max_relative_diff_allowed']:g}) on {len(check['checked_shapes'])} batches"
          f"{_int8_line(report, 'NNCF')}, {report['latency_ms_median_batch_1']:.1f} ms per image at batch 1 here; "
          f"this CPU's default precision {report['cpu_default_precision']}: "
          f"{report['cpu_default_max_relative_diff']:.1e}, {report['cpu_default_latency_ms_median_batch_1']:.1f} ms.")
    return 0


def _calibration_images(model, args: argparse.Namespace):
    """The --calibration-images folder's images, fitted to the model's size as its serving does; None without it."""
    if not args.calibration_images:
        return None
    from keras_vit.export import data, model_io

    return data.directory(args.calibration_images, model_io.image_size(model),
                          model_io.preprocessing_config(model).resize_arguments)


def _int8_line(report: dict, method: str) -> str:
    """How an int8 file agrees with Keras on the check photographs (empty for a float32 file)."""
    if "int8_check" not in report:
        return ""
    int8 = report["int8_check"]
    agreement = f"top-1 agreement {100 * int8['top1_agreement']:.1f}%, " if "top1_agreement" in int8 else ""
    calibrated = f", calibrated on {report['calibration_images']}" if "calibration_images" in report else ""
    return (f" in float32; int8 ({method}{calibrated}) against Keras on {int8['images']} photographs: "
            f"{agreement}least cosine {int8['min_cosine']:.4f}")


if __name__ == "__main__":
    raise SystemExit(main())
