"""keras-vit-export: a keras_vit classifier as a TF Serving SavedModel, `OUT/<version>/`, written atomically.

    keras-vit-export --model vit.keras --out /models/vit [--version N] [--overwrite]
    keras-vit-export --variant B/16 --weights vit.weights.h5 --out /models/vit
    keras-vit-export --variant B/16 --weights imagenet --any-size --out /models/vit
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from keras_vit import cli
from keras_vit.cli import common

# keras_vit.export.serving's defaults, spelled here so that --help needs no TensorFlow (a test checks that
# they agree).
DEFAULT_MAX_PIXELS = 40_000_000
DEFAULT_MAX_BATCH = 256


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-vit-export", description=__doc__.split("\n\n")[0])
    common.add_model_arguments(parser)
    parser.add_argument("--class-names", help="text file with one class name per line, in class order")
    parser.add_argument("--out", required=True, help="base directory; the export goes to OUT/<version>/")
    parser.add_argument("--version", type=int, help="version number (default: next free)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing version")
    parser.add_argument("--top-k", type=int, default=5, help="classes/scores returned per image (default: 5)")
    parser.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                        help="largest height*width per image; larger ones are refused with INVALID_ARGUMENT "
                             f"before decoding (default: {DEFAULT_MAX_PIXELS:,})")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                        help=f"most images per request (default: {DEFAULT_MAX_BATCH})")
    parser.add_argument("--any-size", action="store_true",
                        help="build --variant for any input size (instead of --image-size): serving_default then "
                             "takes images at their own size, multiples of the patch stride, without resizing (a "
                             ".keras model built with input_shape=(None, None, 3) is exported so by itself)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.any_size and not args.variant:
        parser.error("--any-size builds a --variant; a .keras model keeps the input shape it was built with.")
    cli.require("keras-vit-export", "export")
    from keras_vit.export import saved_model, serving

    model = common.model_from_args(parser, args, input_shape=(None, None, 3) if args.any_size else None)
    class_names = Path(args.class_names).read_text(encoding="utf-8").splitlines() if args.class_names else None
    path = saved_model.export_saved_model(model, args.out, version=args.version, overwrite=args.overwrite,
                                          top_k=args.top_k, class_names=class_names, max_pixels=args.max_pixels,
                                          max_batch=args.max_batch)
    print(f"Wrote SavedModel {path} (signatures: serving_default, {serving.BYTES_SIGNATURE}).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
