"""keras-vit-tflite: a keras_vit classifier as LiteRT (`.tflite`) files in six modes, each checked
against the Keras model on real images; prints the report. An int8 mode that loses more than
--max-top1-drop points of top-1 agreement is not written, and the command exits with one line that
names it, its drop, the limit and its most sensitive layers.

    keras-vit-tflite --model vit.keras --out exports/tflite [--images DIR | --dataset digits] [--max-top1-drop 1]
"""

from __future__ import annotations

import argparse
from typing import Sequence

from keras_vit import cli
from keras_vit.cli import common

# keras_vit.export's ALL_MODES, data.DATASETS and tflite.DEFAULT_MAX_TOP1_DROP, spelled here so that --help
# needs no TensorFlow (tests check that they agree).
MODES = ("float32", "float16", "dynamic_int8", "mixed_int8", "int8", "int8_cpu")
DATASETS = ("digits", "photos")
DEFAULT_MAX_TOP1_DROP = 1.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-vit-tflite", description=__doc__.split("\n\n")[0])
    common.add_model_arguments(parser)
    parser.add_argument("--out", required=True, help="output directory for .tflite files and the report")
    images = parser.add_mutually_exclusive_group()
    images.add_argument("--images", help="directory of real images for calibration and checks")
    images.add_argument("--dataset", choices=DATASETS, default="digits",
                        help="embedded real images when no --images (default: digits)")
    parser.add_argument("--modes", nargs="+", choices=MODES,
                        help="the modes to write (default: all that this TensorFlow can write)")
    parser.add_argument("--max-top1-drop", type=float, default=DEFAULT_MAX_TOP1_DROP, metavar="POINTS",
                        help="the most top-1 agreement with the Keras model, in percentage points, that an int8 "
                             "mode (dynamic_int8, mixed_int8, int8, int8_cpu) may lose; past it the file is not "
                             f"written (default: {DEFAULT_MAX_TOP1_DROP:g})")
    return parser


@cli.one_line_exits("keras-vit-tflite", cli.NOTHING_HALF_WRITTEN)
def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.max_top1_drop >= 0:
        parser.error(f"--max-top1-drop takes points >= 0. Received: {args.max_top1_drop}")
    cli.require("keras-vit-tflite", "export")
    from keras_vit.export import tflite

    model = common.model_from_args(parser, args)
    try:
        report = tflite.export_tflite(model, args.out, dataset=args.images or args.dataset, modes=args.modes,
                                      max_top1_drop=args.max_top1_drop)
    except tflite.Top1DropError as refused:
        print(tflite.markdown_report(refused.report))
        raise SystemExit(f"keras-vit-tflite: {refused}") from None
    print(tflite.markdown_report(report))
    return 0 if all(result["passed"] for result in report["modes"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
