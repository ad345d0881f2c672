"""Several processes as one run: JAX's (a TPU pod slice's hosts, several GPU hosts, or N local processes) and
TensorFlow's multi-worker processes (`TF_CONFIG`). Which process writes, on either backend: `process_index()` (0
writes: `is_writer()`), `process_count()`, and `broadcast_from_process_0` (process 0's values on every process).

On JAX, one process per host runs the same program. `initialize` joins them (Keras' `keras.distribution.initialize`
semantics and environment variables, plus timeouts). Then `keras.distribution.list_devices()` lists the devices
of every host, a `DataParallel` over them splits each global batch over all of them, and:

- each process reads its own shard of the input (`shard()`: tf.data by process index), so no host decodes the
  whole dataset; Keras assembles the global batch from the per-process batches (`auto_shard_dataset=False`);
- process 0 writes the outputs (`is_writer()`); every process keeps its own crash backup, and on resume every
  process takes process 0's restored state (`broadcast_from_process_0`).

Without `initialize` (one process) or `TF_CONFIG`, every function here describes that one process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
import time

import numpy as np

# Keras' own environment variables of `keras.distribution.initialize()`, read the same way.
ENV_ADDRESSES = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
ENV_NUM_PROCESSES = "KERAS_DISTRIBUTION_NUM_PROCESSES"
ENV_PROCESS_ID = "KERAS_DISTRIBUTION_PROCESS_ID"

DEFAULT_JOIN_TIMEOUT_S = 300  # JAX's own defaults.
DEFAULT_HEARTBEAT_TIMEOUT_S = 100


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where the processes of a run meet. `None` fields are found by JAX's cluster detection (TPU pod slice,
    SLURM, Open MPI); `coordinator_address` is process 0's `host:port`."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @classmethod
    def from_flags_and_env(cls, job_addresses: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> "Cluster":
        """The cluster from explicit values, else Keras' environment variables. `job_addresses` is process 0's
        address, or all processes' comma-separated (process 0's first), as for `keras.distribution.initialize`."""
        job_addresses = job_addresses or os.environ.get(ENV_ADDRESSES) or None
        num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
        process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
        coordinator = job_addresses
        if job_addresses and "," in job_addresses:
            addresses = [a.strip() for a in job_addresses.split(",")]
            if num_processes is not None and num_processes != len(addresses):
                raise ValueError(f"The job addresses name {len(addresses)} processes ({job_addresses}) but the "
                                 f"process count is {num_processes}. Expected one address per process, or only "
                                 "process 0's address.")
            coordinator = addresses[0]
        cluster = cls(coordinator, num_processes, process_id)
        cluster.check()
        return cluster

    @property
    def given(self) -> bool:
        """True if any field is set (a run of several processes is asked for)."""
        return any(v is not None for v in dataclasses.astuple(self))

    def check(self) -> None:
        """Raises ValueError for a process count or id that cannot be right."""
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"The process count is {self.num_processes}. Expected 1 or more.")
        if self.process_id is not None:
            if self.process_id < 0 or (self.num_processes is not None and self.process_id >= self.num_processes):
                raise ValueError(f"The process id is {self.process_id}, outside 0..{(self.num_processes or 1) - 1} "
                                 f"for {self.num_processes} processes. Expected a distinct id from 0 to "
                                 "num_processes - 1 on each process (0 on the coordinator's host).")
        if self.coordinator_address and ":" not in self.coordinator_address:
            raise ValueError(f"The coordinator address {self.coordinator_address!r} has no port. Expected "
                             "host:port of process 0, e.g. 10.0.0.1:1234.")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer.") from None


class JoinError(RuntimeError):
    """The processes of a run did not all join (`initialize`)."""


def initialize(cluster: Cluster, join_timeout_s: int = DEFAULT_JOIN_TIMEOUT_S,
               heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S) -> None:
    """Joins this process to the run's other processes (JAX only; before any JAX computation).

    `join_timeout_s`: how long to wait for every process to join; `heartbeat_timeout_s`: how long the processes
    wait for one that stopped answering before they all stop. With the coordinator's address, count and id given,
    the processes first meet in `rendezvous`, so that a process missing after `join_timeout_s`, a count that
    differs or an id given twice raise `JoinError` naming it (JAX would abort the process on a failed join).
    """
    import jax

    cluster.check()
    if cluster.coordinator_address and cluster.num_processes and cluster.process_id is not None:
        rendezvous(cluster, join_timeout_s)
    logging.info("Joining %s process(es) at %s as process %s.", cluster.num_processes or "the",
                 cluster.coordinator_address or "the address JAX finds",
                 "(found)" if cluster.process_id is None else cluster.process_id)
    jax.distributed.initialize(coordinator_address=cluster.coordinator_address, num_processes=cluster.num_processes,
                               process_id=cluster.process_id, initialization_timeout=join_timeout_s,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)
    if cluster.num_processes is not None and jax.process_count() != cluster.num_processes:
        raise JoinError(f"This process was told of {cluster.num_processes} processes, the run has "
                        f"{jax.process_count()}. Expected the same process count on every process.")
    _agree_on_a_seed()


def joined() -> bool:
    """Whether this process joined a run of several JAX processes (`initialize`)."""
    jax = _jax()
    return bool(jax) and jax.distributed.is_initialized()


def exit_joined(message: str, status: int) -> None:
    """Ends a process that joined a run of several JAX processes and cannot go on (a setup error that every process
    meets, e.g. the batch check): `message` to stderr, then the processes leave together (JAX's shutdown barrier)
    and this one exits at once, without Python's final garbage collection. There, a process whose peers had already
    gone could wait forever in the destructor of a JAX object (seen in about 1 of 30 such exits on a loaded 2-core
    machine; faulthandler: 'Garbage-collecting', no Python frame)."""
    print(message, file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        _jax().distributed.shutdown()
    finally:
        os._exit(status)


def _agree_on_a_seed() -> None:
    """Seeds Keras (and Python's and NumPy's generators) with process 0's random seed on every process, as
    `keras.distribution.initialize()` does: a model built before any `keras.utils.set_random_seed` call must get
    the same initial weights everywhere (JAX checks that every process places the same values)."""
    import keras

    seed = broadcast_from_process_0([np.array(np.random.SeedSequence().entropy % 2**31, np.int64)])[0]
    keras.utils.set_random_seed(int(seed))


def rendezvous(cluster: Cluster, timeout_s: float) -> None:
    """Every process checks in with process 0 on the coordinator's port before JAX uses it.

    Process 0 listens until all `num_processes` ids have arrived with the same count, then tells each to go on
    and closes the port (JAX's coordinator then binds it). Raises `JoinError` on every process it can reach,
    naming what was wrong: ids missing after `timeout_s`, a count that differs, an id given twice, or (on the
    others) a process 0 that never answered.
    """
    host, port = cluster.coordinator_address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    if cluster.process_id == 0:
        _gather_processes(int(port), cluster.num_processes, deadline, timeout_s)
    else:
        _check_in(host.strip("[]"), int(port), cluster, deadline, timeout_s)


def _gather_processes(port: int, num_processes: int, deadline: float, timeout_s: float) -> None:
    peers: dict[int, socket.socket] = {}
    try:
        server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True) \
            if socket.has_dualstack_ipv6() else socket.create_server(("", port))
    except OSError as error:
        raise JoinError(f"Process 0 cannot listen on port {port} ({error.strerror}): another process 0, or another "
                        "program, holds it. Expected process id 0 on one process only, and a free port.") from None
    with server:
        try:
            while len(peers) < num_processes - 1:
                server.settimeout(max(deadline - time.monotonic(), 0.01))
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    missing = sorted(set(range(1, num_processes)) - set(peers))
                    raise JoinError(f"Process(es) {missing} of {num_processes} did not join within {timeout_s:.0f} s "
                                    f"(port {port}). Start every process with the same coordinator address and "
                                    "process count, or raise --join_timeout.") from None
                conn.settimeout(max(deadline - time.monotonic(), 0.01))
                sent = json.loads(conn.makefile().readline() or "{}")
                problem = _mismatch(sent, num_processes, peers)
                if problem:
                    _send(conn, {"error": problem})
                    raise JoinError(problem)
                peers[sent["process_id"]] = conn
            for conn in peers.values():
                _send(conn, {"ok": True})
                conn.recv(1)  # Waits for the other side to close first (its port, not this one, waits then).
        except JoinError as error:
            for conn in peers.values():
                _send(conn, {"error": str(error)})
            raise
        finally:
            for conn in peers.values():
                conn.close()


def _mismatch(sent: dict, num_processes: int, peers: dict) -> str | None:
    """What is wrong with a process's check-in (its count and id), or None."""
    count, index = sent.get("num_processes"), sent.get("process_id")
    if count != num_processes:
        return (f"Process {index} was started with {count} processes, process 0 with {num_processes}. Expected the "
                "same process count on every process.")
    if index in peers:
        return f"Two processes have process id {index}. Expected a distinct id from 0 to {num_processes - 1} on each."
    return None


def _check_in(host: str, port: int, cluster: Cluster, deadline: float, timeout_s: float) -> None:
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.01))
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise JoinError(f"Process 0 at {host}:{port} did not answer within {timeout_s:.0f} s. Start process 0 "
                                "with the same coordinator address, check the address and that its host accepts "
                                "connections on that port, or raise --join_timeout.") from None
            time.sleep(0.5)
    with conn:
        _send(conn, {"num_processes": cluster.num_processes, "process_id": cluster.process_id})
        try:
            reply = json.loads(conn.makefile().readline() or "{}")
        except (OSError, ValueError):
            reply = {}
    if not reply.get("ok"):
        raise JoinError(reply.get("error") or f"Process 0 at {host}:{port} closed the connection without an answer "
                        "(another process's error ended the join; see process 0's log).")


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass  # The other side has gone; it learns of the outcome by its own timeout.


def process_index() -> int:
    """This process's index (0: the one that writes): among JAX's processes, or TensorFlow's training processes of
    `TF_CONFIG` (the chief first, else worker 0); 0 in a one-process run."""
    return _jax().process_index() if _jax() else _tf_config_processes()[0]


def process_count() -> int:
    """How many processes the run has (JAX's, or the chief and workers of `TF_CONFIG`); 1 in a one-process run."""
    return _jax().process_count() if _jax() else _tf_config_processes()[1]


def is_writer() -> bool:
    """True on the process that writes the run's outputs (process 0)."""
    return process_index() == 0


def _jax():
    """The jax module if Keras runs on JAX (else None: TensorFlow's processes are tf.distribute's)."""
    import keras

    if keras.backend.backend() != "jax":
        return None
    import jax

    return jax


def _tf_config_processes() -> tuple[int, int]:
    """(this process's index, their count) among the training processes of `TF_CONFIG`, the chief (or else worker
    0) first; (0, 1) without it."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster = resolver.cluster_spec().as_dict()
    count = max(len(cluster.get("chief", ())) + len(cluster.get("worker", ())), 1)
    if not cluster or resolver.task_type == "chief":
        return 0, count
    return int(resolver.task_id) + (1 if "chief" in cluster else 0), count


@dataclasses.dataclass(frozen=True)
class Shard:
    """This process's share of a dataset: every `count`-th example from `index`."""

    index: int = 0
    count: int = 1

    def size(self, num_examples: int) -> int:
        """How many of `num_examples` examples this shard holds."""
        return len(range(self.index, num_examples, self.count))

    def per_process_batch(self, global_batch: int) -> int:
        """This process's rows of each global batch; raises unless the processes split it evenly."""
        if global_batch % self.count:
            raise ValueError(f"The global batch of {global_batch} does not split over the {self.count} processes. "
                             f"Expected a multiple of {self.count}.")
        return global_batch // self.count


def shard() -> Shard:
    """This process's shard of the input: on JAX by process; on TensorFlow all of it (tf.distribute shards it)."""
    return Shard(process_index(), process_count()) if _jax() else Shard()


def broadcast_from_process_0(values: list, strategy=None) -> list[np.ndarray]:
    """`values` (arrays or tensors) as process 0 holds them, as NumPy arrays on every process (the same values with
    one process). On TensorFlow through the run's tf.distribute `strategy` (default: the current one): an
    all-reduce sum to which every replica but the first (process 0's) contributes zeros, in float64 (exact for
    float32 and bfloat16 weights and for integer counters below 2**53)."""
    if process_count() == 1:
        return [np.asarray(v) for v in values]
    if _jax():
        from jax.experimental import multihost_utils

        return [np.asarray(v) for v in multihost_utils.broadcast_one_to_all([np.asarray(v) for v in values])]
    import tensorflow as tf

    tensors = [tf.convert_to_tensor(v) for v in values]

    def share(context):
        first = tf.equal(context.replica_id_in_sync_group, 0)
        return [tf.where(first, tf.cast(t, tf.float64), tf.zeros_like(t, tf.float64)) for t in tensors]

    return [tf.cast(total, t.dtype).numpy() for total, t in zip(_tf_replica_sum(share, strategy), tensors)]


def _tf_replica_sum(share, strategy=None) -> list:
    """The all-reduce sum over every replica of the tf.distribute `strategy` (default: the current one) of
    `share(replica_context)`, a list of tensors each replica contributes; this process's copy of the sums."""
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()

    def replica_fn():
        context = tf.distribute.get_replica_context()
        return context.all_reduce(tf.distribute.ReduceOp.SUM, share(context))

    return strategy.experimental_local_results(strategy.run(replica_fn))[0]


def any_process(flag: bool, strategy=None) -> bool:
    """Whether `flag` is true on any process of the run (`flag` itself with one process): every process must call
    it at the same point. On JAX an all-gather (`multihost_utils.process_allgather`); on TensorFlow an all-reduce
    through the run's tf.distribute `strategy` (default: the current one)."""
    if process_count() == 1:
        return bool(flag)
    if _jax():
        from jax.experimental import multihost_utils

        return bool(np.asarray(multihost_utils.process_allgather(np.array(int(flag), np.int32))).any())
    import tensorflow as tf

    (total,) = _tf_replica_sum(lambda context: [tf.constant(int(flag))], strategy)
    return bool(total.numpy() > 0)


def gather_counts(count: int | None) -> list[int] | None:
    """Every JAX process's `count`, by process index (`[count]` with one process, and on TensorFlow, whose processes
    all read the whole input); None if any process's is None."""
    if not _jax() or process_count() == 1:
        return None if count is None else [count]
    from jax.experimental import multihost_utils

    counts = np.asarray(multihost_utils.process_allgather(np.array(-1 if count is None else count, np.int64)))
    return None if (counts < 0).any() else [int(c) for c in counts.reshape(-1)]
