"""Training keras_vit models with `model.fit`: recipes, input pipelines, strategies, checkpoints.

Installed as `keras_vit.training`. `train_and_evaluate(config, workdir)` is the API; `keras-vit-train
--help` the command line (`python -m training.train` in a clone). Runs on the TensorFlow backend
(tf.distribute) and on JAX (keras.distribution); the input pipelines are tf.data on both.
"""

from keras_vit._backend import require_backend

require_backend("keras_vit.training", ("tensorflow", "jax"), "tf.data input pipelines; tf.distribute or "
                "keras.distribution")

from .configs import Config, apply_overrides, get_config  # noqa: E402
from .distribute import get_strategy  # noqa: E402
from .resume import ResumeConfigError, RunInProgressError  # noqa: E402
from .trainer import NaNLossError, build_model, train_and_evaluate  # noqa: E402

__all__ = ["Config", "NaNLossError", "ResumeConfigError", "RunInProgressError", "apply_overrides", "build_model",
           "get_config", "get_strategy", "train_and_evaluate"]
