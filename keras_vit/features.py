"""Per-block features of a keras_vit model, for dense tasks (detection, segmentation) and probing.

`features_model(model, blocks)` is the same model (same weights, no copies) whose outputs are the tokens of
the chosen encoder blocks, the prefix tokens (class, registers) split from the patch tokens, the patch tokens
as NHWC feature maps or as a sequence: the spirit of timm's `forward_intermediates`. `attention_model(model)`
is the same model with every block's attention weights as outputs too (the inspection tools read them).
"""

from __future__ import annotations

from typing import Sequence

import keras
from keras import ops

from keras_vit import layers as vit_layers

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
    tokens, as its layers insert them (whether or not the position embedding covers them)."""
    return sum(layer.num_tokens if isinstance(layer, vit_layers.RegisterTokens) else 1 for layer in model.layers
               if isinstance(layer, (vit_layers.ClassToken, vit_layers.RegisterTokens)))


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
    layer_names = {layer.name for layer in model.layers}
    if norm and "encoder_norm" not in layer_names:
        raise ValueError(f"norm=True needs the model's final norm 'encoder_norm', which model {model.name!r} "
                         "does not have (fc_norm=True models normalize after pooling).")
    position = model.get_layer("posembed_input")
    grid, stride = position.grid_size, position.patch_stride
    prefix = num_prefix_tokens(model)
    outputs = {}
    for index in chosen:
        tokens = block_layers[index].output
        if norm:
            tokens = model.get_layer("encoder_norm")(tokens)
        # A model of any input size: the grid of each image, from the stride.
        splitter = TokenGrid(prefix, grid if stride is None else None, output, patch_stride=stride,
                             name=f"grid_{index}")
        splits = splitter(tokens) if stride is None else splitter(tokens, model.inputs[0])
        outputs[f"block_{index}_prefix"], outputs[f"block_{index}"] = splits
    inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
    return keras.Model(inputs, outputs, name=f"{model.name}_features")


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
