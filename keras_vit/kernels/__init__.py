"""The primitives the layers compute with, and the CPU-specific kernels behind them.

The layers hold the maths (`keras_vit.layers`); they call six primitives for their heavy parts:

    dense(x, kernel, bias)             x (N, in) @ kernel (in, out) + bias
    batch_matmul(a, b, transpose_b)    a @ b (or a @ b^T) over the last two axes, leading axes batched
    fused_attention(q, k, v, scale)    softmax(q k^T * scale) v in one call, where `attention_kernel`
    layer_norm(x, gamma, beta, eps)    LayerNorm of the last axis, statistics in float32
    gelu(x, approximate)               tanh-approximate (Flax's) or exact erf GELU
    compiled_inference(call)           a decorator: the layer's own `call`, XLA-compiled in inference
    rematerialized(call)               a decorator: the layer's own `call` under gradient checkpointing

and two checks for sizes known only at run time: `exact_quotient(size, divisor, message)` for image sizes and
`expect_size(x, axis, expected, message)` for a fixed-size model's token count.

By default each emits the portable `keras.ops` maths, the same on every backend, device and TensorFlow
build. Inside a `cpu_kernels()` scope, which `keras_vit.ViTModel` enters in its `fit` / `evaluate` /
`predict` steps (never in exports or your own `tf.function`), the TensorFlow backend may swap in a faster
kernel for the same maths, each only where it works and pays on this machine (`machine.choose`, one-time
probes against the portable ops):

- `onednn_layer_norm`: oneDNN's fused LayerNorm where TensorFlow runs on oneDNN (bfloat16 only with AVX-512).
- `bfloat16_conv_projections`: bfloat16 `dense` as a 1x1 convolution, which oneDNN gives its AMX kernel, for
  inputs of at least `CONV_PROJECTION_MIN_ROWS` rows (chosen at run time where the rows are unknown when traced).
- `xla_elementwise`: in training steps, the tanh GELU and the LayerNorm backward as XLA-fused loops.
- `xla_inference_gelu`: in inference too, the tanh GELU as one XLA-fused loop, where TensorFlow runs on Eigen
  (oneDNN fuses it into the matmul before it instead).
- `onednn_batch_matmul`: the attention's batched matmuls (and their gradients) by oneDNN's kernel where
  TensorFlow runs on Eigen, whose batched matmul is 2-4x slower on these shapes on AVX2.
- `xla_encoder_blocks`: in inference, each float32 encoder block's `call` as one XLA-compiled function,
  shared by every block of the same shape, for batches of at most `XLA_BLOCK_MAX_ROWS` tokens in all.

Exports trace with the scope off. `served_on("eigen")` (an export's `serving_kernels`) writes the tanh GELU in
fewer ops and the attention head by head for a TensorFlow that serves on Eigen; the default, "onednn", keeps the
forms oneDNN fuses and batches. `scope.for_gpu_delegate()` (the float LiteRT files) writes q k^T with a transpose op
of its own, which LiteRT's GPU delegate computes correctly (it ignores BATCH_MATMUL's transpose flags).

Quantized layers (`model.quantize(...)`) take Keras' own quantized path, not these primitives; LoRA layers
(`enable_lora`) go through them with their merged kernel, and blocks holding either are not XLA-compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Sequence

import keras
import numpy as np
from keras import ops

from keras_vit.kernels import scope, tf_ops
from keras_vit.kernels.machine import (ENV_SWITCH, NATIVE_BFLOAT16_FLAGS, PORTABLE, XLA_BLOCK_MAX_ROWS, Capabilities,
                                       KernelChoice, active, choose, cpu_flags, detect, machine_choice,
                                       warn_if_bfloat16_is_emulated)
from keras_vit.kernels.scope import SERVING_KERNELS, check_serving_kernels, cpu_kernels, served_on

FUSED_ATTENTION_SWITCH = "KERAS_VIT_FUSED_ATTENTION"  # "on" / "off" override `attention_kernel`
# The convolution reorders its weights at every call (oneDNN's AMX layout; a model's weights are variables, not
# constants), which a few rows do not pay back: on an AMX Xeon, B/16 bfloat16 at batch 1 (197 rows) the plain matmul
# was faster in 11 of 12 interleaved pairs (benchmarks/RESULTS.md run BD, a loaded machine); at batch 16 (3,152 rows)
# the convolution was 20% faster on a quiet Sapphire Rapids (run D). The crossover between is not measured.
CONV_PROJECTION_MIN_ROWS = 1024


def dense(x, kernel, bias):
    """x (N, in) @ kernel (in, out) + bias, kept 2-D so TensorFlow fuses MatMul + BiasAdd."""
    if keras.backend.backend() != "tensorflow":
        return ops.matmul(x, kernel) + bias
    import tensorflow as tf

    def matmul():
        return tf.nn.bias_add(tf.linalg.matmul(x, kernel), bias)

    if x.dtype != tf.bfloat16 or not active().bfloat16_conv_projections:
        return matmul()
    rows = x.shape[0]
    if rows is None:  # a graph for any batch: the choice at run time, one branch runs
        return tf.cond(tf.shape(x)[0] >= CONV_PROJECTION_MIN_ROWS,
                       lambda: tf_ops.conv_projection(x, kernel, bias), matmul)
    return tf_ops.conv_projection(x, kernel, bias) if rows >= CONV_PROJECTION_MIN_ROWS else matmul()


def projections(x, kernels: Sequence, biases: Sequence) -> list:
    """[x @ kernel + bias for each pair] of a 2-D x. In training steps (`cpu_kernels(training=True)`) one matmul
    of the kernels side by side, a third of the ops forward and backward; elsewhere one matmul each: a served graph
    then does not copy the weights together at every request (12 x 7 MB for ViT-B/16, 14% of a batch-1 request
    on TensorFlow's Eigen path), and in `predict` three matmuls beat one plus its split (AMD EPYC AVX-512, 2
    cores: 1.028x at batch 1, 1.015x at batch 16, benchmarks/RESULTS.md run N)."""
    if scope.mode() != "training":
        return [dense(x, kernel, bias) for kernel, bias in zip(kernels, biases)]
    fused = dense(x, ops.concatenate(list(kernels), axis=1), ops.concatenate(list(biases), axis=0))
    return ops.split(fused, len(kernels), axis=-1)


def batch_matmul(a, b, transpose_b: bool = False):
    """a @ b (a @ b^T with `transpose_b`) over the last two axes, leading axes batched; with
    `transpose_b` no transpose op appears in the forward or backward graph, except in a graph traced for LiteRT's
    GPU delegate (`scope.for_gpu_delegate`), which ignores BATCH_MATMUL's transpose flags."""
    if keras.backend.backend() != "tensorflow" or scope.gpu_delegate():
        return ops.matmul(a, ops.swapaxes(b, -1, -2) if transpose_b else b)
    import tensorflow as tf
    if a.dtype == tf.float32 and active().onednn_batch_matmul:
        return tf_ops.onednn_batch_matmul(a, b, adjoint_b=transpose_b)
    return tf.linalg.matmul(a, b, transpose_b=transpose_b)


def token_row(tokens, index: int):
    """tokens[:, index] of a (batch, tokens, width) tensor; in a graph traced for LiteRT (`scope.for_litert`) a
    slice that keeps the axis, then a reshape: `tokens[:, index]` converts to a STRIDED_SLICE with a shrink-axis
    mask, which the GPU delegate refuses and XNNPACK leaves to LiteRT's own kernels."""
    if scope.litert():
        return ops.reshape(tokens[:, index:index + 1], (-1, tokens.shape[-1]))
    return tokens[:, index]


def fused_attention(query, key, value, scale: float):
    """softmax(q k^T * scale) v of (batch, tokens, heads, head_dim) tensors, the attention weights never
    returned: one op, `keras.ops.dot_product_attention` (cuDNN's flash attention on NVIDIA GPUs, the TPU's
    fused kernel, PyTorch's scaled_dot_product_attention), or in a graph traced for Eigen serving
    (`served_on("eigen")`) head by head (`tf_ops.attention_by_head`)."""
    if keras.backend.backend() == "tensorflow" and scope.serving_kernels() == "eigen":
        return tf_ops.attention_by_head(query, key, value, scale)
    return ops.dot_product_attention(query, key, value, scale=scale)


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """Where `fused_attention` is the faster way for one attention layer, chosen once when the layer is built
    (`attention_kernel`), as timm chooses at construction: `in_inference`, `in_training`."""

    in_inference: bool
    in_training: bool

    def fused(self, training) -> bool:
        """Whether this call takes `fused_attention`. The one thing left to the trace is the export's request:
        a graph traced for Eigen serving (`served_on("eigen")`) computes inference head by head, and one traced for
        LiteRT's GPU delegate (`scope.for_gpu_delegate`) takes the explicit matmuls."""
        if training:
            return self.in_training
        if scope.gpu_delegate():
            return False
        return self.in_inference or (keras.backend.backend() == "tensorflow" and scope.serving_kernels() == "eigen")


def attention_kernel() -> AttentionKernel:
    """The fused-or-explicit choice of this backend and device (measured, AMD EPYC AVX2: JAX on CPU 1.2-1.4x slower
    than the explicit matmuls; PyTorch on CPU 1.1-2.8x faster in inference, mixed in training; TensorFlow's is the
    same composite as the explicit path, so TensorFlow takes it only in a graph traced for Eigen serving, head by
    head). `KERAS_VIT_FUSED_ATTENTION=on|off`, set before the layer is built, overrides."""
    forced = os.environ.get(FUSED_ATTENTION_SWITCH, "auto").lower()
    if forced in ("on", "off"):
        return AttentionKernel(in_inference=forced == "on", in_training=forced == "on")
    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        on_accelerator = jax.default_backend() != "cpu"
        return AttentionKernel(in_inference=on_accelerator, in_training=on_accelerator)
    if backend == "torch":
        import torch
        return AttentionKernel(in_inference=True, in_training=torch.cuda.is_available())
    return AttentionKernel(in_inference=False, in_training=False)


def layer_norm(x, gamma, beta, epsilon: float):
    """LayerNorm of the last axis of `x` (statistics in float32, as keras.layers.LayerNormalization)."""
    choice = active()
    if keras.backend.standardize_dtype(x.dtype) in choice.onednn_layer_norm:
        rows = ops.reshape(x, (-1, x.shape[-1]))  # the op takes 2-D or 3-D inputs; q/k norms are 4-D
        normed = tf_ops.onednn_layer_norm(rows, ops.cast(gamma, x.dtype), ops.cast(beta, x.dtype), epsilon,
                                          xla_backward=choice.xla_elementwise)
        return ops.reshape(normed, ops.shape(x))
    return tf_ops.portable_layer_norm(x, gamma, beta, epsilon)


def gelu(x, approximate: bool = True):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), Flax's `nn.gelu` (the original), or with
    `approximate=False` the exact 0.5 x (1 + erf(x / sqrt(2))) of PyTorch's `nn.GELU()`."""
    choice = active()
    if approximate and choice.xla_elementwise and (scope.mode() == "training" or choice.xla_inference_gelu):
        return tf_ops.xla_gelu_tanh(x)
    if approximate and scope.serving_kernels() == "eigen":
        return tf_ops.gelu_tanh_as_sigmoid(x)
    if not approximate and scope.onnx():
        return 0.5 * x * (1.0 + ops.erf(x * math.sqrt(0.5)))
    return keras.activations.gelu(x, approximate=approximate)


def exact_quotient(size, divisor: int, message: str):
    """size // divisor, where `size` (an image height or width) must be a multiple of `divisor`.

    A size known when traced (an int: eager calls, JAX, PyTorch, static TensorFlow shapes) that is not one raises
    `ValueError(message.format(size))`. A TensorFlow graph's unknown size gives a scalar tensor computed after an
    assertion, which fails with InvalidArgumentError (the same message) before any op uses the quotient.
    """
    if isinstance(size, (int, np.integer)):
        if size % divisor:
            raise ValueError(message.format(size))
        return int(size) // divisor
    return tf_ops.exact_quotient(size, divisor, message)


def expect_size(x, axis: int, expected: int, message: str):
    """`x`, whose `axis` must have `expected` entries.

    A size known when traced that differs raises `ValueError(message.format(size))`. In a TensorFlow graph traced
    for an unknown size (Keras relaxes a step's input shapes when it retraces it), `x` comes after an assertion that
    fails with InvalidArgumentError (the same message) before any op uses it.
    """
    size = x.shape[axis]
    if size is not None:
        if size != expected:
            raise ValueError(message.format(size))
        return x
    if keras.backend.backend() != "tensorflow":
        return x  # JAX and PyTorch trace with every size known
    return tf_ops.expect_size(x, axis, expected, message)


def compiled_inference(call):
    """Decorates a layer's `call(x, training=None, ...)`: in float32 inference of a statically known
    batch of at most `XLA_BLOCK_MAX_ROWS` tokens, with `xla_encoder_blocks` chosen, the same `call` runs
    as one XLA-compiled function (`tf_ops.compiled_inference_call`); otherwise, or for a layer whose
    variables are not those of its config (quantized, LoRA), as it is. Integer keyword arguments (sizes,
    such as the block's `output_tokens`) are compiled in; tensor ones of known shapes (a RoPE block's `rotary`,
    a NaFlex block's `attention_mask`) are inputs of the compiled function; any other one set
    (`return_attention_scores`) runs the call as it is."""

    @functools.wraps(call)
    def maybe_compiled(layer, x, training=None, **kwargs):
        sizes = {key: value for key, value in kwargs.items() if _is_size(value)}
        tensors = {key: value for key, value in kwargs.items() if key not in sizes and _holds_tensors(value)}
        others_set = any(value is not None and value is not False for key, value in kwargs.items()
                         if key not in sizes and key not in tensors)
        if (not training and not others_set and _compilable_input(x) and _known_shapes(tensors)
                and active().xla_encoder_blocks):
            compiled = tf_ops.compiled_inference_call(layer, x, tensors, **sizes)
            if compiled is not None:
                return compiled
        return call(layer, x, training=training, **kwargs)

    return maybe_compiled


def rematerialized(call):
    """Decorates a layer's `call(x, training=None, ...)`: for a layer with `remat` set, in training, the same
    `call` under the backend's gradient checkpointing (`jax.checkpoint`, `tf.recompute_grad`, PyTorch's
    `checkpoint`), so its activations are recomputed in the backward pass instead of kept. The keyword
    arguments are bound first, and tensor ones (a RoPE block's `rotary`) passed on as positional inputs:
    `tf.recompute_grad` takes positional tensors only in graphs, which is why `keras.RematScope` fails on
    TensorFlow for a layer called with `training=`."""

    @functools.wraps(call)
    def maybe_rematerialized(layer, x, training=None, **kwargs):
        tensors = {key: value for key, value in kwargs.items() if _holds_tensors(value)}  # a RoPE block's `rotary`
        options = {key: value for key, value in kwargs.items() if key not in tensors}
        if layer.remat and training and not any(options.values()):
            flat = keras.tree.flatten(list(tensors.values()))  # passed on as positional tensors

            def checkpointed(inputs, *values):
                given = keras.tree.pack_sequence_as(list(tensors.values()), list(values))
                return call(layer, inputs, training=training, **options, **dict(zip(tensors, given)))

            return _checkpointed(checkpointed)(x, *flat)
        return call(layer, x, training=training, **kwargs)

    return maybe_rematerialized


def _checkpointed(function):
    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        return jax.checkpoint(function)
    if backend == "tensorflow":
        import tensorflow as tf
        return tf.recompute_grad(function)
    if backend == "torch":
        import torch.utils.checkpoint
        return functools.partial(torch.utils.checkpoint.checkpoint, function, use_reentrant=False)
    return function  # numpy and others: no gradients to save memory on


def _holds_tensors(value) -> bool:
    """Whether a keyword argument is a tensor or a structure of tensors."""
    flat = keras.tree.flatten(value) if value is not None else []
    return bool(flat) and all(ops.is_tensor(item) for item in flat)


def _known_shapes(tensors: dict) -> bool:
    """Whether every tensor in `tensors` (a structure of them per key) has a fully known shape."""
    return all(None not in tuple(tensor.shape) for tensor in keras.tree.flatten(list(tensors.values())))


def _is_size(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _compilable_input(x) -> bool:
    batch, tokens = x.shape[0], x.shape[1]
    return (batch is not None and tokens is not None and batch * tokens <= XLA_BLOCK_MAX_ROWS
            and keras.backend.standardize_dtype(x.dtype) == "float32")


__all__ = ["ENV_SWITCH", "FUSED_ATTENTION_SWITCH", "NATIVE_BFLOAT16_FLAGS", "PORTABLE", "SERVING_KERNELS",
           "XLA_BLOCK_MAX_ROWS", "AttentionKernel", "Capabilities", "KernelChoice", "active", "attention_kernel",
           "batch_matmul", "check_serving_kernels", "choose", "compiled_inference", "cpu_flags", "cpu_kernels", "dense",
           "detect", "exact_quotient", "expect_size", "fused_attention", "gelu", "layer_norm", "machine_choice",
           "rematerialized", "served_on", "warn_if_bfloat16_is_emulated"]
