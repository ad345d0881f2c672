"""Where a run's model lives and how its batches split: tf.distribute strategies on TensorFlow,
keras.distribution on JAX, and the Keras 3.15 multi-worker fix.

`get_strategy(name)` returns what a run asks for. On TensorFlow that is a tf.distribute strategy; for
`"multiworker"` it is `KerasMultiWorkerMirroredStrategy`, a `tf.distribute.MultiWorkerMirroredStrategy`
whose `reduce` accepts what Keras hands it. Keras 3.15 `model.fit` fails with MultiWorkerMirroredStrategy
before the first step (https://github.com/keras-team/keras/issues/20585):

1. `TensorFlowTrainer._symbolic_build` calls `strategy.reduce("MEAN", (x, y), axis=None)` on a
   nested batch, but the collective strategy's `reduce` takes one value, not a structure
   ("Attempt to convert a value (PerReplica...) to a Tensor").
2. `reduce_per_replica` reduces every scalar metric with `strategy.reduce("MEAN", v, axis=0)`,
   and a scalar has no axis 0.

The subclass maps `reduce` over nested structures and reduces scalars with `axis=None`; every
other call is the parent's. Nothing else is patched, and no other strategy is touched.

On JAX, `get_strategy` returns a keras.distribution over this process's devices (a TPU
VM's chips, a machine's GPUs): `keras.distribution.DataParallel` (weights replicated, every batch split
over the devices), or with `model_parallel=N` a `keras.distribution.ModelParallel` on a (devices / N, N)
("batch", "model") mesh whose `vit_layout_map` splits each encoder block's attention heads and MLP
width over the N devices of the "model" axis. `None` is one device.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from typing import ContextManager, Union

import keras
import tensorflow as tf

from . import multihost

# What a run is distributed with: tf.distribute on TensorFlow, keras.distribution (None: one device) on JAX.
KERAS_DISTRIBUTIONS = (keras.distribution.DataParallel, keras.distribution.ModelParallel)
Strategy = Union[tf.distribute.Strategy, keras.distribution.DataParallel, keras.distribution.ModelParallel, None]

STRATEGIES = ("auto", "default", "mirrored", "multiworker", "tpu")
JAX_STRATEGIES = ("auto", "default")
BATCH_AXIS, MODEL_AXIS = "batch", "model"

# Megatron-style model parallelism of the encoder blocks (paths: `encoderblock_<i>/...`, also inside a masked
# patch model): the query/key/value projections and the first MLP Dense are split by output (heads, MLP
# units), the attention output and the second Dense by input, so each block needs one all-reduce after its
# attention and one after its MLP. Embeddings, norms, heads and ResNet stems are replicated.
_BLOCK = r".*encoderblock_\d+/"
VIT_LAYOUT = {
    _BLOCK + r"MultiHeadDotProductAttention_1/(query|key|value)/kernel": (None, MODEL_AXIS, None),  # (D, heads, dh)
    _BLOCK + r"MultiHeadDotProductAttention_1/(query|key|value)/bias": (MODEL_AXIS, None),  # (heads, dh)
    _BLOCK + r"MultiHeadDotProductAttention_1/attention_output/kernel": (MODEL_AXIS, None, None),  # (heads, dh, D)
    _BLOCK + r"MlpBlock_3/Dense_0/kernel": (None, MODEL_AXIS),  # (D, mlp_dim)
    _BLOCK + r"MlpBlock_3/Dense_0/bias": (MODEL_AXIS,),
    _BLOCK + r"MlpBlock_3/Dense_1/kernel": (MODEL_AXIS, None),  # (mlp_dim, D)
}


class KerasMultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """MultiWorkerMirroredStrategy whose `reduce` works with Keras 3 `model.fit` (keras#20585)."""

    def reduce(self, reduce_op, value, axis):
        parent_reduce = super().reduce

        def reduce_one(v):
            rank = v.shape.rank if hasattr(v, "shape") else None
            return parent_reduce(reduce_op, v, axis=None if rank == 0 else axis)

        return tf.nest.map_structure(reduce_one, value)


def get_strategy(name: str, tpu: str = "", model_parallel: int = 1) -> Strategy:
    """Returns the strategy called `name`: tf.distribute's on TensorFlow, keras.distribution's on JAX.

    Args:
        name: str. `"auto"` (TensorFlow: TPU if `tpu` is given, else `"multiworker"` if `TF_CONFIG` is
            set, else `"mirrored"` on several GPUs, else `"default"`; JAX: all devices of this process),
            `"default"` (one device), and on TensorFlow only `"mirrored"` (all local GPUs, or the logical
            CPUs if there are no GPUs), `"multiworker"` (hosts from `TF_CONFIG`) or `"tpu"`.
        tpu: str. TensorFlow's TPU address for `"tpu"`/`"auto"`: `"local"` on a TPU VM, a name or `grpc://`
            address. JAX finds a TPU VM's chips itself.
        model_parallel: int. JAX only: devices per model replica. 1 (the default) gives DataParallel, N > 1
            a ModelParallel whose "model" axis of N devices splits the encoder blocks (`vit_layout_map`).
    """
    if name not in STRATEGIES:
        raise ValueError(f"Unknown strategy {name!r}. Expected one of {STRATEGIES}.")
    if keras.backend.backend() == "jax":
        return _jax_distribution(name, tpu, model_parallel)
    if model_parallel != 1:
        raise ValueError(f"model_parallel={model_parallel} splits the model with keras.distribution, which "
                         "keras_vit.training uses on JAX; tf.distribute replicates the whole model. Expected "
                         "model_parallel=1 on TensorFlow, or run with KERAS_BACKEND=jax.")
    if name == "auto":
        name = _auto_strategy_name(tpu)
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
        return tf.distribute.MirroredStrategy([device.name for device in devices])
    if name == "multiworker":
        return KerasMultiWorkerMirroredStrategy()
    if not tpu:
        raise ValueError("strategy='tpu' needs a TPU address: --tpu=local on a TPU VM, or its name/grpc address.")
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return tf.distribute.TPUStrategy(resolver)


def _jax_distribution(name: str, tpu: str, model_parallel: int) -> Strategy:
    """`get_strategy` on JAX: DataParallel or ModelParallel over all devices (`"auto"`), or one device."""
    if tpu:
        raise ValueError(f"tpu={tpu!r} is the address of TensorFlow's TPUStrategy. On JAX a TPU VM's chips are "
                         "JAX devices: leave tpu empty (no --tpu) and use strategy 'auto'.")
    if name not in JAX_STRATEGIES:
        raise ValueError(f"strategy={name!r} is a tf.distribute strategy (TensorFlow). On JAX keras_vit.training "
                         f"uses keras.distribution over this process's devices. Expected one of {JAX_STRATEGIES}: "
                         "'auto' (all devices: DataParallel, or ModelParallel with model_parallel > 1) or "
                         "'default' (one device).")
    if name == "default":
        if model_parallel != 1:
            raise ValueError(f"model_parallel={model_parallel} needs several devices: use strategy 'auto'.")
        return None
    devices = keras.distribution.list_devices()  # Of every process.
    if model_parallel == 1:
        # Each process reads its own shard of the input (training/data.py): Keras assembles the global batch.
        return keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False)
    check_model_parallel_processes(model_parallel, multihost.process_count())
    return model_parallel_distribution(devices, model_parallel)


def check_model_parallel_processes(model_parallel: int, num_processes: int | None) -> None:
    """Raises ValueError for a split model (`model_parallel` > 1) in a run of several processes. The command line
    checks it before the processes join, so that a run that cannot start fails at once."""
    if model_parallel != 1 and (num_processes or 1) > 1:
        raise ValueError(f"model_parallel={model_parallel} with {num_processes} processes: keras_vit saves a split "
                         "model from one process only. Expected model_parallel=1 (DataParallel) in a multi-process "
                         "run.")


def model_parallel_distribution(devices: list[str], model_parallel: int) -> keras.distribution.ModelParallel:
    """ModelParallel on a (len(devices) / model_parallel, model_parallel) ("batch", "model") mesh with the
    ViT layout (`vit_layout_map`): each batch splits over the first axis, each encoder block over the second."""
    if model_parallel < 1 or len(devices) % model_parallel:
        raise ValueError(f"model_parallel={model_parallel} does not divide the {len(devices)} devices. Expected "
                         f"a divisor of {len(devices)} (devices per model replica).")
    mesh = keras.distribution.DeviceMesh((len(devices) // model_parallel, model_parallel), (BATCH_AXIS, MODEL_AXIS),
                                         devices)
    return keras.distribution.ModelParallel(layout_map=vit_layout_map(mesh), batch_dim_name=BATCH_AXIS)


def vit_layout_map(mesh: keras.distribution.DeviceMesh) -> keras.distribution.LayoutMap:
    """`VIT_LAYOUT` on `mesh`, which has a "model" axis; variables that no entry matches are replicated."""
    layout_map = keras.distribution.LayoutMap(mesh)
    for path, axes in VIT_LAYOUT.items():
        layout_map[path] = axes
    return layout_map


def _auto_strategy_name(tpu: str) -> str:
    if tpu:
        return "tpu"
    if os.environ.get("TF_CONFIG"):
        return "multiworker"
    return "mirrored" if len(tf.config.list_logical_devices("GPU")) > 1 else "default"


def num_replicas(strategy: Strategy) -> int:
    """How many parts each global batch splits into: tf.distribute's replicas in sync, or the size of a
    keras.distribution's batch axis (1 for None, one device)."""
    if strategy is None:
        return 1
    if isinstance(strategy, KERAS_DISTRIBUTIONS):
        return strategy.num_model_replicas
    return strategy.num_replicas_in_sync


def describe(strategy: Strategy) -> str:
    """The strategy's class name (with the process count of a multi-process JAX run), or "one device" for None
    (JAX without a distribution)."""
    if strategy is None:
        return "one device"
    processes = multihost.process_count() if isinstance(strategy, KERAS_DISTRIBUTIONS) else 1
    return type(strategy).__name__ + (f" over {processes} processes" if processes > 1 else "")


def check_global_batch(global_batch_size: int, strategy: Strategy) -> int:
    """Returns the per-replica batch size; raises if the global batch does not split evenly."""
    replicas = num_replicas(strategy)
    if global_batch_size < 1 or global_batch_size % replicas:
        raise ValueError(f"Global batch size {global_batch_size} is not divisible by the {replicas} replicas of "
                         f"{describe(strategy)}. Expected a positive multiple of {replicas}.")
    return global_batch_size // replicas


def check_eval_split(shard_sizes: list[int] | None, strategy: Strategy, dataset: str = "", split: str = "") -> None:
    """Raises if a keras.distribution cannot split the eval split's batches (unpadded: `exact_eval=False`).

    `shard_sizes`: the eval examples of each process (one entry in a one-process run). tf.distribute evaluates
    uneven batches; JAX shards every batch evenly over the batch axis, and each process must step as often as
    the others. With a global batch that divides by the replicas, every eval batch does when the split does.
    """
    replicas = num_replicas(strategy)
    if not isinstance(strategy, KERAS_DISTRIBUTIONS) or shard_sizes is None:
        return
    if len(set(shard_sizes)) > 1:
        raise ValueError(f"The eval split falls unevenly on the {len(shard_sizes)} processes ({shard_sizes} "
                         "examples): each process must evaluate as many batches as the others. Expected an eval "
                         f"split whose size divides by {len(shard_sizes)} (with no unreadable files).")
    num_examples = sum(shard_sizes)
    if not num_examples % replicas:
        return
    extra, kept = num_examples % replicas, num_examples - num_examples % replicas
    if dataset == "folder":
        fix = f"move {extra} image(s) out of the folder data_dir/{split or '<eval_split>'}/"
    elif dataset == "digits":
        fix = f"pick an eval split of {kept} digits"
    else:
        fix = f"take a slice of the split, e.g. eval_split={(split or 'validation').split('[')[0]}[:{kept}]"
    raise ValueError(f"The eval split has {num_examples} examples, which do not split evenly over the {replicas} "
                     f"replicas of {describe(strategy)} (JAX shards every batch evenly): {fix}, or train on "
                     "TensorFlow, whose tf.distribute evaluates uneven batches.")


def check_model_parallel(strategy: Strategy, architecture: dict) -> None:
    """Raises unless a ModelParallel's "model" axis divides the attention heads and MLP width it splits."""
    if not isinstance(strategy, keras.distribution.ModelParallel):
        return
    mesh = strategy.device_mesh
    size = mesh.shape[list(mesh.axis_names).index(MODEL_AXIS)]
    for field in ("num_heads", "mlp_dim"):
        if architecture[field] % size:
            raise ValueError(f"model_parallel={size} does not divide {field}={architecture[field]}: each encoder "
                             "block's attention heads and MLP width are split over the model axis. Expected a "
                             f"divisor of num_heads={architecture['num_heads']} and mlp_dim={architecture['mlp_dim']}.")


def build_scope(strategy: Strategy) -> ContextManager:
    """Where the model and optimizer are built: their variables take the strategy's (or distribution's) layout."""
    return contextlib.nullcontext() if strategy is None else strategy.scope()


def run_scope(strategy: Strategy) -> ContextManager:
    """Where `fit` and `evaluate` run: Keras on JAX shards the batches and compiles the steps for the current
    keras.distribution; a tf.distribute model keeps the strategy it was built under."""
    if isinstance(strategy, KERAS_DISTRIBUTIONS):
        return strategy.scope()
    return contextlib.nullcontext()


def device_names() -> list[str]:
    """The devices a run can use: Keras' (JAX's) on JAX, TensorFlow's logical devices on TensorFlow."""
    if keras.backend.backend() == "jax":
        return keras.distribution.list_devices()
    return [device.name for device in tf.config.list_logical_devices()]


def keep_tensorflow_on_cpu() -> None:
    """On JAX, hides the GPUs from TensorFlow, which only runs the tf.data pipelines: it would otherwise
    reserve most of each GPU's memory that JAX needs. Too late once TensorFlow has started its devices."""
    if not tf.config.list_physical_devices("GPU"):
        return
    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError as error:  # TensorFlow's devices are already initialized.
        logging.warning("TensorFlow keeps its GPUs (%s).", error)


def output_dir(workdir: str) -> str:
    """Where this process writes a run's outputs: `workdir` on process 0 (`multihost.is_writer`). Every other
    process saves too, in step with process 0 (tf.distribute's rule; on JAX each save creates variables on the
    devices of every process, a collective step), but elsewhere: TensorFlow's workers in `workdir/worker_<i>`, JAX's
    processes in a local scratch folder that the run deletes (`is_scratch`)."""
    if multihost.is_writer():
        return workdir
    if keras.backend.backend() == "jax":
        return tempfile.mkdtemp(prefix=f"keras_vit_process_{multihost.process_index()}_")
    return os.path.join(workdir, f"worker_{multihost.process_index()}")


def is_scratch(outdir: str, workdir: str) -> bool:
    """True for a JAX process's scratch output folder (`output_dir`), which the run deletes at its end."""
    return keras.backend.backend() == "jax" and outdir != workdir


class AllReducedClipping:
    """Optimizer mixin: `global_clipnorm` on the gradient summed over replicas, as in the paper.

    Keras 3.15 clips inside each replica before the all-reduce (`BaseOptimizer.apply` calls
    `_clip_gradients` on the replica's share), so with N replicas each share of about 1/N of the
    gradient is clipped on its own norm. This sums the shares first (one extra all-reduce), takes
    the global norm of the sum and scales every share by the same factor.
    """

    def _clip_gradients(self, grads):
        context = tf.distribute.get_replica_context()
        if not self.global_clipnorm or context is None or context.num_replicas_in_sync == 1:
            return super()._clip_gradients(grads)
        norm = tf.linalg.global_norm(context.all_reduce(tf.distribute.ReduceOp.SUM, grads))
        scale = tf.minimum(1.0, self.global_clipnorm / tf.maximum(norm, 1e-12))
        return [g * tf.cast(scale, g.dtype) for g in grads]
