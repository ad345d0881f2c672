"""The geometry of a keras_vit model: its input size, patch stride and grid, its prefix tokens, its pixel input, the
encoder's end, the pooled features and the classifier head, answered in one place.

`model_geometry(model)` reads the model's `ViTConfig` (`model.vit_config`) first. A model without one (a `.keras`
file of keras_vit 0.1, a model built around keras_vit's layers, or one derived from a keras_vit model, such as
`features_model`'s or `fewshot.feature_extractor`'s) is read from its layers. This is the only module of keras_vit
that finds a model's layer by its name.
"""

from __future__ import annotations

import dataclasses

import keras

from keras_vit import layers as vit_layers
from keras_vit.variants import PreprocessingConfig, ViTConfig

PREPROCESSING = "preprocessing"  # the Rescaling of include_preprocessing=True: the model takes [0, 255] pixels
ENCODER_NORM = "encoder_norm"  # the final norm of every token (absent with fc_norm=True)
HEAD_NAMES = ("head_average", "zero_shot_head", "head")  # the layer of the logits, by preference
CLASS_TOKEN_HEAD = "head"  # DeiT distilled: the head on the class token (`head_average` averages it)
PIXEL_RANGE = (0.0, 255.0)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelGeometry:
    """What the tools need to know about a keras_vit model (`model_geometry`).

    Attributes:
        input_size: (height, width) of the model's images; None for a model of any size.
        stride: (height, width) in pixels of the input covered by one token (the patch size, times the ResNet
            stem's stride for hybrids).
        grid: (rows, columns) of the patch grid at `input_size`; for a model of any size, the grid its position
            table is stored for (its checkpoint's).
        num_prefix_tokens: tokens before the patch grid (class, distillation and register tokens).
        class_token: whether token 0 is a class token.
        pixel_input: whether the model takes [0, 255] pixels and normalizes them in its graph
            (`include_preprocessing=True`).
        value_range: (low, high) of the values the model takes: [0, 255] pixels, or their normalization.
        image: the model's image input tensor.
        patch_embedding: the `PatchEncoder` layer (`embedding`).
        position_embedding: the `PositionEmbedding` layer (`posembed_input`).
        encoder_norm: the final norm of every token (`encoder_norm`); None for `fc_norm=True` models.
        encoder_end: the layer whose output is the encoder's tokens: `encoder_norm`, else the last block; None
            for a model without either at the top level (`attention_model`'s wraps its blocks).
        pooled: the pooled, pre-logits features (batch, D): the head's input (DeiT distilled: the class token's
            head's), or the output of a model without a head that pools; None for a model that outputs tokens.
        head: the layer whose output is the logits (`head`; DeiT distilled: `head_average`; a zero-shot
            classifier: `zero_shot_head`); None without a classification head.
        config: the model's `ViTConfig`; None for a model without one.
    """

    input_size: tuple[int, int] | None
    stride: tuple[int, int]
    grid: tuple[int, int]
    num_prefix_tokens: int
    class_token: bool
    pixel_input: bool
    value_range: tuple[float, float]
    image: keras.KerasTensor
    patch_embedding: vit_layers.PatchEncoder
    position_embedding: vit_layers.PositionEmbedding
    encoder_norm: keras.layers.Layer | None
    encoder_end: keras.layers.Layer | None
    pooled: keras.KerasTensor | None
    head: keras.layers.Layer | None
    config: ViTConfig | None


def model_geometry(model: keras.Model) -> ModelGeometry:
    """The geometry of a keras_vit model (its `ViTConfig` first, else its layers).

    Raises:
        ValueError: `model` is not a keras_vit model with its layers at the top level (the message names a nested
            one).
    """
    patch_embedding = _only(model, vit_layers.PatchEncoder)
    position = _only(model, vit_layers.PositionEmbedding)
    blocks = [layer for layer in model.layers if isinstance(layer, vit_layers.TransformerBlock)]
    by_name = {layer.name: layer for layer in model.layers}
    config = getattr(model, "vit_config", None)
    image = model.inputs[0]
    height, width = image.shape[1:3]
    input_size = None if height is None or width is None else (int(height), int(width))
    if config is not None:
        stride = (config.stride, config.stride)
        num_prefix_tokens, class_token = config.num_prefix_tokens, config.class_token
    else:
        stride = position.patch_stride or (height // position.grid_size[0], width // position.grid_size[1])
        num_prefix_tokens = sum(layer.num_tokens if isinstance(layer, vit_layers.RegisterTokens) else 1
                                for layer in model.layers
                                if isinstance(layer, (vit_layers.ClassToken, vit_layers.RegisterTokens)))
        class_token = any(isinstance(layer, vit_layers.ClassToken) for layer in model.layers)
    grid = position.grid_size if input_size is None else (input_size[0] // stride[0], input_size[1] // stride[1])
    pixel_input = PREPROCESSING in by_name
    preprocessing = getattr(model, "preprocessing_config", None) or PreprocessingConfig()  # the original's [-1, 1]
    mean, std = preprocessing.image_mean, preprocessing.image_std
    value_range = PIXEL_RANGE if pixel_input else (min(-m / s for m, s in zip(mean, std)),
                                                   max((1 - m) / s for m, s in zip(mean, std)))
    encoder_norm = by_name.get(ENCODER_NORM)
    head = next((by_name[name] for name in HEAD_NAMES if name in by_name), None)
    if head is not None:
        pooled = (by_name[CLASS_TOKEN_HEAD] if head.name == "head_average" else head).input
    else:
        output = model.outputs[0]
        pooled = output if len(output.shape) == 2 else None
    return ModelGeometry(input_size=input_size, stride=tuple(stride), grid=tuple(grid),
                         num_prefix_tokens=num_prefix_tokens, class_token=class_token, pixel_input=pixel_input,
                         value_range=value_range, image=image, patch_embedding=patch_embedding,
                         position_embedding=position, encoder_norm=encoder_norm,
                         encoder_end=encoder_norm or (blocks[-1] if blocks else None), pooled=pooled, head=head,
                         config=config)


def is_naflex_model(model: keras.Model) -> bool:
    """Whether `model` is a NaFlex ViT (`keras_vit.naflex.NaFlexViT`: it takes patch sequences and has a
    `NaFlexPositionEmbedding`), whose geometry is each image's own."""
    return any(isinstance(layer, vit_layers.NaFlexPositionEmbedding) for layer in model.layers)


def _only(model: keras.Model, layer_type: type) -> keras.layers.Layer:
    """The model's one top-level layer of `layer_type`."""
    found = [layer for layer in model.layers if isinstance(layer, layer_type)]
    if not found:
        vit_layers.transformer_blocks(model)  # its error names a nested keras_vit model, or says there is none
    if len(found) != 1:
        raise ValueError(f"Model {model.name!r} has {len(found)} {layer_type.__name__} layers; expected one, as a "
                         "keras_vit model (keras_vit.VisionTransformer, ViTB16, ...).")
    return found[0]
