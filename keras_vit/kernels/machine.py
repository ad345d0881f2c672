"""The machine, and the choice of CPU-specific kernels for it: detection, the decision table, the probes.

`active()` is what the primitives ask: the machine's choice while a TensorFlow graph is traced inside a
`cpu_kernels()` scope, else `PORTABLE`. A GPU or TPU in sight, another Keras backend, eager execution or
`KERAS_VIT_KERNELS=portable` mean `PORTABLE`. A kernel that is not supported, or that fails its one-time
probe against the portable ops, is left out with one log line; never an error.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import warnings

import keras

from keras_vit import _tf_internals
from keras_vit.kernels import scope, tf_ops

logger = logging.getLogger("keras_vit")

ENV_SWITCH = "KERAS_VIT_KERNELS"  # "portable" turns every CPU-specific kernel off
# Batch * tokens up to which an XLA-compiled block beats the separate kernels (B/16 on the AVX2
# CPU: 6% faster at 4 images of 197 tokens, 3% at 8, 7% slower at 16).
XLA_BLOCK_MAX_ROWS = 2048
# The CPU flags of bfloat16 arithmetic in hardware, and their names: elsewhere oneDNN emulates it.
NATIVE_BFLOAT16_FLAGS = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"}


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
        return bool(NATIVE_BFLOAT16_FLAGS.keys() & self.cpu_flags)

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
    xla_inference_gelu: bool = False  # the tanh GELU as an XLA loop in inference too (needs xla_elementwise)


PORTABLE = KernelChoice()


def choose(capabilities: Capabilities) -> KernelChoice:
    """The kernels worth using on a machine with `capabilities` (before the one-time probes).

    From measurements on 2-core machines of both kinds this project runs on (benchmarks/RESULTS.md): the
    XLA elementwise loops pay on AVX2 (with or without oneDNN) and on AMX CPUs; the oneDNN LayerNorm pays
    where TensorFlow runs on oneDNN; the bfloat16 convolutions pay only with AMX. oneDNN's batched matmul,
    called directly, pays where TensorFlow runs on Eigen (Ti/16 training: the attention matmuls 2-4x
    faster on the AVX2 CPU). XLA-compiled encoder blocks pay in inference where TensorFlow runs on Eigen
    (B/16: 12-18% faster on the AVX2 CPU); where it runs on oneDNN its fused oneDNN kernels are kept. For the
    same reason the tanh GELU is an XLA loop in inference only on Eigen, whose fused MatMul has no GELU (oneDNN
    fuses it into the matmul before it).
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
                        xla_encoder_blocks=not capabilities.onednn, xla_inference_gelu=not capabilities.onednn)


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
        layer_norm_op = _tf_internals.op_registered(tf_ops.ONEDNN_LAYER_NORM)
        batch_matmul_op = _tf_internals.op_registered(tf_ops.ONEDNN_BATCH_MATMUL)
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
                                 onednn_batch_matmul=batch_matmul, xla_encoder_blocks=blocks,
                                 xla_inference_gelu=choice.xla_inference_gelu and xla)
    logger.debug("CPU kernels: %s", choice)
    return choice


def active() -> KernelChoice:
    """The kernels for the op being built now: the machine's inside `cpu_kernels()` while tracing a
    TensorFlow graph, else PORTABLE."""
    if scope.mode() == "off" or keras.backend.backend() != "tensorflow":
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


# === The probes: each kernel against the portable ops, once, eagerly ===


def _probe(what: str, probe, *args) -> bool:
    """Runs `probe` eagerly (`tf_ops.run_outside_traces`); False, with one log line, if it fails."""
    try:
        ok = tf_ops.run_outside_traces(_portably, probe, *args)
    except Exception as error:  # noqa: BLE001  anything a kernel can raise means: do not use it
        ok = False
        logger.info("%s unavailable on this machine, using portable ops (%s: %s)", what,
                    type(error).__name__, str(error).splitlines()[0] if str(error) else "")
    else:
        if not ok:
            logger.info("%s disagree with the portable ops on this machine; using portable ops", what)
    return ok


def _portably(probe, *args) -> bool:
    with scope.cpu_kernels(False):  # portable surroundings
        return probe(*args)


def _close(fast, portable, tolerance: float) -> bool:
    import numpy as np
    return bool(np.allclose(np.asarray(fast, "float32"), np.asarray(portable, "float32"), atol=tolerance,
                            rtol=tolerance))


def _probe_layer_norm(dtype: str) -> bool:
    import numpy as np
    import tensorflow as tf
    x = tf.constant(np.random.default_rng(0).normal(size=(6, 40)), dtype)
    gamma, beta = tf.constant(np.linspace(0.5, 1.5, 40), dtype), tf.constant(np.linspace(-1, 1, 40), dtype)
    fast = tf.function(lambda x: tf_ops.onednn_layer_norm(x, gamma, beta, 1e-6, False), autograph=False)(x)
    portable = tf_ops.portable_layer_norm(x, gamma, beta, 1e-6)
    return _close(tf.cast(fast, tf.float32), tf.cast(portable, tf.float32), 1e-5 if dtype == "float32" else 2e-2)


def _probe_xla() -> bool:
    import numpy as np
    import tensorflow as tf
    x = tf.constant(np.linspace(-3, 3, 24, dtype="float32").reshape(4, 6))
    return _close(tf_ops.gelu_forward(x), keras.activations.gelu(x, approximate=True), 1e-6)


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

    fast = run(lambda x, y: tf_ops.onednn_batch_matmul(x, y, adjoint_b=True), tf_ops.onednn_batch_matmul)
    portable = run(lambda x, y: tf.linalg.matmul(x, y, adjoint_b=True), tf.linalg.matmul)
    return all(_close(f, p, 1e-5) for f, p in zip(fast, portable))


def _probe_xla_blocks() -> bool:
    """A small attention block compiled by `tf_ops.compiled_inference_call`, against its plain call."""
    import numpy as np
    inputs = keras.Input((5, 8))
    normed = keras.layers.LayerNormalization(epsilon=1e-6)(inputs)
    attended = keras.layers.MultiHeadAttention(2, 4)(normed, normed)
    layer = keras.Model(inputs, inputs + keras.layers.Dense(8, activation="gelu")(attended))
    for i, weight in enumerate(layer.weights):
        weight.assign(np.random.default_rng(i).normal(size=weight.shape).astype("float32") * 0.3)
    x = keras.ops.convert_to_tensor(np.random.default_rng(9).normal(size=(2, 5, 8)).astype("float32"))
    return _close(tf_ops.compiled_inference_call(layer, x), layer(x, training=False), 1e-5)
