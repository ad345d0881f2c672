"""What a training recipe is: the `Recipe` record that the one run (`trainer.train_and_evaluate`) reads,
and the config's ViT (`build_backbone`) that every recipe trains.

The run owns everything the recipes share: the backbone from the config, the precision policy, the
optimizer, the callbacks, `fit` / `evaluate` and the summary. A recipe says only what differs: the
backbone's head or pooling, the model around it, its loss and metrics, what it reads of the data, and the
files it writes. `trainer.RECIPES` maps `Config.recipe` names to recipes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import keras
import tensorflow as tf

import keras_vit
from keras_vit import models, naflex, variants
from keras_vit.checkpoints import loader as checkpoint_loader
from keras_vit.checkpoints.naflex_file import NaFlexFile
from keras_vit.checkpoints.reader import CheckpointFile
from . import configs
from .configs import Config


def _as_is(dataset: tf.data.Dataset) -> tf.data.Dataset:
    return dataset


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One training recipe.

    Attributes:
        backbone: (config, classes) -> the builder options of the config's ViT (`build_backbone`): its
            head, or `include_top=False` and a pooling. Raises ValueError for a config it cannot run.
        model: (config, backbone, classes) -> the model that `fit` trains.
        compile: (config, classes) -> the `model.compile` arguments besides the optimizer (loss, metrics).
        save: (trained model, backbone, output folder) -> the paths of the files written, by name.
        inputs: the (images, labels) datasets as `fit` and `evaluate` read them. Defaults to as they are.
        best_metric: the metric (higher is better) whose best epoch `checkpoints/best.weights.h5` keeps;
            None for no best checkpoint.
        exact_eval: evaluate on `data.exact_batches` (every example once, on any number of devices: the metrics
            must be weighted); False: the eval batches as `inputs` gives them.
    """

    backbone: Callable[[Config, int], dict]
    model: Callable[[Config, keras.Model, int], keras.Model]
    compile: Callable[[Config, int], dict]
    save: Callable[[keras.Model, keras.Model, str], dict[str, str]]
    inputs: Callable[[tf.data.Dataset], tf.data.Dataset] = _as_is
    best_metric: str | None = None
    exact_eval: bool = True


def weights_file(config: Config) -> CheckpointFile | None:
    """The `CheckpointFile` of `config.weights` where it states its architecture (`configs.states_architecture`),
    else None: read once for the run's checks and its builder, again only where the file changed since."""
    if not configs.states_architecture(config.weights):
        return None
    return _read_weights_file(config.weights, _stamp(config.weights))


def _stamp(path: str) -> tuple:
    """(name, modification time, size) of a local file, or of a folder and each file in it; () for an hf:// name."""
    if not os.path.exists(path):
        return ()
    paths = [path, *(os.path.join(path, name) for name in sorted(os.listdir(path)))] if os.path.isdir(path) else [path]
    return tuple((name, stat.st_mtime_ns, stat.st_size) for name, stat in ((name, os.stat(name)) for name in paths))


@functools.lru_cache(maxsize=2)
def _read_weights_file(weights: str, stamp: tuple) -> CheckpointFile | None:
    """`weights` read; `stamp` (`_stamp(weights)`) is not used here but is part of the cache's key, so a file
    changed since (a new mtime or size) is read again."""
    return checkpoint_loader.local_file(weights)


def naflex_checkpoint(config: Config) -> NaFlexFile | None:
    """What `config.weights` states where it is a SigLIP 2 NaFlex file (transformers' or timm's), else None."""
    file = weights_file(config)
    return None if file is None else file.naflex


def pooling(config: Config) -> str:
    """The `pooling` of a backbone without head: the class token, the attention pooling of `classifier="map"`,
    or the average for `classifier="gap"`; with classifier "", the weights file's (`configs.FROM_FILE`)."""
    if not config.classifier:
        file = weights_file(config)
        if file is None:
            raise ValueError(f"classifier='' takes the pooling of the weights file, but weights={config.weights!r} is "
                             "not a file that states one. Give classifier='token', 'gap' or 'map'.")
        return file.pooling
    return {"token": "token", "map": "map"}.get(config.classifier, "avg")


def _explicit_architecture(config: Config) -> dict:
    """The explicit architecture fields given (not 0, which takes the weights file's: `configs.FROM_FILE`).

    Raises:
        ValueError: with variant "", a field 0 where `weights` is not a file that states its architecture.
    """
    given = dict(patch_size=config.patch_size, hidden_dim=config.hidden_dim, mlp_dim=config.mlp_dim,
                 num_heads=config.num_heads, num_layers=config.num_layers)
    missing = [name for name, value in given.items() if not value]
    if missing and not config.variant and not configs.states_architecture(config.weights):
        raise ValueError(f"{missing[0]}=0 takes the architecture of the weights file, but weights={config.weights!r} "
                         "is not a file that states one (an .npz or .safetensors file, a save_pretrained folder or "
                         "an hf:// name). Give variant= or the architecture fields (patch_size, hidden_dim, mlp_dim, "
                         "num_heads, num_layers).")
    return {name: value for name, value in given.items() if value}


def architecture(config: Config) -> dict | variants.ViTConfig:
    """The config's ViT architecture (`num_heads`, `mlp_dim`, ...): its variant's, its explicit fields, or (fields
    0) the weights file's with the fields given."""
    if config.variant:
        return variants.decode_variant(config.variant)
    explicit, file = _explicit_architecture(config), weights_file(config)
    if file is not None and file.naflex is not None:
        file.check_agrees(explicit)
        return variants.ViTConfig(**file.naflex.config)
    if len(explicit) == len(variants.ARCHITECTURE):
        return explicit
    return models.model_config(None, file, **explicit)


def build_backbone(config: Config, **options) -> keras.Model:
    """The config's ViT: its variant (or, with variant "", its explicit architecture; with `weights` a file that
    states its architecture, the file's with the fields given: `configs.apply_overrides`), input size, classifier,
    dropouts and `weights=config.weights`, built with the recipe's `options`; with `max_num_patches`, a NaFlex ViT
    (`naflex_backbone`)."""
    if config.max_num_patches:
        return naflex_backbone(config, **options)
    if naflex_checkpoint(config) is not None:
        raise ValueError(f"weights={config.weights!r} is a SigLIP 2 NaFlex checkpoint: it trains on patch sequences "
                         "of each image's own grid. Set max_num_patches (the patch budget, e.g. 256).")
    explicit = {} if config.variant else _explicit_architecture(config)
    return keras_vit.VisionTransformer(
        config.variant or None, weights=weights_file(config) or config.weights or None,
        input_shape=(config.image_size, config.image_size, 3),
        classifier=config.classifier or None, dropout_rate=config.dropout_rate,
        attention_dropout_rate=config.attention_dropout_rate, drop_path_rate=config.drop_path_rate,
        **explicit, **options)


def naflex_backbone(config: Config, *, include_top: bool = True, classes: int = 1000,
                    classifier_activation=None, **map_head_options) -> keras.Model:
    """The config's NaFlex ViT (`keras_vit.naflex.NaFlexViT`: inputs `patches`, `patch_mask`, `spatial_shapes`)
    with the recipe's options: `include_top`, a zero-initialized Dense head of `classes` logits on the MAP head's
    pooled embedding; without, that embedding (`map_head_options`, the pooling and pre-logits the config checked
    to be the MAP head's: `Config._check_naflex`). From `config.weights` (a SigLIP 2 NaFlex file) its model with
    the config's dropouts; else the config's architecture with classifier "map" and a position table of
    image_size / patch_size patches square."""
    del map_head_options
    training_fields = dict(dropout_rate=config.dropout_rate, attention_dropout_rate=config.attention_dropout_rate,
                           drop_path_rate=config.drop_path_rate)
    checkpoint = naflex_checkpoint(config)
    if checkpoint is not None:
        forward = dataclasses.replace(variants.ViTConfig(**checkpoint.config), **training_fields)
        encoder = naflex.NaFlexViT(forward, weights=checkpoint)
    else:
        explicit = {} if config.variant else _explicit_architecture(config)
        forward = variants.make_config(config.variant or None, None,
                                       dict(explicit, classifier="map", **training_fields))
        encoder = naflex.NaFlexViT(forward, position_grid=max(config.image_size // forward.patch_size, 1))
    embedding = encoder.output["embedding"]
    if not include_top:
        return keras_vit.ViTModel(encoder.input, embedding, name=encoder.name)
    logits = keras.layers.Dense(classes, kernel_initializer="zeros", activation=classifier_activation, name="head",
                                dtype="float32")(embedding)
    return keras_vit.ViTModel(encoder.input, logits, name=encoder.name)
