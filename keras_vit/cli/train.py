"""keras-vit-train: the training recipes (`keras_vit.training.train_and_evaluate`) under tf.distribute
(TensorFlow) or keras.distribution (KERAS_BACKEND=jax).

    keras-vit-train --config=digits --workdir=/tmp/digits
    keras-vit-train --config=finetune --workdir=/tmp/ft --override weights=/ckpt/ViT-B_16.npz \\
        --override dataset=cifar10 --override total_steps=10000 --strategy=mirrored
    KERAS_BACKEND=jax keras-vit-train --config=pretrain --workdir=$HOME/vit_b16   # a TPU VM's chips

Run the same command again after a crash to resume from `workdir/backup/`.
"""

from __future__ import annotations

import json
import logging
import sys

from absl import app, flags

from keras_vit import cli

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
_VERBOSE = flags.DEFINE_integer("verbose", 1, "Keras progress output: 0 silent, 1 progress bar, 2 one line "
                                "per epoch.")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, "Print the recipe with the overrides applied (field "
                                  "meanings: training/configs.py) as JSON and exit without training.")
flags.mark_flags_as_required(["workdir"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    cli.require("keras-vit-train", "training")
    import dataclasses

    from keras_vit.training import configs, distribute, trainer

    logging.getLogger().setLevel(logging.INFO)
    config = configs.apply_overrides(configs.get_config(_CONFIG.value), _OVERRIDE.value)
    if _PRINT_CONFIG.value:
        print(json.dumps(dataclasses.asdict(config), indent=2))
        return
    strategy = distribute.get_strategy(_STRATEGY.value, _TPU.value, _MODEL_PARALLEL.value)
    logging.info("Devices: %s", distribute.device_names())
    summary = trainer.train_and_evaluate(config, _WORKDIR.value, strategy=strategy, verbose=_VERBOSE.value)
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
