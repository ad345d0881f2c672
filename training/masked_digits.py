"""Does masked patch pre-training help? A measurement on scikit-learn's embedded digits.

1. Pre-train the `digits` architecture (32 px, patch 4, width 64, 4 layers) by masked patch
   prediction (`masked_patches` recipe, 3-bit mean colour) on the 1,437 training images; no labels.
2. Linear few-shot accuracy (k = 5, 10; several draws) of its frozen features against the same
   architecture at random initialization (same seed): k-shot sets from the training split, accuracy
   on the 360 test digits, which pre-training never saw.
3. Fine-tune on `train[:N%]` of the labels (`finetune` recipe from `encoder.weights.h5`) against the
   same run from scratch (`pretrain` recipe, i.e. the `digits` recipe on the same labels).

    keras-vit-masked-digits --workdir=/tmp/masked_digits     (python -m training.masked_digits in a clone)

Prints a JSON summary and writes it to `workdir/summary.json` (`measure`). Rerun with the same arguments after a
stop (Ctrl-C, a crash), it goes on where it stopped: each training run that completed is not run again (its
`stage.json`), and the one that was stopped resumes from its backup.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Sequence

import keras
import numpy as np

from keras_vit import datasets, fewshot
from keras_vit.atomic import write_json

from . import configs, trainer
from . import masked as masked_training
from .configs import Config

STAGE_FILE = "stage.json"  # In each run's workdir: its inputs, summary and time, written once the run completed.

PRETRAIN = ["dataset=digits", "train_split=train", "eval_split=test", "total_steps=0", "steps_per_epoch=0",
            "batch_size=64", "lr=1e-3", "warmup_steps=100", "inception_crop=true", "crop_min_area=0.6",
            "random_flip=false", "shuffle_buffer=2048", "validate=false"]


def _architecture(pooling_classifier: str) -> list[str]:
    digits = configs.get_config("digits")
    return [f"variant={digits.variant}", f"patch_size={digits.patch_size}", f"hidden_dim={digits.hidden_dim}",
            f"mlp_dim={digits.mlp_dim}", f"num_heads={digits.num_heads}", f"num_layers={digits.num_layers}",
            f"image_size={digits.image_size}", f"classifier={pooling_classifier}"]


def _inputs(config: Config) -> dict:
    """What a run's results depend on: its config and, where it starts from a weights file, that file's digest (a
    fine-tuning run of an encoder that was trained again is not the same run)."""
    inputs = configs.as_json(config)
    if config.weights and os.path.isfile(config.weights):
        with open(config.weights, "rb") as f:
            inputs["weights_sha256"] = hashlib.sha256(f.read()).hexdigest()  # The digits encoder: under 1 MB.
    return inputs


def train_once(config: Config, workdir: str, verbose: str | int) -> tuple[dict, float]:
    """`trainer.train_and_evaluate` in `workdir`, unless a run of this same `config` (and weights file) completed
    there: then that run's (summary, seconds), from its `stage.json`. A stopped run resumes from its backup."""
    path = os.path.join(workdir, STAGE_FILE)
    current = _inputs(config)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            completed = json.load(f)
        if completed["inputs"] == current:
            logging.info("%s: completed earlier with this config; its results are used.", workdir)
            return completed["summary"], completed["seconds"]
        os.remove(path)  # Another config: its files are about to be replaced.
    start = time.time()
    summary = trainer.train_and_evaluate(config, workdir, verbose=verbose)
    seconds = time.time() - start
    write_json(path, {"inputs": current, "summary": summary, "seconds": seconds})
    return summary, seconds


def pretrain(workdir: str, epochs: int, classifier: str, seed: int) -> tuple[dict, float]:
    """Runs the masked_patches recipe on the digits images; returns (summary, seconds)."""
    config = configs.apply_overrides(configs.get_config("masked_patches"),
                                     [*_architecture(classifier), *PRETRAIN, f"epochs={epochs}", f"seed={seed}"])
    return train_once(config, workdir, verbose=2)


def finetune(workdir: str, weights: str, percent: int, epochs: int, classifier: str, seed: int) -> tuple[float, float]:
    """The digits recipe on `train[:percent%]`: from `weights` (finetune recipe) or, with "", from scratch."""
    recipe = ["recipe=finetune", f"weights={weights}"] if weights else ["recipe=pretrain"]
    config = configs.apply_overrides(configs.get_config("digits"), [
        *_architecture(classifier), *recipe, f"train_split=train[:{percent}%]", f"epochs={epochs}",
        "steps_per_epoch=4", "validate=false", f"seed={seed}"])
    summary, seconds = train_once(config, workdir, verbose=0)
    return summary["top1"], seconds


def few_shot(encoder: keras.Model, shots: Sequence[int], seeds: int) -> dict[int, tuple[float, float]]:
    """Digits few-shot accuracy `{k: (mean, std)}` of `encoder`'s features on the recipes' split: k-shot sets
    from the training split, accuracy on the 360 test digits, which pre-training never saw."""
    return fewshot.digits_accuracy(encoder, shots, seeds=seeds, test_fraction=datasets.TEST_FRACTION)


def _mean_std(values: Sequence[float]) -> str:
    return f"{np.mean(values):.4f} +- {np.std(values):.4f}"


def measure(workdir: str, pretrain_epochs: int = 30, classifier: str = "gap", shots: Sequence[int] = (5, 10),
            seeds: int = 5, label_percent: int = 10, finetune_epochs: int = 50, finetune_seeds: int = 2) -> dict:
    """Runs the three steps (module docstring) in `workdir`; returns the summary, also written to
    `workdir/summary.json`."""
    result: dict = {"args": dict(workdir=workdir, pretrain_epochs=pretrain_epochs, classifier=classifier,
                                 shots=list(shots), seeds=seeds, label_percent=label_percent,
                                 finetune_epochs=finetune_epochs, finetune_seeds=finetune_seeds)}
    summary, seconds = pretrain(os.path.join(workdir, "pretrain"), pretrain_epochs, classifier, 0)
    result["pretrain"] = {"seconds": round(seconds), "masked_loss": summary["loss"],
                          "masked_accuracy": summary.get("masked_accuracy")}
    keras.utils.set_random_seed(0)  # The initialization the pre-training started from.
    random_encoder = masked_training.build_encoder(configs.apply_overrides(
        configs.get_config("masked_patches"), [*_architecture(classifier), *PRETRAIN]))
    for name, encoder in (("random_init", random_encoder),
                          ("pretrained", keras.saving.load_model(summary["encoder_path"]))):
        accuracies = few_shot(encoder, shots, seeds)
        result[f"fewshot_{name}"] = {k: f"{mean:.4f} +- {std:.4f}" for k, (mean, std) in accuracies.items()}
    for name, weights in (("scratch", ""), ("pretrained", summary["encoder_weights_path"])):
        runs = [finetune(os.path.join(workdir, f"ft_{name}_{seed}"), weights, label_percent, finetune_epochs,
                         classifier, seed) for seed in range(finetune_seeds)]
        result[f"finetune_{name}"] = {"top1": _mean_std([top1 for top1, _ in runs]),
                                      "seconds": round(float(np.mean([s for _, s in runs])))}
    write_json(os.path.join(workdir, "summary.json"), result)
    return result
