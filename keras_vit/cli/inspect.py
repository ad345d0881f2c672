"""keras-vit-inspect: the paper's inspection figures of a model (arXiv:2010.11929, Fig. 6-7) as PNG.

    keras-vit-inspect --model digits_vit.keras --image photo.jpg --out inspect/
    keras-vit-inspect --variant B/16 --weights B_16.npz --image photo.jpg --out inspect/
"""

from __future__ import annotations

import argparse
from typing import Sequence

from keras_vit import cli
from keras_vit.cli import common

# keras_vit.inspection.FIGURES, spelled here so that --help needs no backend (a test checks that they agree).
FIGURES = ("attention_rollout.png", "mean_attention_distance.png", "position_embedding_similarity.png",
           "embedding_filters.png")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-vit-inspect", description=__doc__.split("\n\n")[0],
                                     epilog=f"Writes {', '.join(FIGURES)} to --out.")
    common.add_model_arguments(parser)
    parser.add_argument("--image", nargs="+", required=True,
                        help="image file(s); resized to the model input. The rollout uses the first, "
                             "the attention distance averages all")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--filters", type=int, default=28, help="principal components to show (default: 28)")
    return parser


@cli.one_line_exits("keras-vit-inspect", cli.NOTHING_HALF_WRITTEN)
def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    cli.require("keras-vit-inspect", "inspect")
    import numpy as np

    from keras_vit import inspection as inspect

    model = common.model_from_args(parser, args)
    height, width, channels = model.inputs[0].shape[1:]
    images = np.stack([common.load_image(path, height, width, channels) for path in args.image])
    paths = inspect.write_figures(model, images, args.out, args.filters)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
