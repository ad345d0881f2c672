"""The switch that allows CPU-specific kernels in the layers traced inside it.

`keras_vit.ViTModel` turns it on in its `train_step` (mode "training") and in its `test_step` and
`predict_step` (mode "inference"); everything else (calls, exports, your own `tf.function`) traces
with it off, on the portable ops.
"""

from __future__ import annotations

import contextlib
import threading

MODES = ("off", "inference", "training")
_state = threading.local()


@contextlib.contextmanager
def cpu_kernels(enabled: bool = True, training: bool = False):
    """Allows the machine's CPU kernels in the layers traced inside (Keras' steps of a ViTModel enter it)."""
    previous = mode()
    _state.mode = ("training" if training else "inference") if enabled else "off"
    try:
        yield
    finally:
        _state.mode = previous


def mode() -> str:
    """"off", "inference" or "training": the scope entered last on this thread."""
    return getattr(_state, "mode", "off")
