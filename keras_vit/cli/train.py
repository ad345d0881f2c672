"""keras-vit-train: the training recipes (`keras_vit.training.train_and_evaluate`) under tf.distribute
(TensorFlow) or keras.distribution (KERAS_BACKEND=jax).

    keras-vit-train --config=digits --workdir=/tmp/digits
    keras-vit-train --config=finetune --workdir=/tmp/ft --override weights=/ckpt/ViT-B_16.npz \\
        --override dataset=cifar10 --override total_steps=10000 --strategy=mirrored
    KERAS_BACKEND=jax keras-vit-train --config=pretrain --workdir=$HOME/vit_b16   # a TPU VM's chips
    KERAS_BACKEND=jax keras-vit-train --config=pretrain --workdir=gs://b/vit --multi_process  # every host of
        # a TPU pod slice (gcloud ... ssh --worker=all); elsewhere name process 0's address, the count and an id:
    KERAS_BACKEND=jax keras-vit-train --config=digits --workdir=/tmp/d --coordinator_address=10.0.0.1:1234 \
        --num_processes=2 --process_id=0        # and --process_id=1 on the second host

Run the same command again after a crash to resume from `workdir/backup/`; after a SIGTERM (a preempted VM), which
ends the run at the end of its step with a backup of that step (exit status 143), from that step.
"""

from __future__ import annotations

import json
import logging
import sys

from absl import app, flags

from keras_vit import cli

COMMAND = "keras-vit-train"
# keras_vit.training's configs.RECIPES and distribute.STRATEGIES, spelled here so that --help needs no
# TensorFlow (a test checks that they agree).
RECIPES = ("digits", "finetune", "masked_patches", "pretrain")
STRATEGIES = ("auto", "default", "mirrored", "multiworker", "tpu")

_CONFIG = flags.DEFINE_enum("config", "pretrain", list(RECIPES),
                            "Named recipe: pretrain (paper Table 3, AdamW), finetune (Table 4, SGD; needs "
                            "--override weights=...), digits (small ViT on the embedded digits), masked_patches "
                            "(self-supervised masked patch prediction, Sec. 4.6; labels ignored).")
_OVERRIDE = flags.DEFINE_multi_string(
    "override", [], "key=value changing one config field, repeatable, e.g. --override lr=0.01 "
    "--override batch_size=512. --print_config lists the fields and their values.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (backups, checkpoints, TensorBoard, model.keras, "
                               "model.eval.json). Rerunning with the same workdir resumes.")
_STRATEGY = flags.DEFINE_enum("strategy", "auto", list(STRATEGIES),
                              "TensorFlow: the tf.distribute strategy: auto (tpu if --tpu, multiworker if TF_CONFIG "
                              "is set, mirrored on several GPUs, else default), default (one device), mirrored "
                              "(local GPUs or logical CPUs), multiworker (hosts from TF_CONFIG), tpu. JAX "
                              "(KERAS_BACKEND=jax): auto (keras.distribution over all devices) or default (one "
                              "device).")
_TPU = flags.DEFINE_string("tpu", "", "TensorFlow: TPU address for --strategy=tpu: 'local' on a TPU VM, or a TPU "
                           "name / grpc:// address. On JAX a TPU VM's chips are found without it.")
_MODEL_PARALLEL = flags.DEFINE_integer(
    "model_parallel", 1, "JAX only: devices per model replica. 1: DataParallel (weights replicated, batches "
    "split over all devices); N > 1: ModelParallel on a (devices/N, N) mesh splitting each encoder block's "
    "attention heads and MLP width over N devices, for the large variants.")
_MULTI_PROCESS = flags.DEFINE_bool(
    "multi_process", False, "JAX only: join the other processes of this run (one per host) before training; "
    "implied by any of the three flags below. On a TPU pod slice (and under SLURM or Open MPI) JAX finds the "
    "coordinator, the count and this process's id itself.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "JAX multi-process: process 0's host:port, the same on every process (or "
    "all processes' addresses, comma-separated, process 0's first). Default: $KERAS_DISTRIBUTION_JOB_ADDRESSES.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "JAX multi-process: how many processes the run has. "
                                      "Default: $KERAS_DISTRIBUTION_NUM_PROCESSES.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "JAX multi-process: this process's id, 0 to "
                                   "num_processes - 1 (0 writes the outputs). Default: $KERAS_DISTRIBUTION_PROCESS_ID.")
_JOIN_TIMEOUT = flags.DEFINE_integer("join_timeout", 300, "JAX multi-process: seconds to wait for every process to "
                                     "join before giving up.")
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "heartbeat_timeout", 100, "JAX multi-process: seconds after which the processes stop when one of them stopped "
    "answering (crashed, killed, host lost). Run the same commands again to resume.")
_GRACE = flags.DEFINE_float(
    "grace_period", 25.0, "Seconds a SIGTERM (a spot / preemptible VM, Kubernetes, a batch scheduler) leaves the run "
    "to end its step and back it up; it then exits with status 143, and the same command resumes from that step. "
    "Keep it under the scheduler's (Kubernetes: terminationGracePeriodSeconds, default 30).")
_VERBOSE = flags.DEFINE_integer("verbose", 1, "Keras progress output: 0 silent, 1 progress bar, 2 one line "
                                "per epoch.")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, "Print the recipe with the overrides applied (field "
                                  "meanings: training/configs.py) as JSON and exit without training.")
flags.mark_flags_as_required(["workdir"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    cli.require("keras-vit-train", "training")  # spelled out: tests/project/test_dependencies.py reads this call
    import keras

    from keras_vit.training import configs, distribute, multihost, preemption, resume, trainer

    logging.getLogger().setLevel(logging.INFO)
    try:
        config = configs.apply_overrides(configs.get_config(_CONFIG.value), _OVERRIDE.value)
        if _PRINT_CONFIG.value:
            print(json.dumps(configs.as_json(config), indent=2))
            return
        resume.check_workdir(_WORKDIR.value)
        cluster = multihost.Cluster.from_flags_and_env(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
        if _MULTI_PROCESS.value or cluster.given:
            if keras.backend.backend() != "jax":
                raise ValueError("--multi_process, --coordinator_address, --num_processes and --process_id (and "
                                 "KERAS_DISTRIBUTION_*) join JAX processes: run with KERAS_BACKEND=jax, or on "
                                 "TensorFlow set TF_CONFIG and use --strategy=multiworker.")
            distribute.check_model_parallel_processes(_MODEL_PARALLEL.value, cluster.num_processes)
            multihost.initialize(cluster, _JOIN_TIMEOUT.value, _HEARTBEAT_TIMEOUT.value)
        strategy = distribute.get_strategy(_STRATEGY.value, _TPU.value, _MODEL_PARALLEL.value)
        distribute.check_global_batch(config.batch_size, strategy)
    except (ValueError, multihost.JoinError) as error:  # A config or setup that cannot run: one line, no traceback.
        if cli.wants_traceback():
            raise
        if multihost.joined():
            multihost.exit_joined(cli.error_line(COMMAND, error), 1)
        raise SystemExit(cli.error_line(COMMAND, error)) from None
    logging.info("Devices: %s", distribute.device_names())
    try:
        summary = trainer.train_and_evaluate(config, _WORKDIR.value, strategy=strategy, verbose=_VERBOSE.value,
                                             preemption_grace_s=_GRACE.value)
    except (trainer.NaNLossError, resume.ResumeConfigError, resume.RunInProgressError) as error:  # In one line.
        raise SystemExit(cli.error_line(COMMAND, error)) from None
    except cli.INPUT_ERRORS as error:  # Data that cannot be read (not prepared, unknown), a file that is missing.
        if cli.wants_traceback():
            raise
        raise SystemExit(cli.error_line(COMMAND, error)) from None
    except preemption.Preempted as stop:
        print(f"{COMMAND}: {stop}. Run the same command (--workdir={_WORKDIR.value}) to resume from it.",
              file=sys.stderr)
        raise SystemExit(preemption.EXIT_STATUS) from None
    except KeyboardInterrupt:
        print(f"{COMMAND}: interrupted. Run the same command (--workdir={_WORKDIR.value}) to resume from its "
              f"last backup in {_WORKDIR.value}/backup/.", file=sys.stderr)
        raise SystemExit(130) from None
    if "model_path" not in summary:  # A JAX process other than 0: process 0 saved the model.
        print(f"process {multihost.process_index()}: eval done, process 0 saved the model")
        return
    if config.recipe == "masked_patches":
        print(f"masked patch loss {summary['loss']:.4f}; encoder saved to {summary['encoder_path']} "
              f"(weights: {summary['encoder_weights_path']})")
        return
    print(f"top-1 {summary['top1']:.4f}, top-5 {summary['top5']:.4f}; model saved to {summary['model_path']}")


def run() -> None:
    """The console script's entry point. `--help` lists this command's flags and exits with 0 (absl's own
    would list only the flags of the script file, and exit with 1)."""
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__.strip())
        print(f"\nflags:\n{flags.FLAGS.module_help(__name__)}")
        raise SystemExit(0)
    app.run(main)


if __name__ == "__main__":
    run()
