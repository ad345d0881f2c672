import atexit
import gc
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


# The modules of runs of several processes, whose longest tests take 40 s to 2 min on 2 cores: the first slow tests.
MULTI_PROCESS_MODULES = ("test_multihost.py", "test_backends.py", "test_exact_eval.py", "test_training_runs.py",
                         "test_training_jax.py")


def pytest_collection_modifyitems(config, items):
    """The `slow` tests first, those of `MULTI_PROCESS_MODULES` before the others, each group in collection order:
    with `-n 3` the longest tests start early and the workers end on short ones, so none waits long for the
    others at the end."""
    def rank(item) -> int:
        if item.get_closest_marker("slow") is None:
            return 2
        return 0 if item.path.name in MULTI_PROCESS_MODULES else 1

    items.sort(key=rank)


def pytest_collection_finish(session):
    """Moves what exists once the tests are collected (TensorFlow, Keras, JAX and the test modules: about 550,000
    objects, alive until the process ends) out of the garbage collector's view: every full collection (Keras'
    `clear_session`, each TFLite conversion, Python's own) then walks only what the tests made since, which in a
    worker of the suite took 1-3 s per collection."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n 3` schedules by work stealing (`--dist worksteal`) unless another `--dist` is asked for: xdist's default
    (`load`) first gives each worker an eighth of the list that the others cannot take over (with two workers, of
    825 tests one got the first 103, all slow: most of the suite's time); with work stealing an idle worker takes
    tests from the end of another's queue. Not in pytest.ini: .ci/packaging runs it where pytest-xdist is not
    installed."""
    if config.getoption("dist") == "load":
        from xdist.scheduler import WorkStealingScheduling
        return WorkStealingScheduling(config, log)
    return None
