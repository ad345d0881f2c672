"""What the command lines share: the model-selection flags and reading image files.

Imports nothing heavy at module level, so that every parser, and `--help`, works on the base install.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import keras
    import numpy as np


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--model FILE.keras`, or `[--variant NAME] [--weights W] [--image-size SIZE [WIDTH]] [--classes N]
    [--pooling P]`."""
    parser.add_argument("--model", help="a saved keras_vit model (.keras)")
    parser.add_argument("--variant", help='a variant to build, e.g. "B/16" or "R50+B/16"')
    parser.add_argument("--weights", help="weights to build: a registered name (with --variant), or a weights file, "
                                          "save_pretrained directory or hf://org/name in the local hub cache "
                                          "(the architecture read from it without --variant; default: random)")
    parser.add_argument("--pooling", choices=("token", "avg", "map"),
                        help="build without the head, returning this pooled embedding (default: with the head; "
                             "weights without one pool as their model does)")
    parser.add_argument("--image-size", type=int, nargs="+", metavar="SIZE",
                        help="input size: one value (square) or height width (default: the size the files of "
                             "--weights declare, its processor's crop or timm's input_size, else the size its "
                             "position table was trained at; 224 for --variant without a weights file)")
    parser.add_argument("--classes", type=int,
                        help="classes of --variant's head (default: the head of --weights, else 1000)")


def image_size(parser: argparse.ArgumentParser, values: Sequence[int]) -> tuple[int, int]:
    """`--image-size` as (height, width)."""
    if len(values) not in (1, 2):
        parser.error(f"--image-size takes one value or height width. Received: {list(values)}")
    return values[0], values[-1]


def model_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    input_shape: tuple[int | None, int | None, int] | None = None) -> keras.Model:
    """The model the `add_model_arguments` flags select; `input_shape`, if given, replaces `--image-size`'s."""
    if args.model and (args.variant or args.weights):
        parser.error("--model is a saved model: give it alone, or --variant / --weights to build one.")
    if not (args.model or args.variant or args.weights):
        parser.error("one of --model, --variant or --weights is required.")
    from keras_vit import model_files

    if args.model and args.image_size:
        parser.error("--image-size builds a --variant or --weights; a .keras model keeps the input shape it was built "
                     "with.")
    if input_shape is None and args.image_size:
        input_shape = (*image_size(parser, args.image_size), 3)
    return model_files.load_or_build(args.model, variant=args.variant, weights=args.weights,
                                     input_shape=input_shape, classes=args.classes, pooling=args.pooling)


def load_image(path: str, height: int, width: int, channels: int) -> np.ndarray:
    """Reads an image file as (height, width, channels) float32 pixels in [0, 255]."""
    import numpy as np

    try:
        from PIL import Image
    except ImportError as error:
        raise ImportError("Reading image files needs Pillow: `pip install pillow` (or keras_vit[inspect]).") from error

    modes = {1: "L", 3: "RGB"}
    if channels not in modes:
        raise ValueError(f"Can read images for 1- or 3-channel models. Received channels={channels}")
    with Image.open(path) as image:
        image = image.convert(modes[channels]).resize((width, height), Image.BILINEAR)
    return np.asarray(image, dtype="float32").reshape(height, width, channels)
