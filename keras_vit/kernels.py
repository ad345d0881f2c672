"""The maths of the encoder block, and the choice of CPU-specific kernels for it.

Every keras_vit layer computes through the functions here: the block (`encoder_block`,
`self_attention`, `mlp`) and its parts (`dense`, `layer_norm`, `gelu`, `batch_matmul`).
By default they emit portable ops, the same on every
backend, device and TensorFlow build. Inside a `cpu_kernels()` scope, which
`keras_vit.models.ViTModel` enters in its `train_step` / `test_step` / `predict_step` (so
`fit`, `evaluate` and `predict`, never exports or your own `tf.function`), the TensorFlow
backend may swap in faster kernels for the same maths, each one only where it works and
pays on the machine it runs on (`choose`):

- `onednn_layer_norm`: oneDNN's fused LayerNorm forward (`_MklLayerNorm`), per dtype, where
  TensorFlow runs on oneDNN; in bfloat16 only on CPUs with AVX-512 (oneDNN refuses it on
  AVX2), and each dtype passes a one-time probe against the portable ops before it is used.
- `bfloat16_conv_projections`: bfloat16 projections without GELU as 1x1 convolutions, which
  oneDNN gives its AMX kernel (its bfloat16 MatMul gets a generic gemm); AMX CPUs only.
- `xla_elementwise`: the GELU (training) and the LayerNorm and GELU backward passes as small
  XLA-compiled loops on any CPU, after a one-time compile probe.
- `onednn_batch_matmul`: the attention's batched matmuls (forward and backward) by oneDNN's
  kernel (`_MklBatchMatMulV2`, in float32) where TensorFlow does not itself run on oneDNN
  (where it does, its graph rewrite already uses that kernel); Eigen's is 2-4x slower for
  these (B * heads, T, head_dim) shapes on AVX2. Probed once against the portable ops.
- `xla_encoder_blocks`: the float32 inference of each encoder block (`encoder_block`) as one
  XLA-compiled function, shared by every block of the same width and input shape, where
  TensorFlow does not run on oneDNN (its default on AVX2-only and non-Intel CPUs), for inputs
  of at most `XLA_BLOCK_MAX_ROWS` tokens in all (larger or unknown batches do better on the
  separate kernels), after a one-time probe against the portable ops.

A GPU or TPU in sight, `jit_compile=True`, another Keras backend, eager execution, or
`KERAS_VIT_KERNELS=portable` in the environment all mean the portable ops. Whatever is not
supported, or fails its probe, falls back to them with one log line; never an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import threading
import warnings
from typing import Any, Callable, NamedTuple

import keras
from keras import ops

from keras_vit import _tf_internals

logger = logging.getLogger("keras_vit")

ONEDNN_LAYER_NORM = "_MklLayerNorm"
ONEDNN_BATCH_MATMUL = "_MklBatchMatMulV2"
ONEDNN_KERNEL_LABEL = "MklNameChangeOp"  # the label oneDNN's kernels are registered under
# Batch * tokens up to which an XLA-compiled block beats the separate kernels (B/16 on the AVX2
# CPU: 6% faster at 4 images of 197 tokens, 3% at 8, 7% slower at 16).
XLA_BLOCK_MAX_ROWS = 2048
ENV_SWITCH = "KERAS_VIT_KERNELS"  # "portable" turns every CPU-specific kernel off
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


# === The machine and the choice of kernels ===


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What this process can run: the CPU's ISA flags and the TensorFlow build's features."""

    cpu_flags: frozenset[str] = frozenset()
    onednn: bool = False          # TensorFlow runs CPU ops through oneDNN
    onednn_layer_norm_op: bool = False  # oneDNN's LayerNorm op is registered
    onednn_batch_matmul_op: bool = False  # oneDNN's batched matmul op is registered
    accelerator: bool = False     # a GPU or TPU is visible

    @property
    def avx512(self) -> bool:
        return {"avx512f", "avx512bw", "avx512vl"} <= self.cpu_flags

    @property
    def native_bfloat16(self) -> bool:
        """bfloat16 arithmetic in hardware (AVX512-BF16 or AMX); otherwise oneDNN emulates it."""
        return bool({"avx512_bf16", "amx_bf16"} & self.cpu_flags)

    @property
    def amx(self) -> bool:
        return {"amx_bf16", "amx_tile"} <= self.cpu_flags


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """Which CPU-specific kernels to use; all False is the portable path."""

    onednn_layer_norm: frozenset[str] = frozenset()  # dtypes, of "float32" and "bfloat16"
    bfloat16_conv_projections: bool = False
    xla_elementwise: bool = False
    onednn_batch_matmul: bool = False
    xla_encoder_blocks: bool = False


PORTABLE = KernelChoice()


def choose(capabilities: Capabilities) -> KernelChoice:
    """The kernels worth using on a machine with `capabilities` (before the one-time probes).

    From measurements on 2-core machines of both kinds this project runs on (figures in
    benchmarks/RESULTS.md): the XLA elementwise loops pay on AVX2 (with or without oneDNN) and
    on AMX CPUs; the oneDNN LayerNorm pays where TensorFlow runs on oneDNN
    (on the AVX2 CPU, where it does not by default, it gained nothing); the bfloat16
    convolutions pay only with AMX. oneDNN's batched matmul, called directly, pays where
    TensorFlow runs on Eigen (Ti/16 training: the attention matmuls 2-4x faster on the AVX2
    CPU). XLA-compiled encoder blocks pay in inference where
    TensorFlow runs on Eigen (B/16: 12-18% faster on the AVX2 CPU); where it runs on oneDNN
    its fused oneDNN kernels are kept.
    """
    if capabilities.accelerator or not capabilities.cpu_flags:
        return PORTABLE
    norm_dtypes = set()
    if capabilities.onednn and capabilities.onednn_layer_norm_op:
        norm_dtypes.add("float32")
        if capabilities.avx512:  # oneDNN has no bfloat16 LayerNorm for AVX2
            norm_dtypes.add("bfloat16")
    return KernelChoice(onednn_layer_norm=frozenset(norm_dtypes),
                        bfloat16_conv_projections=capabilities.onednn and capabilities.amx, xla_elementwise=True,
                        onednn_batch_matmul=not capabilities.onednn and capabilities.onednn_batch_matmul_op,
                        xla_encoder_blocks=not capabilities.onednn)


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags (`avx2`, `avx512f`, `amx_bf16`, ...) from /proc/cpuinfo; empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=None)
def detect() -> Capabilities:
    """This process's capabilities, read once (TensorFlow backend; anything unreadable counts as absent)."""
    import tensorflow as tf
    accelerator = any(tf.config.list_logical_devices(kind) for kind in ("GPU", "TPU"))
    try:
        onednn = _tf_internals.onednn_enabled()
        layer_norm_op = _tf_internals.op_registered(ONEDNN_LAYER_NORM)
        batch_matmul_op = _tf_internals.op_registered(ONEDNN_BATCH_MATMUL)
    except _tf_internals.Unavailable as error:
        logger.info("CPU kernels off: %s", error)
        onednn = layer_norm_op = batch_matmul_op = False
    return Capabilities(cpu_flags(), onednn, layer_norm_op, batch_matmul_op, accelerator)


_lock = threading.RLock()


@functools.lru_cache(maxsize=None)
def machine_choice() -> KernelChoice:
    """`choose(detect())`, after the one-time probes; PORTABLE with `KERAS_VIT_KERNELS=portable`."""
    if os.environ.get(ENV_SWITCH, "").lower() == "portable":
        return PORTABLE
    choice = choose(detect())
    norm_dtypes = frozenset(dtype for dtype in choice.onednn_layer_norm if _probe("oneDNN LayerNorm " + dtype,
                                                                                    _probe_layer_norm, dtype))
    xla = choice.xla_elementwise and _probe("XLA elementwise kernels", _probe_xla)
    batch_matmul = choice.onednn_batch_matmul and _probe("oneDNN batched matmul", _probe_batch_matmul)
    blocks = choice.xla_encoder_blocks and _probe("XLA encoder blocks", _probe_xla_blocks)
    choice = dataclasses.replace(choice, onednn_layer_norm=norm_dtypes, xla_elementwise=xla,
                                 onednn_batch_matmul=batch_matmul, xla_encoder_blocks=blocks)
    logger.debug("CPU kernels: %s", choice)
    return choice


def _probe(what: str, probe, *args) -> bool:
    """Runs `probe` eagerly (outside any graph being traced); False, with one log line, if it fails."""
    import tensorflow as tf
    try:
        with tf.init_scope(), cpu_kernels(False):  # the probe itself traces portable surroundings
            ok = probe(*args)
    except Exception as error:  # noqa: BLE001  anything a kernel can raise means: do not use it
        ok = False
        logger.info("%s unavailable on this machine, using portable ops (%s: %s)", what,
                    type(error).__name__, str(error).splitlines()[0] if str(error) else "")
    else:
        if not ok:
            logger.info("%s disagree with the portable ops on this machine; using portable ops", what)
    return ok


def _probe_layer_norm(dtype: str) -> bool:
    import numpy as np
    import tensorflow as tf
    x = tf.constant(np.random.default_rng(0).normal(size=(6, 40)), dtype)
    gamma, beta = tf.constant(np.linspace(0.5, 1.5, 40), dtype), tf.constant(np.linspace(-1, 1, 40), dtype)
    fast = tf.function(lambda x: _onednn_layer_norm(x, gamma, beta, 1e-6), autograph=False)(x)
    portable = _portable_layer_norm(x, gamma, beta, 1e-6)
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    return bool(np.allclose(np.asarray(tf.cast(fast, tf.float32)), np.asarray(tf.cast(portable, tf.float32)),
                            atol=tolerance, rtol=tolerance))


def _probe_xla() -> bool:
    import numpy as np
    import tensorflow as tf
    x = tf.constant(np.linspace(-3, 3, 24, dtype="float32").reshape(4, 6))
    expected = keras.activations.gelu(x, approximate=True)
    return bool(np.allclose(np.asarray(_gelu_forward(x)), np.asarray(expected), atol=1e-6))


def _probe_batch_matmul() -> bool:
    """The forward and both gradients of each batched matmul the attention uses, against Eigen's."""
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(0)
    a, b = (tf.constant(rng.normal(size=(3, 5, 4)), tf.float32) for _ in range(2))
    probs = tf.constant(rng.normal(size=(3, 5, 5)), tf.float32)

    def with_gradients(function, x, y):  # graph gradients: the probe runs where tapes are paused
        out = function(x, y)
        return [out, *tf.gradients(tf.reduce_sum(out * tf.cos(out)), [x, y])]

    def run(transposed, plain):
        return tf.function(lambda a, b, probs: with_gradients(transposed, a, b) + with_gradients(plain, probs, b),
                           autograph=False)(a, b, probs)

    fast = run(lambda x, y: _onednn_batch_matmul(x, y, adjoint_b=True), _onednn_batch_matmul)
    portable = run(lambda x, y: tf.linalg.matmul(x, y, adjoint_b=True), tf.linalg.matmul)
    return all(np.allclose(np.asarray(f), np.asarray(p), atol=1e-5, rtol=1e-5) for f, p in zip(fast, portable))


def _probe_xla_blocks() -> bool:
    import numpy as np
    rng = np.random.default_rng(0)

    def normal(*shape):
        return ops.convert_to_tensor(rng.normal(size=shape).astype("float32") * 0.3)

    width, heads, mlp_dim = 8, 2, 16
    weights = BlockWeights(
        (normal(width) + 1.0, normal(width)),
        AttentionWeights(normal(width, heads, 4), normal(heads, 4), normal(width, heads, 4), normal(heads, 4),
                         normal(width, heads, 4), normal(heads, 4), normal(heads, 4, width), normal(width)),
        (normal(width) + 1.0, normal(width)),
        MlpWeights(normal(width, mlp_dim), normal(mlp_dim), normal(mlp_dim, width), normal(width)))
    x = normal(2, 5, width)
    fast = _compiled_encoder_block(x, weights, heads, 1e-6, True)
    portable = _encoder_block(x, weights, heads, 1e-6, True)
    return bool(np.allclose(np.asarray(fast), np.asarray(portable), atol=1e-5, rtol=1e-5))


# === The scope that allows them ===


_scope = threading.local()


@contextlib.contextmanager
def cpu_kernels(enabled: bool = True):
    """Allows the machine's CPU kernels in the layers traced inside (Keras' own steps enter it)."""
    previous = getattr(_scope, "enabled", False)
    _scope.enabled = enabled
    try:
        yield
    finally:
        _scope.enabled = previous


def active() -> KernelChoice:
    """The kernels for the op being built now: the machine's inside `cpu_kernels()` while tracing
    a TensorFlow graph, else PORTABLE."""
    if not getattr(_scope, "enabled", False) or keras.backend.backend() != "tensorflow":
        return PORTABLE
    import tensorflow as tf
    if not tf.inside_function():
        return PORTABLE
    with _lock:
        return machine_choice()


def warn_if_bfloat16_is_emulated(compute_dtype: str) -> None:
    """Says once per process when a bfloat16 model is built on a CPU that emulates bfloat16."""
    if compute_dtype != "bfloat16" or keras.backend.backend() != "tensorflow" or _warned:
        return
    capabilities = detect()
    if capabilities.accelerator or capabilities.native_bfloat16 or not capabilities.cpu_flags:
        return
    _warned.add("emulated_bfloat16")
    warnings.warn("keras_vit: this CPU has no native bfloat16 (no AVX512-BF16 or AMX): bfloat16 is emulated and "
                  "float32 is faster here. mixed_bfloat16 still computes correctly.", stacklevel=2)


_warned: set[str] = set()


# === The maths ===


def dense(x, kernel, bias, gelu: bool = False, residual=None, gelu_approximate: bool = True):
    """x (N, in) @ kernel (in, out) + bias, then the GELU when `gelu` (tanh approximation, or the
    exact erf form with `gelu_approximate=False`), plus `residual` (N, out).

    Kept 2-D (not the (B, T, D) batched form) so TensorFlow's oneDNN remapper fuses MatMul +
    BiasAdd (+ GELU, or + the residual add) into one kernel. With `bfloat16_conv_projections`,
    a bfloat16 projection without GELU runs as a 1x1 convolution (bias and residual add fused too).
    """
    if keras.backend.backend() != "tensorflow":
        y = ops.matmul(x, kernel) + bias
        y = keras.activations.gelu(y, approximate=gelu_approximate) if gelu else y
        return y if residual is None else residual + y
    import tensorflow as tf
    if not gelu and x.dtype == tf.bfloat16 and active().bfloat16_conv_projections:
        width_in, width_out = kernel.shape
        y = tf.nn.conv2d(tf.reshape(x, (1, -1, 1, width_in)), tf.reshape(kernel, (1, 1, width_in, width_out)),
                         strides=1, padding="VALID")
        y = tf.nn.bias_add(y, bias)
        if residual is not None:
            y = y + tf.reshape(residual, (1, -1, 1, width_out))
        return tf.reshape(y, (-1, width_out))
    y = tf.nn.bias_add(tf.linalg.matmul(x, kernel), bias)
    y = tf.nn.gelu(y, approximate=gelu_approximate) if gelu else y
    return y if residual is None else residual + y


def batch_matmul(a, b, transpose_b: bool = False):
    """a @ b (a @ b^T with `transpose_b`) over the last two axes, leading axes batched; with
    `transpose_b` no transpose op appears in the forward or backward graph."""
    if keras.backend.backend() != "tensorflow":
        return ops.matmul(a, ops.swapaxes(b, -1, -2) if transpose_b else b)
    import tensorflow as tf
    if a.dtype == tf.float32 and active().onednn_batch_matmul:
        return _onednn_batch_matmul(a, b, adjoint_b=transpose_b)
    return tf.linalg.matmul(a, b, transpose_b=transpose_b)


def _onednn_batch_matmul(a, b, adjoint_b: bool = False):
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


def layer_norm(x, gamma, beta, epsilon: float):
    """LayerNorm of the last axis of `x` (statistics in float32, as keras.layers.LayerNormalization)."""
    if keras.backend.standardize_dtype(x.dtype) in active().onednn_layer_norm:
        return _onednn_layer_norm(x, ops.cast(gamma, x.dtype), ops.cast(beta, x.dtype), epsilon)
    return _portable_layer_norm(x, gamma, beta, epsilon)


def _portable_layer_norm(x, gamma, beta, epsilon: float):
    dtype = x.dtype
    x = ops.cast(x, "float32")
    mean = ops.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    variance = ops.mean(ops.square(centered), axis=-1, keepdims=True)
    scale = ops.rsqrt(variance + epsilon) * ops.cast(gamma, "float32")
    return ops.cast(centered * scale + ops.cast(beta, "float32"), dtype)


def gelu_tanh(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as Flax's `nn.gelu` (the original)."""
    if active().xla_elementwise:
        return _xla_gelu_tanh(x)
    return keras.activations.gelu(x, approximate=True)


def gelu(x, approximate: bool = True):
    """The tanh GELU (`gelu_tanh`) or, with `approximate=False`, the exact 0.5 x (1 + erf(x / sqrt(2)))
    of PyTorch's `nn.GELU()` (portable ops on every path)."""
    if approximate:
        return gelu_tanh(x)
    return keras.activations.gelu(x, approximate=False)


class AttentionWeights(NamedTuple):
    """Self-attention weights in the checkpoints' shapes: query, key and value kernels
    (D, heads, head_dim) and biases (heads, head_dim); output kernel (heads, head_dim, D), bias (D,)."""

    query_kernel: Any
    query_bias: Any
    key_kernel: Any
    key_bias: Any
    value_kernel: Any
    value_bias: Any
    output_kernel: Any
    output_bias: Any


class MlpWeights(NamedTuple):
    """The MLP's kernels (D, mlp_dim), (mlp_dim, D) and biases."""

    kernel_0: Any
    bias_0: Any
    kernel_1: Any
    bias_1: Any


class BlockWeights(NamedTuple):
    """One encoder block: (gamma, beta) of each LayerNorm, the attention and the MLP weights."""

    norm_attention: tuple
    attention: AttentionWeights
    norm_mlp: tuple
    mlp: MlpWeights


def self_attention(x, weights: AttentionWeights, num_heads: int, residual=None,
                   dropout: Callable | None = None):
    """Multi-head self-attention of `x` (B, T, D): `softmax(q k^T / sqrt(head_dim)) v` per head,
    then the output projection, plus `residual` (B, T, D) if given.

    One (D, 3D) QKV matmul on (B * T, D) rows (the kernels concatenated here, 1/sqrt(head_dim)
    folded into the query's kernel and bias), batched matmuls for the logits and the context,
    softmax in the compute dtype. `dropout` (training) is applied to the attention weights.
    Returns (output (B, T, D), attention weights (B, heads, T, T)).
    """
    batch, tokens, width = ops.shape(x)[0], ops.shape(x)[1], x.shape[-1]
    head_dim = width // num_heads
    # Scaling the (D, D) kernel costs D^2 multiplies instead of B*T*D; exact when head_dim is
    # a power of four (16, 64), one rounding of the scale otherwise (H/14's 80).
    scale = ops.cast(1.0 / math.sqrt(head_dim), x.dtype)
    w = weights
    qkv_kernel = ops.concatenate([ops.reshape(w.query_kernel, (width, width)) * scale,
                                  ops.reshape(w.key_kernel, (width, width)),
                                  ops.reshape(w.value_kernel, (width, width))], axis=1)
    qkv_bias = ops.concatenate([ops.reshape(w.query_bias, (width,)) * scale, ops.reshape(w.key_bias, (width,)),
                                ops.reshape(w.value_bias, (width,))], axis=0)
    rows = ops.reshape(x, (-1, width))
    qkv = ops.reshape(dense(rows, qkv_kernel, qkv_bias), (batch, tokens, 3, num_heads, head_dim))
    # unstack, not qkv[i]: its gradient is one stack, where strided slices each
    # scatter into a zero-filled copy of the whole tensor.
    query, key, value = ops.unstack(ops.transpose(qkv, (2, 0, 3, 1, 4)), 3, axis=0)
    # Softmax in the compute dtype: in bfloat16 oneDNN's softmax accumulates in float32 internally.
    probs = ops.softmax(batch_matmul(query, key, transpose_b=True), axis=-1)
    context = batch_matmul(probs if dropout is None else dropout(probs), value)  # (B, H, T, hd)
    context = ops.reshape(ops.transpose(context, (0, 2, 1, 3)), (-1, width))
    residual_rows = None if residual is None else ops.reshape(residual, (-1, width))
    out = dense(context, ops.reshape(w.output_kernel, (width, width)), w.output_bias, residual=residual_rows)
    return ops.reshape(out, (batch, tokens, width)), probs


def mlp(x, weights: MlpWeights, gelu_approximate: bool = True, residual=None, training: bool = False,
        dropout: Callable | None = None):
    """Dense(mlp_dim) -> GELU -> Dense(D) of `x` (..., D), plus `residual` if given.

    On (rows, D): outside training the GELU fuses into the first matmul and the residual add
    into the second. `dropout` (training) follows the GELU and the second Dense.
    """
    width = x.shape[-1]
    rows = ops.reshape(x, (-1, width))
    if training:  # the GELU's input is kept for the backward pass, so it cannot fuse into the matmul
        h = gelu(dense(rows, weights.kernel_0, weights.bias_0), gelu_approximate)
    else:
        h = dense(rows, weights.kernel_0, weights.bias_0, gelu=True, gelu_approximate=gelu_approximate)
    residual_rows = None if residual is None else ops.reshape(residual, (-1, width))
    if dropout is None:
        out = dense(h, weights.kernel_1, weights.bias_1, residual=residual_rows)
    else:
        out = dropout(dense(dropout(h), weights.kernel_1, weights.bias_1))
        out = out if residual_rows is None else residual_rows + out
    return ops.reshape(out, ops.shape(x))


def encoder_block(x, weights: BlockWeights, num_heads: int, epsilon: float, gelu_approximate: bool = True):
    """Inference of one pre-norm encoder block (paper Eq. 2-3, dropout and drop path off):
    `y = x + MHA(LN(x))`, `out = y + MLP(LN(y))`, each residual add fused into the projection
    before it. With `xla_encoder_blocks`, a float32 block of a statically known batch of at most
    `XLA_BLOCK_MAX_ROWS` tokens in all runs as one XLA-compiled function."""
    batch, tokens = x.shape[0], x.shape[1]
    small = batch is not None and tokens is not None and batch * tokens <= XLA_BLOCK_MAX_ROWS
    if small and active().xla_encoder_blocks and keras.backend.standardize_dtype(x.dtype) == "float32":
        return _compiled_encoder_block(x, weights, num_heads, epsilon, gelu_approximate)
    return _encoder_block(x, weights, num_heads, epsilon, gelu_approximate)


def _encoder_block(x, weights: BlockWeights, num_heads: int, epsilon: float, gelu_approximate: bool):
    attended, _ = self_attention(layer_norm(x, *weights.norm_attention, epsilon), weights.attention, num_heads,
                                 residual=x)
    return mlp(layer_norm(attended, *weights.norm_mlp, epsilon), weights.mlp, gelu_approximate, residual=attended)


def _portable_encoder_block(*args):
    with cpu_kernels(False):  # XLA compiles the portable ops
        return _encoder_block(*args)


def _onednn_layer_norm(x, gamma, beta, epsilon: float):
    """oneDNN's fused LayerNorm forward; the backward is the closed-form LayerNorm gradient."""
    import tensorflow as tf
    xla_backward = active().xla_elementwise

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


def _xla_compiled(function, reduce_retracing: bool = True):
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


# Static widths: one trace per block width, head count and input shape, shared by every block
# that has them (XLA compiles each such trace once).
_compiled_encoder_block = _xla_compiled(_portable_encoder_block, reduce_retracing=False)


@_xla_compiled
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


@_xla_compiled
def _gelu_forward(x):
    import tensorflow as tf
    x32 = tf.cast(x, tf.float32)
    return tf.cast(0.5 * x32 * (1.0 + tf.tanh(_GELU_C * (x32 + _GELU_K * x32 * x32 * x32))), x.dtype)


@_xla_compiled
def _gelu_backward(x, dy):
    import tensorflow as tf
    x32 = tf.cast(x, tf.float32)
    squared = tf.square(x32)
    t = tf.tanh(_GELU_C * x32 * (1.0 + _GELU_K * squared))
    slope = 0.5 * (1.0 + t) + 0.5 * x32 * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_K * squared)
    return tf.cast(tf.cast(dy, tf.float32) * slope, x.dtype)


def _xla_gelu_tanh(x):
    """tanh GELU with its closed-form gradient, each one XLA-fused loop."""
    import tensorflow as tf

    @tf.custom_gradient
    def gelu(x):
        return _gelu_forward(x), lambda dy: _gelu_backward(x, dy)

    return gelu(x)
