import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The tests compare float32 maths with NumPy references. On GPUs and TPUs the frameworks' default rounds matmul
# inputs (TF32, bfloat16 passes): ~1e-3 off on an H100 (docs/models.md#float32-on-gpus-and-tpus). No effect on
# CPUs. Set here, not in Python, so that the tests' subprocesses inherit them.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _float32_policy():
    """Every test starts and ends with the default float32 policy."""
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")
