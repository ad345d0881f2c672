"""A digits training run that SIGKILLs itself once, for the crash-safe resume tests (TensorFlow and JAX):

    python -m tests.killable_run WORKDIR KILL_AT STRATEGY [OVERRIDE ...]

With Keras' KERAS_DISTRIBUTION_* variables set (KERAS_BACKEND=jax), the process first joins the run's other
processes (`multihost.initialize`; heartbeat timeout: $HEARTBEAT_TIMEOUT_S, default 10 s). Trains
`configs.get_config("digits")` with the overrides under `distribute.get_strategy(STRATEGY)`; the process kills
itself as optimizer step KILL_AT begins, on its first run in WORKDIR only (-1: never). Prints
`REPORT: <the run's summary as JSON>`. `SignalOnce` sends another signal too (the 2-process SIGTERM test's).
"""

import json
import os
import signal
import sys

import keras

from keras_vit.training import configs, distribute, multihost, trainer


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
    marker = os.path.join(workdir, f"killed_worker_{multihost.process_index()}")
    config = configs.apply_overrides(configs.get_config("digits"), overrides)
    summary = trainer.train_and_evaluate(config, workdir, strategy=distribute.get_strategy(strategy),
                                         callbacks=[SignalOnce(int(kill_at), signal.SIGKILL, marker)], verbose=0)
    print("REPORT:", json.dumps(summary))
