"""The `masked_patches` recipe: self-supervised masked patch prediction (paper Sec. 4.6, App. B.1.2).

`train_masked_patches(config, workdir)` (what `training.train_and_evaluate` runs for
`recipe="masked_patches"`) wraps the config's ViT encoder with `keras_vit.masked_patch_model` and fits
it on the images of any source the trainer reads (labels are dropped), with the same crash safety as
the supervised recipes (`training.trainer.make_callbacks` without the best-top-1 checkpoint): NaN
stop first, synced BackupAndRestore per worker, run log, last weights, CSV history, TensorBoard.
Outputs in `workdir` (besides those of `training.trainer`):

    model.keras               the masked-patch model (corruption, encoder, head, targets)
    encoder.keras             the encoder as a keras_vit model without head (pooled features,
                              `pool` = "token" or "avg" as `classifier`): `keras-vit-fewshot --model`
    encoder.weights.h5        its weights: `--config=finetune --override weights=<this>` with the same
                              architecture and image size
    model.eval.json           masked loss (and accuracy) on the eval split

    keras-vit-train --config=masked_patches --workdir=/tmp/mpp \\
        --override dataset=imagenet2012 --override total_steps=100000
"""

from __future__ import annotations

import json
import logging
import os
from typing import Sequence

import keras
import tensorflow as tf

import keras_vit
from . import trainer
from .configs import Config


def build_encoder(config: Config) -> keras.Model:
    """The config's ViT without head: `VisionTransformer(include_top=False, pooling=...)`, exactly the
    backbone that the `finetune` recipe builds, with `weights=config.weights` (to continue from one)."""
    architecture = {} if config.variant else dict(
        patch_size=config.patch_size, hidden_dim=config.hidden_dim, mlp_dim=config.mlp_dim,
        num_heads=config.num_heads, num_layers=config.num_layers)
    return keras_vit.VisionTransformer(
        config.variant or None, include_top=False, pooling="token" if config.classifier == "token" else "avg",
        weights=config.weights or None, input_shape=(config.image_size, config.image_size, 3),
        classifier=config.classifier, dropout_rate=config.dropout_rate,
        attention_dropout_rate=config.attention_dropout_rate, drop_path_rate=config.drop_path_rate,
        **architecture)


def build_masked_model(config: Config, encoder: keras.Model) -> keras_vit.MaskedPatchModel:
    """`encoder` wrapped for masked patch prediction with the config's target and corruption."""
    return keras_vit.masked_patch_model(encoder, target=config.masked_target, corruption_rate=config.corruption_rate,
                                        mask_rate=config.mask_rate, random_rate=config.random_rate,
                                        bits=config.target_bits, seed=config.seed)


def images_only(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Drops the labels of an (images, labels) dataset."""
    return dataset.map(lambda images, labels: images, num_parallel_calls=tf.data.AUTOTUNE)


def _save_outputs(model: keras_vit.MaskedPatchModel, encoder: keras.Model, outdir: str) -> dict[str, str]:
    """Writes model.keras (uncompiled), encoder.keras and encoder.weights.h5; returns their paths."""
    paths = {"model_path": os.path.join(outdir, "model.keras"),
             "encoder_path": os.path.join(outdir, "encoder.keras"),
             "encoder_weights_path": os.path.join(outdir, "encoder.weights.h5")}
    # Uncompiled, as the trainer saves: the files must load without this package's optimizers.
    keras_vit.MaskedPatchModel(model.network, model.target, name=model.name).save(paths["model_path"])
    encoder.save(paths["encoder_path"])  # Its layers are the trained ones (shared with the masked model).
    encoder.save_weights(paths["encoder_weights_path"])
    return paths


def train_masked_patches(config: Config, workdir: str, *, strategy: tf.distribute.Strategy | None = None,
                         callbacks: Sequence[keras.callbacks.Callback] = (), verbose: str | int = "auto") -> dict:
    """Pre-trains the config's encoder by masked patch prediction in `workdir` (resuming from its backup).

    Args: as `training.train_and_evaluate`.

    Returns:
        dict with the eval split's masked `loss` (and `masked_accuracy` for classification targets),
        `model_path`, `encoder_path`, `encoder_weights_path`, `eval_path` and `optimizer_iterations`.
    """
    strategy = strategy or tf.distribute.get_strategy()
    worker, outdir, datasets, steps_per_epoch, epochs = trainer.prepare_run(config, workdir, strategy)
    logging.info("Masked patch prediction (%s target), strategy %s with %d replicas; %s train images; "
                 "%d epochs x %d steps.", config.masked_target, type(strategy).__name__,
                 strategy.num_replicas_in_sync, datasets.num_train_examples, epochs, steps_per_epoch)
    previous_policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(trainer.PRECISIONS[config.precision])
    try:
        with strategy.scope():
            encoder = build_encoder(config)
            model = build_masked_model(config, encoder)
            model.compile(optimizer=trainer.make_optimizer(config, epochs * steps_per_epoch))
        nan_guard, *standard = trainer.make_callbacks(config, workdir, outdir, worker, best_metric=None)
        eval_images = images_only(datasets.eval)
        model.fit(images_only(datasets.train), epochs=epochs, steps_per_epoch=steps_per_epoch, shuffle=False,
                  validation_data=eval_images if config.validate else None,
                  callbacks=[nan_guard, *callbacks, *standard], verbose=verbose)
        results = model.evaluate(eval_images, return_dict=True, verbose=0)
        paths = _save_outputs(model, encoder, outdir)
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)
    summary = {**{key: float(value) for key, value in results.items()}, **paths,
               "optimizer_iterations": int(model.optimizer.iterations.numpy()),
               "eval_path": os.path.join(outdir, "model.eval.json")}
    with open(summary["eval_path"], "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    logging.info("Eval: masked loss %.4f. Saved %s and %s", summary["loss"], paths["model_path"],
                 paths["encoder_path"])
    return summary
