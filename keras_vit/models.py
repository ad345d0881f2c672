"""Functional Vision Transformer models, called like `keras.applications`.

`VisionTransformer(...)` is the one generic builder; `ViTB16`, `R50ViTB16`, ... are thin
wrappers over it that read the variant table (`keras_vit.variants`). The forward pass
reads in paper order: preprocessing, (ResNet stem), patch embedding, class token,
position embedding, encoder blocks, final norm, pooling, pre-logits, head.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import keras

from keras_vit import kernels
from keras_vit import layers as vit_layers
from keras_vit import resnet
from keras_vit import variants
from keras_vit.checkpoints import loader as checkpoint_loader
from keras_vit.checkpoints import torch_layout
from keras_vit.checkpoints.architecture import ARCHITECTURE_ARGUMENTS, checkpoint_shapes, read_architecture

CLASSIFIERS = ("token", "gap", "map")
POOLINGS = (*vit_layers.POOLINGS, "map")

BASE_DOCSTRING = """Builds {paper_name} (arXiv:2010.11929), keras.applications style.

Args:
    include_top: bool. Include the classification head (and pre-logits). Defaults to `True`.
    weights: `None` (random initialization), a registered checkpoint name (see
        `keras_vit.list_weights("{variant}")`), or a path to an original `.npz` checkpoint, a
        Keras `.weights.h5` file, or a timm / Hugging Face ViT `.safetensors` file (whose
        numerics, exact GELU and LayerNorm epsilon, the model then takes). `"imagenet"` picks
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
        model, as the loader resamples it. Defaults to `(224, 224, 3)`.
    pooling: with `include_top=False`: `None` returns the token sequence
        (batch, tokens, {hidden_dim}) after the final norm; `"token"` (class token), `"avg"`
        (mean of all tokens) or `"map"` (the attention-pooling head of `classifier="map"`) return a
        vector. Ignored with `include_top=True`. `pooling="avg"` is the same operation as
        `classifier="gap"`: `classifier` says how the model was trained (with or without a class
        token), `pooling` what a backbone returns.
    classes: int. Number of classes of the head. Defaults to `1000`.
    classifier_activation: str or callable for the head's output, `None` for logits.
        Defaults to `"softmax"`.
    include_preprocessing: bool. `True`: the model takes raw pixels in [0, 255] and
        maps them to [-1, 1] inside; `False`: it takes [-1, 1]. Defaults to `True`.
    classifier: `"token"` (class token, the paper's default), `"gap"` (global average
        pooling, no class token) or `"map"` (no class token; multihead attention pooling, `MAPHead`:
        SigLIP, big_vision). Defaults to `"token"` (in `VisionTransformer`: that of `weights=` a checkpoint
        file, else `"token"`).
    representation_size: optional int. Width of a `pre_logits` Dense + tanh layer before the
        head (the ImageNet-21k pre-training head). Defaults to `None`: no such layer, except
        that pretrained weights whose head is loaded (`include_top=True` and the checkpoint's
        `classes`) bring their own (e.g. `weights="imagenet21k"`, 21843 classes).
    position_embedding: `"learned"`, `"learned_2d"`, `"sincos_2d"` or `"none"`.
        Defaults to `"learned"`.
    dropout_rate: float. Dropout after the position embedding, attention and in the MLP.
    attention_dropout_rate: float. Dropout on attention weights.
    drop_path_rate: float. Stochastic depth, rising linearly from 0 to this rate over the blocks.
    Options of the ViT family (DeiT-III, DINOv2, CLIP; timm's names in brackets):
    activation: optional `"gelu"` (as `gelu_approximate` says) or `"quick_gelu"` (OpenAI CLIP). Defaults to
        `None`: as `layer_norm_epsilon`, the checkpoint's, else `"gelu"`.
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
    name: str. Model name. Defaults to `"{model_name}"`.

Returns:
    A `keras_vit.ViTModel` (a functional `keras.Model`).
"""


LORA_NAMES = ("query", "key", "value", "attention_output", "Dense_0", "Dense_1")
LORA_TARGETS = ("query", "value")


def _block_projections(block: vit_layers.TransformerBlock) -> dict[str, keras.layers.Layer]:
    attention, mlp = block.attention, block.mlp
    return dict(zip(LORA_NAMES, (attention.query_dense, attention.key_dense, attention.value_dense,
                                 attention.output_dense, mlp.dense_0, mlp.dense_1)))


class CpuKernelSteps:
    """Mixin for a `keras.Model`: its `fit` / `evaluate` / `predict` steps may use the machine's
    CPU kernels (`keras_vit.kernels.cpu_kernels`); nothing else changes."""

    # The steps' signatures differ by backend (JAX passes its state too): pass them on as they come.
    def train_step(self, *args, **kwargs):
        with kernels.cpu_kernels(not self.jit_compile, training=True):  # XLA compiles the whole step: portable ops
            return super().train_step(*args, **kwargs)

    def test_step(self, *args, **kwargs):
        with kernels.cpu_kernels(not self.jit_compile):
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args, **kwargs):
        with kernels.cpu_kernels(not self.jit_compile):
            return super().predict_step(*args, **kwargs)


@keras.saving.register_keras_serializable(package="keras_vit")
class ViTModel(CpuKernelSteps, keras.Model):
    """A functional `keras.Model` (`ViTModel(inputs, outputs)`) whose `fit` / `evaluate` /
    `predict` steps may use the machine's CPU kernels (`keras_vit.kernels`).

    The builders return one. Everything else is `keras.Model`: its `__call__`, exports and
    your own `tf.function`s compute with the portable ops. Wrap a keras_vit backbone in
    `ViTModel` rather than `keras.Model` (e.g. to add a head) to keep those kernels; with
    `keras.Model` the wrapper is just as correct, on the portable ops.
    """

    def enable_lora(self, rank: int, target_names: Sequence[str] = LORA_TARGETS) -> None:
        """Low-rank adaptation (Hu et al. 2021) of the encoder, as keras-hub's `Backbone.enable_lora`.

        Every weight is frozen except, in each encoder block, the projections named in `target_names`
        (of `query`, `key`, `value`, `attention_output`, `Dense_0`, `Dense_1`), which Keras'
        `enable_lora(rank)` gives a trainable rank-`rank` update of their frozen kernel (their bias stays
        trainable, as in Keras). Defaults to the attention's query and value.
        """
        unknown = set(target_names) - set(LORA_NAMES)
        if unknown:
            raise ValueError(f"Unknown LoRA targets {sorted(unknown)}. Expected some of {LORA_NAMES}.")
        for layer in self.layers:
            if not isinstance(layer, vit_layers.TransformerBlock):
                layer.trainable = False
                continue
            layer.norm_attention.trainable = layer.norm_mlp.trainable = False
            for name, projection in _block_projections(layer).items():
                if name in target_names:
                    projection.enable_lora(rank)
                else:
                    projection.trainable = False

    def load_weights(self, filepath, *args, **kwargs):
        """`keras.Model.load_weights` (Keras files); says to use `keras_vit.load_weights` for checkpoints."""
        if os.fspath(filepath).endswith((".npz", ".safetensors")):
            raise ValueError(f"Model.load_weights reads Keras weights files (.weights.h5), not the original "
                             f"checkpoint {os.fspath(filepath)!r}: use `keras_vit.load_weights(model, path)`, which "
                             "maps its keys and resizes position embeddings.")
        return super().load_weights(filepath, *args, **kwargs)


def _validate(*, include_top, pooling, classes, classifier, position_embedding, classifier_activation,
              weights_source) -> None:
    if classifier not in CLASSIFIERS:
        hint = " (the model's own pooling is spelled classifier='gap'; pooling='avg' is the output pooling)" \
            if classifier == "avg" else ""
        raise ValueError(f"Unknown classifier {classifier!r}. Expected one of {CLASSIFIERS}{hint}.")
    if position_embedding not in vit_layers.POSITION_EMBEDDINGS:
        raise ValueError(f"Unknown position_embedding {position_embedding!r}. "
                         f"Expected one of {vit_layers.POSITION_EMBEDDINGS}.")
    if pooling is not None and pooling not in POOLINGS:
        hint = " (global average pooling is spelled pooling='avg' here, classifier='gap' in the model)" \
            if pooling == "gap" else ""
        raise ValueError(f"Unknown pooling {pooling!r}. Expected None or one of {POOLINGS}{hint}.")
    if pooling == "token" and classifier != "token" and not include_top:
        raise ValueError(f"pooling='token' needs a class token, but classifier={classifier!r} has none. "
                         "Use pooling='avg' or classifier='token'.")
    if pooling == "map" and classifier != "map" and not include_top:
        raise ValueError(f"pooling='map' is the attention-pooling head of classifier='map'. Received: "
                         f"classifier={classifier!r}; use pooling='token' or 'avg', or classifier='map'.")
    if not isinstance(classes, int) or classes < 1:
        raise ValueError(f"`classes` must be a positive int. Received: classes={classes!r}")
    if weights_source is not None and include_top and classifier_activation not in (None, "softmax"):
        raise ValueError("With pretrained weights and include_top=True, classifier_activation must be None "
                         f"or 'softmax'. Received: classifier_activation={classifier_activation!r}")


def _image_input(input_tensor, input_shape, stride: int, pretrained: bool):
    """Returns the model's image input tensor after checking its shape (a `None` height or width: any size)."""
    if input_tensor is not None:
        image = input_tensor if keras.backend.is_keras_tensor(input_tensor) else keras.Input(tensor=input_tensor)
        shape = tuple(image.shape[1:])
    else:
        shape = tuple(input_shape) if input_shape is not None else (224, 224, 3)
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


def VisionTransformer(
    variant: str | None = None,
    *,
    patch_size: int | None = None,
    hidden_dim: int | None = None,
    mlp_dim: int | None = None,
    num_heads: int | None = None,
    num_layers: int | None = None,
    resnet_stages: Sequence[int] | None = None,
    include_top: bool = True,
    weights: str | None = None,
    input_tensor=None,
    input_shape: Sequence[int | None] | None = None,
    pooling: str | None = None,
    classes: int = 1000,
    classifier_activation: str | Callable | None = "softmax",
    include_preprocessing: bool = True,
    classifier: str | None = None,
    representation_size: int | None = None,
    position_embedding: str = "learned",
    dropout_rate: float = 0.0,
    attention_dropout_rate: float = 0.0,
    drop_path_rate: float = 0.0,
    layer_norm_epsilon: float | None = None,
    gelu_approximate: bool | None = None,
    activation: str | None = None,
    layer_scale_init: float | None = None,
    qk_norm: bool = False,
    num_register_tokens: int = 0,
    no_embed_class: bool = False,
    norm_pre: bool = False,
    fc_norm: bool = False,
    distillation_token: bool = False,
    patch_bias: bool = True,
    remat: bool = False,
    name: str = "vision_transformer",
) -> keras.Model:
    """Builds a Vision Transformer of any size (arXiv:2010.11929).

    Args:
        variant: optional variant name ("B/16", "R50+B/16", ...) whose architecture fills the
            architecture arguments not given; needed for registered `weights` names.
        patch_size, hidden_dim, mlp_dim, num_heads, num_layers: the architecture
            (patch size on the image, or on the ResNet feature map for hybrids). With `weights=` an `.npz`
            or `.safetensors` file, those not given (and the family options left at their defaults) are
            read from the file's keys (the classifier too, when left `None`). timm and Hugging Face files do not
            store `num_heads`: give it, or (Hugging Face) keep the `config.json` beside the file.
        resnet_stages: optional units per ResNet stage, e.g. (3, 4, 9), for a hybrid model.
        Other arguments: as the variant builders (`help(keras_vit.ViTB16)`); `weights`
            defaults to `None` here.
    """
    checkpoint_loader.check_file_exists(weights)
    config = variants.decode_variant(variant) if variant else {}
    overrides = dict(patch_size=patch_size, hidden_dim=hidden_dim, mlp_dim=mlp_dim, num_heads=num_heads,
                     num_layers=num_layers, resnet_stages=resnet_stages)
    config.update({key: value for key, value in overrides.items() if value is not None})
    family = dict(layer_scale_init=layer_scale_init, qk_norm=qk_norm,
                  num_register_tokens=num_register_tokens, no_embed_class=no_embed_class, norm_pre=norm_pre,
                  fc_norm=fc_norm, distillation_token=distillation_token, patch_bias=patch_bias)
    checkpoint_size = None  # the square side a checkpoint file's position embedding was trained at
    if _is_checkpoint_file(weights):
        config, family, classifier, checkpoint_size = _read_from_file(weights, config, family, classifier)
        if classifier == "map" and not include_top and pooling != "map":
            raise ValueError(f"{weights!r} pools with an attention-pooling head (classifier='map', SigLIP): pass "
                             f"pooling='map' for its pooled embedding (received pooling={pooling!r}); for the "
                             "tokens, build with pooling='map' and use keras_vit.features_model(model).")
    classifier = classifier or "token"
    if family["distillation_token"] and (classifier != "token" or family["num_register_tokens"]
                                         or family["no_embed_class"] or family["fc_norm"]):
        raise ValueError("distillation_token=True needs classifier='token' and no register tokens, no_embed_class "
                         f"or fc_norm. Received: classifier={classifier!r}, num_register_tokens="
                         f"{family['num_register_tokens']}, no_embed_class={family['no_embed_class']}, "
                         f"fc_norm={family['fc_norm']}")
    missing = [key for key in ("patch_size", "hidden_dim", "mlp_dim", "num_heads", "num_layers")
               if key not in config]
    if missing:
        raise ValueError(f"VisionTransformer needs `variant`, the architecture arguments {missing}, or `weights=` "
                         "an .npz or .safetensors file that holds them.")
    stride = variants.total_stride(config)
    image, image_shape = _image_input(input_tensor, input_shape, stride, pretrained=weights is not None)
    weights_source = checkpoint_loader.resolve(weights, variant=variant, image_size=image_shape[:2],
                                         include_top=include_top, classes=classes)
    _validate(include_top=include_top, pooling=pooling, classes=classes, classifier=classifier,
              position_embedding=position_embedding, classifier_activation=classifier_activation,
              weights_source=weights_source)
    if representation_size is None and weights_source is not None:
        # ImageNet-21k checkpoints end in pre_logits (Dense + tanh): build it when their head is used.
        representation_size = weights_source.representation_size
    numerics = _numerics(weights_source, layer_norm_epsilon=layer_norm_epsilon, gelu_approximate=gelu_approximate,
                         activation=activation)
    outputs = _forward(image, config, include_top=include_top, pooling=pooling, classes=classes,
                       classifier_activation=classifier_activation, include_preprocessing=include_preprocessing,
                       classifier=classifier, representation_size=representation_size,
                       position_embedding=position_embedding, dropout_rate=dropout_rate,
                       attention_dropout_rate=attention_dropout_rate, drop_path_rate=drop_path_rate, remat=remat,
                       family=family, grid_size=_grid_size(image_shape, stride, checkpoint_size, weights_source),
                       **numerics)
    inputs = keras.utils.get_source_inputs(input_tensor) if input_tensor is not None else image
    model = ViTModel(inputs, outputs, name=name)
    if weights_source is not None:
        checkpoint_loader.load(model, weights_source)
    return model


# The ViT family's options at their defaults (`VisionTransformer`'s): what `weights=` a file may fill in.
FAMILY_DEFAULTS = dict(layer_scale_init=None, qk_norm=False, num_register_tokens=0,
                       no_embed_class=False, norm_pre=False, fc_norm=False, distillation_token=False,
                       patch_bias=True)


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


def _is_checkpoint_file(weights) -> bool:
    return isinstance(weights, str) and weights.endswith((".npz", ".safetensors")) and os.path.isfile(weights)


def _read_from_file(path: str, config: dict[str, Any], family: dict[str, Any],
                    classifier: str | None) -> tuple[dict, dict, str, int | None]:
    """The architecture arguments not given, the family options left at their defaults, the classifier (if
    None) and the square input side of the position embedding (None without one), from the checkpoint's keys
    and shapes (headers only). The number of heads, which the PyTorch layouts do not store, comes from
    `config` (or the variant table)."""
    shapes, layout = checkpoint_shapes(path)
    num_heads = config.get("num_heads")
    hf_config = torch_layout.read_hf_config(path) if layout in torch_layout.HF_LAYOUTS else None
    if hf_config and "num_heads" in hf_config:
        if num_heads not in (None, hf_config["num_heads"]):
            raise ValueError(f"num_heads={num_heads} contradicts the config.json beside {path!r}, whose model has "
                             f"{hf_config['num_heads']} heads. Leave num_heads=None to take the config's.")
        num_heads = config["num_heads"] = hf_config["num_heads"]
    found = read_architecture(shapes, num_heads=num_heads, heads_stored=layout is None)
    config = dict({key: found[key] for key in ARCHITECTURE_ARGUMENTS}, **config)
    family = {key: found["options"].get(key, value) if value == FAMILY_DEFAULTS[key] else value
              for key, value in family.items()}
    return config, family, classifier or found["classifier"], found.get("image_size")


ORIGINAL_NUMERICS = dict(layer_norm_epsilon=vit_layers.LAYER_NORM_EPSILON, gelu_approximate=True, activation="gelu")


def _numerics(weights_source, **requested) -> dict[str, Any]:
    """`layer_norm_epsilon`, `gelu_approximate` and `activation`: the requested value, else the checkpoint's
    default (a timm / Hugging Face layout's), else the original's. Where the checkpoint fixes an option (a
    Hugging Face `config.json`), a requested value must agree with it."""
    fixed = weights_source.numerics if weights_source is not None else {}
    defaults = {**ORIGINAL_NUMERICS, **(weights_source.default_numerics if weights_source is not None else {})}
    numerics = {}
    for option, value in requested.items():
        if value is not None and option in fixed and value != fixed[option]:
            raise ValueError(f"{option}={value!r} contradicts the checkpoint {weights_source.location!r}, whose "
                             f"model uses {option}={fixed[option]!r} (its config.json). Leave {option}=None to "
                             "take the checkpoint's.")
        numerics[option] = value if value is not None else fixed.get(option, defaults[option])
    return numerics


def _forward(image, config: dict[str, Any], *, include_top, pooling, classes, classifier_activation,
             include_preprocessing, classifier, representation_size, position_embedding, dropout_rate,
             attention_dropout_rate, drop_path_rate, remat, family, grid_size, layer_norm_epsilon,
             gelu_approximate, activation):
    """The ViT forward pass on a symbolic image tensor, in paper order."""
    x = image
    if include_preprocessing:
        # Original models take [-1, 1]: x / 127.5 - 1.
        x = keras.layers.Rescaling(1.0 / 127.5, offset=-1.0, name="preprocessing")(x)
    if config.get("resnet_stages"):
        x = resnet.resnet_stem(x, config["resnet_stages"])
    x = vit_layers.PatchEncoder(config["hidden_dim"], config["patch_size"], use_bias=family["patch_bias"],
                                name="embedding")(x)
    distilled = family["distillation_token"]
    prefix = (1 if classifier == "token" else 0) + distilled
    embedded_prefix = 0 if family["no_embed_class"] else prefix  # the prefix tokens the position table covers
    if embedded_prefix:
        x = vit_layers.ClassToken(name="cls")(x)
    if distilled:  # DeiT: [class, distillation, patches], both with a position
        x = vit_layers.RegisterTokens(1, position=1, name="dist_token")(x)
    any_size = None in image.shape[1:3]  # then the table is fitted to each image's grid
    position = vit_layers.PositionEmbedding(grid_size, embedded_prefix, position_embedding, name="posembed_input",
                                            patch_stride=variants.total_stride(config) if any_size else None)
    x = position(x, image) if any_size else position(x)
    registers = family["num_register_tokens"]
    if registers:
        x = vit_layers.RegisterTokens(registers, position=embedded_prefix, name="registers")(x)
    if prefix and not embedded_prefix:
        x = vit_layers.ClassToken(name="cls")(x)
    x = keras.layers.Dropout(dropout_rate, name="dropout")(x)
    if family["norm_pre"]:
        x = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon, name="norm_pre")(x)
    num_layers = config["num_layers"]
    for i in range(num_layers):
        rate = drop_path_rate * i / max(num_layers - 1, 1)
        x = vit_layers.TransformerBlock(config["num_heads"], config["mlp_dim"], dropout_rate,
                                        attention_dropout_rate, rate, layer_norm_epsilon=layer_norm_epsilon,
                                        gelu_approximate=gelu_approximate, activation=activation,
                                        layer_scale_init=family["layer_scale_init"], qk_norm=family["qk_norm"],
                                        remat=remat, name=f"encoderblock_{i}")(x)
    if not family["fc_norm"]:
        x = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon, name="encoder_norm")(x)
    if not include_top and pooling is None:
        return x
    tokens = x
    if classifier == "map" and (include_top or pooling == "map"):
        x = vit_layers.MAPHead(config["num_heads"], config["mlp_dim"], layer_norm_epsilon, gelu_approximate,
                               activation, name="MAPHead_0")(x)
    else:
        method = "avg" if family["fc_norm"] else "token" if include_top and prefix else pooling or "avg"
        # Models of 0.2.0 average every token; with the family's options, the patch tokens only (as timm).
        skipped = prefix + registers if registers or family["fc_norm"] else 0
        x = vit_layers.TokenPooling(method, num_prefix_tokens=skipped, name="pool")(x)
    if family["fc_norm"]:
        x = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon, name="fc_norm")(x)
    if representation_size:
        x = keras.layers.Dense(representation_size, activation="tanh", name="pre_logits")(x)
    if not include_top:
        return x
    x = keras.layers.Dense(classes, kernel_initializer="zeros", name="head", dtype="float32")(x)
    if distilled:  # DeiT in inference: the mean of the class token's head and the distillation token's
        distillation = vit_layers.TokenPooling("distillation", name="pool_distillation")(tokens)
        distillation = keras.layers.Dense(classes, kernel_initializer="zeros", name="head_dist",
                                          dtype="float32")(distillation)
        x = keras.layers.Average(name="head_average", dtype="float32")([x, distillation])
    if classifier_activation is not None:
        x = keras.layers.Activation(classifier_activation, name="predictions", dtype="float32")(x)
    return x


def load_or_build(model_or_path: keras.Model | str | os.PathLike | None = None, *, variant: str | None = None,
                  weights: str | None = None, input_shape: Sequence[int] | None = None,
                  classes: int | None = None) -> keras.Model:
    """The model a tool was pointed at: a `keras.Model`, a `.keras` file, or a variant to build.

    Args:
        model_or_path: a `keras.Model`, or the path of a `.keras` file. Give this or `variant`.
        variant: a variant name ("B/16", "R50+B/16", ...) to build with `weights`.
        weights: the variant's weights: `None` (random), a path or a registered name.
        input_shape: the variant's input shape. Defaults to `(224, 224, 3)`.
        classes: the variant's number of classes. Defaults to the head of `weights` where it
            has one, else `1000`.
    """
    if (model_or_path is None) == (variant is None):
        raise ValueError("Give exactly one of a model (or `.keras` path) or a `variant`. "
                         f"Received: model={model_or_path!r}, variant={variant!r}")
    if isinstance(model_or_path, keras.Model):
        return model_or_path
    if model_or_path is not None:
        path = os.fspath(model_or_path)
        if not path.endswith(".keras") or not os.path.isfile(path):
            raise ValueError(f"Expected an existing `.keras` model file. Received: {path!r}")
        return keras.saving.load_model(path)
    if classes is None:
        size = tuple(input_shape or (224, 224, 3))[:2]
        source = checkpoint_loader.resolve(weights, variant=variant, image_size=size, include_top=False, classes=1)
        classes = source.head_classes if source is not None and source.head_classes else 1000
    return VisionTransformer(variant, weights=weights, input_shape=input_shape, classes=classes)


class _AttentionProbe(keras.layers.Layer):
    """Calls a TransformerBlock (sharing its weights) and returns (tokens, attention scores).

    A separate layer because Keras checks a functional graph against each layer's first
    call: re-calling the block itself with a second output would fail that check.
    """

    def __init__(self, block: vit_layers.TransformerBlock, **kwargs):
        super().__init__(name=f"{block.name}_attention", dtype=block.dtype_policy, **kwargs)
        self.block = block

    def call(self, x, training=None):
        return self.block(x, training=training, return_attention_scores=True)


def attention_model(model: keras.Model) -> keras.Model:
    """The same model (same weights, no copies) with per-layer attention outputs.

    Returns a model whose outputs are `{"output": <model's output>, "attention": [scores of
    encoderblock_0, ...]}`, each score (batch, heads, tokens, tokens). The original model
    is untouched.
    """
    vit_layers.transformer_blocks(model)  # a clear error for a model without (top-level) blocks
    scores = []

    def call_function(layer, *args, **kwargs):
        if isinstance(layer, vit_layers.TransformerBlock):
            outputs, attention = _AttentionProbe(layer)(*args, **kwargs)
            scores.append(attention)
            return outputs
        return layer(*args, **kwargs)

    clone = keras.models.clone_model(model, clone_function=lambda layer: layer, call_function=call_function)
    return keras.Model(clone.input, {"output": clone.output, "attention": scores},
                       name=f"{model.name}_attention")


def _make_builder(builder_name: str, variant: str) -> Callable[..., keras.Model]:
    """A thin public builder (`ViTB16`, ...) for one row of the variant table."""
    model_name = "vit_" + variant.lower().replace("+", "_").replace("/", "")

    def builder(include_top: bool = True, weights: str | None = "imagenet", input_tensor=None,
                input_shape: Sequence[int | None] | None = None, pooling: str | None = None,
                classes: int = 1000, classifier_activation: str | Callable | None = "softmax",
                include_preprocessing: bool = True, classifier: str = "token",
                representation_size: int | None = None, position_embedding: str = "learned",
                dropout_rate: float = 0.0, attention_dropout_rate: float = 0.0, drop_path_rate: float = 0.0,
                layer_norm_epsilon: float | None = None, gelu_approximate: bool | None = None,
                remat: bool = False, name: str = model_name) -> keras.Model:
        return VisionTransformer(
            variant, include_top=include_top, weights=weights, input_tensor=input_tensor,
            input_shape=input_shape, pooling=pooling, classes=classes, classifier_activation=classifier_activation,
            include_preprocessing=include_preprocessing, classifier=classifier,
            representation_size=representation_size, position_embedding=position_embedding,
            dropout_rate=dropout_rate, attention_dropout_rate=attention_dropout_rate,
            drop_path_rate=drop_path_rate, layer_norm_epsilon=layer_norm_epsilon,
            gelu_approximate=gelu_approximate, remat=remat, name=name)

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
