"""Per-block features of a keras_vit model, for dense tasks (detection, segmentation) and probing.

`features_model(model, blocks)` is the same model (same weights, no copies) whose outputs are the tokens of
the chosen encoder blocks, the prefix tokens (class, registers) split from the patch tokens, the patch tokens
as NHWC feature maps or as a sequence: the spirit of timm's `forward_intermediates`. `attention_model(model)`
is the same model with every block's attention weights as outputs too (the inspection tools read them);
`explain_model(model)` adds their attention rollout as a map at the image's resolution. `embedding_model(model)`
is the pooled image embedding (optionally L2-normalized, as CLIP and SigLIP are used for retrieval), and
`zero_shot_classifier(model, class_embeddings)` a classifier whose head is made of class embeddings computed
elsewhere (e.g. a CLIP text tower's). All of them are graphs the exporters serve (`keras-vit-export --signatures`).
"""

from __future__ import annotations

from typing import Sequence

import keras
import numpy as np
from keras import ops

from keras_vit import layers as vit_layers
from keras_vit.geometry import model_geometry

OUTPUTS = ("nhwc", "tokens")


@keras.saving.register_keras_serializable(package="keras_vit")
class TokenGrid(keras.layers.Layer):
    """Splits (batch, prefix + rows * columns, D) tokens into the prefix tokens (batch, prefix, D) and the patch
    tokens, as an NHWC map (batch, rows, columns, D) (`output="nhwc"`) or as they are (batch, rows * columns, D).

    Args:
        num_prefix_tokens: int. Tokens before the patch grid (class token, registers).
        grid_size: (int, int). Rows and columns of the patch grid; `None` with `patch_stride`.
        output: `"nhwc"` or `"tokens"`. Defaults to `"nhwc"`.
        patch_stride: optional (int, int). For a model of any input size: the grid is that of the images given
            to `call`, (height / stride, width / stride). Give this or `grid_size`.

    Call arguments:
        tokens: (batch, num_prefix_tokens + rows * columns, D).
        images: with `patch_stride`, the (batch, height, width, channels) images the tokens come from.
    """

    def __init__(self, num_prefix_tokens: int, grid_size: Sequence[int] | None = None, output: str = "nhwc",
                 patch_stride: Sequence[int] | None = None, **kwargs):
        super().__init__(**kwargs)
        if output not in OUTPUTS:
            raise ValueError(f"Unknown output {output!r}. Expected one of {OUTPUTS}.")
        if (grid_size is None) == (patch_stride is None):
            raise ValueError(f"TokenGrid needs exactly one of `grid_size` (a fixed grid) or `patch_stride` (the grid "
                             f"of the images). Received: grid_size={grid_size!r}, patch_stride={patch_stride!r}")
        self.num_prefix_tokens = num_prefix_tokens
        self.grid_size = None if grid_size is None else tuple(grid_size)
        self.output_format = output
        self.patch_stride = None if patch_stride is None else tuple(patch_stride)

    def call(self, tokens, images=None):
        prefix, patches = tokens[:, :self.num_prefix_tokens], tokens[:, self.num_prefix_tokens:]
        if self.output_format == "nhwc":
            grid = self.grid_size or vit_layers.patch_grid(images, self.patch_stride, unit="patch stride")
            patches = ops.reshape(patches, (-1, *grid, tokens.shape[-1]))
        return prefix, patches

    def compute_output_spec(self, tokens, images=None):
        batch, width = tokens.shape[0], tokens.shape[-1]
        rows, columns = self.grid_size or (None, None)
        grid = None if self.grid_size is None else rows * columns
        patches = (batch, rows, columns, width) if self.output_format == "nhwc" else (batch, grid, width)
        return (keras.KerasTensor((batch, self.num_prefix_tokens, width), dtype=tokens.dtype),
                keras.KerasTensor(patches, dtype=tokens.dtype))

    def get_config(self):
        config = super().get_config()
        config.update({"num_prefix_tokens": self.num_prefix_tokens, "grid_size": self.grid_size,
                       "output": self.output_format, "patch_stride": self.patch_stride})
        return config


def num_prefix_tokens(model: keras.Model) -> int:
    """The tokens before the patch grid in a keras_vit model's sequence: its class, distillation and register
    tokens (`model_geometry(model).num_prefix_tokens`)."""
    return model_geometry(model).num_prefix_tokens


def features_model(model: keras.Model, blocks: Sequence[int] | None = None, *, output: str = "nhwc",
                   norm: bool = False) -> keras.Model:
    """The model's per-block features, sharing its layers and weights.

    Args:
        model: a keras_vit model (any `include_top`).
        blocks: encoder block indices (negative counts from the end). Defaults to every block.
        output: `"nhwc"`: patch tokens as (batch, rows, columns, D) maps; `"tokens"`: (batch, rows * columns, D).
        norm: pass each block's tokens through the model's final norm (`encoder_norm`), as timm's
            `forward_intermediates(norm=True)`. Defaults to `False`: the blocks' outputs as they are.

    Returns:
        A `keras.Model` on the model's inputs with outputs `{"block_<i>": patches, "block_<i>_prefix": prefix
        tokens}` for each chosen block `i`.
    """
    block_layers = vit_layers.transformer_blocks(model)
    indices = range(len(block_layers)) if blocks is None else blocks
    chosen = []
    for index in indices:
        if not -len(block_layers) <= index < len(block_layers):
            raise ValueError(f"Block {index} does not exist: model {model.name!r} has {len(block_layers)} blocks "
                             f"(indices {-len(block_layers)} to {len(block_layers) - 1}).")
        chosen.append(index % len(block_layers))
    geometry = model_geometry(model)
    if norm and geometry.encoder_norm is None:
        raise ValueError(f"norm=True needs the model's final norm 'encoder_norm', which model {model.name!r} "
                         "does not have (fc_norm=True models normalize after pooling).")
    grid, prefix = geometry.grid, geometry.num_prefix_tokens
    stride = geometry.stride if geometry.input_size is None else None
    outputs = {}
    for index in chosen:
        tokens = block_layers[index].output
        if norm:
            tokens = geometry.encoder_norm(tokens)
        # A model of any input size: the grid of each image, from the stride.
        splitter = TokenGrid(prefix, grid if stride is None else None, output, patch_stride=stride,
                             name=f"grid_{index}")
        splits = splitter(tokens) if stride is None else splitter(tokens, model.inputs[0])
        outputs[f"block_{index}_prefix"], outputs[f"block_{index}"] = splits
    return keras.Model(model.input, outputs, name=f"{model.name}_features")


class _AttentionProbe(keras.layers.Layer):
    """Calls a TransformerBlock (sharing its weights) and returns (tokens, attention scores).

    A separate layer because Keras checks a functional graph against each layer's first
    call: re-calling the block itself with a second output would fail that check.
    """

    def __init__(self, block: vit_layers.TransformerBlock, **kwargs):
        super().__init__(name=f"{block.name}_attention", dtype=block.dtype_policy, **kwargs)
        self.block = block

    def call(self, x, training=None, rotary=None):
        return self.block(x, training=training, return_attention_scores=True, rotary=rotary)


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


# === Served views: embeddings, zero-shot heads, explanations ===

EMBEDDING_SOURCES = ("pooled", "head")


def classifier_head(model: keras.Model) -> keras.layers.Layer | None:
    """The layer whose output is the model's logits (`head`; DeiT distilled: `head_average`; a zero-shot
    classifier: `zero_shot_head`), or None for a model without a classification head (`model_geometry`)."""
    return model_geometry(model).head


def embedding_model(model: keras.Model, source: str = "pooled", l2_normalize: bool = False) -> keras.Model:
    """The model's image embedding (batch, D), sharing its layers and weights.

    Args:
        model: a keras_vit model: a classifier, or one built with `include_top=False` and a `pooling`.
        source: `"pooled"`: the input of the classification head (the pooled, pre-logits representation), or the
            output of a model without a head; `"head"`: the head's output (a CLIP tower's projection, which the
            loader puts in `head`). Defaults to `"pooled"`.
        l2_normalize: divide by the L2 norm (CLIP and SigLIP embeddings are compared by cosine). Defaults to
            `False`.

    Returns:
        A `keras.Model` on the model's inputs with output `{"embedding": (batch, D)}`.
    """
    if source not in EMBEDDING_SOURCES:
        raise ValueError(f"Unknown embedding source {source!r}. Expected one of {EMBEDDING_SOURCES}.")
    geometry = model_geometry(model)
    if geometry.head is None and source == "head":
        raise ValueError(f"source='head' needs a classification head (a CLIP tower's projection), which model "
                         f"{model.name!r} does not have: use source='pooled'.")
    if geometry.pooled is None:
        raise ValueError(f"Model {model.name!r} outputs tokens {tuple(model.outputs[0].shape)}, not one vector per "
                         "image: build it with include_top=False and pooling='token', 'avg' or 'map'.")
    embedding = geometry.head.output if source == "head" else geometry.pooled
    if l2_normalize:
        embedding = keras.layers.UnitNormalization(axis=-1, name="l2_normalize")(embedding)
    return keras.Model(model.input, {"embedding": embedding}, name=f"{model.name}_embedding")


def zero_shot_weights(class_embeddings, width: int, *, logit_scale: float = 100.0, logit_bias: float = 0.0,
                      of: str = "the embedding") -> tuple[np.ndarray, np.ndarray]:
    """The (width, classes) kernel and (classes,) bias of a zero-shot head on unit-length image embeddings:
    `unit(image) @ kernel + bias = logit_scale * cos(image, class) + logit_bias`.

    Raises:
        ValueError: `class_embeddings` is not (classes, width) with classes >= 1 (`of` names the embedding it
            must match), or a row is zero.
    """
    embeddings = np.asarray(class_embeddings, dtype="float32")
    if embeddings.ndim != 2 or embeddings.shape[1] != width or not len(embeddings):
        raise ValueError(f"class_embeddings must be (classes, {width}) to match {of}. Received shape: "
                         f"{embeddings.shape}")
    norms = np.linalg.norm(embeddings, axis=1, keepdims=True)
    if not np.all(norms > 0):
        raise ValueError(f"class_embeddings rows {np.flatnonzero(norms[:, 0] == 0).tolist()} are zero vectors.")
    return (embeddings / norms).T * np.float32(logit_scale), np.full(len(embeddings), logit_bias, "float32")


def zero_shot_classifier(model: keras.Model, class_embeddings, *, source: str = "head", logit_scale: float = 100.0,
                         logit_bias: float = 0.0, classifier_activation: str | None = "softmax") -> keras.Model:
    """A classifier whose classes are embeddings: `logit_scale * cos(image, class) + logit_bias`.

    With a CLIP image tower and its text tower's embeddings of prompts ("a photo of a {class}"), this is CLIP's
    zero-shot classifier (logit_scale 100); with SigLIP's, pass its `logit_scale` and `logit_bias` (SigLIP scores
    each class with a sigmoid of the logit; softmax ranks them the same). The result is a keras_vit classifier
    like any other (its head is `zero_shot_head`), so `keras-vit-export` serves it.

    Args:
        model: a keras_vit image tower.
        class_embeddings: (classes, D) array, one row per class, in the space of `embedding_model(model, source)`.
        source: as `embedding_model`. Defaults to `"head"` (a CLIP tower's projection).
        logit_scale, logit_bias: floats. Default to `100.0` and `0.0` (CLIP's).
        classifier_activation: of the output. Defaults to `"softmax"`.
    """
    tower = embedding_model(model, source=source, l2_normalize=True)
    kernel, bias = zero_shot_weights(class_embeddings, tower.outputs[0].shape[-1], logit_scale=logit_scale,
                                     logit_bias=logit_bias, of=f"the {source!r} embedding of model {model.name!r}")
    head = keras.layers.Dense(len(bias), name="zero_shot_head", dtype="float32")
    logits = head(tower.outputs[0])
    head.set_weights([kernel, bias])
    outputs = logits if classifier_activation is None else keras.layers.Activation(
        classifier_activation, name="predictions", dtype="float32")(logits)
    from keras_vit.models import ViTModel  # the models import this module

    return ViTModel(model.input, outputs, name=f"{model.name}_zero_shot",
                    vit_config=getattr(model, "vit_config", None),
                    preprocessing_config=getattr(model, "preprocessing_config", None))


def rollout(attentions: Sequence):
    """Attention rollout (Abnar & Zuidema 2020) of per-block attention weights, in float32.

    Each block's weights are averaged over heads, the identity is added (the residual connection), rows are
    renormalized, and the blocks are multiplied, first block rightmost.

    Args:
        attentions: sequence of (batch, heads, tokens, tokens) tensors, rows summing to 1.

    Returns:
        (batch, tokens, tokens) tensor whose rows sum to 1.
    """
    if not attentions:
        raise ValueError("`attentions` is empty; expected one (batch, heads, tokens, tokens) array per layer.")
    joint = None
    for attention in attentions:
        if len(attention.shape) != 4 or attention.shape[-1] != attention.shape[-2]:
            raise ValueError(f"Expected attention of shape (batch, heads, tokens, tokens). "
                             f"Received shape: {tuple(attention.shape)}")
        attention = ops.cast(attention, "float32")
        mixed = ops.mean(attention, axis=1) + ops.eye(attention.shape[-1], dtype="float32")
        mixed = mixed / ops.sum(mixed, axis=-1, keepdims=True)
        joint = mixed if joint is None else ops.matmul(mixed, joint)
    return joint


def rollout_map(joint, grid_size: Sequence[int], num_prefix_tokens: int, class_token: bool | None = None):
    """The (batch, rows, columns) map of a rolled-out attention matrix (`rollout`).

    With a class token (row 0; by default, whenever there are prefix tokens) it is the class token's row over the
    patch columns: how much of the pooled representation flows from each patch (its sum is below 1, the rest stays
    on the prefix tokens). Without one (`classifier="gap"` or `"map"`, whose output pools all tokens) it is the
    mean of all rows.
    """
    patches = joint[:, :, num_prefix_tokens:]
    class_token = bool(num_prefix_tokens) if class_token is None else class_token
    flows = patches[:, 0] if class_token else ops.mean(patches, axis=1)
    return ops.reshape(flows, (-1, *grid_size))


@keras.saving.register_keras_serializable(package="keras_vit")
class AttentionRollout(keras.layers.Layer):
    """Attention rollout (Abnar & Zuidema 2020) in the model's graph: per-block attention weights -> the
    (batch, rows, columns) share of the pooled output that flows from each patch (`rollout`, `rollout_map`).

    Args:
        grid_size: (rows, columns) of the patch grid.
        num_prefix_tokens: tokens before the grid.
        class_token: whether token 0 is a class token.
    """

    def __init__(self, grid_size: Sequence[int], num_prefix_tokens: int, class_token: bool, **kwargs):
        super().__init__(**kwargs)
        self.grid_size = tuple(grid_size)
        self.num_prefix_tokens = num_prefix_tokens
        self.class_token = class_token

    def call(self, attentions):
        return rollout_map(rollout(attentions), self.grid_size, self.num_prefix_tokens, self.class_token)

    def compute_output_shape(self, input_shape):
        return (input_shape[0][0], *self.grid_size)

    def get_config(self):
        return {**super().get_config(), "grid_size": self.grid_size, "num_prefix_tokens": self.num_prefix_tokens,
                "class_token": self.class_token}


def explain_model(model: keras.Model) -> keras.Model:
    """The model with its attention-rollout map at the input's resolution, sharing its weights.

    Returns a `keras.Model` with outputs `{"output": the model's output, "rollout": (batch, height, width)}`:
    the rollout over the patch grid (`AttentionRollout`), resized bilinearly to the input's height and width.
    Needs a model of a fixed input size.
    """
    geometry = model_geometry(model)
    if geometry.input_size is None:
        raise ValueError(f"explain_model needs a model of a fixed input size, but model {model.name!r} takes any "
                         "size: build it at the served size, input_shape=(height, width, 3), from the same weights.")
    height, width = geometry.input_size
    probe = attention_model(model)
    grid = AttentionRollout(geometry.grid, geometry.num_prefix_tokens, geometry.class_token,
                            name="attention_rollout")(probe.output["attention"])
    resized = keras.layers.Resizing(height, width, interpolation="bilinear", name="rollout_resize",
                                    dtype="float32")(ops.expand_dims(grid, -1))
    return keras.Model(probe.input, {"output": probe.output["output"], "rollout": resized[..., 0]},
                       name=f"{model.name}_explain")
