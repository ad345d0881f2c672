"""The supervised recipes: `pretrain` (the builder's head) and `finetune` (a new zero-initialized head).

`pretrain` keeps the builder's head (and pre-logits). `finetune` builds the backbone without a head at the
new resolution (the weights loader resizes position embeddings), drops the pre-logits and adds one
zero-initialized Dense head. Both train softmax or sigmoid cross-entropy on logits and report top-1 and
top-5 accuracy; their `model.keras` is the uncompiled classifier.
"""

from __future__ import annotations

import os

import keras

import keras_vit
from keras_vit.atomic import atomic_write
from .configs import Config
from .recipe import Recipe, pooling


def make_loss(config: Config) -> keras.losses.Loss:
    """Softmax or sigmoid cross-entropy on logits, with label smoothing."""
    if config.loss == "softmax":
        return keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=config.label_smoothing)
    if config.loss == "sigmoid":
        return keras.losses.BinaryCrossentropy(from_logits=True, label_smoothing=config.label_smoothing)
    raise ValueError(f"Unknown loss {config.loss!r}. Expected 'softmax' or 'sigmoid'.")


EVAL_LOSS = "eval_loss"


def _compile(config: Config, num_classes: int) -> dict:
    """The loss and the metrics, weighted: the evaluation's padding rows (weight 0, `data.exact_batches`) count for
    nothing. `eval_loss` is the loss as a weighted mean over the examples (Keras' own `loss` divides each batch's
    sum by its rows, padding included); the summary reports it as `loss`."""
    loss = make_loss(config)
    return dict(loss=loss,
                weighted_metrics=[keras.metrics.CategoricalAccuracy(name="top1"),
                                  keras.metrics.TopKCategoricalAccuracy(min(5, num_classes), name="top5"),
                                  keras.metrics.MeanMetricWrapper(loss.call, name=EVAL_LOSS)])


def _save(model: keras.Model, backbone: keras.Model, outdir: str) -> dict[str, str]:
    """Writes `model.keras`, uncompiled: the file is the deployable model and must load wherever keras_vit
    is installed. Its compile state names training/'s optimizers and schedule, which only resuming needs,
    and resuming restores them from the BackupAndRestore folder instead."""
    path = os.path.join(outdir, "model.keras")
    with atomic_write(path) as partial:  # whole or absent
        keras_vit.ViTModel(model.input, model.output, name=model.name).save(partial)
    return {"model_path": path}


def _pretrain_backbone(config: Config, num_classes: int) -> dict:
    return dict(classes=num_classes, classifier_activation=None, representation_size=config.representation_size or None)


def _finetune_backbone(config: Config, num_classes: int) -> dict:
    if not config.weights:
        raise ValueError("recipe='finetune' needs weights=<.npz or .weights.h5 path, or a registered name>.")
    return dict(include_top=False, pooling=pooling(config))


def _finetune_model(config: Config, backbone: keras.Model, num_classes: int) -> keras.Model:
    logits = keras.layers.Dense(num_classes, kernel_initializer="zeros", name="head", dtype="float32")(backbone.output)
    return keras_vit.ViTModel(backbone.input, logits, name=f"{backbone.name}_finetune")


PRETRAIN = Recipe(backbone=_pretrain_backbone, model=lambda config, backbone, num_classes: backbone,
                  compile=_compile, save=_save, best_metric="top1")
FINETUNE = Recipe(backbone=_finetune_backbone, model=_finetune_model, compile=_compile, save=_save, best_metric="top1")
