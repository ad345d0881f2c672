"""Preemption: a SIGTERM (a spot or preemptible TPU VM, a Kubernetes pod, a batch scheduler: each sends it, then
stops the machine some seconds later) ends training at the end of the step it arrives in, with a backup of that
step; the same command resumes from it.

    with preemption.sigterm_requests(grace_s=25) as request:
        model.fit(..., callbacks=[..., preemption.StopAtStep(request, backup.save_now, first_batch, accumulation,
                                                             agree=multihost.any_process)])
    # raises Preempted(step) out of `fit` once the backup is written (on every process of the run, after one step)

The grace period counts from the signal: a step (or a backup) still running when it ends is not waited for; the
process exits with `EXIT_STATUS`, and the backup written before, which a new one never overwrites in place
(`SyncedBackupAndRestore` keeps two copies), is the one the rerun resumes from.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator

import keras

EXIT_STATUS = 143  # 128 + SIGTERM: what a shell reports for a process a SIGTERM ended, and what schedulers expect
DEFAULT_GRACE_S = 25.0  # GKE's default terminationGracePeriodSeconds is 30; a spot TPU VM gets about 30 s


class Preempted(Exception):
    """Training stopped on a SIGTERM after optimizer step `step`, whose backup was written (`backed_up`); `here`:
    the SIGTERM came to this process (else to another process of the run, which all stopped after that step)."""

    def __init__(self, step: int, backed_up: bool, here: bool = True):
        self.step, self.backed_up, self.here = step, backed_up, here
        where = f"step {step}: its backup is written" if backed_up else (
            f"step {step}, but this Keras cannot write a backup mid-epoch: the last backup stays")
        super().__init__(f"Preempted (SIGTERM{'' if here else ' to another process of the run'}) after {where}")


class StopRequest:
    """A SIGTERM's arrival (`requested`), shared by the signal handler, `StopAtStep` and the grace-period timer."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.requested = False
        self.finished = threading.Event()  # the stop (or the run) is over: the timer does nothing

    def receive(self) -> None:
        if self.requested:
            return
        self.requested = True
        timer = threading.Timer(self.grace_s, self._expire)
        timer.daemon = True
        timer.start()

    def _expire(self) -> None:
        if self.finished.is_set():
            return
        print(f"keras_vit: SIGTERM {self.grace_s:g} s ago and the step has not ended: exiting without a new "
              "backup; the last one is kept and the same command resumes from it.", file=sys.stderr, flush=True)
        os._exit(EXIT_STATUS)


@contextlib.contextmanager
def sigterm_requests(grace_s: float = DEFAULT_GRACE_S) -> Iterator[StopRequest]:
    """Within the block, a SIGTERM does not end the process: it marks the returned request (`StopAtStep` ends the
    run at the step's end) and starts the grace period. Outside the main thread (where Python takes no signal
    handler) the request is never marked. The previous handler is restored at the end."""
    if grace_s <= 0:
        raise ValueError(f"The grace period after a SIGTERM must be positive. Received: {grace_s} s.")
    request = StopRequest(grace_s)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: request.receive())
    try:
        yield request
    finally:
        request.finished.set()
        signal.signal(signal.SIGTERM, previous)


class StopAtStep(keras.callbacks.Callback):
    """Once `request` is marked, at the end of the first step that ends an optimizer update (every
    `accumulation`-th batch), calls `save` (the backup of this step; it returns whether it wrote one) and raises
    `Preempted` out of `fit`, which stops there without ending the epoch (Keras' `stop_training` would end it:
    validation, checkpoints, and a backup that says the epoch is done). `first_batch`: the batches trained before
    this `fit` (a resumed run's).

    In a run of several processes, `agree` (`multihost.any_process`) is asked at the end of every update whether
    any process's request is marked: all of them stop after the same step, each with its backup of it."""

    def __init__(self, request: StopRequest, save: Callable[[], bool], first_batch: int = 0, accumulation: int = 1,
                 agree: Callable[[bool], bool] = bool):
        super().__init__()
        self.request, self.save, self.accumulation, self.agree = request, save, max(1, accumulation), agree
        self.batches = first_batch

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        if self.batches % self.accumulation == 0 and self.agree(self.request.requested):
            backed_up = self.save()
            self.request.finished.set()
            raise Preempted(self.batches // self.accumulation, backed_up, here=self.request.requested)
