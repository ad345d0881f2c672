"""Training keras_vit models with `model.fit`: recipes, input pipelines, strategies, checkpoints.

Installed as `keras_vit.training`. `train_and_evaluate(config, workdir)` is the API; `keras-vit-train
--help` the command line (`python -m training.train` in a clone). Runs on the TensorFlow backend.
"""

from keras_vit._backend import require_tensorflow_backend

require_tensorflow_backend("keras_vit.training")

from .configs import Config, apply_overrides, get_config  # noqa: E402
from .distribute import get_strategy  # noqa: E402
from .trainer import NaNLossError, build_model, train_and_evaluate  # noqa: E402

__all__ = ["Config", "NaNLossError", "apply_overrides", "build_model", "get_config", "get_strategy",
           "train_and_evaluate"]
