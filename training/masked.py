"""The `masked_patches` recipe: self-supervised masked patch prediction (paper Sec. 4.6, App. B.1.2).

`MASKED_PATCHES` (what `training.train_and_evaluate` runs for `recipe="masked_patches"`) wraps the
config's ViT encoder with `keras_vit.masked_patch_model` and fits it on the images of any source the
trainer reads (labels are dropped), in the same run as the supervised recipes: NaN stop first, synced
BackupAndRestore per worker, run log, last weights (no best-top-1 checkpoint), CSV history, TensorBoard.
Outputs in `workdir` (besides those of every run, `training/trainer.py`):

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

import os

import keras
import tensorflow as tf

import keras_vit
from keras_vit.atomic import atomic_write
from .configs import Config
from .recipe import Recipe, build_backbone, pooling


def _encoder_options(config: Config, num_classes: int = 0) -> dict:
    return dict(include_top=False, pooling=pooling(config))


def build_encoder(config: Config) -> keras.Model:
    """The config's ViT without head, exactly the backbone that the `finetune` recipe builds, with
    `weights=config.weights` (to continue from one)."""
    return build_backbone(config, **_encoder_options(config))


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
    with atomic_write(paths["model_path"]) as partial:  # each file whole or absent
        keras_vit.MaskedPatchModel(model.network, model.target, name=model.name).save(partial)
    with atomic_write(paths["encoder_path"]) as partial:
        encoder.save(partial)  # Its layers are the trained ones (shared with the masked model).
    with atomic_write(paths["encoder_weights_path"]) as partial:
        encoder.save_weights(partial)
    return paths


MASKED_PATCHES = Recipe(backbone=_encoder_options,
                        model=lambda config, encoder, num_classes: build_masked_model(config, encoder),
                        compile=lambda config, num_classes: {},  # The loss is the model's own.
                        save=_save_outputs,
                        inputs=images_only,
                        exact_eval=False)  # its loss is over random masks: no exact count to keep
