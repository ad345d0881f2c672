"""keras-vit-tflite: a keras_vit classifier as LiteRT (`.tflite`) files in four modes, each checked
against the Keras model on real images; prints the report.

    keras-vit-tflite --model vit.keras --out exports/tflite [--images DIR | --dataset digits]
"""

from __future__ import annotations

import argparse
from typing import Sequence

from keras_vit import cli
from keras_vit.cli import common

# keras_vit.export's ALL_MODES and data.DATASETS, spelled here so that --help needs no TensorFlow (a test
# checks that they agree).
MODES = ("float32", "float16", "dynamic_int8", "int8")
DATASETS = ("digits", "photos")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-vit-tflite", description=__doc__.split("\n\n")[0])
    common.add_model_arguments(parser)
    parser.add_argument("--out", required=True, help="output directory for .tflite files and the report")
    images = parser.add_mutually_exclusive_group()
    images.add_argument("--images", help="directory of real images for calibration and checks")
    images.add_argument("--dataset", choices=DATASETS, default="digits",
                        help="embedded real images when no --images (default: digits)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    cli.require("keras-vit-tflite", "export")
    from keras_vit.export import tflite

    model = common.model_from_args(parser, args)
    report = tflite.export_tflite(model, args.out, dataset=args.images or args.dataset, modes=args.modes)
    print(tflite.markdown_report(report))
    return 0 if all(result["passed"] for result in report["modes"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
