"""The TensorFlow implementations behind the primitives: the portable maths and each CPU-specific kernel.

Nothing here chooses; `keras_vit.kernels.machine` decides which of these a traced op gets.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
from typing import Any, Callable

import keras
from keras import ops

from keras_vit import _tf_internals
from keras_vit.kernels import scope

ONEDNN_LAYER_NORM = "_MklLayerNorm"
ONEDNN_BATCH_MATMUL = "_MklBatchMatMulV2"
ONEDNN_KERNEL_LABEL = "MklNameChangeOp"  # the label oneDNN's kernels are registered under
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


def portable_layer_norm(x, gamma, beta, epsilon: float):
    """LayerNorm of the last axis, statistics in float32 (as keras.layers.LayerNormalization).

    The variance squares by a product, not `ops.square`: LiteRT's converter fuses square(x - mean) into
    SQUARED_DIFFERENCE, which XNNPACK has no int8 kernel for (a full-int8 file then runs it in the interpreter,
    10x slower). The same float32 numbers either way."""
    dtype = x.dtype
    x = ops.cast(x, "float32")
    mean = ops.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    variance = ops.mean(centered * centered, axis=-1, keepdims=True)
    scale = ops.rsqrt(variance + epsilon) * ops.cast(gamma, "float32")
    return ops.cast(centered * scale + ops.cast(beta, "float32"), dtype)


def exact_quotient(size, divisor: int, message: str):
    """`size // divisor` of a scalar int tensor, evaluated only after an assertion that `divisor` divides it,
    failing with `message` (`{}`: the size)."""
    import tensorflow as tf
    return _after_assertion(tf.equal(size % divisor, 0), message, size, size // divisor)


def expect_size(x, axis: int, expected: int, message: str):
    """`x`, evaluated only after an assertion that its `axis` has `expected` entries, failing with `message`
    (`{}`: the size)."""
    import tensorflow as tf
    size = tf.shape(x)[axis]
    return _after_assertion(tf.equal(size, expected), message, size, x)


def _after_assertion(condition, message: str, size, value):
    """`value`, which no op can read before `condition` holds; otherwise InvalidArgumentError(`message` with
    `size` in its `{}`)."""
    import tensorflow as tf
    check = tf.debugging.Assert(condition, [tf.strings.format(message, (size,))])
    with tf.control_dependencies([check]):
        return tf.identity(value)


def conv_projection(x, kernel, bias):
    """x (N, in) @ kernel + bias as a 1x1 convolution, which oneDNN gives its AMX kernel in bfloat16."""
    import tensorflow as tf
    width_in, width_out = kernel.shape
    y = tf.nn.conv2d(tf.reshape(x, (1, -1, 1, width_in)), tf.reshape(kernel, (1, 1, width_in, width_out)),
                     strides=1, padding="VALID")
    return tf.reshape(tf.nn.bias_add(y, bias), (-1, width_out))


def onednn_batch_matmul(a, b, adjoint_b: bool = False):
    """a @ b (or a @ b^T) by oneDNN's batched matmul; the gradients are batched matmuls by it too."""
    import tensorflow as tf

    def matmul(x, y, adj_x=False, adj_y=False):
        return _tf_internals.create_op(ONEDNN_BATCH_MATMUL, [x, y], x.dtype, {"T": x.dtype, "adj_x": adj_x,
                                       "adj_y": adj_y}, name="onednn_batch_matmul", kernel_label=ONEDNN_KERNEL_LABEL)

    @tf.custom_gradient
    def forward(a, b):
        def backward(grad):
            if adjoint_b:  # c = a b^T: da = g b, db = g^T a
                return matmul(grad, b), matmul(grad, a, adj_x=True)
            return matmul(grad, b, adj_y=True), matmul(a, grad, adj_x=True)  # c = a b: da = g b^T, db = a^T g
        return matmul(a, b, adj_y=adjoint_b), backward

    return forward(a, b)


def onednn_layer_norm(x, gamma, beta, epsilon: float, xla_backward: bool):
    """oneDNN's fused LayerNorm forward; the backward is the closed-form LayerNorm gradient."""
    import tensorflow as tf

    @tf.custom_gradient
    def forward(x, gamma, beta):
        y = _tf_internals.create_op(ONEDNN_LAYER_NORM, [x, gamma, beta], x.dtype,
                                    {"T": x.dtype, "epsilon": epsilon}, name="onednn_layer_norm")

        def backward(dy):
            if xla_backward:
                return _layer_norm_backward(x, gamma, dy, epsilon)
            return _layer_norm_backward.python_function(x, gamma, dy, epsilon)
        return y, backward

    return forward(x, gamma, beta)


def xla_gelu_tanh(x):
    """tanh GELU with its closed-form gradient, each one XLA-fused loop."""
    import tensorflow as tf

    @tf.custom_gradient
    def gelu(x):
        return gelu_forward(x), lambda dy: _gelu_backward(x, dy)

    return gelu(x)


def xla_compiled(function, reduce_retracing: bool = True):
    """`function` as an XLA-compiled tf.function, built on its first call (TensorFlow stays a lazy
    import); `.python_function` is the plain function."""
    compiled = None

    @functools.wraps(function)
    def call(*args):
        nonlocal compiled
        if compiled is None:
            import tensorflow as tf
            compiled = tf.function(function, jit_compile=True, autograph=False, reduce_retracing=reduce_retracing)
        return compiled(*args)
    call.python_function = function
    return call


@xla_compiled
def _layer_norm_backward(x, gamma, dy, epsilon: float):
    """Closed-form LayerNorm gradient (d_x, d_gamma, d_beta) of a forward that kept no stats."""
    import tensorflow as tf
    x32, dy32 = tf.cast(x, tf.float32), tf.cast(dy, tf.float32)
    centered = x32 - tf.reduce_mean(x32, axis=-1, keepdims=True)
    inv_std = tf.math.rsqrt(tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True) + epsilon)
    normed = centered * inv_std
    reduce_axes = list(range(len(x.shape) - 1))
    d_gamma = tf.reduce_sum(dy32 * normed, axis=reduce_axes)
    d_beta = tf.reduce_sum(dy32, axis=reduce_axes)
    d_normed = dy32 * tf.cast(gamma, tf.float32)
    d_x = inv_std * (d_normed - tf.reduce_mean(d_normed, axis=-1, keepdims=True)
                     - normed * tf.reduce_mean(d_normed * normed, axis=-1, keepdims=True))
    return tf.cast(d_x, x.dtype), tf.cast(d_gamma, gamma.dtype), tf.cast(d_beta, gamma.dtype)


def attention_by_head(query, key, value, scale: float):
    """softmax(q k^T * scale) v of (batch, tokens, heads, head_dim) tensors, one head at a time: per head a
    product batched over the images only, and no transposes, for a graph served on Eigen, whose batched matmul
    over images x heads runs these small products at half its speed on them one head at a time (ViT-B/16, one
    image: 1.8 ms a block against 3.1 ms, benchmarks/RESULTS.md run U). The same maths as the layer's
    explicit path, head by head."""
    import tensorflow as tf
    attended = []
    for q, k, v in zip(*(tf.unstack(t, axis=2) for t in (query, key, value))):  # each (batch, tokens, head_dim)
        logits = tf.linalg.matmul(q * tf.cast(scale, q.dtype), k, transpose_b=True)
        attended.append(tf.linalg.matmul(tf.nn.softmax(logits, axis=-1), v))
    return tf.stack(attended, axis=2)


def gelu_tanh_as_sigmoid(x):
    """The tanh GELU as x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), since 0.5 (1 + tanh(u)) = sigmoid(2u):
    6 elementwise ops to `tf.nn.gelu`'s 9, for a graph served on Eigen (which fuses no GELU into its matmul)."""
    scale = 2.0 * _GELU_C
    return x * ops.sigmoid(x * (scale + scale * _GELU_K * ops.square(x)))


@xla_compiled
def gelu_forward(x):
    import tensorflow as tf
    x32 = tf.cast(x, tf.float32)
    return tf.cast(0.5 * x32 * (1.0 + tf.tanh(_GELU_C * (x32 + _GELU_K * x32 * x32 * x32))), x.dtype)


@xla_compiled
def _gelu_backward(x, dy):
    import tensorflow as tf
    x32 = tf.cast(x, tf.float32)
    squared = tf.square(x32)
    t = tf.tanh(_GELU_C * x32 * (1.0 + _GELU_K * squared))
    slope = 0.5 * (1.0 + t) + 0.5 * x32 * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_K * squared)
    return tf.cast(tf.cast(dy, tf.float32) * slope, x.dtype)


# === Whole layers, XLA-compiled from outside their maths ===

_compiled_layer_calls: dict = {}
_templates: dict = {}


def compiled_inference_call(layer: keras.layers.Layer, x, tensors: dict | None = None, **sizes: int):
    """`layer(x, training=False, **tensors, **sizes)`, its own `call` run as one XLA-compiled function of
    (weights, x, tensors); None for a layer whose variables differ from those of a new layer of its config
    (quantized, LoRA). `tensors`: tensor keyword arguments of the call (a RoPE block's `rotary` tables), inputs
    of the function; `sizes`: integer ones (a block's `output_tokens`), compiled in.

    One trace per layer class, config (less the name), variables, input shape and sizes, shared by every
    layer that has them: the twelve blocks of a ViT-B/16 compile once (the last, with `output_tokens`, once
    more in `keras_vit.head_rows_model`). The trace runs a template layer of that config through
    `stateless_call` with the given layer's weights, on the portable ops. One template serves every batch
    size and `sizes` of a config: building one runs its initializers (0.3 s for a ViT-B/16 block).
    """
    config = {key: value for key, value in layer.get_config().items() if key != "name"}
    variables = tuple((tuple(v.shape), v.dtype, v.trainable) for v in layer.variables)
    template_key = (type(layer), repr(sorted(config.items())), tuple(x.shape[1:]), variables)
    tensors = tensors or {}
    tensor_specs = tuple((name, tuple((tuple(t.shape), keras.backend.standardize_dtype(t.dtype))
                                      for t in keras.tree.flatten(value))) for name, value in sorted(tensors.items()))
    key = (template_key, tuple(x.shape), keras.backend.standardize_dtype(x.dtype), tensor_specs,
           tuple(sorted(sizes.items())))
    if key not in _compiled_layer_calls:
        if template_key not in _templates:
            _templates[template_key] = _template(layer, (None, *x.shape[1:]), variables)
        template = _templates[template_key]
        _compiled_layer_calls[key] = None if template is None else _compile(template, sizes)
    compiled = _compiled_layer_calls[key]
    if compiled is None:
        return None
    return compiled([v.value for v in layer.trainable_variables], [v.value for v in layer.non_trainable_variables], x,
                    tensors)


def run_outside_traces(function: Callable[..., Any], *args) -> Any:
    """`function(*args)`, run eagerly in a thread of its own, where no graph is being traced (a probe, a template).

    Variables it makes are unseen by any `tf.function` being traced in the calling thread. Made in that thread, a
    first trace that made variables would be traced again, and a later trace fails: `tf.function` allows
    variables only in its first trace, `tf.init_scope()` included. Keras' and keras_vit's scopes (dtype policy,
    `cpu_kernels`) are per thread: in the new thread they are at their defaults. Exceptions reach the caller.
    """
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="keras_vit_outside_traces") as pool:
        return pool.submit(function, *args).result()


def _template(layer: keras.layers.Layer, input_shape: tuple, variables: tuple):
    """A new, built layer of `layer`'s config with its weights split as `layer`'s are; None if its variables
    differ from `variables`."""
    template = run_outside_traces(_built_copy, layer, input_shape)
    if tuple((tuple(v.shape), v.dtype) for v in template.variables) != tuple(v[:2] for v in variables):
        return None
    for weight, (_, _, trainable) in zip(template.variables, variables):
        weight.trainable = trainable  # stateless_call takes the weights split as the layer splits them
    return template


def _built_copy(layer: keras.layers.Layer, input_shape: tuple) -> keras.layers.Layer:
    """A new layer of `layer`'s config, built for `input_shape`."""
    copy = type(layer).from_config(layer.get_config())
    copy.build(input_shape)
    return copy


def _compile(template: keras.layers.Layer, sizes: dict):
    """The XLA-compiled stateless inference call of `template`, `sizes` compiled in."""

    def run(trainable, non_trainable, x, tensors):
        with scope.cpu_kernels(False):  # XLA compiles the portable ops
            return template.stateless_call(trainable, non_trainable, x, training=False, **tensors, **sizes)[0]

    return xla_compiled(run, reduce_retracing=False)
