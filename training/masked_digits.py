"""Does masked patch pre-training help? A measurement on scikit-learn's embedded digits.

1. Pre-train the `digits` architecture (32 px, patch 4, width 64, 4 layers) by masked patch
   prediction (`masked_patches` recipe, 3-bit mean colour) on the 1,437 training images; no labels.
2. Linear few-shot accuracy (k = 5, 10; several draws) of its frozen features against the same
   architecture at random initialization (same seed): k-shot sets from the training split, accuracy
   on the 360 test digits, which pre-training never saw.
3. Fine-tune on `train[:N%]` of the labels (`finetune` recipe from `encoder.weights.h5`) against the
   same run from scratch (`pretrain` recipe, i.e. the `digits` recipe on the same labels).

    python -m training.masked_digits --workdir=/tmp/masked_digits

Prints a JSON summary and writes it to `workdir/summary.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Sequence

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_vit import fewshot  # noqa: E402
from . import configs, data, trainer  # noqa: E402
from . import masked as masked_training  # noqa: E402

PRETRAIN = ["dataset=digits", "train_split=train", "eval_split=test", "total_steps=0", "steps_per_epoch=0",
            "batch_size=64", "lr=1e-3", "warmup_steps=100", "inception_crop=true", "crop_min_area=0.6",
            "random_flip=false", "shuffle_buffer=2048", "validate=false"]


def _architecture(pooling_classifier: str) -> list[str]:
    digits = configs.get_config("digits")
    return [f"variant={digits.variant}", f"patch_size={digits.patch_size}", f"hidden_dim={digits.hidden_dim}",
            f"mlp_dim={digits.mlp_dim}", f"num_heads={digits.num_heads}", f"num_layers={digits.num_layers}",
            f"image_size={digits.image_size}", f"classifier={pooling_classifier}"]


def pretrain(workdir: str, epochs: int, classifier: str, seed: int) -> tuple[dict, float]:
    """Runs the masked_patches recipe on the digits images; returns (summary, seconds)."""
    config = configs.apply_overrides(configs.get_config("masked_patches"),
                                     [*_architecture(classifier), *PRETRAIN, f"epochs={epochs}", f"seed={seed}"])
    start = time.time()
    summary = trainer.train_and_evaluate(config, workdir, verbose=2)
    return summary, time.time() - start


def _split(name: str) -> tuple[np.ndarray, np.ndarray]:
    source = data.digits_source(name)
    images, labels = zip(*source.dataset.as_numpy_iterator())
    resized = keras.ops.image.resize(np.stack(images), (32, 32))
    return keras.ops.convert_to_numpy(resized), np.array(labels)


def few_shot(encoder: keras.Model, shots: Sequence[int], seeds: int) -> dict[int, list[float]]:
    """k-shot accuracies (one per draw) of `encoder`'s pooled features: pool = train split, test = test split."""
    (train_x, train_y), (test_x, test_y) = _split("train"), _split("test")
    extractor = fewshot.feature_extractor(encoder)
    train_f = extractor.predict(train_x, batch_size=128, verbose=0)
    test_f = extractor.predict(test_x, batch_size=128, verbose=0)
    return {k: [fewshot.few_shot_accuracy(train_f, train_y, test_f, test_y, k, seed=s) for s in range(seeds)]
            for k in shots}


def finetune(workdir: str, weights: str, percent: int, epochs: int, classifier: str, seed: int) -> tuple[float, float]:
    """The digits recipe on `train[:percent%]`: from `weights` (finetune recipe) or, with "", from scratch."""
    recipe = ["recipe=finetune", f"weights={weights}"] if weights else ["recipe=pretrain"]
    config = configs.apply_overrides(configs.get_config("digits"), [
        *_architecture(classifier), *recipe, f"train_split=train[:{percent}%]", f"epochs={epochs}",
        "steps_per_epoch=4", "validate=false", f"seed={seed}"])
    start = time.time()
    summary = trainer.train_and_evaluate(config, workdir, verbose=0)
    return summary["top1"], time.time() - start


def _mean_std(values: Sequence[float]) -> str:
    return f"{np.mean(values):.4f} +- {np.std(values):.4f}"


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m training.masked_digits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--pretrain-epochs", type=int, default=30)
    parser.add_argument("--classifier", default="gap", choices=("token", "gap"),
                        help="features and fine-tuning head: class token or average of the tokens (default gap)")
    parser.add_argument("--shots", type=int, nargs="+", default=(5, 10))
    parser.add_argument("--seeds", type=int, default=5, help="k-shot draws per k (default 5)")
    parser.add_argument("--label-percent", type=int, default=10, help="labels used in fine-tuning (default 10%%)")
    parser.add_argument("--finetune-epochs", type=int, default=50, help="epochs of 4 steps of 64 (default 50)")
    parser.add_argument("--finetune-seeds", type=int, default=2)
    args = parser.parse_args(argv)
    result: dict = {"args": vars(args)}
    summary, seconds = pretrain(os.path.join(args.workdir, "pretrain"), args.pretrain_epochs, args.classifier, 0)
    result["pretrain"] = {"seconds": round(seconds), "masked_loss": summary["loss"],
                          "masked_accuracy": summary.get("masked_accuracy")}
    keras.utils.set_random_seed(0)  # The initialization the pre-training started from.
    random_encoder = masked_training.build_encoder(configs.apply_overrides(
        configs.get_config("masked_patches"), [*_architecture(args.classifier), *PRETRAIN]))
    for name, encoder in (("random_init", random_encoder),
                          ("pretrained", keras.saving.load_model(summary["encoder_path"]))):
        accuracies = few_shot(encoder, args.shots, args.seeds)
        result[f"fewshot_{name}"] = {k: _mean_std(v) for k, v in accuracies.items()}
    for name, weights in (("scratch", ""), ("pretrained", summary["encoder_weights_path"])):
        runs = [finetune(os.path.join(args.workdir, f"ft_{name}_{seed}"), weights, args.label_percent,
                         args.finetune_epochs, args.classifier, seed) for seed in range(args.finetune_seeds)]
        result[f"finetune_{name}"] = {"top1": _mean_std([top1 for top1, _ in runs]),
                                      "seconds": round(float(np.mean([s for _, s in runs])))}
    print(json.dumps(result, indent=2))
    with open(os.path.join(args.workdir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
