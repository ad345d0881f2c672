"""keras-vit-masked-digits: does masked patch pre-training (paper Sec. 4.6) help? Pre-trains on the
embedded digits without labels, then compares few-shot accuracy and fine-tuning with 10% of the labels
against the same architecture from random initialization (`keras_vit.training.masked_digits`).

    keras-vit-masked-digits --workdir=/tmp/masked_digits
"""

from __future__ import annotations

import argparse
import json
from typing import Sequence

from keras_vit import cli


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-vit-masked-digits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="output folder (runs and summary.json)")
    parser.add_argument("--pretrain-epochs", type=int, default=30, help="masked patch epochs (default: 30)")
    parser.add_argument("--classifier", default="gap", choices=("token", "gap"),
                        help="features and fine-tuning head: class token or average of the tokens (default: gap)")
    parser.add_argument("--shots", type=int, nargs="+", default=(5, 10), help="k values (default: 5 10)")
    parser.add_argument("--seeds", type=int, default=5, help="k-shot draws per k (default: 5)")
    parser.add_argument("--label-percent", type=int, default=10, help="labels used in fine-tuning (default: 10%%)")
    parser.add_argument("--finetune-epochs", type=int, default=50, help="epochs of 4 steps of 64 (default: 50)")
    parser.add_argument("--finetune-seeds", type=int, default=2, help="fine-tuning runs per arm (default: 2)")
    return parser


@cli.one_line_exits("keras-vit-masked-digits", "The same command goes on where it stopped: runs that completed are "
                    "not run again, and the stopped one resumes from its backup.")
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cli.require("keras-vit-masked-digits", "training")
    from keras_vit.training import masked_digits

    result = masked_digits.measure(args.workdir, args.pretrain_epochs, args.classifier, args.shots, args.seeds,
                                   args.label_percent, args.finetune_epochs, args.finetune_seeds)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
