"""A digits training run that SIGKILLs or SIGTERMs itself once, for the crash-safe resume tests (TensorFlow and JAX):

    python -m tests.killable_run WORKDIR KILL_AT STRATEGY [OVERRIDE ...]

With Keras' KERAS_DISTRIBUTION_* variables set (KERAS_BACKEND=jax), the process first joins the run's other
processes (`multihost.initialize`; heartbeat timeout: $HEARTBEAT_TIMEOUT_S, default 10 s). Trains
`configs.get_config("digits")` with the overrides under `distribute.get_strategy(STRATEGY)`; the process kills
itself as optimizer step KILL_AT begins (`term@N`: sends itself a SIGTERM as step N begins), on its first run in
WORKDIR only (-1: never). Prints `REPORT: <the run's summary as JSON>`, or after a SIGTERM's stop (to it or to
another process of the run) `PREEMPTED: {"step": ..., "here": ...}` and exits with `preemption.EXIT_STATUS`.
"""

import json
import os
import signal
import sys

import keras

from keras_vit.training import configs, distribute, multihost, preemption, trainer


class SignalOnce(keras.callbacks.Callback):
    """Sends this process `signum` as optimizer step `step` begins, on its first run only (a marker file says)."""

    def __init__(self, step: int, signum: int, marker: str):
        super().__init__()
        self.step, self.signum, self.marker = step, signum, marker

    def on_train_batch_begin(self, batch, logs=None):
        if trainer.optimizer_iterations(self.model) == self.step and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), self.signum)


if __name__ == "__main__":
    workdir, kill_at, strategy, *overrides = sys.argv[1:]
    cluster = multihost.Cluster.from_flags_and_env()
    if cluster.given:
        multihost.initialize(cluster, join_timeout_s=60,
                             heartbeat_timeout_s=int(os.environ.get("HEARTBEAT_TIMEOUT_S", "10")))
    terminate = kill_at.startswith("term@")
    signum, step = (signal.SIGTERM, int(kill_at[5:])) if terminate else (signal.SIGKILL, int(kill_at))
    marker = os.path.join(workdir, f"{'termed' if terminate else 'killed'}_worker_{multihost.process_index()}")
    config = configs.apply_overrides(configs.get_config("digits"), overrides)
    try:
        summary = trainer.train_and_evaluate(config, workdir, strategy=distribute.get_strategy(strategy),
                                             callbacks=[SignalOnce(step, signum, marker)], verbose=0)
    except preemption.Preempted as stop:
        print("PREEMPTED:", json.dumps({"step": stop.step, "here": stop.here}), flush=True)
        sys.exit(preemption.EXIT_STATUS)
    print("REPORT:", json.dumps(summary))
