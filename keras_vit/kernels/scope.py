"""The switch that allows CPU-specific kernels in the layers traced inside it.

`keras_vit.ViTModel` turns it on in its `train_step` (mode "training") and in its `test_step` and
`predict_step` (mode "inference"); everything else (calls, exports, your own `tf.function`) traces
with it off, on the portable ops. `served_on` names the kernels of the TensorFlow that will serve an export, and
`for_litert` traces a LiteRT file, `for_gpu_delegate` one for the GPU delegate, and `for_onnx` an ONNX file.
"""

from __future__ import annotations

import contextlib
import threading

MODES = ("off", "inference", "training")
# The CPU kernels of the TensorFlow that serves an export (`served_on`): oneDNN fuses MatMul + BiasAdd + the tanh
# GELU (its remapper matches `tf.nn.gelu`'s ops); Eigen fuses no GELU, so its ops run one pass each.
SERVING_KERNELS = ("onednn", "eigen")
_state = threading.local()


@contextlib.contextmanager
def cpu_kernels(enabled: bool = True, training: bool = False):
    """Allows the machine's CPU kernels in the layers traced inside (Keras' steps of a ViTModel enter it)."""
    with _holding("mode", ("training" if training else "inference") if enabled else "off"):
        yield


def mode() -> str:
    """"off", "inference" or "training": the scope entered last on this thread."""
    return getattr(_state, "mode", "off")


@contextlib.contextmanager
def served_on(kernels: str):
    """Traces the graph an export serves for TensorFlow on `kernels`, one of `SERVING_KERNELS`."""
    check_serving_kernels(kernels)
    with _holding("serving", kernels):
        yield


@contextlib.contextmanager
def for_litert():
    """Traces a graph for LiteRT, every mode: `kernels.token_row` takes a token without a shrink-axis mask, which
    neither XNNPACK nor the GPU delegate runs."""
    with _holding("litert", "on"):
        yield


def litert() -> bool:
    """Whether `for_litert` (or `for_gpu_delegate`) is entered on this thread."""
    return getattr(_state, "litert", None) == "on" or gpu_delegate()


@contextlib.contextmanager
def for_gpu_delegate():
    """Traces a graph for LiteRT's GPU delegate: no op form it ignores or refuses (`kernels.batch_matmul` transposes
    its right operand with an op of its own, not BATCH_MATMUL's adj_y flag, which the delegate ignores;
    `kernels.token_row` takes a token without a shrink-axis mask, which it refuses)."""
    with _holding("gpu_delegate", "on"):
        yield


def gpu_delegate() -> bool:
    """Whether `for_gpu_delegate` is entered on this thread."""
    return getattr(_state, "gpu_delegate", None) == "on"


@contextlib.contextmanager
def for_onnx():
    """Traces a graph for ONNX: the exact GELU as 0.5 x (1 + erf(x / sqrt(2))). TensorFlow's `tf.nn.gelu` writes it
    with Erfc, an op ONNX does not have: tf2onnx passes the node on and ONNX Runtime refuses the file."""
    with _holding("onnx", "on"):
        yield


def onnx() -> bool:
    """Whether `for_onnx` is entered on this thread."""
    return getattr(_state, "onnx", None) == "on"


def serving_kernels() -> str:
    """The kernels `served_on` named last on this thread; "onednn" outside it."""
    return getattr(_state, "serving", "onednn")


@contextlib.contextmanager
def _holding(name: str, value: str):
    """This thread's `name` is `value` inside; whatever it was (or unset) after."""
    previous = getattr(_state, name, None)
    setattr(_state, name, value)
    try:
        yield
    finally:
        if previous is None:
            delattr(_state, name)
        else:
            setattr(_state, name, previous)


def check_serving_kernels(kernels: str) -> None:
    """Raises ValueError unless `kernels` is one of `SERVING_KERNELS`."""
    if kernels not in SERVING_KERNELS:
        raise ValueError(f"Unknown serving kernels {kernels!r}. Expected one of {SERVING_KERNELS}: \"onednn\" "
                         "(x86 TensorFlow on CPUs with AVX512-VNNI, AVX512-BF16 or AMX) or \"eigen\" (AVX2-only "
                         "CPUs, TF_ENABLE_ONEDNN_OPTS=0).")
