"""Taking a keras_vit classifier apart into what serving needs.

Serving always takes raw pixels in [0, 255] and returns logits and probabilities, so the
exporters work on a *pixel logits model*: the classifier up to its `head` layer (before any
softmax), with the checkpoint's normalization prepended when the model does not carry it
(`preprocessing_config`: the model's `PreprocessingConfig`; the original's [0, 255] -> [-1, 1] for a model without
one).
"""

from __future__ import annotations

import keras

from keras_vit import resnet, variants
from keras_vit.geometry import ModelGeometry, is_naflex_model, model_geometry
from keras_vit.head_rows import head_rows_model


def _geometry(model: keras.Model) -> ModelGeometry | None:
    """`model_geometry(model)`, or None for a model that is not a keras_vit model (any Keras image model).

    Raises:
        ValueError: `model` is a NaFlex ViT, whose exports take image bytes only (`export.naflex_serving`).
    """
    if is_naflex_model(model):
        raise ValueError(f"Model {model.name!r} is a NaFlex ViT (it takes patch sequences, as keras-vit-train with "
                         "max_num_patches writes one): its SavedModel, LiteRT, ONNX and OpenVINO files are not built "
                         "yet. keras-vit-export serves SigLIP 2 NaFlex folders (--weights FOLDER --max-num-patches N).")
    try:
        return model_geometry(model)
    except ValueError:
        return None


def patch_stride(model: keras.Model) -> int | None:
    """The patch stride of a keras_vit model built for any input size (`input_shape=(None, None, 3)`), whose
    position embedding is fitted to each image's grid; None for a model of a fixed size."""
    geometry = _geometry(model)
    return geometry.stride[0] if geometry is not None and geometry.input_size is None else None


def image_size(model: keras.Model) -> tuple[int, int]:
    """The (height, width) a single-input RGB image model takes; raises ValueError otherwise. For a keras_vit
    model of any input size: the size its position embedding is stored for (its checkpoint's)."""
    shape = tuple(model.input_shape) if not isinstance(model.input_shape, list) else None
    geometry = _geometry(model)
    if geometry is not None and geometry.input_size is None and shape is not None and len(shape) == 4 \
            and shape[3] == 3:
        return geometry.grid[0] * geometry.stride[0], geometry.grid[1] * geometry.stride[1]
    if shape is None or len(shape) != 4 or shape[1] is None or shape[2] is None or shape[3] != 3:
        raise ValueError(f"Expected a model with one input of shape (batch, height, width, 3) with a static "
                         f"height and width. Received input shape: {model.input_shape}")
    return int(shape[1]), int(shape[2])


def logits_model(model: keras.Model) -> keras.Model:
    """The classifier up to its logits, sharing the model's weights: its `head` Dense layer, for a DeiT
    distilled model the mean of its two heads (`head_average`), for a zero-shot classifier `zero_shot_head`.

    Raises ValueError when the model has no `head`, or when its output is neither the logits
    nor a softmax of them: probabilities computed from the logits would then be wrong.
    """
    geometry = _geometry(model)
    head = None if geometry is None else geometry.head
    if head is None:
        last_layers = [layer.name for layer in model.layers][-4:]
        raise ValueError(f"Model {model.name!r} has no classification `head` (it ends in {last_layers}): these "
                         "exports serve a classifier's probabilities. Build it with include_top=True (and the "
                         "checkpoint's `classes`), or add a head: keras_vit.ViTModel(backbone.input, "
                         "keras.layers.Dense(classes, name='head')(backbone.output)).")
    last = model.layers[-1]
    if last is not head:
        activation = getattr(last, "activation", None)
        if not (isinstance(last, keras.layers.Activation) and activation is keras.activations.softmax):
            raise ValueError(f"Expected the model to end in its logits or a softmax of them. Received last layer "
                             f"{last.name!r} ({type(last).__name__}, activation={activation!r}).")
    return keras.Model(model.input, head.output, name=f"{model.name}_logits")


def _carried(model: keras.Model, attribute: str):
    """The `attribute` (`vit_config`, `preprocessing_config`) of the keras_vit model in `model` (itself or a nested
    one); None where neither has it."""
    for candidate in (model, *model.layers):
        config = getattr(candidate, attribute, None)
        if config is not None:
            return config
    return None


def vit_config(model: keras.Model) -> variants.ViTConfig | None:
    """The `ViTConfig` of the keras_vit model in `model` (itself or a nested one); None for another model."""
    return _carried(model, "vit_config")


def preprocessing_config(model: keras.Model) -> variants.PreprocessingConfig:
    """The `PreprocessingConfig` (mean, std, resize, crop, interpolation) of the keras_vit model in `model` (itself
    or a nested one); the defaults (the original's) for a model without one."""
    return _carried(model, "preprocessing_config") or variants.PreprocessingConfig()


def widest_activation_per_image(model: keras.Model) -> int | None:
    """How many numbers the widest activation of the keras_vit model in `model` holds per image at its own size
    (`image_size`): its MLP's hidden layer (tokens x mlp_dim), its attention weights (heads x tokens^2) or, in a
    hybrid, its ResNet root's output (height/2 x width/2 x `resnet.ROOT_WIDTH`), tokens being the patch grid plus
    the prefix tokens (class token, registers); None for a model without a `vit_config`."""
    config = vit_config(model)
    if config is None:
        return None
    height, width = image_size(model)
    tokens = (height // config.stride) * (width // config.stride) + config.num_prefix_tokens
    stem = (height // 2) * (width // 2) * resnet.ROOT_WIDTH if config.resnet_stages else 0
    return max(tokens * config.mlp_dim, config.num_heads * tokens * tokens, stem)


def with_pixel_input(model: keras.Model, preprocessing: variants.PreprocessingConfig | None = None) -> keras.Model:
    """`model` itself when it takes [0, 255] pixels; else a model that normalizes them first, with `preprocessing`
    (default: `preprocessing_config(model)`)."""
    geometry = _geometry(model)
    if geometry is not None and geometry.pixel_input:
        return model
    preprocessing = preprocessing or preprocessing_config(model)
    image = keras.Input(shape=model.input_shape[1:], name="image")
    scale, offset = preprocessing.pixel_normalization()
    scaled = keras.layers.Rescaling(scale, offset=offset, name="preprocessing")(image)
    return keras.Model(image, model(scaled), name=f"{model.name}_pixels")


def pixel_logits_model(model: keras.Model) -> keras.Model:
    """Raw [0, 255] pixels at the model's size -> logits, the last encoder block computing only the rows the
    head reads (`keras_vit.head_rows_model`)."""
    return with_pixel_input(head_rows_model(logits_model(model)), preprocessing_config(model))


def export_archive(*models: keras.Model) -> keras.export.ExportArchive:
    """A `keras.export.ExportArchive` that saves the models' variables (each once) as the SavedModel's `variables`,
    `trainable_variables` and `non_trainable_variables`, as `archive.track(model)` does. Not `track`: it also walks
    each Keras model for lookup tables (a ViT has none), tracing the whole model once more per model to do so (a tiny
    classifier's export took 4.0 s with it, 2.5 s without, on the AVX2 EPYC)."""
    archive = keras.export.ExportArchive()
    for name in ("variables", "trainable_variables", "non_trainable_variables"):
        unique = {id(variable): variable for model in models for variable in getattr(model, name)}
        # Each Keras variable's own tf.Variable (`.value` on TensorFlow), the object the traced endpoints capture:
        # the Keras wrapper is another trackable, whose value the checkpoint would store a second time.
        archive.add_variable_collection(name, [variable.value for variable in unique.values()])
    return archive
