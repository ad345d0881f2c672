import atexit
import os
import shutil
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The tests compare float32 maths with NumPy references. On GPUs and TPUs the frameworks' default rounds matmul
# inputs (TF32, bfloat16 passes): ~1e-3 off on an H100 (docs/models.md#float32-on-gpus-and-tpus). No effect on
# CPUs. Set here, not in Python, so that the tests' subprocesses inherit them.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
# The tests start dozens of JAX processes (multi-process, killed and resumed runs, the command line) that compile the
# same tiny steps: one persistent compilation cache for the test session, its xdist workers and their subprocesses
# (all inherit this environment) compiles each step once. JAX keys an entry by the computation, the devices and the
# versions, and recompiles where an entry cannot be read. A new folder per session, removed at its end.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="keras_vit_tests_jax_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # Tiny steps compile in under 1 s.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _float32_policy():
    """Every test starts and ends with the default float32 policy."""
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


def pytest_collection_modifyitems(config, items):
    """The `slow` tests first, each group in collection order: with `-n 2` the workers start on the long tests and
    end on short ones, so neither waits long for the other at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
