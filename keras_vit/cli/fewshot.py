"""keras-vit-fewshot: linear few-shot accuracy of a model's frozen features (paper Fig. 4) on the
embedded digits (`keras_vit.fewshot.digits_accuracy`; no download).

    keras-vit-fewshot --model digits_vit.keras
    keras-vit-fewshot --variant Ti/16 --image-size 32 --shots 1 5
"""

from __future__ import annotations

import argparse
from typing import Sequence

from keras_vit import cli
from keras_vit.cli import common

SHOTS = (1, 5, 10, 25)  # keras_vit.fewshot.SHOTS, spelled here so that --help needs no backend (tested)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-vit-fewshot", description=__doc__.split("\n\n")[0])
    common.add_model_arguments(parser)
    parser.add_argument("--shots", type=int, nargs="+", default=SHOTS, help="k values (default: 1 5 10 25)")
    parser.add_argument("--l2-reg", type=float, default=1.0, help="ridge penalty (default: 1.0)")
    parser.add_argument("--seeds", type=int, default=3, help="k-shot draws averaged per k (default: 3)")
    return parser


@cli.one_line_exits("keras-vit-fewshot")
def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    cli.require("keras-vit-fewshot", "training")  # the digits ship with scikit-learn
    from keras_vit import fewshot

    model = common.model_from_args(parser, args)
    results = fewshot.digits_accuracy(model, args.shots, args.l2_reg, args.seeds)
    for k, (mean, std) in results.items():
        print(f"{k:>3}-shot digits accuracy: {mean:.4f} +- {std:.4f} ({args.seeds} draws)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
