"""tf.distribute strategies for `model.fit`, and the Keras 3.15 multi-worker fix.

`get_strategy(name)` returns the strategy a run asks for. For `"multiworker"` it returns
`KerasMultiWorkerMirroredStrategy`, a `tf.distribute.MultiWorkerMirroredStrategy` whose `reduce`
accepts what Keras hands it. Keras 3.15 `model.fit` fails with MultiWorkerMirroredStrategy
before the first step (https://github.com/keras-team/keras/issues/20585):

1. `TensorFlowTrainer._symbolic_build` calls `strategy.reduce("MEAN", (x, y), axis=None)` on a
   nested batch, but the collective strategy's `reduce` takes one value, not a structure
   ("Attempt to convert a value (PerReplica...) to a Tensor").
2. `reduce_per_replica` reduces every scalar metric with `strategy.reduce("MEAN", v, axis=0)`,
   and a scalar has no axis 0.

The subclass maps `reduce` over nested structures and reduces scalars with `axis=None`; every
other call is the parent's. Nothing else is patched, and no other strategy is touched.
"""

from __future__ import annotations

import os

import tensorflow as tf

STRATEGIES = ("auto", "default", "mirrored", "multiworker", "tpu")


class KerasMultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """MultiWorkerMirroredStrategy whose `reduce` works with Keras 3 `model.fit` (keras#20585)."""

    def reduce(self, reduce_op, value, axis):
        parent_reduce = super().reduce

        def reduce_one(v):
            rank = v.shape.rank if hasattr(v, "shape") else None
            return parent_reduce(reduce_op, v, axis=None if rank == 0 else axis)

        return tf.nest.map_structure(reduce_one, value)


def get_strategy(name: str, tpu: str = "") -> tf.distribute.Strategy:
    """Returns the tf.distribute strategy called `name`.

    Args:
        name: str. `"auto"` (TPU if `tpu` is given, else `"multiworker"` if `TF_CONFIG` is set, else
            `"mirrored"` on several GPUs, else `"default"`), `"default"` (one device), `"mirrored"` (all
            local GPUs, or the logical CPUs if there are no GPUs), `"multiworker"` (hosts from
            `TF_CONFIG`) or `"tpu"`.
        tpu: str. TPU address for `"tpu"`/`"auto"`: `"local"` on a TPU VM, a name or `grpc://` address.
    """
    if name not in STRATEGIES:
        raise ValueError(f"Unknown strategy {name!r}. Expected one of {STRATEGIES}.")
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


def _auto_strategy_name(tpu: str) -> str:
    if tpu:
        return "tpu"
    if os.environ.get("TF_CONFIG"):
        return "multiworker"
    return "mirrored" if len(tf.config.list_logical_devices("GPU")) > 1 else "default"


def check_global_batch(global_batch_size: int, strategy: tf.distribute.Strategy) -> int:
    """Returns the per-replica batch size; raises if the global batch does not split evenly."""
    replicas = strategy.num_replicas_in_sync
    if global_batch_size < 1 or global_batch_size % replicas:
        raise ValueError(f"Global batch size {global_batch_size} is not divisible by the {replicas} replicas of "
                         f"{type(strategy).__name__}. Expected a positive multiple of {replicas}.")
    return global_batch_size // replicas


def worker_index() -> int:
    """This process's index among the training processes of `TF_CONFIG`: 0 for the chief (or worker 0
    when there is no chief task), distinct for every other worker; 0 without a cluster."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster = resolver.cluster_spec().as_dict()
    if not cluster or resolver.task_type == "chief":
        return 0
    return int(resolver.task_id) + (1 if "chief" in cluster else 0)


def is_chief() -> bool:
    """True on the one process that writes the shared outputs (the only process outside multi-worker)."""
    return worker_index() == 0


def broadcast_from_first_replica(strategy: tf.distribute.Strategy, values: list) -> list[tf.Tensor]:
    """`values` as global replica 0 (on the chief) holds them, on every worker.

    An all-reduce sum in which every other replica contributes zeros, computed in float64 (exact
    for float32/bfloat16 weights and for integer counters below 2**53) and cast back.
    """
    def replica_fn():
        first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
        shares = [tf.where(first, tf.cast(v, tf.float64), tf.zeros_like(v, tf.float64)) for v in values]
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, shares)

    summed = strategy.experimental_local_results(strategy.run(replica_fn))[0]
    return [tf.cast(total, tf.as_dtype(v.dtype)) for total, v in zip(summed, values)]


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
