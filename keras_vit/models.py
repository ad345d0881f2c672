"""Functional Vision Transformer models, called like `keras.applications`.

`VisionTransformer(variant, **options)` is the one builder: its options are the fields of
`keras_vit.variants.ViTConfig` (the forward), merged over the variant's row and the fields a checkpoint file
fixes, and those of `keras_vit.variants.PreprocessingConfig` (the input), over what the file's processor declares;
`ViTB16`, `R50ViTB16`, ... are thin wrappers over it for one row of the variant table. The forward pass
(`_forward`) reads in paper order: preprocessing, (ResNet stem), patch embedding, class token, position
embedding, encoder blocks, final norm, pooling, pre-logits, head. Nothing here opens a file: the checkpoint
reader (`keras_vit.checkpoints`) reads one once and the loader loads it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Sequence

import keras

from keras_vit import layers as vit_layers
from keras_vit import naflex, resnet
from keras_vit import variants
from keras_vit.checkpoints import loader as checkpoint_loader
from keras_vit.checkpoints import naflex_file
from keras_vit.checkpoints.reader import CheckpointFile
from keras_vit.kernels.routed_layers import LayerNormalization
from keras_vit.variants import PreprocessingConfig, ViTConfig
from keras_vit.variants import CLASSIFIERS  # noqa: F401  (CLASSIFIERS: the 0.2 name; 0.4 removes it)
from keras_vit.vit_model import FLOAT_LAYERS, CpuKernelSteps, ViTModel  # noqa: F401  (the 0.2 paths)

POOLINGS = (*vit_layers.POOLINGS, "map")


def _validate(*, include_top: bool, pooling: str | None, classes: int, config: ViTConfig, classifier_activation,
              weights_source) -> None:
    if pooling is not None and pooling not in POOLINGS:
        hint = " (global average pooling is spelled pooling='avg' here, classifier='gap' in the model)" \
            if pooling == "gap" else ""
        raise ValueError(f"Unknown pooling {pooling!r}. Expected None or one of {POOLINGS}{hint}.")
    if pooling in ("token", "token_avg") and not config.class_token and not include_top:
        raise ValueError(f"pooling={pooling!r} needs a class token, but classifier={config.classifier!r} has none. "
                         "Use pooling='avg' or classifier='token'.")
    if pooling == "map" and config.classifier != "map" and not include_top:
        raise ValueError(f"pooling='map' is the attention-pooling head of classifier='map'. Received: "
                         f"classifier={config.classifier!r}; use pooling='token' or 'avg', or classifier='map'.")
    if not isinstance(classes, int) or classes < 1:
        raise ValueError(f"`classes` must be a positive int. Received: classes={classes!r}")
    if weights_source is not None and include_top and classifier_activation not in (None, "softmax"):
        raise ValueError("With pretrained weights and include_top=True, classifier_activation must be None "
                         f"or 'softmax'. Received: classifier_activation={classifier_activation!r}")


def _image_input(input_tensor, input_shape, stride: int, pretrained: bool, default_size: tuple[int, int]):
    """Returns the model's image input tensor after checking its shape (a `None` height or width: any size;
    `default_size` without `input_shape` or `input_tensor`: the checkpoint's own, else 224)."""
    if input_tensor is not None:
        image = input_tensor if keras.backend.is_keras_tensor(input_tensor) else keras.Input(tensor=input_tensor)
        shape = tuple(image.shape[1:])
        if input_shape is not None and (len(input_shape) != len(shape) or any(
                given is not None and size is not None and given != size for given, size in zip(input_shape, shape))):
            raise ValueError(f"`input_shape` {tuple(input_shape)} differs from the shape of `input_tensor`, {shape}. "
                             "Expected one of them, or the same shape.")
    else:
        shape = tuple(input_shape) if input_shape is not None else (*default_size, 3)
        image = None
    if len(shape) != 3:
        raise ValueError(f"`input_shape` must be (height, width, channels). Received: {shape}")
    height, width, channels = shape
    if channels is None or channels < 1 or (pretrained and channels != 3):
        expected = "3 (RGB), as the pretrained weights" if pretrained else "a positive number of"
        raise ValueError(f"Wrong channel count: input has {channels} channels; expected {expected} channels.")
    for size, axis in ((height, "height"), (width, "width")):
        if size is not None and size % stride:
            raise ValueError(f"Input {axis} {size} is not divisible by the model's patch stride {stride}. "
                             f"Expected a multiple of {stride}, e.g. {max(stride, size // stride * stride)}.")
    return (image if image is not None else keras.Input(shape=shape, name="image")), shape


def model_config(variant: str | None = None, file: CheckpointFile | None = None, **options) -> ViTConfig:
    """The `ViTConfig` of `VisionTransformer(variant, weights=file, **options)`: the fields the file fixes, then
    the variant's row, then the options given (`None`: not given).

    Raises:
        TypeError: an unknown option, naming the closest valid one.
        ValueError: an option that contradicts the file's config.json, missing architecture fields, or an
            invalid value.
    """
    if file is None:
        return variants.make_config(variant, None, options)
    row = variants.variant_row(variant) if variant else {}
    given = {**row, **{name: value for name, value in options.items() if value is not None}}
    file.check_agrees(given)
    config = variants.make_config(variant, file.config_fields(given.get("num_heads")), options)
    if file.heads_guessed(given.get("num_heads")):
        warnings.warn(f"keras_vit: {file.path!r} does not state its number of heads (no config.json beside it says "
                      f"it): num_heads={config.num_heads} is guessed from the variant of the same shapes. Give "
                      "num_heads= (or the variant) if the model has another.", stacklevel=3)
    return config


def preprocessing_config(file: CheckpointFile | None = None, **options) -> PreprocessingConfig:
    """The `PreprocessingConfig` of `VisionTransformer(weights=file, **options)`: what the file's processor
    declares, then the input options given (`None`: not given), each given one that differs from the declared
    value with a one-line warning (the given value is used)."""
    declared = (file.preprocessing if file is not None else None) or {}
    preprocessing = variants.make_preprocessing(declared, options)
    for name, value in declared.items():
        if getattr(preprocessing, name) != value:
            warnings.warn(f"keras_vit: {name}={getattr(preprocessing, name)!r} overrides the checkpoint's "
                          f"{name}={value!r} ({file.preprocessing_source}).", stacklevel=3)
    return preprocessing


def VisionTransformer(
    variant: str | None = None,
    *,
    include_top: bool = True,
    weights: str | CheckpointFile | None = None,
    input_tensor=None,
    input_shape: Sequence[int | None] | None = None,
    pooling: str | None = None,
    classes: int = 1000,
    classifier_activation: str | Callable | None = "softmax",
    include_preprocessing: bool = True,
    name: str = "vision_transformer",
    **options: Any,
) -> keras.Model:
    """Builds a Vision Transformer of any size (arXiv:2010.11929).

    Args:
        variant: optional variant name ("B/16", "R50+B/16", ...) whose row fills the architecture options not
            given; needed for registered `weights` names.
        **options: the fields of `keras_vit.variants.ViTConfig`: the architecture (`patch_size`, `hidden_dim`,
            `mlp_dim`, `num_heads`, `num_layers`, `resnet_stages`; patch size on the image, or on the ResNet
            feature map for hybrids), the ViT family's options and the numerics. With `weights=` an `.npz` or
            `.safetensors` file, those not given are read from the file (timm and Hugging Face files do not
            store `num_heads`: give it, or keep the Hugging Face `config.json` beside the file). An unknown
            name is a TypeError naming the closest valid one.
        Other arguments: as the variant builders (`help(keras_vit.ViTB16)`); `weights` defaults to `None` here.
    """
    variants.check_options(options, "VisionTransformer", variants.BUILDER_OPTIONS)  # before any file is read
    file = checkpoint_loader.local_file(weights)  # one read of its header, carried to the loader
    if file is not None and file.layout == naflex_file.LAYOUT:  # SigLIP 2 NaFlex: each image's own patch grid
        given = dict(variant=variant, input_tensor=input_tensor, input_shape=input_shape, **options)
        return naflex.from_checkpoint(file.naflex, given=given, pooling=pooling,
                                      include_preprocessing=include_preprocessing, name=name)
    if file is not None:
        file.check_preprocessing(options, include_preprocessing)
    forward_options, input_options = variants.split_options(options)
    config = model_config(variant, file, **forward_options)
    if file is not None and file.shapes and file.pooling == "map" and not include_top and pooling != "map":
        raise ValueError(f"{file.path!r} pools with an attention-pooling head (classifier='map', SigLIP): pass "
                         f"pooling='map' for its pooled embedding (received pooling={pooling!r}); for the "
                         "tokens, build with pooling='map' and use keras_vit.features_model(model).")
    default_size = file.input_size if file is not None and file.input_size else (224, 224)
    image, image_shape = _image_input(input_tensor, input_shape, config.stride, pretrained=weights is not None,
                                      default_size=default_size)
    preprocessing = _declared_resize_at(preprocessing_config(file, **input_options), file, image_shape,
                                        resize_size_given=input_options.get("resize_size") is not None)
    weights_source = checkpoint_loader.resolve(file or weights, variant=variant, image_size=image_shape[:2],
                                               include_top=include_top, classes=classes)
    _validate(include_top=include_top, pooling=pooling, classes=classes, config=config,
              classifier_activation=classifier_activation, weights_source=weights_source)
    if config.representation_size is None and weights_source is not None and weights_source.representation_size:
        # ImageNet-21k checkpoints end in pre_logits (Dense + tanh): build it when their head is used.
        config = dataclasses.replace(config, representation_size=weights_source.representation_size)
    checkpoint_size = file.image_size if file is not None and None in image_shape[:2] else None
    outputs = _forward(image, config, include_top=include_top, pooling=pooling, classes=classes,
                       classifier_activation=classifier_activation,
                       normalization=preprocessing if include_preprocessing else None,
                       grid_size=_grid_size(image_shape, config.stride, checkpoint_size, weights_source))
    inputs = keras.utils.get_source_inputs(input_tensor) if input_tensor is not None else image
    model = ViTModel(inputs, outputs, name=name, vit_config=config, preprocessing_config=preprocessing)
    if weights_source is not None:
        checkpoint_loader.load(model, weights_source)
    return model


def _declared_resize_at(preprocessing: PreprocessingConfig, file: CheckpointFile | None,
                        image_shape: tuple, resize_size_given: bool) -> PreprocessingConfig:
    """`preprocessing` whose declared `resize_size` (the integer a processor declares for its own size) applies
    only where the model's images are that size: a model built at another size resizes by `crop_fraction`
    (timm's rule). A `resize_size` the user gives is kept."""
    if file is None or preprocessing.resize_size is None or resize_size_given:
        return preprocessing
    height, width = image_shape[:2]
    size = (height, width) if height is not None and width is not None else (file.image_size, file.image_size)
    return preprocessing if tuple(size) == file.input_size else dataclasses.replace(preprocessing, resize_size=None)


def _grid_size(image_shape: tuple, stride: int, checkpoint_size: int | None, weights_source) -> tuple[int, int]:
    """The patch grid the position embedding is stored for: the input's; for a model of any input size (a `None`
    height or width), the checkpoint's (`checkpoint_size` of a file, or the registered checkpoint's), so that its
    table loads as it is (the default size 224 without one)."""
    height, width = image_shape[:2]
    if height is not None and width is not None:
        return height // stride, width // stride
    if checkpoint_size is None and weights_source is not None and weights_source.checkpoint is not None:
        checkpoint_size = weights_source.checkpoint.image_size
    size = checkpoint_size or 224
    return size // stride, size // stride


def _forward(image, config: ViTConfig, *, include_top: bool, pooling: str | None, classes: int,
             classifier_activation, normalization: PreprocessingConfig | None, grid_size: tuple[int, int]):
    """The ViT forward pass on a symbolic image tensor, in paper order (`normalization`: that of [0, 255] pixels,
    or None for a model that takes normalized input)."""
    x = image
    if normalization is not None:
        # (x / 255 - mean) / std: the original's x / 127.5 - 1 by default.
        scale, offset = normalization.pixel_normalization()
        x = keras.layers.Rescaling(scale, offset=offset, name="preprocessing")(x)
    if config.resnet_stages:
        x = resnet.resnet_stem(x, config.resnet_stages)
    x = vit_layers.PatchEncoder(config.hidden_dim, config.patch_size, use_bias=config.patch_bias, name="embedding")(x)
    prefix = config.class_token + config.distillation_token
    embedded_prefix = 0 if config.no_embed_class else prefix  # the prefix tokens the position table covers
    if embedded_prefix:
        x = vit_layers.ClassToken(name="cls")(x)
    if config.distillation_token:  # DeiT: [class, distillation, patches], both with a position
        x = vit_layers.RegisterTokens(1, position=1, name="dist_token")(x)
    any_size = None in image.shape[1:3]  # then the table is fitted to each image's grid
    position = vit_layers.PositionEmbedding(grid_size, embedded_prefix, config.position_embedding,
                                            name="posembed_input", patch_stride=config.stride if any_size else None,
                                            resampling=config.position_resampling)
    x = position(x, image) if any_size else position(x)
    if config.num_register_tokens:
        x = vit_layers.RegisterTokens(config.num_register_tokens, position=embedded_prefix, name="registers")(x)
    if prefix and not embedded_prefix:
        x = vit_layers.ClassToken(name="cls")(x)
    x = keras.layers.Dropout(config.dropout_rate, name="dropout")(x)
    if config.norm_pre:
        x = LayerNormalization(epsilon=config.layer_norm_epsilon, name="norm_pre")(x)
    rotary = {}
    if config.rope is not None:  # the angles of q and k, from each image's own patch grid
        rotary["rotary"] = vit_layers.RotaryPositionEmbedding(
            config.hidden_dim // config.num_heads, config.stride, config.num_prefix_tokens, config.rope_theta,
            config.rope_shift, config.rope_jitter, config.rope_rescale, form=config.rope,
            reference_grid=config.rope_reference_grid, name="rope")(image)
    block_arguments = config.arguments_of(vit_layers.TransformerBlock)
    for i in range(config.num_layers):
        rate = config.drop_path_rate * i / max(config.num_layers - 1, 1)  # rising linearly over the blocks
        x = vit_layers.TransformerBlock(**dict(block_arguments, drop_path_rate=rate), name=f"encoderblock_{i}")(
            x, **rotary)
    if not config.fc_norm:
        x = LayerNormalization(epsilon=config.layer_norm_epsilon, name="encoder_norm")(x)
    if not include_top and pooling is None:
        return x
    tokens = x
    if config.classifier == "map" and (include_top or pooling == "map"):
        x = vit_layers.MAPHead(**config.arguments_of(vit_layers.MAPHead), name="MAPHead_0")(x)
    else:
        x = vit_layers.TokenPooling(*_token_pooling(config, include_top, pooling), name="pool")(x)
    if config.fc_norm:
        x = LayerNormalization(epsilon=config.layer_norm_epsilon, name="fc_norm")(x)
    if config.representation_size:
        x = keras.layers.Dense(config.representation_size, activation="tanh", name="pre_logits")(x)
    if not include_top:
        return x
    x = keras.layers.Dense(classes, kernel_initializer="zeros", name="head", dtype="float32")(x)
    if config.distillation_token:  # DeiT in inference: the mean of the class token's head and the distillation one
        distillation = vit_layers.TokenPooling("distillation", name="pool_distillation")(tokens)
        distillation = keras.layers.Dense(classes, kernel_initializer="zeros", name="head_dist",
                                          dtype="float32")(distillation)
        x = keras.layers.Average(name="head_average", dtype="float32")([x, distillation])
    if classifier_activation is not None:
        x = keras.layers.Activation(classifier_activation, name="predictions", dtype="float32")(x)
    return x


def _token_pooling(config: ViTConfig, include_top: bool, pooling: str | None) -> tuple[str, int]:
    """The `TokenPooling` method and prefix rows left out of its mean, for the head (`include_top`) or `pooling`."""
    if config.fc_norm:
        method = "avg"
    elif include_top and config.classifier == "token_gap":
        method = "token_avg"
    elif include_top and config.classifier == "patch_gap":
        method = "avg"
    elif include_top and config.class_token + config.distillation_token:
        method = "token"
    else:
        method = pooling or "avg"
    # Models of 0.2.0 average every token; with the family's options, the patch tokens only (as timm).
    patches_only = (config.num_register_tokens or config.fc_norm or method == "token_avg"
                    or config.classifier == "patch_gap")
    return method, config.num_prefix_tokens if patches_only else 0


BASE_DOCSTRING = """Builds {paper_name} (arXiv:2010.11929), keras.applications style.

Args:
    include_top: bool. Include the classification head (and pre-logits). Defaults to `True`.
    weights: `None` (random initialization), a registered checkpoint name (see
        `keras_vit.list_weights("{variant}")`), or a path to an original `.npz` checkpoint, a
        Keras `.weights.h5` file, or a timm / Hugging Face ViT `.safetensors` file (whose
        numerics, exact GELU and LayerNorm epsilon, the model then takes), a `save_pretrained`
        directory, or `hf://org/name[@revision]` from the local Hugging Face cache. `"imagenet"` picks
        the best ImageNet-1k checkpoint for the input size (one fine-tuned at that size if
        registered, else the 384 one). `.npz` and `.safetensors` weights load at any input
        size: position embeddings are resampled like the original
        loader does. Registered files are downloaded once into the Keras cache
        (`~/.keras/models`). With `include_top=True`, `classes` must be the checkpoint's
        (1000 for `"imagenet"`), as in `keras.applications`; to fine-tune, build with
        `include_top=False` and add a head. Defaults to `"imagenet"`.
    input_tensor: optional Keras tensor to use as the image input.
    input_shape: (height, width, channels); height and width divisible by {stride}, or
        `(None, None, channels)` for any size at run time (multiples of {stride}): the position
        embedding, stored at the checkpoint's grid, is fitted to each image's grid inside the
        model, as the loader resamples it. Defaults to the checkpoint's own size: the images its declared
        transform produces (a `preprocessor_config.json`'s crop, timm's `input_size`), else its config.json's
        `image_size`, else the size its position table was trained at; `(224, 224, 3)` without a file. A size
        that differs from the file's is the user's choice: the position table is resampled, said in one line.
    pooling: with `include_top=False`: `None` returns the token sequence
        (batch, tokens, {hidden_dim}) after the final norm; `"token"` (class token), `"avg"`
        (mean of all tokens), `"token_avg"` ([class token; mean patch token], twice as wide: what DINOv2's
        and DINOv3's linear classifiers read) or `"map"` (the attention-pooling head of
        `classifier="map"`) return a vector. Ignored with `include_top=True`. `pooling="avg"` is the same operation as
        `classifier="gap"`: `classifier` says how the model was trained (with or without a class
        token), `pooling` what a backbone returns.
    classes: int. Number of classes of the head. Defaults to `1000`.
    classifier_activation: str or callable for the head's output, `None` for logits.
        Defaults to `"softmax"`.
    include_preprocessing: bool. `True`: the model takes raw pixels in [0, 255] and normalizes them
        inside with the checkpoint's own mean and std, `(x / 255 - image_mean) / image_std` (read from a
        `preprocessor_config.json` or timm `config.json` beside `weights=`; else mean = std = 0.5, the
        original's [-1, 1]); `False`: it takes the normalized input. Defaults to `True`.
    name: str. Model name. Defaults to `"{model_name}"`.
    **options: the fields of `keras_vit.variants.ViTConfig`, as keywords (`qk_norm=True`). One not given
        (or given as `None`) takes the value of a weights file that fixes it, else its default below. An
        unknown name is a TypeError that names the closest valid one. The architecture fields
        (`patch_size`, `hidden_dim`, `mlp_dim`, `num_heads`, `num_layers`, `resnet_stages`) default to the
        variant's row.
    classifier: `"token"` (class token, the paper's default), `"gap"` (global average
        pooling, no class token), `"map"` (no class token; multihead attention pooling, `MAPHead`:
        SigLIP, big_vision), `"token_gap"` (a class token; the head reads [class token; mean patch
        token]: DINOv2's ImageNet classifiers, transformers' `Dinov2ForImageClassification`) or
        `"patch_gap"` (a class token; the head reads the mean patch token: timm's `global_pool="avg"`
        without `fc_norm`, as its DINOv3 models pool). Defaults to `"token"` (in `VisionTransformer`:
        that of `weights=` a checkpoint file, else `"token"`).
    representation_size: optional int. Width of a `pre_logits` Dense + tanh layer before the
        head (the ImageNet-21k pre-training head). Defaults to `None`: no such layer, except
        that pretrained weights whose head is loaded (`include_top=True` and the checkpoint's
        `classes`) bring their own (e.g. `weights="imagenet21k"`, 21843 classes).
    position_embedding: `"learned"`, `"learned_2d"`, `"sincos_2d"` or `"none"`: the table added to the tokens.
        Defaults to `"learned"` (that of `weights=` a DINOv3 file: `"none"`).
    rope: optional `"dinov3"` or `"eva02"`: q and k of the patch tokens rotated by their positions
        (`RotaryPositionEmbedding`, from each image's own grid; DINOv3's centred coordinates or EVA-02's patch
        indices). Defaults to `None` (that of `weights=` a DINOv3 or EVA-02 file: its form).
    rope_theta: float. The base period of the rotary frequencies, theta ** (-4 j / head_dim). Defaults to `100.0`
        (DINOv3's; EVA-02's is 10000; a file's config fixes it).
    rope_reference_grid: optional (rows, columns), with `rope="eva02"`: EVA-02 measures positions in patches of
        its pre-training grid (timm's `ref_feat_shape`, (16, 16)). Defaults to `None` (that of an EVA-02 file).
    rope_shift, rope_jitter, rope_rescale: optional floats. DINOv3's train-time augmentations of the rotary
        coordinates (shift in [-shift, shift]; log-uniform scale per axis in [1 / jitter, jitter]; one for both
        axes in [1 / rescale, rescale]), in training only. Default to `None` (off; a DINOv3 file's, e.g.
        `rope_rescale=2.0`).
    position_resampling: how a model of any input size (`input_shape=(None, None, 3)`) fits its table to each
        image's grid: `"linear_corners"` (the original's), `"bicubic"` (transformers') or `"bicubic_antialias"`
        (timm's). Defaults to that of `weights=` a timm or Hugging Face file, else `"linear_corners"`; the
        loader resizes a file's table to a fixed input size the same way.
    dropout_rate: float. Dropout after the position embedding, attention and in the MLP.
    attention_dropout_rate: float. Dropout on attention weights.
    drop_path_rate: float. Stochastic depth, rising linearly from 0 to this rate over the blocks.
    Options of the ViT family (DeiT-III, DINOv2, DINOv3, CLIP; timm's names in brackets):
    activation: optional `"gelu"` (as `gelu_approximate` says), `"quick_gelu"` (OpenAI CLIP) or `"silu"`
        (DINOv3 H+ / 7B). Defaults to `None`: as `layer_norm_epsilon`, the checkpoint's, else `"gelu"`.
    gated_mlp: bool. The SwiGLU MLP, `Dense_1(act(Dense_gate(x)) * Dense_0(x))` (`use_gated_mlp`: DINOv3 H+ /
        7B, EVA-02). Defaults to `False` (that of `weights=` a file with a gate).
    mlp_norm: bool. A LayerNorm on the MLP's hidden layer, before `Dense_1` (`scale_mlp`: EVA-02 B / L). Defaults
        to `False` (that of `weights=` a file with one).
    layer_scale_init: optional float. Per-channel learned scales of every residual branch, starting at
        this value (`init_values`). Defaults to `None`: none.
    qk_norm: bool. LayerNorm each head's q and k (`qk_norm`). Defaults to `False`.
    num_register_tokens: int. Learned register tokens after the class token, without a position
        (`reg_tokens`; DINOv2 uses 4). Defaults to `0`.
    no_embed_class: bool. The position embedding covers only the patches; the class token is prepended
        after it is added (`no_embed_class`: DeiT-III). Defaults to `False`.
    norm_pre: bool. A LayerNorm after the embedding, before the blocks (`norm_pre`: CLIP). Defaults to
        `False`.
    patch_bias: bool. The patch embedding has a bias (`False`: CLIP's has none). Defaults to `True`.
    fc_norm: bool. Instead of the final norm of every token, a LayerNorm after the average of the patch
        tokens, which the head then pools (`global_pool="avg", fc_norm=True`). Defaults to `False`.
    distillation_token: bool. DeiT's distillation token after the class token, with a position; the head is
        then the mean of `head` (class token) and `head_dist` (distillation token), as DeiT's inference.
        Needs `classifier="token"`; not with registers, `no_embed_class` or `fc_norm`. Defaults to `False`.
    remat: bool. Rematerialize each encoder block in training (gradient checkpointing): activation
        memory of one block instead of all, for about a third more compute. Needs `dropout_rate`,
        `attention_dropout_rate` and `drop_path_rate` at 0. Defaults to `False`.
    layer_norm_epsilon: optional float. Epsilon of every LayerNorm. Defaults to `None`: for a
        `.safetensors` file, that of the Hugging Face `config.json` beside it, else the layout's default
        (timm 1e-6; Hugging Face ViT / DeiT 1e-12, DINOv2 1e-6, CLIP 1e-5, SigLIP 1e-6); else the
        original's 1e-6. The files do not store it: give it for a timm CLIP (1e-5). A value that
        contradicts a `config.json` is an error.
    gelu_approximate: optional bool. `True`: tanh-approximate GELU (the original's, SigLIP's);
        `False`: exact erf GELU (timm's and Hugging Face's). Defaults to `None`: as
        `layer_norm_epsilon` (`True` for `.npz` files).
    Input options (defaults: those declared beside `weights=`, else the original's):
    image_mean, image_std: 3 floats on [0, 1] pixels. Defaults to `(0.5, 0.5, 0.5)` each. A value that
        differs from the checkpoint's is used, with a one-line warning.
    resize_mode, crop_fraction, resize_size, interpolation, crop_offset: how the exports (`keras-vit-export`,
        `keras-vit-tflite`) fit an image of another size: `"squash"` both sides or `"shortest_edge"` the short
        side to `resize_size` (the integer a processor declares, used as it is at the checkpoint's own size), or
        without one to `floor(size / crop_fraction)` (timm's `crop_pct` rule, and the rule at any other size),
        then a centre crop of the model's size whose corner is `(resized - size) // 2` (`"floor"`, transformers)
        or rounded (`"round"`, torchvision); `"bilinear"`, `"bicubic"`, `"nearest"` or `"lanczos3"`
        (antialiased when shrinking). Defaults to `"squash"`, `1.0`, `None`, `"bilinear"`, `"floor"`.

Returns:
    A `keras_vit.ViTModel` (a functional `keras.Model`); its `vit_config` is the `ViTConfig` it was built from,
    its `preprocessing_config` the `PreprocessingConfig` (the input options).
"""


def _make_builder(builder_name: str, variant: str) -> Callable[..., keras.Model]:
    """A thin public builder (`ViTB16`, ...) for one row of the variant table."""
    model_name = "vit_" + variant.lower().replace("+", "_").replace("/", "")

    def builder(include_top: bool = True, weights: str | None = "imagenet", input_tensor=None,
                input_shape: Sequence[int | None] | None = None, pooling: str | None = None,
                classes: int = 1000, classifier_activation: str | Callable | None = "softmax",
                include_preprocessing: bool = True, name: str = model_name, **options: Any) -> keras.Model:
        variants.check_options(options, builder_name, variants.BUILDER_OPTIONS)
        return VisionTransformer(
            variant, include_top=include_top, weights=weights, input_tensor=input_tensor, input_shape=input_shape,
            pooling=pooling, classes=classes, classifier_activation=classifier_activation,
            include_preprocessing=include_preprocessing, name=name, **options)

    config = variants.VARIANTS[variant]
    paper_name = variant.replace("+", "+ViT-") if "+" in variant else f"ViT-{variant}"
    builder.__name__ = builder.__qualname__ = builder_name
    builder.variant = variant
    builder.__doc__ = BASE_DOCSTRING.format(paper_name=paper_name, variant=variant,
                                            stride=variants.total_stride(config),
                                            hidden_dim=config["hidden_dim"], model_name=model_name)
    return builder


ViTTi16 = _make_builder("ViTTi16", "Ti/16")
ViTS16 = _make_builder("ViTS16", "S/16")
ViTS32 = _make_builder("ViTS32", "S/32")
ViTB8 = _make_builder("ViTB8", "B/8")
ViTB16 = _make_builder("ViTB16", "B/16")
ViTB32 = _make_builder("ViTB32", "B/32")
ViTL16 = _make_builder("ViTL16", "L/16")
ViTL32 = _make_builder("ViTL32", "L/32")
ViTH14 = _make_builder("ViTH14", "H/14")
R50ViTB16 = _make_builder("R50ViTB16", "R50+B/16")
R26ViTS32 = _make_builder("R26ViTS32", "R26+S/32")
R50ViTL32 = _make_builder("R50ViTL32", "R50+L/32")

BUILDERS: dict[str, Callable[..., keras.Model]] = {
    builder.__name__: builder
    for builder in (ViTTi16, ViTS16, ViTS32, ViTB8, ViTB16, ViTB32, ViTL16, ViTL32, ViTH14, R50ViTB16,
                    R26ViTS32, R50ViTL32)
}
